"""Cleanba PQN: actor threads step EnvPool on actor devices, a data-parallel learner trains.

PQN: Gallici et al. 2024, "Simplifying Deep Temporal Difference Learning". The ENGINE blocks are the
same in every script (docs/design.md).

    python cleanba/cleanba_pqn.py --env-id Breakout-v5 --actor-device-ids 0 --learner-device-ids 1 2
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
import rlax
import tyro
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanba import checkpoint, devices, evaluate, flags, lifetime, logs, memory, replay, spaces
from cleanba.flags import fail, flag
from cleanba.lifetime import Stop, StopTraining, queue_get, queue_put
from cleanba.logs import Stopwatch
from cleanba.networks import ConvSequence, LSTMCore, conv_layer
from cleanba.reductions import Groups, chunked_apply, learner_env_blocks, learner_shapes, make_groups, put_on_learners
from cleanba.replicas import digest, unreplicate

# ======== ALGORITHM: what to train, then PQN's flags (CleanRL's pqn_atari_envpool values)


@dataclass
class Args:
    env_id: str = "Breakout-v5"
    """an EnvPool id: Atari gets the Nature CNN, vectors an MLP"""
    total_timesteps: int = flag(10_000_000, "[1, inf)")
    """env steps of all envs together (frames / 4 on Atari)"""
    seed: int = flag(1, "[0, inf)")
    """seed of the envs, the network's init and the action sampling"""
    actor_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that run the actor threads' policy inference"""
    learner_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that the learner is data-parallel over"""
    local_num_envs: int = flag(4, "[1, inf)", may_change_on_resume=True)
    """the number of parallel envs of each actor thread"""
    num_actor_threads: int = flag(2, "[1, inf)", may_change_on_resume=True)
    """the number of actor threads per actor device"""
    learning_rate: float = flag(2.5e-4, "(0, inf)")
    """the optimizer's learning rate"""
    num_steps: int = flag(128, "[1, inf)")
    """steps of each env per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = flag(0.99, "[0, 1]")
    """the discount gamma"""
    q_lambda: float = flag(0.65, "[0, 1]")
    """the lambda of the Q(lambda) returns"""
    num_minibatches: int = flag(4, "[1, inf)")
    """the number of minibatches per epoch"""
    update_epochs: int = flag(4, "[1, inf)")
    """passes over each rollout"""
    max_grad_norm: float = flag(10.0, "(0, inf)")
    """the gradient clipping norm"""
    start_e: float = flag(1.0, "[0, 1]")
    """epsilon at first"""
    end_e: float = flag(0.01, "[0, 1]")
    """epsilon at its schedule's end"""
    exploration_fraction: float = flag(0.1, "(0, 1]")
    """the fraction of the steps over which epsilon falls linearly to end_e"""
    resnet: bool = False
    """images: the IMPALA ResNet, not the Nature CNN"""
    channels: tuple[int, ...] = (16, 32, 32)
    """with --resnet: the ResNet's channels"""
    hidden_dim: int = flag(512, "[1, inf)")
    """width of the dense layer after the torso"""
    mlp_widths: tuple[int, ...] = (120, 84)
    """vectors: the MLP's widths (CleanRL's pqn.py)"""
    conv_dtype: Literal["float32", "bfloat16"] = "float32"
    """the image torso's dtype (bfloat16: a GPU's tensor cores)"""
    concurrency: bool = False
    """overlap rollouts and updates: the actor runs one policy version behind the learner"""
    lstm: bool = False
    """an LSTM core before the Q head (CleanRL's PQN-LSTM)"""
    lstm_size: int = flag(128, "[1, inf)")
    """with --lstm: the LSTM's width"""

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


# ======== ALGORITHM: the Q-network, PQN's loss and update, the hooks


