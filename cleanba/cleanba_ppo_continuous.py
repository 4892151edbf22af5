"""Cleanba PPO for continuous actions: actor threads step EnvPool on an actor device, a data-parallel learner trains.

Read top to bottom: the flags most runs set; above the ENGINE line, the algorithm a fork edits (flags, checks, the
Gaussian policy, the learner's observation and reward normalisation, GAE, PPO loss, minibatches, optimizer); below it,
the engine, byte for byte as in cleanba_ppo.py (tests/test_engine.py): envs, actor threads, learner, the run.
CleanRL's ppo_continuous_action.py on Cleanba's engine, for EnvPool's Box-action envs (docs/continuous.md). Helpers,
one concern each (docs/design.md): cleanba/reductions.py (the sums behind --exact), spaces.py, checkpoint.py,
flags.py, memory.py, logs.py, lifetime.py, devices.py, replicas.py. Usage: README.md and docs/.

    python cleanba/cleanba_ppo_continuous.py --env-id Hopper-v4 --actor-device-ids 0 --learner-device-ids 1 2 3
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

# Before JAX and EnvPool load: XLA's flags and memory fraction (cleanba/startup.py), and one line naming what to
# install where this Python or EnvPool cannot run. The imports that follow it are this file's own lint exception
# (E402), so that a fork, a copy of the file, passes the project's lint wherever it lies.
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

from cleanba import checkpoint, devices, flags, lifetime, logs, memory, spaces
from cleanba.flags import fail, flag
from cleanba.lifetime import Stop, StopTraining, queue_get, queue_put
from cleanba.logs import Stopwatch
from cleanba.reductions import Groups, chunked_apply, learner_env_blocks, learner_shapes, make_groups, put_on_learners
from cleanba.replicas import digest, unreplicate


@dataclass
class CommonFlags:
    """The flags most runs set, first in --help: what to train, for how long, from which seed, on which devices. The
    algorithm's flags (Algorithm) and the engine's (Args, below the ENGINE line) follow."""

    env_id: str = "HalfCheetah-v4"
    """an EnvPool id with Box actions: MuJoCo's gym tasks (e.g. Hopper-v4) or dm_control's (e.g. CheetahRun-v1)"""
    total_timesteps: int = flag(1_000_000, "[1, inf)")
    """total environment steps of all envs together"""
    seed: int = flag(1, "[0, inf)")
    """seed of the experiment: environments, network initialisation and action sampling derive from it"""
    actor_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that run the actor threads' policy inference"""
    learner_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that the learner is data-parallel over"""


@dataclass
class Algorithm:
    """PPO's flags for continuous actions (Schulman et al. 2017), with CleanRL's MuJoCo values (ppo_continuous_action:
    2,048 steps per update, 32 minibatches, 10 epochs). Args, below the ENGINE line, adds the engine's. Each numeric
    flag carries its meaningful range ("[" and "]" include the bound), checked before anything starts."""

    local_num_envs: int = flag(4, "[1, inf)", may_change_on_resume=True)
    """the number of parallel envs of each actor thread"""
    num_actor_threads: int = flag(2, "[1, inf)", may_change_on_resume=True)
    """the number of actor threads per actor device"""
    learning_rate: float = flag(3e-4, "(0, inf)")
    """the learning rate of the optimizer"""
    num_steps: int = flag(256, "[1, inf)")
    """the number of steps of each env per rollout (8 envs x 256 = CleanRL's 2,048 steps per update)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = flag(0.99, "[0, 1]")
    """the discount factor gamma (also that of the return whose scale the rewards are divided by)"""
    gae_lambda: float = flag(0.95, "[0, 1]")
    """the lambda of the general advantage estimation"""
    num_minibatches: int = flag(32, "[1, inf)")
    """the number of minibatches per epoch"""
    update_epochs: int = flag(10, "[1, inf)")
    """the number of passes over the rollout per update"""
    norm_adv: bool = True
    """normalise advantages with the statistics of the whole (global) minibatch"""
    clip_coef: float = flag(0.2, "(0, 1]")
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss around the rollout's values, as CleanRL's continuous PPO does"""
    ent_coef: float = flag(0.0, "[0, inf)")
    """coefficient of the entropy bonus"""
    vf_coef: float = flag(0.5, "(0, inf)")
    """coefficient of the value loss"""
    max_grad_norm: float = flag(0.5, "(0, inf)")
    """the maximum norm for gradient clipping"""
    hidden_dim: int = flag(64, "[1, inf)")
    """width of the two tanh layers of the policy MLP and of the value MLP"""
    norm_obs: bool = True
    """normalise observations by running mean and variance (the learner's, sent with the params), then clip them"""
    obs_clip: float = flag(10.0, "(0, inf)")
    """with --norm-obs: normalised observations are clipped to [-obs_clip, obs_clip]"""
    norm_reward: bool = True
    """divide rewards by the running standard deviation of each env's discounted return, then clip them"""
    reward_clip: float = flag(10.0, "(0, inf)")
    """with --norm-reward: scaled rewards are clipped to [-reward_clip, reward_clip]"""
    concurrency: bool = False
    """overlap rollouts and updates: the actor runs one policy version behind the learner"""


def check_algorithm(args: "Args"):
    """PPO's checks of flags that act together (each flag's range is checked by the engine)."""
    micro_batches = args.num_minibatches * args.gradient_accumulation_steps
    if args.num_steps % micro_batches:
        fail(
            f"--num-steps={args.num_steps} must be divisible by --num-minibatches x --gradient-accumulation-steps "
            f"= {micro_batches} (each minibatch takes the same number of time steps from every env); use a "
            f"multiple of {micro_batches}"
        )


# The action space this script trains (the engine refuses an env of another kind, naming the script that trains it).
ACTION_SPACE = "Box"
# How the engine groups a learner device's envs for PPO: every minibatch takes time steps of every env (one env set,
# minibatch_env_sets), and a group's micro-batches split its time steps.
MICRO_BATCHES_SPLIT = "time"


def minibatch_env_sets(args: "Args") -> int:
    return 1


class Agent(nn.Module):
    """Separate two-layer tanh MLPs for the policy's mean and the value, and a state-independent log standard
    deviation: a diagonal Gaussian, its action components independent (Huang et al., "The 37 Implementation Details
    of PPO", continuous details 1-3). Observations are normalised inside, with the statistics of the collection
    "normalizer", which the learner updates (update_normalizer) and the optimizer leaves alone; they travel with the
    params, so the actors and a saved model normalise as the learner does."""

    action_dim: int
    hidden_dim: int
    num_envs: int  # all envs of the run: each has its discounted return, for the reward scale
    norm_obs: bool
    obs_clip: float

    @nn.compact
    def __call__(self, obs):
        x = obs.reshape(obs.shape[0], -1).astype(jnp.float32)  # an image (CarRacing's frames) as one vector
        obs_mean = self.variable("normalizer", "obs_mean", jnp.zeros, x.shape[-1:])
        obs_var = self.variable("normalizer", "obs_var", jnp.ones, x.shape[-1:])
        self.variable("normalizer", "obs_count", lambda: jnp.float32(1e-4))  # gym's RunningMeanStd's prior count
        self.variable("normalizer", "return_mean", lambda: jnp.float32(0.0))
        self.variable("normalizer", "return_var", lambda: jnp.float32(1.0))
        self.variable("normalizer", "return_count", lambda: jnp.float32(1e-4))
        self.variable("normalizer", "env_returns", jnp.zeros, (self.num_envs,))  # each env's discounted return
        if self.norm_obs:
            mean, var = jax.lax.stop_gradient((obs_mean.value, obs_var.value))
            x = jnp.clip((x - mean) / jnp.sqrt(var + 1e-8), -self.obs_clip, self.obs_clip)
        action_mean = self.mlp(x, self.action_dim, 0.01)
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        value = self.mlp(x, 1, 1.0)
        return jnp.concatenate([action_mean, jnp.broadcast_to(log_std, action_mean.shape)], axis=1), value[:, 0]

    def mlp(self, x, outputs: int, head_gain: float):
        # Orthogonal init, gain sqrt(2) for the hidden layers, 0.01 for the policy head and 1 for the value head.
        for _ in range(2):
            x = nn.tanh(nn.Dense(self.hidden_dim, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(outputs, kernel_init=nn.initializers.orthogonal(head_gain))(x)


def make_network(args: "Args", action_space, platform: str | None = None) -> Agent:
    """The network from the flags, for training and for evaluating a saved model (used by cleanba/evaluate.py and
    gpu_compile.py): change this function with Agent's signature. Agent maps observations to (policy (batch,
    2 x action dims): the Gaussian's means then log standard deviations, values (batch,)). platform: where it runs
    (unused: the MLP is the same on every platform)."""
    return Agent(action_space.shape[0], args.hidden_dim, args.num_envs, args.norm_obs, args.obs_clip)


def gaussian_logprob(policy, actions):
    """Log-density of actions (..., d) under the diagonal Gaussians policy (..., 2d) (means, log stds), and the
    Gaussians' entropies: the sums over independent components."""
    mean, log_std = jnp.split(policy, 2, axis=-1)
    z = (actions - mean) * jnp.exp(-log_std)
    logprob = jnp.sum(-0.5 * z**2 - log_std - 0.5 * np.log(2 * np.pi), axis=-1)
    return logprob, jnp.sum(log_std + 0.5 * (1 + np.log(2 * np.pi)), axis=-1)


def recurrent_state_size(args: "Args") -> int:
    """The width of the recurrent state each env carries (the actor keeps it, a rollout stores it at row 0): none,
    the network is feed-forward (cleanba_impala.py's --lstm has one)."""
    return 0


def policy_step(agent: Agent, params, obs, state, starts) -> tuple:
    """The actors' and the evaluation's network step: (policy (n, width), the recurrent state, here empty)."""
    return agent.apply(params, obs)[0], state


def sample_actions(policy, keys):
    """The actor's sampling: for each env, with its own key, an action from its Gaussian and its log-probability. The
    sampled action is what the rollout stores and PPO learns from (env_actions clips what the env is sent)."""
    mean, log_std = jnp.split(policy, 2, axis=-1)
    noise = jax.vmap(lambda k: jax.random.normal(k, mean.shape[1:]))(keys)
    actions = mean + jnp.exp(log_std) * noise
    return actions, gaussian_logprob(policy, actions)[0]


def env_actions(actions: np.ndarray, action_space) -> np.ndarray:
    """What EnvPool is sent for the sampled actions: clipped to the action space's bounds (gym's ClipAction), on the
    host, so that the rollout keeps the unclipped sample whose log-probability PPO's ratio uses."""
    return np.clip(actions, action_space.low, action_space.high)


def compute_gae(values, rewards, terminations, truncations, gamma: float, gae_lambda: float):
    """GAE over (T, n) arrays, values (T + 1, n). A termination does not bootstrap; a truncation bootstraps from
    the final obs (the next row); neither lets the advantage of the auto-reset step flow back."""
    discounts = gamma * (1.0 - terminations)
    lambdas = gae_lambda * (1.0 - (terminations | truncations))
    gae = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=1, out_axes=1)
    advantages = gae(rewards, discounts, lambdas, values)
    return advantages, advantages + values[:-1]


def merge_statistics(mean, var, count, batch_mean, batch_var, batch_count):
    """Running mean and variance merged with a batch's (Chan et al. 1979), as gym's RunningMeanStd does."""
    delta = batch_mean - mean
    total = count + batch_count
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return mean + delta * batch_count / total, m2 / total, total


def batch_statistics(groups: "Groups", x, mask):
    """Mean and variance, and the count, of x's valid samples over every group of every learner device: x (rows, n,
    ...) and mask (rows, n); sums in the groups' order, so with --exact the same on every layout."""
    data = groups.take(dict(x=x, mask=mask))
    count = groups.total(jnp.sum, data["mask"])
    safe = jnp.maximum(count, 1.0)
    mean = groups.total(lambda v, m: jnp.tensordot(m, v, axes=2), data["x"], data["mask"]) / safe
    var = groups.total(lambda v, m: jnp.tensordot(m, (v - mean) ** 2, axes=2), data["x"], data["mask"]) / safe
    return mean, var, count


def scale_rewards(args: "Args", normalizer: dict, rollout: "Rollout", groups: "Groups"):
    """(rewards divided by the standard deviation of the discounted return and clipped, normalizer with the return
    statistics and each env's return updated): gym's NormalizeReward, with the statistics of every env of the run,
    updated from this rollout before it is scaled. Each env's discounted return carries over from its last rollout
    and restarts at the auto-reset step (invalid), where a new episode begins."""
    env_ids = rollout.env_ids[0]

    def discount(carry, step):
        reward, valid = step
        carry = jnp.where(valid, reward + args.gamma * carry, 0.0)
        return carry, carry

    start = normalizer["env_returns"][jnp.maximum(env_ids, 0)]  # pad envs (negative ids): every step invalid
    last, returns = jax.lax.scan(discount, start, (rollout.rewards, rollout.valid))
    batch = batch_statistics(groups, returns, rollout.valid.astype(jnp.float32))
    mean, var, count = normalizer["return_mean"], normalizer["return_var"], normalizer["return_count"]
    mean, var, count = merge_statistics(mean, var, count, *batch)
    # Every device gets every env's return at the rollout's end (a copy, no arithmetic: the same on every layout).
    ids, last = jax.lax.all_gather((env_ids, last), "learner", tiled=True)
    env_returns = normalizer["env_returns"].at[jnp.where(ids >= 0, ids, args.num_envs)].set(last, mode="drop")
    rewards = jnp.clip(rollout.rewards / jnp.sqrt(var + 1e-8), -args.reward_clip, args.reward_clip)
    return rewards, dict(normalizer, return_mean=mean, return_var=var, return_count=count, env_returns=env_returns)


def update_obs_statistics(normalizer: dict, rollout: "Rollout", groups: "Groups") -> dict:
    """The observation statistics merged with the rollout's valid observations (each once: the last row is the next
    rollout's first), after the update, so that the update saw the observations normalised as the actor did."""
    obs = rollout.obs[:-1].reshape(*rollout.valid.shape, -1).astype(jnp.float32)  # as the network flattens it
    batch = batch_statistics(groups, obs, rollout.valid.astype(jnp.float32))
    mean, var, count = merge_statistics(normalizer["obs_mean"], normalizer["obs_var"], normalizer["obs_count"], *batch)
    return dict(normalizer, obs_mean=mean, obs_var=var, obs_count=count)


def minibatch_time_indices(key, env_ids, num_steps: int, num_minibatches: int):
    """(num_minibatches, num_steps // num_minibatches, n): each env's time steps, shuffled with its own key, so a
    global minibatch holds the same samples however the envs are spread over learner devices."""
    perms = jax.vmap(lambda i: jax.random.permutation(jax.random.fold_in(key, i), num_steps))(env_ids)
    return perms.T.reshape(num_minibatches, num_steps // num_minibatches, -1)


def ppo_loss(agent: Agent, args: "Args", params, batch: dict, count):
    obs_shape = batch["obs"].shape[2:]
    policy, values = agent.apply(params, batch["obs"].reshape(-1, *obs_shape))
    policy = policy.reshape(*batch["actions"].shape[:2], -1)
    values = values.reshape(batch["actions"].shape[:2])
    newlogprobs, entropy = gaussian_logprob(policy, batch["actions"])
    logratio = newlogprobs - batch["logprobs"]
    ratio = jnp.exp(logratio)
    advantages = batch["advantages"]
    pg_loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - args.clip_coef, 1 + args.clip_coef))
    v_loss = 0.5 * (values - batch["returns"]) ** 2
    if args.clip_vloss:  # the larger of the plain and the clipped error (CleanRL; "37 details", detail 9)
        clipped = batch["values"] + jnp.clip(values - batch["values"], -args.clip_coef, args.clip_coef)
        v_loss = jnp.maximum(v_loss, 0.5 * (clipped - batch["returns"]) ** 2)
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    # Forking: add a new loss term here, per sample (docs/forking.md): it is then masked and summed like the
    # rest, the same on any layout. A new entry of `metrics` is logged as losses/<name>.
    # Sums over this device's valid samples divided by the global count: after the sum of the gradients over all
    # groups this is exactly the gradient of the global minibatch mean, on any number of devices.
    mask = batch["valid"]
    metrics = dict(
        loss=loss,
        policy_loss=pg_loss,
        value_loss=v_loss,
        entropy=entropy,
        approx_kl=(ratio - 1) - logratio,
        clipfrac=(jnp.abs(ratio - 1) > args.clip_coef).astype(jnp.float32),
    )
    # Masked sums as dots: XLA computes a dot as one op (the discrete PPO's comment says why that matters).
    metrics = {k: jnp.vdot(v, mask) / count for k, v in metrics.items()}
    return metrics["loss"], metrics


def update_minibatch(agent: Agent, args: "Args", state: TrainState, batch: dict, groups: "Groups"):
    """One gradient step on a global minibatch. batch: this device's share, (groups, rows, width) per field. Every
    sum is taken per group, then over all groups of all devices (groups.total)."""
    mask = batch["valid"].astype(jnp.float32)
    count = jnp.maximum(groups.total(jnp.sum, mask), 1.0)
    if args.norm_adv:  # statistics of the global minibatch, whatever the layout
        advantages = batch["advantages"]
        mean = groups.total(jnp.vdot, advantages, mask) / count
        std = jnp.sqrt(groups.total(lambda a, m: jnp.vdot((a - mean) ** 2, m), advantages, mask) / count)
        batch = dict(batch, advantages=(advantages - mean) / (std + 1e-8))
    grads, metrics = groups.gradients(partial(ppo_loss, agent, args), state.params, dict(batch, valid=mask), count)
    return state.apply_gradients(grads=grads), metrics


def rollout_values(agent: Agent, params, obs, groups: "Groups", chunk_steps: int):
    """Values of (T + 1, n) observations, chunk_steps time steps of one group of envs at a time, then the last row:
    with --exact, a group's values are computed on the same shapes on every layout."""

    def group_values(o):  # (rows, width, ...) -> (rows, width)
        return agent.apply(params, o.reshape(-1, *o.shape[2:]))[1].reshape(o.shape[:2])

    def chunk_values(o):  # (rows, n, ...) -> (rows, n)
        by_group = o.reshape(o.shape[0], -1, groups.width, *o.shape[2:]).swapaxes(0, 1)
        return groups.map(group_values, by_group).swapaxes(0, 1).reshape(o.shape[:2])

    values = groups.map(chunk_values, obs[:-1].reshape(-1, chunk_steps, *obs.shape[1:]))
    return jnp.concatenate([values.reshape(-1, obs.shape[1]), chunk_values(obs[-1:])])


def learn(agent: Agent, args: "Args", shuffle_key, state: TrainState, rollout: "Rollout", groups: "Groups"):
    """One learner iteration on this learner device's envs (inside shard_map). The rewards scaled (scale_rewards),
    then the loop nest of discrete PPO's learn: epochs x minibatches (lax.scan over minibatch_step) -> groups of
    envs (groups.total) -> micro-batches (groups.gradients); then the observation statistics updated. Returns the new
    state and the metrics averaged over the minibatches, with the normalizer's."""
    groups = groups.of_env_set(0)  # every minibatch takes time steps of every env: one env set
    normalizer = state.params["normalizer"]
    rewards = rollout.rewards
    if args.norm_reward:
        rewards, normalizer = scale_rewards(args, normalizer, rollout, groups)
    chunk_steps = args.num_steps // (args.num_minibatches * args.gradient_accumulation_steps)  # a micro-batch
    values = rollout_values(agent, state.params, rollout.obs, groups, chunk_steps)
    advantages, returns = compute_gae(
        values, rewards, rollout.terminations, rollout.truncations, args.gamma, args.gae_lambda
    )
    data = dict(
        obs=rollout.obs[:-1],
        actions=rollout.actions,
        logprobs=rollout.logprobs,
        values=values[:-1],
        advantages=advantages,
        returns=returns,
        valid=rollout.valid,
    )
    key = jax.random.fold_in(shuffle_key, state.step)  # state.step differs every iteration
    env_ids = rollout.env_ids[0]
    schedule = jnp.concatenate(
        [  # (epochs x minibatches, rows, n): each minibatch's time steps of each env
            minibatch_time_indices(jax.random.fold_in(key, epoch), env_ids, args.num_steps, args.num_minibatches)
            for epoch in range(args.update_epochs)
        ]
    )

    def minibatch_step(state, time_indices):
        return update_minibatch(agent, args, state, groups.take(data, time_indices), groups)

    state, metrics = jax.lax.scan(minibatch_step, state, schedule)
    if args.norm_obs:
        normalizer = update_obs_statistics(normalizer, rollout, groups)
    state = state.replace(params=dict(state.params, normalizer=normalizer))
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["normalizer/return_std"] = jnp.sqrt(normalizer["return_var"])
    metrics["normalizer/obs_std_mean"] = jnp.mean(jnp.sqrt(normalizer["obs_var"]))
    metrics["normalizer/obs_count"] = normalizer["obs_count"]
    return state, metrics


def make_optimizer(args: "Args"):
    updates_per_iteration = args.update_epochs * args.num_minibatches

    def linear_schedule(count):
        return args.learning_rate * (1.0 - (count // updates_per_iteration) / args.num_iterations)

    network = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.inject_hyperparams(optax.adam)(
            learning_rate=linear_schedule if args.anneal_lr else args.learning_rate, eps=1e-5
        ),
    )
    # The normalizer's statistics are the learner's to update (learn), not the optimizer's.
    return optax.multi_transform(
        {"network": network, "normalizer": optax.set_to_zero()},
        lambda params: {name: name if name == "normalizer" else "network" for name in params},
    )


# ======== ENGINE: everything below this line is the same, byte for byte, in every script of the family
# In the order a run uses it: flags, envs, actor, learner, run (start, train, stop). It calls the algorithm above
# only through the names tests/test_engine.py lists; the helpers it imports from cleanba/ change nothing it learns.


@dataclass
class Args(Algorithm, CommonFlags):
    """The flags most runs set (CommonFlags), the algorithm's, then the engine's: envs, learner, logs, checkpoints."""

    atari_protocol: Literal["machado", "impala"] = "machado"
    """Atari settings: Machado et al. 2018 (sticky actions) or the IMPALA paper's (life loss, 30 no-ops)"""
    gradient_accumulation_steps: int = flag(1, "[1, inf)")
    """split each minibatch into this many micro-batches whose gradients are summed (saves memory)"""
    exact: bool = False
    """sum over fixed groups of envs in a fixed order: the same params, bit for bit, on every learner layout"""
    group_envs: int = flag(8, "[1, inf)")
    """with --exact: the envs of one actor thread per group (each group's gradient is computed on its own)"""
    memory_check: bool = flag(True, may_change_on_resume=True)
    """refuse, before training, a learner update that needs more memory than its devices (or the host) have left"""
    exp_name: str = flag(Path(__file__).stem, may_change_on_resume=True)
    """the name of this experiment"""
    run_name: str | None = flag(None, may_change_on_resume=True)
    """the run directory under runs/; without it env__exp__seed, then the SLURM job ids or the start time"""
    log_frequency: int = flag(10, "[1, inf)", may_change_on_resume=True)
    """write charts/ and losses/ and print the progress line every this many iterations (stats/ every one)"""
    track: bool = flag(False, may_change_on_resume=True)
    """sync the TensorBoard logs to Weights and Biases"""
    wandb_project_name: str = flag("cleanba", may_change_on_resume=True)
    """the wandb project name"""
    wandb_entity: str | None = flag(None, may_change_on_resume=True)
    """the wandb entity (team); None uses your default entity"""
    checkpoint_frequency: int = flag(0, "[0, inf)", may_change_on_resume=True)
    """save a checkpoint every this many iterations, at the last, and when stopped by SIGINT or SIGTERM (0: never)"""
    resume: bool = flag(False, may_change_on_resume=True)
    """continue from runs/<run_name>/checkpoint.msgpack (automatic in a requeued SLURM job)"""
    save_model: bool = flag(False, may_change_on_resume=True)
    """save the final params and args to runs/<run_name>/<exp_name>.cleanba_model, then evaluate them"""
    eval_episodes: int = flag(10, "[0, inf)", may_change_on_resume=True)
    """with --save-model: episodes played by the saved model at the end, logged as eval/episodic_return (0: none)"""
    capture_video: bool = flag(False, may_change_on_resume=True)
    """with --save-model: record the evaluation episodes of one env to runs/<run_name>/videos/*.mp4"""
    upload_model: bool = flag(False, may_change_on_resume=True)
    """with --save-model: upload the model, its evaluation, videos and a model card to the Hugging Face Hub"""
    hf_repo_id: str | None = flag(None, may_change_on_resume=True)
    """with --upload-model: the Hub repository; without it <your Hub user>/<env_id>-<exp_name>-seed<seed>"""
    distributed: bool = flag(False, may_change_on_resume=True)
    """call jax.distributed.initialize() first: several processes, e.g. one per node under SLURM"""
    coordinator_address: str | None = flag(None, may_change_on_resume=True)
    """with --distributed outside SLURM: host:port of process 0; without it $JAX_COORDINATOR_ADDRESS"""
    num_processes: int | None = flag(None, may_change_on_resume=True)
    """with --distributed outside SLURM: the number of processes"""
    process_id: int | None = flag(None, may_change_on_resume=True)
    """with --distributed outside SLURM: the rank of this process, 0 .. num_processes - 1"""
    heartbeat_timeout: int = flag(100, "[1, inf)", may_change_on_resume=True)
    """with --distributed: seconds after which the others abort when a process has died"""
    stall_timeout: int = flag(0, "[0, inf)", may_change_on_resume=True)
    """abort when no iteration completes for this many seconds, e.g. a peer process is stuck (0: never)"""

    # Sizes filled in at run time (paper, appendix A); not command-line flags.
    world_size: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)  # the number of processes
    process_index: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)  # this process's, 0 .. world_size - 1
    num_envs: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)
    local_minibatch_size: tyro.conf.Suppress[int] = flag(0, may_change_on_resume=True)
    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_iterations: tyro.conf.Suppress[int] = 0


