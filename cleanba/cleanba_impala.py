"""Cleanba IMPALA: actor threads step EnvPool on an actor device, a data-parallel learner trains on others.

Read top to bottom: the flags most runs set; above the ENGINE line, the algorithm a fork edits (flags, checks, network,
V-trace, IMPALA loss, minibatches, optimizer); below it, the engine, byte for byte as in cleanba_ppo.py
(tests/test_engine.py): envs, actor threads, learner, the run. Helpers, one concern each (docs/design.md):
cleanba/reductions.py (the sums behind --exact), spaces.py, checkpoint.py, flags.py, memory.py, logs.py,
lifetime.py, devices.py, replicas.py. Huang et al., "Cleanba: A Reproducible and Efficient Distributed Reinforcement
Learning Platform" (arXiv 2310.00036). Usage: README.md and docs/.

    python cleanba/cleanba_impala.py --env-id Breakout-v5 --actor-device-ids 0 --learner-device-ids 1 2 3
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

    env_id: str = "Breakout-v5"
    """an EnvPool id: Atari ids (e.g. Breakout-v5) use the IMPALA ResNet, vector ids (e.g. CartPole-v1) an MLP"""
    total_timesteps: int = flag(50_000_000, "[1, inf)")
    """total environment steps of all envs together (frames / 4 on Atari)"""
    seed: int = flag(1, "[0, inf)")
    """seed of the experiment: environments, network initialisation and action sampling derive from it"""
    actor_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that run the actor threads' policy inference"""
    learner_device_ids: list[int] = flag([0], may_change_on_resume=True)
    """local device ids that the learner is data-parallel over"""


@dataclass
class Algorithm:
    """IMPALA's flags (Espeholt et al. 2018), with the Cleanba paper's Atari values (appendix A). Args, below the ENGINE
    line, adds the engine's. Each numeric flag carries its meaningful range ("[" and "]" include the bound), checked
    before anything starts."""

    local_num_envs: int = flag(64, "[1, inf)", may_change_on_resume=True)
    """the number of parallel envs of each actor thread"""
    num_actor_threads: int = flag(2, "[1, inf)", may_change_on_resume=True)
    """the number of actor threads per actor device"""
    learning_rate: float = flag(6e-4, "(0, inf)")
    """the learning rate of the optimizer"""
    num_steps: int = flag(20, "[1, inf)")
    """the number of steps of each env per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = flag(0.99, "[0, 1]")
    """the discount factor gamma"""
    num_minibatches: int = flag(4, "[1, inf)")
    """the number of minibatches (of whole env sequences) per rollout, one pass"""
    ent_coef: float = flag(0.01, "[0, inf)")
    """coefficient of the entropy bonus"""
    vf_coef: float = flag(0.5, "(0, inf)")
    """coefficient of the baseline (value) loss"""
    max_grad_norm: float = flag(40.0, "(0, inf)")
    """the maximum norm for gradient clipping"""
    rmsprop_decay: float = flag(0.99, "[0, 1)")
    """RMSProp's decay of the squared-gradient average"""
    rmsprop_eps: float = flag(0.01, "(0, inf)")
    """RMSProp's epsilon, added outside the square root as in PyTorch"""
    channels: tuple[int, ...] = (16, 32, 32)
    """channels of the IMPALA ResNet's conv sequences"""
    hidden_dim: int = flag(256, "[1, inf)")
    """width of the dense layer after the ResNet, and of the two MLP layers for vector observations"""
    conv_dtype: Literal["float32", "bfloat16"] = "float32"
    """the ResNet's dtype: bfloat16 runs its convolutions in bfloat16 with float32 accumulation on a GPU's tensor
    cores (params, optimizer, heads and losses stay float32; docs/gpu.md); on a CPU it only adds casts"""
    concurrency: bool = True
    """overlap rollouts and updates: the actor runs one policy version behind the learner"""
    lstm: bool = False
    """an LSTM core between the torso and the heads (the IMPALA paper's agent): each env's state carries over steps
    and rollouts, restarts at each episode's first obs, and the learner unrolls it over the rollout from its start"""
    lstm_size: int = flag(256, "[1, inf)")
    """with --lstm: the width of the LSTM's cell and hidden state (the IMPALA paper's 256)"""


def check_algorithm(args: "Args"):
    """IMPALA's checks of flags that act together (each flag's range is checked by the engine)."""
    if args.exact and args.group_envs % args.gradient_accumulation_steps:
        fail(
            f"--group-envs={args.group_envs} must be divisible by --gradient-accumulation-steps="
            f"{args.gradient_accumulation_steps} (with --exact a group's sequences are cut into the micro-batches); "
            f"use a multiple of {args.gradient_accumulation_steps}"
        )
    envs = args.local_num_envs * flags.actor_threads(args)
    if envs < args.num_minibatches:
        fail(
            f"--num-minibatches={args.num_minibatches} is more than the {envs} envs of a process (--local-num-envs x "
            f"--num-actor-threads x actor devices): minibatches are whole env sequences; use at most {envs}"
        )