class Agent(nn.Module):
    """Q-values as CleanRL's PQN, LayerNorm keeping TD stable without a target network (the PQN paper)."""

    num_actions: int
    channels: tuple[int, ...]
    hidden_dim: int
    mlp_widths: tuple[int, ...]
    resnet: bool = False
    xla_cpu: bool = False
    dtype: type = jnp.float32  # the image torso's; the dense layers compute in float32
    lstm_size: int = 0  # 0: feed-forward

    @nn.compact
    def __call__(self, obs, state=None, starts=None):
        """obs (n, ...) -> (q (n, actions), max q (n,)); with a state, the LSTM's unroll (T, n, ...)."""
        if self.lstm_size and state is None:
            zeros, starts = jnp.zeros((len(obs), 2 * self.lstm_size)), jnp.ones((1, len(obs)), bool)
            q, values, _ = self.unroll(obs[None], zeros, starts)
            return q[0], values[0]
        if self.lstm_size:
            return self.unroll(obs, state, starts)
        return self.head(self.torso(obs))

    def unroll(self, obs, state, starts):
        features = self.torso(obs.reshape(-1, *obs.shape[2:])).reshape(*obs.shape[:2], -1)
        outputs, state = LSTMCore(self.lstm_size)(features, state, starts)
        return *self.head(outputs), state

    def torso(self, obs):
        orthogonal = nn.initializers.orthogonal(np.sqrt(2))
        if obs.ndim != 4:  # not a frame stack: flattened
            x = obs.reshape(len(obs), -1).astype(jnp.float32)
            for width in self.mlp_widths:
                x = nn.relu(nn.LayerNorm()(nn.Dense(width, kernel_init=orthogonal)(x)))
            return x
        x = jnp.transpose(obs, (0, 2, 3, 1)).astype(self.dtype) / 255.0  # Atari: (n, stack, 84, 84)
        if self.resnet:
            for channels in self.channels:
                x = ConvSequence(channels, self.xla_cpu, self.dtype)(x)
            x = nn.relu(x)
        else:
            conv = partial(conv_layer, self.xla_cpu, padding="VALID", kernel_init=orthogonal, dtype=self.dtype)
            norm = partial(nn.LayerNorm, reduction_axes=(-3, -2, -1), feature_axes=(-3, -2, -1))
            for features, size, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
                x = nn.relu(norm(dtype=self.dtype)(conv(features, (size, size), (stride, stride))(x)))
        x = nn.Dense(self.hidden_dim, kernel_init=orthogonal)(x.reshape(x.shape[0], -1).astype(jnp.float32))
        return nn.relu(nn.LayerNorm()(x))

    def head(self, features) -> tuple:
        q = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(features)
        return q, jnp.max(q, axis=-1)


def q_lambda_targets(values, rewards, terminations, truncations, gamma: float, q_lambda: float):
    """Q(lambda) returns from the max Q (T + 1, n) of each row: a truncation bootstraps, a termination
    does not, nothing crosses the auto-reset step."""
    discounts = gamma * (1.0 - terminations)
    lambdas = q_lambda * (1.0 - (terminations | truncations))
    returns = jax.vmap(rlax.lambda_returns, in_axes=1, out_axes=1)
    return returns(rewards, discounts, values[1:], lambdas)


def rollout_values(agent: Agent, params, obs, groups: Groups, chunk_steps: int):
    """Values of (T + 1, n) obs, chunk_steps rows of a group at a time: memory follows the micro-batch."""

    def group_values(o):  # (rows, width, ...) -> (rows, width)
        return agent.apply(params, o.reshape(-1, *o.shape[2:]))[1].reshape(o.shape[:2])

    def chunk_values(o):  # (rows, n, ...) -> (rows, n)
        by_group = o.reshape(o.shape[0], -1, groups.width, *o.shape[2:]).swapaxes(0, 1)
        return groups.map(group_values, by_group).swapaxes(0, 1).reshape(o.shape[:2])

    values = groups.map(chunk_values, obs[:-1].reshape(-1, chunk_steps, *obs.shape[1:]))
    return jnp.concatenate([values.reshape(-1, obs.shape[1]), chunk_values(obs[-1:])])