def check_args(args: Args):
    flags.check_flags(args)  # ranges, device ids, flags that act together
    check_algorithm(args)
    spaces.check_env(args.env_id, env_kwargs(args), ACTION_SPACE, Path(__file__).name, args.capture_video)


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
            f"--total-timesteps={args.total_timesteps} is smaller than one batch of {args.batch_size} steps "
            f"(num_envs={args.num_envs} x num_steps={args.num_steps}); raise it or shrink the batch"
        )


# ---- Envs: EnvPool, and the rollout an actor thread fills


def env_kwargs(args: Args) -> dict:
    if envpool.registration.registry.specs[args.env_id][0] != "envpool.atari":
        return {}
    common = dict(img_height=84, img_width=84, stack_num=4, frame_skip=4, reward_clip=True, max_episode_steps=27_000)
    if args.atari_protocol == "machado":  # Machado et al. 2018, section 5; Cleanba paper, appendix A
        return dict(common, repeat_action_probability=0.25, full_action_space=True, episodic_life=False, noop_max=1)
    return dict(common, repeat_action_probability=0.0, full_action_space=False, episodic_life=True, noop_max=30)


def make_env(args: Args, num_envs: int, seed: int):
    # batch_size == num_envs keeps recv() deterministic and in env-id order (EnvPool docs, "Auto-reset").
    return envpool.make(
        args.env_id, env_type="gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seed, **env_kwargs(args)
    )