# The action space this script trains (the engine refuses an env of another kind, naming the script that trains it).
ACTION_SPACE = "Discrete"
# How the engine groups a learner device's envs for IMPALA: minibatch k holds whole sequences (V-trace runs along
# time) of the envs whose global index is k modulo num_minibatches (num_minibatches env sets, minibatch_env_sets),
# and a group's micro-batches split its envs.
MICRO_BATCHES_SPLIT = "envs"


def minibatch_env_sets(args: "Args") -> int:
    return args.num_minibatches


def conv_and_pool(channels: int, xla_cpu: bool, dtype):
    """The ResNet's 3x3 convolution (inputs and outputs in dtype) and its 3x3, stride-2 max pool. On XLA:CPU those of
    cleanba/xla_cpu.py (flax's values and gradients up to float32 rounding, fast inside the learner's loops:
    docs/performance.md); else flax's."""
    if not xla_cpu:
        pool = partial(nn.max_pool, window_shape=(3, 3), strides=(2, 2), padding="SAME")
        return nn.Conv(channels, (3, 3), dtype=dtype), pool
    from cleanba import xla_cpu

    return nn.Conv(channels, (3, 3), dtype=dtype, conv_general_dilated=xla_cpu.conv_general_dilated), xla_cpu.max_pool


class ResidualBlock(nn.Module):
    channels: int
    xla_cpu: bool
    dtype: type

    @nn.compact
    def __call__(self, x):
        y = conv_and_pool(self.channels, self.xla_cpu, self.dtype)[0](nn.relu(x))
        y = conv_and_pool(self.channels, self.xla_cpu, self.dtype)[0](nn.relu(y))
        return x + y


class ConvSequence(nn.Module):
    channels: int
    xla_cpu: bool
    dtype: type

    @nn.compact
    def __call__(self, x):
        conv, max_pool = conv_and_pool(self.channels, self.xla_cpu, self.dtype)
        x = max_pool(conv(x))
        block = partial(ResidualBlock, self.channels, self.xla_cpu, self.dtype)
        return block()(block()(x))


class LSTMCore(nn.Module):
    """An LSTM over time, (T, n, features) -> (T, n, size), from each env's state (n, 2 * size: cell, then hidden),
    restarting from zeros at the rows where starts (T, n) is true. One cell, its params shared over time (nn.scan)."""

    size: int

    @nn.compact
    def __call__(self, features, state, starts):
        def step(cell, carry, inputs):
            x, start = inputs
            carry = jnp.where(start[:, None], 0.0, carry)
            (c, h), y = cell((carry[:, : self.size], carry[:, self.size :]), x)
            return jnp.concatenate([c, h], axis=1), y

        scan = nn.scan(step, variable_broadcast="params", split_rngs={"params": False})
        state, outputs = scan(nn.OptimizedLSTMCell(self.size), state, (features, starts))
        return outputs, state