def sequence_values(agent: Agent, params, data: dict, groups: Groups):
    """Max Q of (T + 1, n) rows, the LSTM unrolled from each env's stored state."""

    def group_values(obs, state, valid):  # (T + 1, width, ...), (1, width, size), (T, width)
        starts = jnp.concatenate([jnp.zeros_like(valid[:1]), ~valid])
        return agent.apply(params, obs, state[0], starts)[1]

    values = jnp.zeros(data["obs"].shape[:2])
    for k in range(groups.columns.shape[0]):
        env_set = groups.of_env_set(k)
        batch = env_set.take(dict(obs=data["obs"], state=data["recurrent_state"], valid=data["valid"]))
        per_group = env_set.map(group_values, batch["obs"], batch["state"], batch["valid"])
        values = values.at[:, env_set.columns].set(jnp.moveaxis(per_group, 0, 1))
    return values


def minibatch_time_indices(key, env_ids, num_steps: int, num_minibatches: int):
    """(minibatches, rows, n): each env's time steps shuffled with its own key, as on any layout."""
    perms = jax.vmap(lambda i: jax.random.permutation(jax.random.fold_in(key, i), num_steps))(env_ids)
    return perms.T.reshape(num_minibatches, num_steps // num_minibatches, -1)


def pqn_loss(agent: Agent, args: Args, params, batch: dict, count):
    """Half the squared TD error (purejaxql), summed over valid samples over the global count."""
    obs = batch["obs"]
    if batch["recurrent_state"].shape[-1]:  # whole sequences: the LSTM unrolled from the stored state
        starts = jnp.concatenate([jnp.zeros_like(batch["valid"][:1]), 1.0 - batch["valid"][:-1]]) > 0
        q = agent.apply(params, obs[:-1], batch["recurrent_state"][0], starts)[0]
    else:
        q = agent.apply(params, obs.reshape(-1, *obs.shape[2:]))[0].reshape(*obs.shape[:2], -1)
    q_taken = jnp.take_along_axis(q, batch["actions"][..., None], axis=-1)[..., 0]
    td_loss = 0.5 * (q_taken - batch["targets"]) ** 2
    metrics = dict(loss=td_loss, q_values=q_taken, targets=batch["targets"])
    # Dots behind a barrier: one order on every layout.
    valid = batch["valid"]
    metrics = {k: jnp.vdot(*jax.lax.optimization_barrier((v, valid))) / count for k, v in metrics.items()}
    return metrics["loss"], metrics


def update_minibatch(agent: Agent, args: Args, groups: Groups, data: dict, state, index):
    """One gradient step on time slices of every env, or with --lstm of env set `index`."""
    if args.lstm:
        groups = groups.of_env_set(index)
        batch = groups.take(data)
    else:
        batch = groups.take(data, index)  # (groups, rows, width) per field
    mask = batch["valid"].astype(jnp.float32)
    count = jnp.maximum(groups.total(jnp.sum, mask), 1.0)
    loss = partial(pqn_loss, agent, args)
    grads, metrics = groups.gradients(loss, state.params, dict(batch, valid=mask), count)
    return state.apply_gradients(grads=grads), metrics


# ---- The hooks the engine calls (tests/test_engine.py)

ACTION_SPACE = "Discrete"  # the engine refuses other envs
MICRO_BATCHES_SPLIT = "envs"  # a group's micro-batches split its envs (whole sequences with --lstm)


def minibatch_env_sets(args: Args) -> int:
    """The env sets (env id mod sets) minibatches take whole: each with --lstm, else one."""
    return args.num_minibatches if args.lstm else 1


def check_algorithm(args: Args):
    """Checks of flags that act together."""
    steps, envs = args.gradient_accumulation_steps, args.local_num_envs * flags.actor_threads(args)
    if args.exact and args.group_envs % steps:
        fail(f"--group-envs={args.group_envs} must be a multiple of --gradient-accumulation-steps={steps}")
    if args.lstm and envs < args.num_minibatches:
        fail(f"--num-minibatches={args.num_minibatches}: with --lstm, at most the {envs} envs of a process")
    if not args.lstm and args.num_steps % args.num_minibatches:
        fail(f"--num-steps={args.num_steps} must be a multiple of --num-minibatches={args.num_minibatches}")


def make_network(args: Args, action_space, platform: str | None = None) -> Agent:
    """obs -> (q (n, actions), max q (n,)), also for a saved model (cleanba/evaluate.py)."""
    xla_cpu = (platform or jax.default_backend()) == "cpu"
    dtype, lstm_size = jnp.dtype(args.conv_dtype).type, args.lstm_size if args.lstm else 0
    widths = tuple(args.channels), args.hidden_dim, tuple(args.mlp_widths)
    return Agent(action_space.n, *widths, args.resnet, xla_cpu, dtype, lstm_size)


def replay_fields(args: Args, spec) -> dict:
    """The replay memory's fields per env: none."""
    return {}


def recurrent_state_size(args: Args) -> int:
    """Each env's recurrent state width: cell and hidden (0 without --lstm)."""
    return 2 * args.lstm_size if args.lstm else 0


def policy_step(agent: Agent, params, obs, state, starts) -> tuple:
    """The actors' step: (q, next state), restarted where starts."""
    if not state.shape[-1]:
        return agent.apply(params, obs)[0], state
    q, _, state = agent.apply(params, obs[None], state, starts[None])
    return q[0], state


def sample_actions(args: Args, q, keys, step):
    """Epsilon-greedy with each env's own key, epsilon linear in the global env steps (CleanRL's)."""
    global_step = (step + 1.0) * args.num_envs
    duration = args.exploration_fraction * args.total_timesteps
    epsilon = jnp.maximum(args.start_e + (args.end_e - args.start_e) * global_step / duration, args.end_e)
    split = jax.vmap(jax.random.split)(keys)
    explore_keys, action_keys = split[:, 0], split[:, 1]
    explore = jax.vmap(jax.random.uniform)(explore_keys) < epsilon
    random_actions = jax.vmap(lambda k: jax.random.randint(k, (), 0, q.shape[1]))(action_keys)
    greedy = jnp.argmax(q, axis=1)
    actions = jnp.where(explore, random_actions, greedy)
    probs = epsilon / q.shape[1] + (1 - epsilon) * (actions == greedy)
    return actions, jnp.log(probs)


def env_actions(actions: np.ndarray, action_space) -> np.ndarray:
    """What EnvPool is sent: the sampled actions."""
    return actions


def make_optimizer(args: Args):
    """Gradient clipping, then RAdam (CleanRL's PQN), the rate annealed."""
    updates_per_iteration = args.update_epochs * args.num_minibatches

    def linear_schedule(count):
        return args.learning_rate * (1.0 - (count // updates_per_iteration) / args.num_iterations)

    return optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.inject_hyperparams(optax.radam)(learning_rate=linear_schedule if args.anneal_lr else args.learning_rate),
    )


def learn(agent: Agent, args: Args, shuffle_key, state: TrainState, replay_memory: dict, rollouts: tuple):
    """One learner iteration on this device's envs (in shard_map)."""
    rollout, groups = merge_rollouts(args, rollouts)
    data = dict(obs=rollout.obs, actions=rollout.actions, valid=rollout.valid, recurrent_state=rollout.recurrent_state)
    if args.lstm:
        values = sequence_values(agent, state.params, data, groups)
    else:
        groups = groups.of_env_set(0)  # every minibatch takes time steps of every env
        chunk_steps = args.num_steps // args.num_minibatches
        values = rollout_values(agent, state.params, rollout.obs, groups, chunk_steps)
        data["obs"] = rollout.obs[:-1]
    terminal = rollout.terminations, rollout.truncations
    data["targets"] = q_lambda_targets(values, rollout.rewards, *terminal, args.gamma, args.q_lambda)
    key = jax.random.fold_in(shuffle_key, state.step)  # state.step differs every iteration
    epochs = [jax.random.fold_in(key, epoch) for epoch in range(args.update_epochs)]
    if args.lstm:  # each epoch: the env sets in a shuffled order
        schedule = jnp.concatenate([jax.random.permutation(k, args.num_minibatches) for k in epochs])
    else:  # (epochs x minibatches, rows, n)
        ids, T = rollout.env_ids[0], args.num_steps
        schedule = jnp.concatenate([minibatch_time_indices(k, ids, T, args.num_minibatches) for k in epochs])
    state, metrics = jax.lax.scan(partial(update_minibatch, agent, args, groups, data), state, schedule)
    return state, replay_memory, jax.tree.map(jnp.mean, metrics)


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