class Rollout(NamedTuple):
    """num_steps transitions of some envs, time-major: every field is (rows, envs, ...). obs has one more row: the
    obs after the last step. A new field needs its (shape, dtype) in rollout_fields and its value in rollout_actor."""

    obs: np.ndarray  # (T + 1, n, *obs_shape)
    actions: np.ndarray  # (T, n, *action_shape): an index, or a Box action as sampled
    logprobs: np.ndarray  # (T, n) of the actions under the actor's policy
    rewards: np.ndarray  # (T, n)
    terminations: np.ndarray  # (T, n) the episode ended: no bootstrap
    truncations: np.ndarray  # (T, n) time limit: bootstrap from the final obs, stored in the next row
    valid: np.ndarray  # (T, n) False for EnvPool's auto-reset step, whose action is ignored
    env_ids: np.ndarray  # (1, n) global env indices, for layout-invariant shuffling and sums (pad envs: negative)
    recurrent_state: np.ndarray  # (1, n, state size) each env's at row 0, as restarted there (feed-forward: empty)


def rollout_fields(args: Args, spec) -> Rollout:
    """(shape, dtype) of each field of one actor thread's rollout of the envs of spec (envpool.make_spec)."""
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
    """Host-side facts about a rollout, logged by the learner (the only thread that writes logs)."""

    policy_version: int
    param_queue_wait: float
    handover_start: float  # time.time() when the actor began to queue the rollout
    rollout_time: float
    episode_returns: np.ndarray  # (T, n) raw score of each game that ended at a step, NaN elsewhere
    episode_lengths: np.ndarray  # (T, n) its length in agent steps, NaN elsewhere
    timings: dict  # seconds per part of the rollout (Stopwatch)
    rollout_queue_wait: float = 0.0  # how long the actor waited to queue it: filled in by the learner