class Agent(nn.Module):
    """Images: IMPALA ResNet torso shared by both heads (Espeholt et al. 2018, fig. 3). Vectors: separate
    two-layer tanh MLPs for the policy and the value, as in CleanRL's classic-control PPO; with an LSTM core (between
    the torso and the heads, as in the IMPALA paper), one MLP shared by both heads."""

    num_actions: int
    channels: tuple[int, ...]
    hidden_dim: int
    xla_cpu: bool = False  # the network runs on XLA:CPU: conv_and_pool takes cleanba/xla_cpu.py's
    dtype: type = jnp.float32  # the ResNet's (--conv-dtype); the dense layers compute in float32
    lstm_size: int = 0  # --lstm-size with --lstm; 0: feed-forward

    @nn.compact
    def __call__(self, obs, state=None, starts=None):
        """obs (n, ...) -> (logits (n, actions), values (n,)): with an LSTM core, one step from the zero state. With a
        state, the LSTM's unroll: obs (T, n, ...), state (n, 2 * lstm_size) before row 0, starts (T, n) ->
        (logits (T, n, actions), values (T, n), the state after row T - 1)."""
        if self.lstm_size and state is None:
            logits, values, _ = self.unroll(
                obs[None], jnp.zeros((len(obs), 2 * self.lstm_size)), jnp.ones((1, len(obs)), bool)
            )
            return logits[0], values[0]
        if self.lstm_size:
            return self.unroll(obs, state, starts)
        policy_features, value_features = self.torso(obs)
        return self.heads(policy_features, value_features)

    def unroll(self, obs, state, starts):
        features = self.torso(obs.reshape(-1, *obs.shape[2:]))[0]
        outputs, state = LSTMCore(self.lstm_size)(features.reshape(*obs.shape[:2], -1), state, starts)
        return *self.heads(outputs, outputs), state

    def torso(self, obs) -> tuple:
        """(policy features, value features) of a batch of observations."""
        if obs.ndim == 4:  # EnvPool Atari: (batch, stack, height, width) uint8
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(self.dtype) / 255.0
            for channels in self.channels:
                x = ConvSequence(channels, self.xla_cpu, self.dtype)(x)
            x = nn.relu(x.reshape(x.shape[0], -1).astype(jnp.float32))
            # Orthogonal with gain sqrt(2) for the ReLU layer, as the original Cleanba's (and the heads below).
            dense = nn.Dense(self.hidden_dim, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))
            return (nn.relu(dense(x)),) * 2
        if self.lstm_size:
            return (self.mlp(obs),) * 2
        return self.mlp(obs), self.mlp(obs)

    def heads(self, policy_features, value_features) -> tuple:
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(policy_features)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(value_features)
        return logits, value[..., 0]

    def mlp(self, obs):
        x = obs.astype(jnp.float32)
        for _ in range(2):
            x = nn.tanh(nn.Dense(self.hidden_dim, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


def make_network(args: "Args", action_space, platform: str | None = None) -> Agent:
    """The network from the flags, for training and for evaluating a saved model (used by cleanba/evaluate.py and
    gpu_compile.py): change this function with Agent's signature. Agent maps observations to (logits (batch,
    actions), values (batch,)). platform: where it runs ("cpu", "gpu", ...; default: JAX's default backend)."""
    xla_cpu = (platform or jax.default_backend()) == "cpu"
    lstm_size = args.lstm_size if args.lstm else 0
    return Agent(
        action_space.n, tuple(args.channels), args.hidden_dim, xla_cpu, jnp.dtype(args.conv_dtype).type, lstm_size
    )


def recurrent_state_size(args: "Args") -> int:
    """The width of the recurrent state each env carries (the actor keeps it, a rollout stores it at row 0): the
    LSTM's cell and hidden; 0 for the feed-forward network."""
    return 2 * args.lstm_size if args.lstm else 0


def policy_step(agent: Agent, params, obs, state, starts) -> tuple:
    """The actors' and the evaluation's network step: (policy (n, actions), the next recurrent state) of obs (n, ...)
    with each env's state (n, recurrent_state_size), restarted from zeros where starts (n,) is true."""
    if not state.shape[-1]:
        return agent.apply(params, obs)[0], state
    logits, _, state = agent.apply(params, obs[None], state, starts[None])
    return logits[0], state


def sample_actions(logits, keys):
    """The actor's sampling: for each env, with its own key, an action by the Gumbel-max trick (a sample of the
    softmax) and its log-probability."""
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:]))(keys)
    actions = jnp.argmax(logits + gumbel, axis=1)
    return actions, jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], axis=1)[:, 0]


def env_actions(actions: np.ndarray, action_space) -> np.ndarray:
    """What EnvPool is sent for the sampled actions: the actions themselves."""
    return actions


def vtrace_targets(values, rewards, terminations, valid, rhos, gamma: float):
    """V-trace errors and policy-gradient advantages (Espeholt et al. 2018, eq. 1 and 4) over (T, n) arrays,
    values (T + 1, n), rho and c clipped at 1. A termination does not bootstrap; a truncation bootstraps from the
    final obs (the next row)."""
    discounts = gamma * (1.0 - terminations)
    # EnvPool's auto-reset step gets importance weight 0: its TD error and its trace vanish, so its target is
    # its own value (that of the final obs) and nothing flows back across the episode boundary.
    rhos = jnp.where(valid, rhos, 0.0)
    vtrace = partial(rlax.vtrace_td_error_and_advantage, lambda_=1.0, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0)
    return jax.vmap(vtrace, in_axes=1, out_axes=1)(values[:-1], values[1:], rewards, discounts, rhos)


def sequence_outputs(agent: Agent, params, batch: dict) -> tuple:
    """(logits (T + 1, n, actions), values (T + 1, n)) of a minibatch's sequences. The LSTM unrolls over each env's
    rollout from its stored state with the current params, restarting where the actor did (the row after EnvPool's
    auto-reset step, which is invalid, begins an episode): the gradient flows through the whole rollout."""
    obs = batch["obs"]
    if batch["recurrent_state"].shape[-1]:
        starts = jnp.concatenate([jnp.zeros_like(batch["valid"][:1]), 1.0 - batch["valid"]]) > 0
        return agent.apply(params, obs, batch["recurrent_state"][0], starts)[:2]
    logits, values = agent.apply(params, obs.reshape(-1, *obs.shape[2:]))
    return logits.reshape(*obs.shape[:2], -1), values.reshape(obs.shape[:2])


