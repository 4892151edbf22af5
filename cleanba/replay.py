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

from cleanba.flags import actor_threads
from cleanba.reductions import split_envs


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


def empty_memory(args, fields: dict, rollouts: tuple, blocks: tuple) -> dict:
    """memory_shapes' memory placed on the learner devices: zeros, each column's global env id in env_ids."""
    shapes = memory_shapes(args, fields, rollouts, blocks)
    if not shapes:
        return {}
    env_ids = column_env_ids(args, len(shapes["env_ids"].sharding.mesh.local_devices), blocks)

    def zeros():
        memory = {name: jnp.zeros(x.shape, x.dtype) for name, x in shapes.items()}
        return dict(memory, env_ids=jnp.asarray(env_ids)[None])

    return jax.jit(zeros, out_shardings={name: x.sharding for name, x in shapes.items()})()


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


def from_host(saved: dict, memory: dict) -> dict:
    """A memory like `memory` (its layout: columns, sharding) holding `saved` (to_host's, in global env order)."""
    env_ids = np.asarray(multihost_utils.process_allgather(memory["env_ids"], tiled=True))[0]
    real = env_ids >= 0
    placed = {"env_ids": memory["env_ids"]}
    for name, x in memory.items():
        if name == "env_ids":
            continue
        full = np.zeros(x.shape, x.dtype)
        full[:, real] = np.asarray(saved[name])[:, env_ids[real]]
        placed[name] = jax.make_array_from_callback(x.shape, x.sharding, lambda index, full=full: full[index])
    return placed