# ---- Actor: each actor thread plays its envs with the params the learner queued for it, and queues the rollout


def make_policy(args: Args, agent, action_key):
    """The actor's jitted policy step: (params, obs, recurrent state, starts, global env ids, step) -> (the columns
    [actions, logprobs]: an action's components, then its log-probability (sample_actions); the next recurrent
    state). starts: the obs begins an episode (policy_step restarts the state). With --exact the network runs on
    --group-envs envs at a time, each chunk on its own (optimization barriers), so that an env's logits do not depend
    on how many envs its actor thread steps (XLA:CPU's kernels round by batch)."""
    chunk = args.group_envs if args.exact else 0

    @jax.jit
    def policy(params, obs, state, starts, env_ids, step):
        def network(obs, state, starts):
            return policy_step(agent, params, obs, state, starts)

        policy_out, state = (
            chunked_apply(network, (obs, state, starts), chunk) if chunk else network(obs, state, starts)
        )
        # One key per (global env index, step): env n samples the same actions on every device layout.
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(action_key, i), step))(env_ids)
        actions, logprobs = sample_actions(policy_out, keys)
        # One array, so one device-to-host copy per step instead of two (an action index is exact in float32).
        columns = [actions.reshape(actions.shape[0], -1).astype(jnp.float32), logprobs[:, None]]
        return jnp.concatenate(columns, axis=1), state

    return policy


