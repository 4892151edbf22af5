"""Cleanba SAC: actor threads step EnvPool, a data-parallel learner trains from a replay memory.

CleanRL's sac_continuous_action.py on Cleanba's engine (docs/sac.md): each learner device keeps its envs'
transitions. The ENGINE blocks are the same in every script (docs/design.md).

    python cleanba/cleanba_sac.py --env-id Hopper-v4 --actor-device-ids 0 --learner-device-ids 1 2
"""

import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, NamedTuple

from cleanba.startup import add_xla_flags, prepare_process

# XLA's flags, before JAX loads (cleanba/startup.py): hence the E402 exception.
prepare_process(main=__name__ == "__main__")
# ruff: noqa: E402

import envpool
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanba import checkpoint, devices, evaluate, flags, lifetime, logs, memory, replay, spaces
from cleanba.flags import fail, flag
from cleanba.lifetime import Stop, StopTraining, queue_get, queue_put
from cleanba.logs import Stopwatch
from cleanba.reductions import Groups, chunked_apply, learner_env_blocks, learner_shapes, make_groups, put_on_learners
from cleanba.replicas import digest, unreplicate

# ======== ALGORITHM: what to train, then SAC's flags (CleanRL's MuJoCo values)


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"
    """an EnvPool id with Box actions: MuJoCo's Hopper-v4 or dm_control's CheetahRun-v1"""
    total_timesteps: int = flag(1_000_000, "[1, inf)")
    """environment steps of all envs together"""
    seed: int = flag(1, "[0, inf)")
    """seed of the envs, the network's initialisation and the action sampling"""
    actor_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that run the actor threads' policy inference"""
    learner_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that the learner is data-parallel over"""
    local_num_envs: int = flag(4, "[1, inf)", may_change_on_resume=True)
    """the number of parallel envs of each actor thread"""
    num_actor_threads: int = flag(2, "[1, inf)", may_change_on_resume=True)
    """the number of actor threads per actor device"""
    num_steps: int = flag(8, "[1, inf)")
    """the steps of each env per rollout (the actors' params change once per rollout)"""
    buffer_size: int = flag(1_000_000, "[1, inf)")
    """the replay memory's transitions, of all envs (an equal share each)"""
    replay_batch_size: int = flag(256, "[1, inf)")
    """transitions per gradient step, as many from every env"""
    updates_per_step: float = flag(1.0, "(0, inf)")
    """critic updates per env step (CleanRL's 1), per rollout rounded to a policy_frequency multiple"""
    learning_starts: int = flag(5_000, "[0, inf)")
    """env steps of uniform random actions before learning starts"""
    gamma: float = flag(0.99, "[0, 1]")
    """the discount factor gamma"""
    tau: float = flag(0.005, "[0, 1]")
    """the target critics' Polyak averaging coefficient"""
    policy_lr: float = flag(3e-4, "(0, inf)")
    """the learning rate of the policy"""
    q_lr: float = flag(1e-3, "(0, inf)")
    """the learning rate of the critics and the entropy temperature"""
    policy_frequency: int = flag(2, "[1, inf)")
    """update the policy (that many times) every this many critic updates"""
    alpha: float = flag(0.2, "(0, inf)")
    """the temperature, without --autotune"""
    autotune: bool = True
    """tune the temperature toward a target entropy of minus the action dimension"""
    hidden_dim: int = flag(256, "[1, inf)")
    """width of the policy's and critics' two ReLU layers"""
    concurrency: bool = False
    """overlap rollouts and updates: the actor runs one policy version behind the learner"""
    num_minibatches: tyro.conf.Suppress[int] = 1  # SAC's minibatches: replay_batch_size

    # ======== ENGINE: the engine's flags, the run's sizes, the rollout's containers
    env_kwargs: tuple[str, ...] = ()
    """EnvPool options, KEY=VALUE: e.g. Procgen's num_levels=200 start_level=0"""
    test_frequency: int = flag(0, "[0, inf)", may_change_on_resume=True)
    """every this many iterations, --eval-episodes games on the test envs (0: never)"""
    test_env_kwargs: tuple[str, ...] = flag((), may_change_on_resume=True)
    """KEY=VALUE over --env-kwargs for the test envs, e.g. num_levels=0"""
    atari_protocol: Literal["machado", "impala"] = "machado"
    """Atari settings: Machado et al. 2018's (sticky actions) or the IMPALA paper's (life loss)"""
    frame_stack: int = flag(4, "[1, inf)")
    """Atari: the frames stacked in each observation (1 with an LSTM, as CleanRL's PQN-LSTM)"""
    gradient_accumulation_steps: int = flag(1, "[1, inf)")
    """split each minibatch into this many micro-batches, gradients summed (saves memory)"""
    exact: bool = False
    """sum over fixed groups of envs in a fixed order: the same params, bitwise, on every layout"""
    group_envs: int = flag(8, "[1, inf)")
    """with --exact: the envs of one actor thread per group (each group computed on its own)"""
    memory_check: bool = flag(True, may_change_on_resume=True)
    """refuse, before training, a learner that needs more memory than its devices have free"""
    exp_name: str = flag(Path(__file__).stem, may_change_on_resume=True)
    """the name of this experiment"""
    run_name: str | None = flag(None, may_change_on_resume=True)
    """the run directory under runs/; without it env__exp__seed__ and the SLURM job id or the time"""
    log_frequency: int = flag(10, "[1, inf)", may_change_on_resume=True)
    """log charts/ and losses/ and print progress every this many iterations (stats/ every one)"""
    track: bool = flag(False, may_change_on_resume=True)
    """sync the TensorBoard logs to Weights and Biases"""
    wandb_project_name: str = flag("cleanba", may_change_on_resume=True)
    """the wandb project name"""
    wandb_entity: str | None = flag(None, may_change_on_resume=True)
    """the wandb entity (team); None uses your default entity"""
    checkpoint_frequency: int = flag(0, "[0, inf)", may_change_on_resume=True)
    """checkpoint every this many iterations, at the last, and on SIGINT or SIGTERM (0: never)"""
    resume: bool = flag(False, may_change_on_resume=True)
    """continue from runs/<run_name>/checkpoint.msgpack (automatic in a requeued SLURM job)"""
    save_model: bool = flag(False, may_change_on_resume=True)
    """save the final params and args to runs/<run_name>/<exp_name>.cleanba_model, evaluate them"""
    eval_episodes: int = flag(10, "[0, inf)", may_change_on_resume=True)
    """with --save-model: episodes the saved model plays, logged as eval/episodic_return"""
    capture_video: bool = flag(False, may_change_on_resume=True)
    """with --save-model: record the evaluation of one env to runs/<run_name>/videos/*.mp4"""
    upload_model: bool = flag(False, may_change_on_resume=True)
    """with --save-model: upload the model and its evaluation to the Hugging Face Hub"""
    hf_repo_id: str | None = flag(None, may_change_on_resume=True)
    """with --upload-model: the Hub repository; without it <user>/<env_id>-<exp_name>-seed<seed>"""
    distributed: bool = flag(False, may_change_on_resume=True)
    """call jax.distributed.initialize(): several processes, e.g. one per node under SLURM"""
    coordinator_address: str | None = flag(None, may_change_on_resume=True)
    """with --distributed outside SLURM: host:port of process 0 (or $JAX_COORDINATOR_ADDRESS)"""
    num_processes: int | None = flag(None, may_change_on_resume=True)
    """with --distributed outside SLURM: the number of processes"""
    process_id: int | None = flag(None, may_change_on_resume=True)
    """with --distributed outside SLURM: the rank of this process, 0 .. num_processes - 1"""
    heartbeat_timeout: int = flag(100, "[1, inf)", may_change_on_resume=True)
    """with --distributed: seconds after which the others abort when a process died"""
    stall_timeout: int = flag(0, "[0, inf)", may_change_on_resume=True)
    """abort when no iteration completes for this many seconds (0: never)"""

    # Filled in at run time (paper, appendix A).
    world_size: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)
    process_index: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)
    num_envs: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)
    local_minibatch_size: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)
    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_iterations: tyro.conf.Suppress[int] = 0