def impala_loss(agent: Agent, args: "Args", params, batch: dict, count):
    logits, values = sequence_outputs(agent, params, batch)
    logits = logits[:-1]
    logp = jax.nn.log_softmax(logits)
    newlogprobs = jnp.take_along_axis(logp, batch["actions"][..., None], axis=-1)[..., 0]
    logratio = jax.lax.stop_gradient(newlogprobs) - batch["logprobs"]
    rhos = jnp.exp(logratio)
    vtrace = vtrace_targets(values, batch["rewards"], batch["terminations"], batch["valid"] > 0, rhos, args.gamma)
    pg_loss = -newlogprobs * jax.lax.stop_gradient(vtrace.pg_advantage)
    v_loss = 0.5 * vtrace.errors**2  # errors = stop_gradient(v-trace target) - value
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    # Forking: add a new loss term here, per sample (docs/forking.md): it is then masked and summed like the
    # rest, the same on any layout. A scalar added to the returned loss would count once per learner device and
    # micro-batch, whose gradients are summed. A new entry of `metrics` is logged as losses/<name>.
    # The loss is a sum over the minibatch's valid samples, the scale that the RMSProp epsilon and gradient clip
    # of TorchBeast and the original Cleanba were tuned for; after the sum of the gradients over all groups it is
    # the global sum, on any number of devices. The logged metrics are per-sample means (count is the global number).
    mask = batch["valid"]
    metrics = dict(
        loss=loss,
        policy_loss=pg_loss,
        value_loss=v_loss,
        entropy=entropy,
        approx_kl=(rhos - 1) - logratio,
        clipped_rho_fraction=(rhos > 1.0).astype(jnp.float32),
    )
    # Masked sums as dots: XLA computes a dot as one op, while a reduce of v * mask fused with its producers was
    # summed in another order in one group position of four, so logged losses differed in the last bit.
    metrics = {k: jnp.vdot(v, mask) / count for k, v in metrics.items()}
    return jnp.vdot(loss, mask), metrics


def update_minibatch(agent: Agent, args: "Args", state: TrainState, batch: dict, groups: "Groups"):
    """One gradient step on a global minibatch. batch: this device's share, (groups, rows, width) per field. Every
    sum is taken per group, then over all groups of all devices (groups.total)."""
    mask = batch["valid"].astype(jnp.float32)
    count = jnp.maximum(groups.total(jnp.sum, mask), 1.0)
    grads, metrics = groups.gradients(partial(impala_loss, agent, args), state.params, dict(batch, valid=mask), count)
    return state.apply_gradients(grads=grads), metrics


def learn(agent: Agent, args: "Args", shuffle_key, state: TrainState, rollout: "Rollout", groups: "Groups"):
    """One learner iteration on this learner device's envs (inside shard_map). The loop nest of one iteration:
    minibatches (lax.scan over minibatch_step, in a shuffled order of the minibatch env sets) -> groups of envs
    (groups.total) -> micro-batches (groups.gradients). Returns the new state and the metrics averaged over the
    minibatches."""
    data = dict(
        obs=rollout.obs,
        actions=rollout.actions,
        logprobs=rollout.logprobs,
        rewards=rollout.rewards,
        terminations=rollout.terminations,
        valid=rollout.valid,
        recurrent_state=rollout.recurrent_state,
    )
    order = jax.random.permutation(jax.random.fold_in(shuffle_key, state.step), args.num_minibatches)

    def minibatch_step(state, k):  # minibatch k: whole sequences of the envs of set k
        minibatch_groups = groups.of_env_set(k)
        return update_minibatch(agent, args, state, minibatch_groups.take(data), minibatch_groups)

    state, metrics = jax.lax.scan(minibatch_step, state, order)
    return state, jax.tree.map(jnp.mean, metrics)


def make_optimizer(args: "Args"):
    updates_per_iteration = args.num_minibatches

    def linear_schedule(count):
        return args.learning_rate * (1.0 - (count // updates_per_iteration) / args.num_iterations)

    return optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        # PyTorch-style RMSProp, eps outside the square root, as in TorchBeast and the original Cleanba (the IMPALA
        # paper's RMSProp puts it inside).
        optax.inject_hyperparams(optax.rmsprop, static_args=("eps_in_sqrt",))(
            learning_rate=linear_schedule if args.anneal_lr else args.learning_rate,
            decay=args.rmsprop_decay,
            eps=args.rmsprop_eps,
            eps_in_sqrt=False,
        ),
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