@lifetime.stops_run_on_error  # an error in an actor thread stops the run; the main thread reports it
def rollout_actor(args, start_iteration, actor_id, device, mesh, policy, param_queue, rollout_queue, stop):
    """Thread body: for each iteration, take the params the learner queued for it, play num_steps steps of its envs,
    queue the rollout. How far behind the learner it runs is decided by the learner alone (train). actor_id: the
    thread's index over the actor threads of all processes."""
    first_env = actor_id * args.local_num_envs  # global env indices, the same on every layout
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
        # EnvPool resets an env on the step after its episode ends (a lost life too, with episodic_life): that step
        # ignores the action and must not be learned from (cleanrl issue 562). Its elapsed_step is 0 only after a
        # real game over, so the mask follows the done flags of the step before.
        resetting = np.zeros(n, bool)
        # Each env's recurrent state carries over steps and rollouts on the actor device (empty for a feed-forward
        # network); it restarts from zeros at each episode's first obs (starts), as the learner's unroll does.
        state, starts = jax.device_put(np.zeros((n, recurrent_state_size(args)), np.float32), device), np.ones(n, bool)
        for iteration in range(start_iteration, args.num_iterations + 1):
            clock = Stopwatch()
            policy_version, params = queue_get(param_queue, stop)
            params = jax.device_put(params, device)
            clock.lap("param_queue_wait")
            fields = rollout_fields(args, spec)
            storage = Rollout(*[np.empty(shape, dtype) for shape, dtype in fields])._replace(env_ids=env_ids[None])
            storage.recurrent_state[0] = np.where(starts[:, None], 0.0, np.asarray(state))  # the learner's at row 0
            returns, lengths = np.full((T, n), np.nan), np.full((T, n), np.nan)  # of the games that end, at their end
            for t in range(T):
                storage.obs[t] = next_obs
                clock.lap("storage")
                # The step keys the action sampling: a resumed run continues it (envs restart from a reset, as
                # EnvPool's state cannot be saved).
                sampled, state = policy(params, next_obs, state, starts, env_ids_on_device, (iteration - 1) * T + t)
                clock.lap("inference")  # dispatch only: device_to_host waits for the result (no extra sync)
                sampled = np.asarray(sampled)
                actions = sampled[:, :-1].reshape(storage.actions.shape[1:]).astype(storage.actions.dtype)
                logprobs = sampled[:, -1]
                clock.lap("device_to_host")
                envs.send(env_actions(actions, spec.action_space), info["env_id"])
                clock.lap("env_send")
                next_obs, reward, terminated, truncated, info = envs.recv()
                next_obs = spaces.flat_observations(next_obs, spec.observation_space)
                clock.lap("env_recv")
                storage.actions[t], storage.logprobs[t], storage.rewards[t] = actions, logprobs, reward
                storage.terminations[t], storage.truncations[t] = terminated, truncated
                storage.valid[t] = ~resetting
                # EnvPool's auto-reset step (resetting) ignores its action and returns a new episode's first obs: the
                # next step starts the recurrent state afresh. The final obs before it keeps the episode's state.
                starts, resetting = resetting, terminated | truncated
                # Scores are raw game rewards until the real game over (not a lost life, not clipped). EnvPool's
                # info["terminated"] is int32: unconverted, it would index envs 0 and 1 instead of masking.
                game_over = info.get("terminated", terminated).astype(bool) | truncated
                returns[t], lengths[t] = scores.step(info.get("reward", reward), storage.valid[t], game_over)
                clock.lap("storage")
            storage.obs[T] = next_obs
            rollout = put_on_learners(storage, mesh, learner_blocks(args))
            clock.lap("host_to_device")
            waited, timings = clock.sums.pop("param_queue_wait"), clock.sums
            rollout_info = RolloutInfo(
                policy_version, waited, time.time(), sum(timings.values()), returns, lengths, timings
            )
            queue_put(rollout_queue, (rollout, rollout_info), stop)
    finally:
        envs.close()


