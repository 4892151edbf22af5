"""The learner's replay memory: what an off-policy script (SAC) keeps of past rollouts beside its train state, on the
learner devices, each device holding the transitions of the envs it learns from (docs/sac.md).

A script names its memory's fields in its replay_fields hook, each (rows, *shape) per env; the on-policy scripts name
none and their memory is {}. The memory is a dict of global arrays (rows, env columns, ...) sharded along the columns
over the learner mesh, P(None, "learner"), the columns in the order in which each learner device's merged rollouts
hold their envs, with an "env_ids" row: the global env id of each column, negative for pad envs. It goes into the
compiled update and comes out of it (donated: updated in place), and checkpoints hold it in global env order, so
that a resume places each env's memory where the new layout learns from that env.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from cleanba.flags import actor_threads, fail
from cleanba.reductions import split_envs
from cleanba.replicas import digest


def column_env_ids(args, num_local_learners: int, blocks: tuple) -> np.ndarray:
    """The global env id of each memory column on this layout (pad envs negative): for each process, each of its
    learner devices, each of its actor threads, the envs put_on_learners sends that device from that thread, as
    merge_rollouts concatenates them."""
    threads, n = actor_threads(args), args.local_num_envs
    columns = []
    for process in range(args.world_size):
        actors = [
            np.arange(a * n, (a + 1) * n, dtype=np.int32) for a in range(process * threads, (process + 1) * threads)
        ]
        shards = [split_envs(env_ids, num_local_learners, *blocks) for env_ids in actors]
        for device in range(num_local_learners):
            for env_ids, actor_shards in zip(actors, shards):
                envs, pad_ids = actor_shards[device]
                columns += [env_ids[envs], pad_ids]
    return np.concatenate(columns).astype(np.int32)


def memory_shapes(args, fields: dict, rollouts: tuple, blocks: tuple) -> dict:
    """The memory of fields {name: ((rows, *shape), dtype)} per env as jax.ShapeDtypeStructs on the learner mesh of
    the update's rollout shapes (one per actor thread), with its env_ids row; {} without fields."""
    if not fields:
        return {}
    sharding = rollouts[0].env_ids.sharding
    width = len(column_env_ids(args, len(sharding.mesh.local_devices), blocks))
    shapes = {name: ((shape[0], width, *shape[1:]), dtype) for name, (shape, dtype) in fields.items()}
    shapes["env_ids"] = ((1, width), np.int32)
    return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for name, (shape, dtype) in shapes.items()}


def place(args, shapes: dict, blocks: tuple, saved: dict | None = None) -> dict:
    """The memory of memory_shapes on the learner devices: zeros, or `saved` (to_host's, in global env order) in
    this layout's columns; each column's global env id in env_ids."""
    if not shapes:
        return {}
    env_ids = column_env_ids(args, len(shapes["env_ids"].sharding.mesh.local_devices), blocks)
    real = env_ids >= 0
    memory = {}
    for name, x in shapes.items():
        full = np.zeros(x.shape, x.dtype)
        if name == "env_ids":
            full[0] = env_ids
        elif saved is not None:
            full[:, real] = np.asarray(saved[name])[:, env_ids[real]]
        memory[name] = jax.make_array_from_callback(x.shape, x.sharding, lambda index, full=full: full[index])
    if saved is not None:  # what training continues from, read back from the devices (compare the checkpoint's line)
        print(f"rank {args.process_index}: placed replay memory sha256 {digest(to_host(memory))}", flush=True)
    return memory


def to_host(memory: dict) -> dict:
    """The memory on the host in global env order, pad envs left out: (rows, num_envs, ...) per field. Gathered from
    every process: a collective, so every process calls it."""
    if not memory:
        return {}
    gathered = multihost_utils.process_allgather(memory, tiled=True)
    env_ids = gathered.pop("env_ids")[0]
    real = np.flatnonzero(env_ids >= 0)
    order = real[np.argsort(env_ids[real])]
    return {name: np.ascontiguousarray(x[:, order]) for name, x in gathered.items()}


def check_sizes(args):
    """Refuse, before anything starts, a memory whose flags do not fit the run's env count (args.num_envs): every
    gradient step takes --replay-batch-size / num_envs transitions from each env, and each env's ring of
    --buffer-size / num_envs slots holds at least one rollout."""
    per_env = args.replay_batch_size // args.num_envs
    if args.replay_batch_size % args.num_envs or per_env % args.gradient_accumulation_steps:
        fail(
            f"--replay-batch-size={args.replay_batch_size} must be a multiple of the run's {args.num_envs} envs x "
            f"--gradient-accumulation-steps={args.gradient_accumulation_steps} (each gradient step takes as many "
            "transitions from every env)"
        )
    if args.buffer_size // args.num_envs < args.num_steps:
        fail(
            f"--buffer-size={args.buffer_size} must hold a rollout of --num-steps={args.num_steps} transitions for "
            f"each of the run's {args.num_envs} envs: use at least {args.num_steps * args.num_envs}"
        )


def remember(memory: dict, transitions: dict, valid) -> dict:
    """Each env's valid transitions ((T, n, ...) fields, valid (T, n)) written at the next slots of its ring (the
    memory's rows), in order, and counted in memory["filled"]: invalid steps (EnvPool's auto-reset step, pad envs)
    never enter, so every slot holds a transition to learn from."""
    filled = memory["filled"][0]
    capacity = memory[next(iter(transitions))].shape[0]
    slots = (filled + jnp.cumsum(valid, axis=0) - 1) % capacity
    slots, columns = jnp.where(valid, slots, capacity), jnp.arange(valid.shape[1])  # out of range: dropped

    def write(x, rows):
        return x.at[slots, columns].set(rows.astype(x.dtype), mode="drop")

    memory = dict(memory, **{name: write(memory[name], rows) for name, rows in transitions.items()})
    return dict(memory, filled=(filled + jnp.sum(valid, axis=0, dtype=filled.dtype))[None])


def sample(memory: dict, groups, key, per_env: int, names: tuple, noise_shape: tuple = ()) -> dict:
    """per_env transitions of every env, uniform over those its ring holds, drawn with a key of its global env id
    (and standard normal noise of noise_shape per transition): the same global minibatch on every layout. Fields
    (groups, per_env, width, ...) as Groups.take gives them, `valid` 0 where an env holds none (pad envs)."""
    capacity = memory[names[0]].shape[0]
    stored = jnp.minimum(memory["filled"][0], capacity)

    def draw(env_id, count):
        slot_key, noise_key = jax.random.split(jax.random.fold_in(key, env_id))
        slots = jax.random.randint(slot_key, (per_env,), 0, jnp.maximum(count, 1))
        return slots, jax.random.normal(noise_key, (per_env, *noise_shape))

    slots, noise = jax.vmap(draw)(memory["env_ids"][0], stored)  # (n, per_env), (n, per_env, *noise_shape)
    batch = groups.take({name: memory[name] for name in names}, slots.T)
    valid = jnp.broadcast_to(stored > 0, slots.T.shape).astype(jnp.float32)
    return dict(batch, **groups.take(dict(noise=noise.swapaxes(0, 1), valid=valid)))