class Rollout(NamedTuple):
    """num_steps transitions of some envs, time-major."""

    obs: np.ndarray  # (T + 1, n, *obs_shape)
    actions: np.ndarray  # (T, n, *action_shape)
    logprobs: np.ndarray  # (T, n) under the actor's policy
    rewards: np.ndarray  # (T, n)
    terminations: np.ndarray  # (T, n) the episode ended: no bootstrap
    truncations: np.ndarray  # (T, n) time limit: bootstrap from the final obs (the next row)
    valid: np.ndarray  # (T, n) False for EnvPool's auto-reset step
    env_ids: np.ndarray  # (1, n) global env indices (pad envs: negative)
    recurrent_state: np.ndarray  # (1, n, state size) each env's at row 0 (feed-forward: empty)


def rollout_fields(args: Args, spec) -> Rollout:
    T, n = args.num_steps, args.local_num_envs
    obs_shape, obs_dtype = spaces.observation_field(spec.observation_space)
    action_shape, action_dtype = spaces.action_field(spec.action_space)
    return Rollout(
        obs=((T + 1, n, *obs_shape), obs_dtype),
        actions=((T, n, *action_shape), action_dtype),
        logprobs=((T, n), np.float32),
        rewards=((T, n), np.float32),
        terminations=((T, n), bool),
        truncations=((T, n), bool),
        valid=((T, n), bool),
        env_ids=((1, n), np.int32),
        recurrent_state=((1, n, recurrent_state_size(args)), np.float32),
    )