def make_actor_threads(args: Args, start_iteration: int, mesh: Mesh, policy, stop: Stop) -> tuple:
    """(param queues, rollout queues, threads) of this process's actor threads, not started. Each queue holds one
    item: the params of an actor's next rollout, or its last rollout."""
    actor_devices = [jax.local_devices()[i] for i in args.actor_device_ids for _ in range(args.num_actor_threads)]
    param_queues = [queue.Queue(maxsize=1) for _ in actor_devices]
    rollout_queues = [queue.Queue(maxsize=1) for _ in actor_devices]
    threads = []
    for local_id, (device, param_queue, rollout_queue) in enumerate(zip(actor_devices, param_queues, rollout_queues)):
        actor_id = args.process_index * len(actor_devices) + local_id  # over all processes: it fixes the actor's envs
        actor_args = (args, start_iteration, actor_id, device, mesh, policy, param_queue, rollout_queue, stop)
        threads.append(threading.Thread(target=rollout_actor, args=actor_args, name=f"actor-{actor_id}", daemon=True))
    return param_queues, rollout_queues, threads


# ---- Learner: the update of every actor thread's rollout, split over the learner devices (put_on_learners)


def learner_blocks(args: Args) -> tuple:
    """(env sets, block size): learner devices get an actor thread's envs in whole blocks of the algorithm's groups."""
    return learner_env_blocks(args, minibatch_env_sets(args), MICRO_BATCHES_SPLIT)


def learner_update(agent, args: Args, shuffle_key, state: TrainState, rollouts: tuple):
    """One learner iteration on this device's share of the envs of every actor thread (runs in shard_map)."""
    rollout = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *rollouts)  # every field: envs on axis 1
    groups = make_groups(args, rollout.env_ids[0], minibatch_env_sets(args), MICRO_BATCHES_SPLIT)
    return learn(agent, args, shuffle_key, state, rollout, groups)


def make_learner_update(agent, args: Args, shuffle_key, mesh: Mesh, num_actors: int):
    """(state, one rollout per actor thread of this process) -> (state, metrics), data-parallel over the mesh.
    Loops (minibatches, groups, micro-batches) are rolled on every platform, so that memory is reused from one step
    to the next: the learner needs about one micro-batch step's memory (docs/gpu.md).
    Forking: `args` is read once, when the update is traced; a value that changes during training must be an input
    (the learning rate is one: optax.inject_hyperparams keeps it in state.opt_state), not a field changed on args."""
    return jax.jit(
        jax.shard_map(
            partial(learner_update, agent, args, shuffle_key),
            mesh=mesh,
            in_specs=(P(), (P(None, "learner"),) * num_actors),
            out_specs=(P(), P()),
            # Without replication typing, gradients stay per-device until the explicit sum over groups (Groups.sum)
            # (and rlax's scans, whose carries are unannotated, trace as they are).
            check_vma=False,
        )
    )


def compile_learner_update(agent, args: Args, shuffle_key, mesh: Mesh, state: TrainState, rollouts: tuple):
    """make_learner_update compiled ahead of time from shapes: the first iteration waits for no compile, and what the
    update needs in memory is known before any env steps (check_learner_memory)."""
    return make_learner_update(agent, args, shuffle_key, mesh, len(rollouts)).lower(state, rollouts).compile()


def make_agent(args: Args, spec, mesh: Mesh):
    """The network, its initial train state replicated over the learner devices, and the action and shuffle keys.
    spec: the envs' (envpool.make_spec)."""
    agent = make_network(args, spec.action_space, mesh.devices.flat[0].platform)
    init_key, action_key, shuffle_key = jax.random.split(jax.random.key(args.seed), 3)
    state = initial_state(agent, args, spec, init_key)
    return agent, jax.device_put(state, NamedSharding(mesh, P())), action_key, shuffle_key


def initial_state(agent, args: Args, spec, init_key) -> TrainState:
    obs_shape, obs_dtype = spaces.observation_field(spec.observation_space)
    obs_example = np.zeros((1, *obs_shape), obs_dtype)

    def create(key):  # one compiled program: run op by op, the initializers compile dozens (seconds at each start)
        state = TrainState.create(apply_fn=None, params=agent.init(key, obs_example), tx=make_optimizer(args))
        return state.replace(step=jnp.int32(0))  # an int32 array, as update returns it: no second compile

    return jax.jit(create)(init_key)


# ---- Run: start sets up devices, state, the compiled update, queues and actor threads; train is the learner's loop


@dataclass
class TrainingRun:
    """What start() sets up for train() and main's end (lifetime.shut_down, the evaluation, close_and_exit)."""

    args: Args
    stop: Stop  # set to stop every thread; it keeps why (a signal, an error)
    run_dir: Path  # runs/<run_name>: logs, checkpoint, model
    mesh: Mesh  # the learner devices of all processes
    state: TrainState  # replicated over the mesh
    iterations_done: int  # the last iteration whose update is in `state` (0: none)
    start_iteration: int  # the first iteration of this run (after a resumed checkpoint's)
    update: jax.stages.Compiled  # the learner update: (state, one rollout per actor thread) -> (state, metrics)
    logger: logs.IterationLogger | None  # process 0's logs (None on the others)
    param_queues: list  # per actor thread, size 1: the params of its next rollout
    rollout_queues: list  # per actor thread, size 1: its last rollout
    threads: list  # the actor threads, started by train
    model_path: Path | None = None  # set once the trained model is saved

    @property
    def checkpoint_path(self) -> Path:
        return checkpoint.checkpoint_path(self.run_dir)