class RolloutInfo(NamedTuple):
    policy_version: int
    param_queue_wait: float
    handover_start: float  # when the actor began to queue it
    rollout_time: float
    episode_returns: np.ndarray  # (T, n) raw score of the games that ended, NaN elsewhere
    episode_lengths: np.ndarray  # (T, n) in agent steps, NaN elsewhere
    timings: dict  # seconds per part (Stopwatch)
    rollout_queue_wait: float = 0.0  # filled in by the learner


def merge_rollouts(args: Args, rollouts: tuple) -> tuple:
    """(this learner device's envs of every actor thread as one Rollout, their reduction groups)."""
    rollout = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *rollouts)
    env_sets = minibatch_env_sets(args)
    return rollout, make_groups(args, rollout.env_ids[0], env_sets, MICRO_BATCHES_SPLIT)


# ======== ALGORITHM: the squashed Gaussian policy, twin critics, SAC's update, the hooks


def dense(features: int):
    """PyTorch's default weights, as CleanRL's."""
    return nn.Dense(features, kernel_init=nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"))


class MLP(nn.Module):
    hidden_dim: int
    outputs: int

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(dense(self.hidden_dim)(x))
        return dense(self.outputs)(x)


TwinMLP = nn.vmap(MLP, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=2)


def vector(obs):
    return obs.reshape(obs.shape[0], -1).astype(jnp.float32)


class Agent(nn.Module):
    """The policy, twin critics, their targets (collection "target") and the log temperature."""

    action_dim: int
    hidden_dim: int
    action_scale: tuple  # (high - low) / 2
    action_bias: tuple  # (high + low) / 2

    def setup(self):
        self.actor = MLP(self.hidden_dim, 2 * self.action_dim)
        self.critic = TwinMLP(self.hidden_dim, 1)
        self.log_alpha = self.param("log_alpha", nn.initializers.zeros, ())

    def __call__(self, obs):
        """obs -> (the Gaussian, min Q of its mean's action)."""
        policy = self.policy(obs)
        q = self.q(obs, squash(self, policy, 0.0)[0])
        if self.is_initializing():  # the targets start as copies (CleanRL's load_state_dict)
            self.put_variable("target", "critic", self.critic.variables["params"])
        return policy, jnp.min(q, axis=0)

    def policy(self, obs):
        """The Gaussian of pre-tanh actions: means, log stds in CleanRL's [-5, 2]."""
        mean, log_std = jnp.split(self.actor(vector(obs)), 2, axis=1)
        return jnp.concatenate([mean, -5.0 + 3.5 * (jnp.tanh(log_std) + 1)], axis=1)

    def q(self, obs, actions):
        return self.critic(jnp.concatenate([vector(obs), actions], axis=1))[..., 0]  # (2, n)


def squash(agent: Agent, policy, noise):
    """The action tanh(mean + std x noise) in the bounds, its log-density corrected for the tanh
    (the SAC paper's appendix C; CleanRL's 1e-6)."""
    mean, log_std = jnp.split(policy, 2, axis=-1)
    y = jnp.tanh(mean + jnp.exp(log_std) * noise)
    scale = np.asarray(agent.action_scale, np.float32)
    logprob = -0.5 * noise**2 - log_std - 0.5 * np.log(2 * np.pi) - jnp.log(scale * (1 - y**2) + 1e-6)
    return y * scale + np.asarray(agent.action_bias, np.float32), jnp.sum(logprob, axis=-1)


def with_params(params, **parts):
    return dict(params, params=dict(params["params"], **parts))


def temperature(args: Args, params):
    return jnp.exp(params["params"]["log_alpha"]) if args.autotune else args.alpha


def flat(batch: dict) -> dict:  # (rows, width, ...) fields as (rows x width, ...)
    return {name: x.reshape(-1, *x.shape[2:]) for name, x in batch.items()}


def policy_sample(agent: Agent, params, obs, noise):
    return squash(agent, agent.apply(params, obs, method="policy"), noise)


def critic_loss(agent: Agent, args: Args, params, critic, batch: dict, count):
    """Both critics' squared errors to the target critics' soft Bellman target (CleanRL's qf_loss),
    over the global count of valid samples."""
    b = flat(batch)
    next_actions, next_logprob = policy_sample(agent, params, b["next_obs"], b["noise"][:, 0])
    targets = with_params(params, critic=params["target"]["critic"])
    next_q = jnp.min(agent.apply(targets, b["next_obs"], next_actions, method="q"), axis=0)
    soft_value = next_q - temperature(args, params) * next_logprob
    target = jax.lax.stop_gradient(b["rewards"] + (1 - b["terminations"]) * args.gamma * soft_value)
    q = agent.apply(with_params(params, critic=critic), b["obs"], b["actions"], method="q")
    metrics = dict(qf_loss=jnp.sum((q - target) ** 2, axis=0), qf1_values=q[0])
    metrics = {k: jnp.vdot(v, b["valid"]) / count for k, v in metrics.items()}
    return metrics["qf_loss"], metrics


def actor_loss(agent: Agent, args: Args, params, actor, batch: dict, count, draw: int):
    """alpha x log pi - min Q of the policy's actions (noise number `draw`)."""
    b, params = flat(batch), with_params(params, actor=actor)
    actions, logprob = policy_sample(agent, params, b["obs"], b["noise"][:, draw])
    q = jnp.min(agent.apply(params, b["obs"], actions, method="q"), axis=0)
    metrics = dict(actor_loss=temperature(args, params) * logprob - q, entropy=-logprob)
    metrics = {k: jnp.vdot(v, b["valid"]) / count for k, v in metrics.items()}
    return metrics["actor_loss"], metrics


def mean_logprob(agent: Agent, params, groups: Groups, batch: dict, count, draw: int):
    def group_sum(group):
        b = flat(group)
        return jnp.vdot(policy_sample(agent, params, b["obs"], b["noise"][:, draw])[1], b["valid"])

    return groups.total(group_sum, batch) / count


def optimizers(args: Args) -> dict:
    actor = optax.inject_hyperparams(optax.adam)(learning_rate=args.policy_lr)
    return dict(actor=actor, critic=optax.adam(args.q_lr), log_alpha=optax.adam(args.q_lr))


def apply_gradients(args: Args, state: TrainState, part: str, grads) -> TrainState:
    """An Adam step of one part (actor, critic or log_alpha), no other's."""
    params = state.params["params"]
    updates, opt_state = optimizers(args)[part].update(grads, state.opt_state[part], params[part])
    params = with_params(state.params, **{part: optax.apply_updates(params[part], updates)})
    return state.replace(params=params, opt_state=dict(state.opt_state, **{part: opt_state}))


def update_chunk(agent: Agent, args: Args, groups: Groups, memory: dict, state: TrainState, key):
    """policy_frequency critic steps, the first followed by policy_frequency policy and temperature
    steps (CleanRL's order); the targets averaged after each."""
    names, per_env = ("obs", "next_obs", "actions", "rewards", "terminations"), args.replay_batch_size // args.num_envs
    for j in range(args.policy_frequency):
        noise = (1 + 2 * args.policy_frequency, agent.action_dim)
        batch = replay.sample(memory, groups, jax.random.fold_in(key, j), per_env, names, noise)
        count = jnp.maximum(groups.total(jnp.sum, batch["valid"]), 1.0)
        loss = partial(critic_loss, agent, args, state.params)
        grads, logged = groups.gradients(loss, state.params["params"]["critic"], batch, count)
        state = apply_gradients(args, state, "critic", grads)
        if j == 0:
            metrics = logged
        for k in range(args.policy_frequency if j == 0 else 0):
            loss = partial(actor_loss, agent, args, state.params, draw=1 + 2 * k)
            grads, actor_metrics = groups.gradients(loss, state.params["params"]["actor"], batch, count)
            state = apply_gradients(args, state, "actor", grads)
            if args.autotune:  # d/d log alpha of -alpha (log pi + target entropy)
                gap = mean_logprob(agent, state.params, groups, batch, count, 2 + 2 * k) - agent.action_dim
                state = apply_gradients(args, state, "log_alpha", -temperature(args, state.params) * gap)
                actor_metrics["alpha_loss"] = -temperature(args, state.params) * gap
        critic, target = state.params["params"]["critic"], state.params["target"]["critic"]
        target = jax.tree.map(lambda c, t: args.tau * c + (1 - args.tau) * t, critic, target)
        state = state.replace(params=dict(state.params, target={"critic": target}))
    return state, dict(metrics, **actor_metrics, alpha=temperature(args, state.params))


# ---- The hooks the engine calls (tests/test_engine.py)

ACTION_SPACE = "Box"  # the engine refuses other envs
MICRO_BATCHES_SPLIT = "time"  # a group's micro-batches split its samples


def minibatch_env_sets(args: Args) -> int:
    """The env sets (env id mod sets) that minibatches take whole: one."""
    return 1


def check_algorithm(args: Args):
    """None: replay_fields checks the sizes, once the env count is known."""


def make_network(args: Args, action_space, platform: str | None = None) -> Agent:
    """obs -> (the Gaussian, min Q), also for a saved model (cleanba/evaluate.py)."""
    low, high = action_space.low.astype(float), action_space.high.astype(float)
    scale, bias = tuple(((high - low) / 2).tolist()), tuple(((high + low) / 2).tolist())
    return Agent(action_space.shape[0], args.hidden_dim, scale, bias)


def replay_fields(args: Args, spec) -> dict:
    """Each env's ring of buffer_size / num_envs transitions, and its count written."""
    replay.check_sizes(args)
    obs_shape, obs_dtype = spaces.observation_field(spec.observation_space)
    capacity = args.buffer_size // args.num_envs
    obs, scalar = ((capacity, *obs_shape), obs_dtype), ((capacity,), np.float32)
    actions = ((capacity, *spec.action_space.shape), np.float32)
    return dict(obs=obs, next_obs=obs, actions=actions, rewards=scalar, terminations=scalar, filled=((1,), np.int32))


def recurrent_state_size(args: Args) -> int:
    """The width of each env's recurrent state: none."""
    return 0


def policy_step(agent: Agent, params, obs, state, starts) -> tuple:
    """The actors' network step: (the Gaussians, the recurrent state)."""
    return agent.apply(params, obs, method="policy"), state


def sample_actions(args: Args, policy, keys, step):
    """Each env's pre-tanh action, with its own key; before learning_starts, a uniform tanh."""
    mean, log_std = jnp.split(policy, 2, axis=-1)

    def draw(key):
        noise_key, uniform_key = jax.random.split(key)
        uniform = jax.random.uniform(uniform_key, mean.shape[1:], minval=-0.999999, maxval=0.999999)
        return jax.random.normal(noise_key, mean.shape[1:]), jnp.arctanh(uniform)

    noise, random_actions = jax.vmap(draw)(keys)
    actions = jnp.where(step * args.num_envs < args.learning_starts, random_actions, mean + jnp.exp(log_std) * noise)
    return actions, jnp.zeros(actions.shape[0])


def env_actions(actions: np.ndarray, action_space) -> np.ndarray:
    """What EnvPool is sent: tanh of the actors' actions, scaled to the bounds."""
    low, high = action_space.low, action_space.high
    return np.clip(np.tanh(actions) * (high - low) / 2 + (high + low) / 2, low, high)


def make_optimizer(args: Args):
    """Adam states of the policy, critics and temperature, each stepped on its own."""
    parts = optimizers(args)
    return optax.GradientTransformation(lambda p: {k: tx.init(p["params"][k]) for k, tx in parts.items()}, None)


def learn(agent: Agent, args: Args, shuffle_key, state: TrainState, replay_memory: dict, rollouts: tuple):
    """One learner iteration on this device's envs (in shard_map): the rollout into the memory,
    then, past learning_starts, the updates."""
    rollout, groups = merge_rollouts(args, rollouts)
    scale, bias = np.asarray(agent.action_scale, np.float32), np.asarray(agent.action_bias, np.float32)
    transitions = dict(
        obs=rollout.obs[:-1],
        next_obs=rollout.obs[1:],  # a truncation's: the final obs
        actions=jnp.tanh(rollout.actions) * scale + bias,
        rewards=rollout.rewards,
        terminations=rollout.terminations,
    )
    memory = replay.remember(replay_memory, transitions, rollout.valid)
    chunks = max(1, round(args.updates_per_step * args.batch_size / args.policy_frequency))
    keys = jax.random.split(jax.random.fold_in(shuffle_key, state.step), chunks)  # step: iterations done

    def train(state):
        update = partial(update_chunk, agent, args, groups.of_env_set(0), memory)
        state, metrics = jax.lax.scan(update, state, keys)
        return state, jax.tree.map(jnp.mean, metrics)

    def wait(state):
        return state, jax.tree.map(jnp.zeros_like, jax.eval_shape(train, state)[1])

    learning = (state.step + 1) * args.batch_size > args.learning_starts
    state, metrics = jax.lax.cond(learning, train, wait, state)
    return state.replace(step=state.step + 1), memory, metrics


# ======== ENGINE: flags checked and sized, envs, actor threads, the learner, the run


def check_args(args: Args):
    flags.check_flags(args)
    check_algorithm(args)
    script = Path(__file__).name
    spaces.check_env(args.env_id, env_kwargs(args), ACTION_SPACE, script, args.capture_video)


def fill_runtime_sizes(args: Args, world_size: int, process_index: int):
    args.world_size, args.process_index = world_size, process_index
    process_envs = args.local_num_envs * flags.actor_threads(args)
    args.num_envs = process_envs * world_size
    args.local_batch_size = process_envs * args.num_steps
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    args.batch_size = args.local_batch_size * world_size
    args.minibatch_size = args.local_minibatch_size * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    if args.num_iterations == 0:
        fail(
            f"--total-timesteps={args.total_timesteps} is smaller than one batch of "
            f"{args.batch_size} steps (num_envs={args.num_envs} x num_steps={args.num_steps}); "
            "raise it or shrink the batch"
        )


def env_kwargs(args: Args, test: bool = False) -> dict:
    atari = {}
    if envpool.registration.registry.specs[args.env_id][0] == "envpool.atari":
        machado = args.atari_protocol == "machado"  # Machado et al. 2018, section 5; Cleanba, appendix A
        atari = dict(img_height=84, img_width=84, frame_skip=4, stack_num=args.frame_stack)
        atari.update(reward_clip=True, max_episode_steps=27_000, episodic_life=not machado)
        atari.update(noop_max=1 if machado else 30, full_action_space=machado)
        atari.update(repeat_action_probability=0.25 * machado)
    return spaces.env_options(args, atari, test)


def make_env(args: Args, num_envs: int, seed: int):
    # batch_size == num_envs: recv() is deterministic, in env-id order (EnvPool's docs).
    sizes = dict(num_envs=num_envs, batch_size=num_envs)
    return envpool.make(args.env_id, env_type="gymnasium", seed=seed, **sizes, **env_kwargs(args))


def make_policy(args: Args, agent, action_key):
    """(params, obs, state, starts, env ids, step) -> ([actions, logprobs], state)."""
    chunk = args.group_envs if args.exact else 0  # logits independent of the thread's batch size

    @jax.jit
    def policy(params, obs, state, starts, env_ids, step):
        def network(obs, state, starts):
            return policy_step(agent, params, obs, state, starts)

        inputs = (obs, state, starts)
        policy_out, state = chunked_apply(network, inputs, chunk) if chunk else network(*inputs)
        # One key per (global env index, step): the same actions on every layout.
        env_keys = jax.vmap(partial(jax.random.fold_in, action_key))(env_ids)
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(env_keys, step)
        actions, logprobs = sample_actions(args, policy_out, keys, step)
        # One device-to-host copy per step (an action index is exact in float32).
        columns = [actions.reshape(actions.shape[0], -1).astype(jnp.float32), logprobs[:, None]]
        return jnp.concatenate(columns, axis=1), state

    return policy


@lifetime.stops_run_on_error  # the main thread reports the error
def rollout_actor(args, start_iteration, actor_id, device, mesh, policy, param_queue, rollout_queue, stop):
    """For each iteration: take the params the learner queued, play num_steps, queue the rollout."""
    first_env = actor_id * args.local_num_envs  # global env indices
    env_ids = np.arange(first_env, first_env + args.local_num_envs, dtype=np.int32)
    spec = envpool.make_spec(args.env_id, **env_kwargs(args))
    envs = make_env(args, args.local_num_envs, seed=args.seed + first_env)
    try:
        T, n = args.num_steps, args.local_num_envs
        env_ids_on_device = jax.device_put(env_ids, device)
        scores = logs.GameScores(n)
        envs.async_reset()
        next_obs, _, _, _, info = envs.recv()
        next_obs = spaces.flat_observations(next_obs, spec.observation_space)
        # EnvPool's auto-reset step ignores the action: not learned from (cleanrl issue 562).
        resetting = np.zeros(n, bool)
        state = jax.device_put(np.zeros((n, recurrent_state_size(args)), np.float32), device)
        starts = np.ones(n, bool)
        for iteration in range(start_iteration, args.num_iterations + 1):
            clock = Stopwatch()
            policy_version, params = queue_get(param_queue, stop)
            params = jax.device_put(params, device)
            clock.lap("param_queue_wait")
            fields = rollout_fields(args, spec)
            storage = Rollout(*[np.empty(shape, dtype) for shape, dtype in fields])
            storage = storage._replace(env_ids=env_ids[None])
            storage.recurrent_state[0] = np.where(starts[:, None], 0.0, np.asarray(state))
            returns, lengths = np.full((T, n), np.nan), np.full((T, n), np.nan)  # of the games that end
            for t in range(T):
                if stop.is_set():
                    return
                storage.obs[t] = next_obs
                clock.lap("storage")
                step = (iteration - 1) * T + t
                sampled, state = policy(params, next_obs, state, starts, env_ids_on_device, step)
                clock.lap("inference")
                sampled = np.asarray(sampled)
                actions = sampled[:, :-1].reshape(storage.actions.shape[1:])
                actions, logprobs = actions.astype(storage.actions.dtype), sampled[:, -1]
                clock.lap("device_to_host")
                envs.send(env_actions(actions, spec.action_space), info["env_id"])
                clock.lap("env_send")
                next_obs, reward, terminated, truncated, info = envs.recv()
                next_obs = spaces.flat_observations(next_obs, spec.observation_space)
                clock.lap("env_recv")
                storage.actions[t], storage.logprobs[t], storage.rewards[t] = actions, logprobs, reward
                storage.terminations[t], storage.truncations[t] = terminated, truncated
                storage.valid[t] = ~resetting
                starts, resetting = resetting, terminated | truncated  # the reset obs starts an episode
                # Scores: raw game rewards until the real game over (not a lost life).
                game_over = info.get("terminated", terminated).astype(bool) | truncated
                raw_reward = info.get("reward", reward)
                returns[t], lengths[t] = scores.step(raw_reward, storage.valid[t], game_over)
                clock.lap("storage")
            storage.obs[T] = next_obs
            rollout = put_on_learners(storage, mesh, learner_blocks(args))
            clock.lap("host_to_device")
            waited, timings = clock.sums.pop("param_queue_wait"), clock.sums
            rollout_time = sum(timings.values())
            rollout_info = RolloutInfo(policy_version, waited, time.time(), rollout_time, returns, lengths, timings)
            queue_put(rollout_queue, (rollout, rollout_info), stop)
    finally:
        envs.close()


def make_actor_threads(args: Args, start_iteration: int, mesh: Mesh, policy, stop: Stop) -> tuple:
    threads_per_device = range(args.num_actor_threads)
    actor_devices = [jax.local_devices()[i] for i in args.actor_device_ids for _ in threads_per_device]
    param_queues = [queue.Queue(maxsize=1) for _ in actor_devices]
    rollout_queues = [queue.Queue(maxsize=1) for _ in actor_devices]
    threads = []
    for local_id, device in enumerate(actor_devices):
        actor_id = args.process_index * len(actor_devices) + local_id
        queues = param_queues[local_id], rollout_queues[local_id]
        actor_args = (args, start_iteration, actor_id, device, mesh, policy, *queues, stop)
        thread = threading.Thread(target=rollout_actor, args=actor_args, name=f"actor-{actor_id}")
        thread.daemon = True
        threads.append(thread)
    return param_queues, rollout_queues, threads


def learner_blocks(args: Args) -> tuple:
    return learner_env_blocks(args, minibatch_env_sets(args), MICRO_BATCHES_SPLIT)


def make_learner_update(agent, args: Args, shuffle_key, mesh: Mesh, num_actors: int):
    """learn, data-parallel over the mesh: (state, replay memory, rollouts) -> (state, replay memory, metrics)"""
    return jax.jit(
        jax.shard_map(
            partial(learn, agent, args, shuffle_key),
            mesh=mesh,
            in_specs=(P(), P(None, "learner"), (P(None, "learner"),) * num_actors),
            out_specs=(P(), P(None, "learner"), P()),
            check_vma=False,  # gradients stay per device until the sum over groups (Groups.sum)
        ),
        donate_argnums=1,
    )


def make_agent(args: Args, spec, mesh: Mesh):
    agent = make_network(args, spec.action_space, mesh.devices.flat[0].platform)
    init_key, action_key, shuffle_key = jax.random.split(jax.random.key(args.seed), 3)
    state = initial_state(agent, args, spec, init_key)
    return agent, jax.device_put(state, NamedSharding(mesh, P())), action_key, shuffle_key


def initial_state(agent, args: Args, spec, init_key) -> TrainState:
    obs_shape, obs_dtype = spaces.observation_field(spec.observation_space)
    obs_example = np.zeros((1, *obs_shape), obs_dtype)

    def create(key):
        params = agent.init(key, obs_example)
        state = TrainState.create(apply_fn=None, params=params, tx=make_optimizer(args))
        return state.replace(step=jnp.int32(0))  # int32, as the update returns it: no recompile

    return jax.jit(create)(init_key)


@dataclass
class TrainingRun:
    args: Args
    stop: Stop  # set to stop every thread; it keeps why
    run_dir: Path
    mesh: Mesh  # the learner devices of all processes
    state: TrainState  # replicated over the mesh
    replay: dict  # split by env over the mesh (cleanba/replay.py)
    iterations_done: int
    start_iteration: int
    update: jax.stages.Compiled  # make_learner_update, compiled
    logger: logs.IterationLogger | None  # process 0's
    param_queues: list
    rollout_queues: list
    threads: list
    model_path: Path | None = None


def start(args: Args) -> TrainingRun:
    """Everything before the first iteration: bad input fails before any thread starts."""
    if args.exact:
        add_xla_flags("--xla_gpu_deterministic_ops=true")
    if args.distributed:  # before anything touches a device
        devices.initialize_distributed(args)
    devices.check_devices(args)
    fill_runtime_sizes(args, jax.process_count(), jax.process_index())
    stop, run_dir = Stop(), Path("runs") / (args.run_name or flags.default_run_name(args))
    processes = range(args.world_size)
    learners = [jax.local_devices(process_index=p)[i] for p in processes for i in args.learner_device_ids]
    mesh = Mesh(np.array(learners), ("learner",))

    spec = envpool.make_spec(args.env_id, **env_kwargs(args))
    agent, state, action_key, shuffle_key = make_agent(args, spec, mesh)
    spaces.check_network(sys.modules[__name__], args, unreplicate(state.params))
    fields = rollout_fields(args, spec)
    shapes = learner_shapes(fields, args.local_num_envs, mesh, learner_blocks(args))
    rollouts = (shapes,) * flags.actor_threads(args)
    replay_shapes = replay.memory_shapes(args, replay_fields(args, spec), rollouts, learner_blocks(args))
    checkpoint_path = checkpoint.checkpoint_path(run_dir)
    iterations_done, state, episode_window, saved_replay = checkpoint.resume(args, checkpoint_path, state)

    def compile_update(args: Args):  # before any env steps: its memory is known
        update = make_learner_update(agent, args, shuffle_key, mesh, len(rollouts))
        return update.lower(state, replay_shapes, rollouts).compile()

    compile_start = time.time()
    update = compile_update(args)
    compile_time = time.time() - compile_start
    if args.memory_check:
        memory.check_learner_memory(args, update, compile_update, rollouts, fields, replay_shapes)
    replay_memory = replay.place(args, replay_shapes, learner_blocks(args), saved_replay)

    logger = None
    if args.process_index == 0:  # process 0 writes logs, checkpoints and the model
        purge_step = iterations_done * args.batch_size + 1 if iterations_done else None
        logger = logs.IterationLogger(args, run_dir, purge_step, episode_window, compile_time)
        evaluate.start_tests(sys.modules[__name__], logger, stop)
        logs.print_start(args, run_dir, learner_blocks(args))

    start_iteration = iterations_done + 1
    policy = make_policy(args, agent, action_key)
    actors = make_actor_threads(args, start_iteration, mesh, policy, stop)
    lifetime.handle_signals(stop, args.distributed)
    progress = (state, replay_memory, iterations_done, start_iteration)
    return TrainingRun(args, stop, run_dir, mesh, *progress, update, logger, *actors)


def send_params_for_rollout(run: TrainingRun, rollout: int):
    if rollout <= run.args.num_iterations:
        params = unreplicate(run.state.params)
        for q in run.param_queues:
            queue_put(q, (run.iterations_done, params), run.stop)


def train(run: TrainingRun):
    args, stop = run.args, run.stop
    last_progress = lifetime.start_watchdog(args.stall_timeout, stop)
    for thread in run.threads:
        thread.start()
    # The one-step lag (paper, section 4): rollout i is played with the params of update i - 1 - lag.
    lag = int(args.concurrency)
    for rollout in range(run.start_iteration, run.start_iteration + 1 + lag):  # the starting params
        send_params_for_rollout(run, rollout)
    process_gather = devices.make_process_gather(run.mesh)
    taken_at = [None] * len(run.rollout_queues)
    for iteration in range(run.start_iteration, args.num_iterations + 1):
        start_time = time.time()
        received = [queue_get(q, stop) for q in run.rollout_queues]  # (rollout, RolloutInfo) pairs
        rollout_queue_wait = time.time() - start_time
        # An actor's wait ends when the learner takes its previous rollout.
        rollout_infos = [
            info._replace(rollout_queue_wait=max(0.0, (taken or info.handover_start) - info.handover_start))
            for (_, info), taken in zip(received, taken_at)
        ]
        taken_at = [time.time()] * len(received)
        start_time = time.time()
        run.state, run.replay, metrics = run.update(run.state, run.replay, tuple(r for r, _ in received))
        jax.block_until_ready(run.state)
        update_time = time.time() - start_time
        run.iterations_done = iteration
        last_progress[0] = time.time()
        send_params_for_rollout(run, iteration + 1 + lag)
        # The games that ended, of every process.
        ended = [np.stack([i.episode_returns, i.episode_lengths]) for i in rollout_infos]
        episodes = process_gather(np.concatenate(ended, 2))
        if run.logger is not None:
            waits = rollout_queue_wait, update_time
            run.logger.log(iteration, rollout_infos, episodes, *waits, run.state, metrics)
        last = iteration == args.num_iterations
        if args.checkpoint_frequency and (iteration % args.checkpoint_frequency == 0 or last):
            checkpoint.save_run_checkpoint(run)  # on every process: it gathers the replay
        # All processes see a SIGTERM (SLURM's preemption) at the same iteration.
        if args.distributed and multihost_utils.reached_preemption_sync_point(iteration):
            stop.signals.append(signal.SIGTERM)
            raise StopTraining
        if stop.is_set():
            raise StopTraining
    final_digest = digest(unreplicate(run.state.params))
    print(f"rank {args.process_index}: final params sha256 {final_digest}", flush=True)
    if args.save_model and run.logger is not None:
        run.model_path = checkpoint.save_trained_model(run, Path(__file__).name)


def main(args: Args):
    run = start(args)
    try:
        train(run)
    except StopTraining:
        pass  # run.stop says why
    except Exception as error:
        run.stop.errors.append(error)
    finally:  # threads joined, a checkpoint if a signal stopped the run
        lifetime.shut_down(run, checkpoint.save_run_checkpoint)
    try:
        if run.model_path is not None and args.eval_episodes and not run.stop.signals:
            evaluate.evaluate_after_training(sys.modules[__name__], run)
    finally:
        lifetime.close_and_exit(run)


if __name__ == "__main__":
    args = flags.parse_flags(Args, __doc__)
    check_args(args)
    main(args)