def start(args: Args) -> TrainingRun:
    """Everything before the first iteration, in the order that lets bad input fail before any thread starts."""
    if args.exact:  # deterministic GPU kernels: what --exact needs besides its order of sums (read as XLA starts)
        add_xla_flags("--xla_gpu_deterministic_ops=true")
    if args.distributed:  # before anything touches a device
        devices.initialize_distributed(args)
    devices.check_devices(args)
    fill_runtime_sizes(args, jax.process_count(), jax.process_index())
    stop, run_dir = Stop(), Path("runs") / (args.run_name or flags.default_run_name(args))
    learners = [jax.local_devices(process_index=p)[i] for p in range(args.world_size) for i in args.learner_device_ids]
    mesh = Mesh(np.array(learners), ("learner",))

    spec = envpool.make_spec(args.env_id, **env_kwargs(args))
    agent, state, action_key, shuffle_key = make_agent(args, spec, mesh)
    # The network's contract, from shapes alone: a fork's head of the wrong width fails now, not silently in training.
    from cleanba.evaluate import check_network

    check_network(sys.modules[__name__], args, unreplicate(state.params))
    # With --resume or in a requeued SLURM job: the iteration and train state of the checkpoint (else 0 and state).
    iterations_done, state, episode_window = checkpoint.resume(args, checkpoint.checkpoint_path(run_dir), state)

    fields = rollout_fields(args, spec)
    rollouts = (learner_shapes(fields, args.local_num_envs, mesh, learner_blocks(args)),) * flags.actor_threads(args)
    compile_update = partial(compile_learner_update, agent, shuffle_key=shuffle_key, mesh=mesh, state=state)
    compile_start = time.time()
    update = compile_update(args, rollouts=rollouts)
    compile_time = time.time() - compile_start
    if args.memory_check:  # refuse a learner that cannot fit in memory, before training
        memory.check_learner_memory(args, update, partial(compile_update, rollouts=rollouts), rollouts, fields)

    logger = None
    if args.process_index == 0:  # only process 0 writes logs, checkpoints and the model
        purge_step = iterations_done * args.batch_size + 1 if iterations_done else None  # resumed: drop later logs
        logger = logs.IterationLogger(args, run_dir, purge_step, episode_window, compile_time)
        logs.print_start(args, run_dir, learner_blocks(args))

    actors = make_actor_threads(args, iterations_done + 1, mesh, make_policy(args, agent, action_key), stop)
    lifetime.handle_signals(stop, args.distributed)
    return TrainingRun(args, stop, run_dir, mesh, state, iterations_done, iterations_done + 1, update, logger, *actors)


def send_params_for_rollout(run: TrainingRun, rollout: int):
    """Queue the current params for every actor thread as those of its rollout number `rollout`, if the run has it:
    an actor takes params before each rollout, so params sent for no rollout would wait forever in a full queue."""
    if rollout <= run.args.num_iterations:
        params = unreplicate(run.state.params)
        for q in run.param_queues:
            queue_put(q, (run.iterations_done, params), run.stop)


def train(run: TrainingRun):
    """The learner's loop, from run.start_iteration to the end or a stop; the model saved at the end."""
    args, stop = run.args, run.stop
    # Before the first sends: each waits for an actor to take the previous one, so a stuck actor would stop them.
    last_progress = lifetime.start_watchdog(args.stall_timeout, stop)
    for thread in run.threads:
        thread.start()
    # The one-step lag (paper, section 4): rollout i is played with the params of update i - 1 - lag.
    lag = int(args.concurrency)
    for rollout in range(run.start_iteration, run.start_iteration + 1 + lag):  # played with the starting params
        send_params_for_rollout(run, rollout)
    process_gather = devices.make_process_gather(run.mesh)
    taken_at = [None] * len(run.rollout_queues)  # when the learner took each actor's last rollout
    for iteration in range(run.start_iteration, args.num_iterations + 1):
        start_time = time.time()
        received = [queue_get(q, stop) for q in run.rollout_queues]  # (rollout, RolloutInfo) of each actor thread
        rollout_queue_wait = time.time() - start_time
        # An actor queues a rollout once the learner took its previous one: the wait is known at this take.
        rollout_infos = [
            info._replace(rollout_queue_wait=max(0.0, (previous or info.handover_start) - info.handover_start))
            for (_, info), previous in zip(received, taken_at)
        ]
        taken_at = [time.time()] * len(received)
        start_time = time.time()
        run.state, metrics = run.update(run.state, tuple(rollout for rollout, _ in received))
        jax.block_until_ready(run.state)
        update_time = time.time() - start_time
        run.iterations_done = iteration
        last_progress[0] = time.time()
        send_params_for_rollout(run, iteration + 1 + lag)
        # The games that ended, in global env order (actor threads, then processes): every process takes part.
        episodes = process_gather(
            np.concatenate([np.stack([i.episode_returns, i.episode_lengths]) for i in rollout_infos], 2)
        )
        if run.logger is not None:
            run.logger.log(iteration, rollout_infos, episodes, rollout_queue_wait, update_time, run.state, metrics)
            # And the last iteration's: a signal during the model's save or evaluation, or a requeue, then finds
            # nothing left to train.
            last = iteration == args.num_iterations
            if args.checkpoint_frequency and (iteration % args.checkpoint_frequency == 0 or last):
                checkpoint.save_run_checkpoint(run)
        # All processes see a SIGTERM (e.g. SLURM preemption) at the same iteration and stop together.
        if args.distributed and multihost_utils.reached_preemption_sync_point(iteration):
            stop.signals.append(signal.SIGTERM)
            raise StopTraining
        if stop.is_set():
            raise StopTraining
    print(f"rank {args.process_index}: final params sha256 {digest(unreplicate(run.state.params))}", flush=True)
    if args.save_model and run.logger is not None:
        run.model_path = checkpoint.save_trained_model(run, Path(__file__).name)


def main(args: Args):
    run = start(args)
    try:
        train(run)
    except StopTraining:
        pass  # a signal, or an actor failed: run.stop says which
    except Exception as error:  # the learner failed: the run ends as on an actor's error
        run.stop.errors.append(error)
    finally:  # threads joined, a checkpoint if a signal stopped the run, all processes past their barrier
        lifetime.shut_down(run, checkpoint.save_run_checkpoint)
    try:
        if run.model_path is not None and args.eval_episodes and not run.stop.signals:
            from cleanba.evaluate import evaluate_after_training  # optional, so imported only when used

            evaluate_after_training(sys.modules[__name__], run)
    finally:
        lifetime.close_and_exit(run)


if __name__ == "__main__":
    args = flags.parse_flags(Args, __doc__)
    check_args(args)
    main(args)
