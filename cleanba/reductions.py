"""How a learner device gets its envs and sums over them: the layer behind --exact and gradient accumulation, shared
by every training script.

An actor thread's rollout goes to the learner devices in whole blocks of envs (put_on_learners). Every sum the
learner's update takes over samples is a sum over groups of envs (Groups): each group computed on its own, its
micro-batches accumulated by a scan, then the groups of all learner devices added, by psum or, with --exact, in a
fixed order that is the same on any layout (docs/reproducibility.md). The scripts' losses call `groups.total` and
`groups.gradients`; what the algorithm decides (the env sets its minibatches take whole, what its micro-batches
split) is passed in. A fork changes the algorithm in its own file and rarely needs to read this one.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# What a group's micro-batches split: its time rows (axis 0 of a group's (rows, width) fields) or its envs (axis 1).
SPLIT_AXIS = {"time": 0, "envs": 1}


def learner_env_blocks(args, env_sets: int, micro_batches_split: str) -> tuple:
    """(env_sets, block_size): how the learner devices split an actor thread's envs. The envs of a learner device
    fall in `env_sets` minibatch env sets (env id mod env_sets, the script's minibatch_env_sets), and in groups
    within a set (make_groups). Devices get whole blocks of `block_size` consecutive envs: one --exact group of each
    set, else as many envs of each set as a group has micro-batches where those split envs, else one."""
    per_set = (
        args.group_envs if args.exact else args.gradient_accumulation_steps if micro_batches_split == "envs" else 1
    )
    return env_sets, env_sets * per_set


def split_envs(env_ids: np.ndarray, num_devices: int, env_sets: int, block_size: int) -> list:
    """How one actor thread's envs go to the local learner devices: for each device, the slice of the envs it
    gets and the ids of the pad envs that fill it up to the common width.

    The learner needs the same number of envs on every device, in whole blocks (learner_env_blocks). Where the envs
    do not split so, masked pad envs make up the difference, whatever the number of devices: every step of a pad env
    is invalid, so it adds nothing to any sum, mean or count. Pad ids are negative, congruent to the env set they
    fill (id % env_sets), and cost at most the padding in learner compute."""
    blocks = math.ceil(len(env_ids) / block_size)
    width = math.ceil(blocks / num_devices) * block_size  # whole blocks, as many on every device
    shards = []
    for start in range(0, width * num_devices, width):
        counts = np.bincount(env_ids[start : start + width] % env_sets, minlength=env_sets)
        pad_ids = [np.full(width // env_sets - count, s - env_sets, np.int32) for s, count in enumerate(counts)]
        shards.append((slice(start, start + width), np.concatenate(pad_ids)))
    return shards


def put_on_learners(rollout: NamedTuple, mesh, blocks: tuple) -> NamedTuple:
    """One actor thread's rollout (a NamedTuple of (rows, envs, ...) arrays, one being env_ids) as global arrays
    sharded along envs over the mesh: one transfer per field and learner device of this process, each device's
    slice padded with pad envs (zeros, env_ids negative) where the envs do not split evenly (split_envs)."""
    shards = split_envs(rollout.env_ids[0], len(mesh.local_devices), *blocks)

    def put(name: str, x: np.ndarray):
        parts = []
        for (envs, pad_ids), device in zip(shards, mesh.local_devices):
            part = x[:, envs]
            if len(pad_ids):  # no copy where no padding is needed
                pad = (
                    pad_ids[None] if name == "env_ids" else np.zeros((x.shape[0], len(pad_ids), *x.shape[2:]), x.dtype)
                )
                part = np.concatenate([part, pad], axis=1)
            parts.append(jax.device_put(part, device))
        global_shape = (x.shape[0], parts[0].shape[1] * mesh.size, *x.shape[2:])  # the same width on every device
        return jax.make_array_from_single_device_arrays(global_shape, NamedSharding(mesh, P(None, "learner")), parts)

    return type(rollout)(*[put(name, x) for name, x in zip(rollout._fields, rollout)])


def learner_shapes(fields: NamedTuple, num_envs: int, mesh, blocks: tuple) -> NamedTuple:
    """The (shape, dtype) fields of one actor thread's rollout of num_envs envs as put_on_learners hands them to the
    learner (padded, sharded): jax.ShapeDtypeStructs."""
    envs = split_envs(np.arange(num_envs), len(mesh.local_devices), *blocks)[0][0]
    width = (envs.stop - envs.start) * mesh.size  # every learner device of every process holds the same width
    sharding = NamedSharding(mesh, P(None, "learner"))
    return type(fields)(
        *[jax.ShapeDtypeStruct((shape[0], width, *shape[2:]), dtype, sharding=sharding) for shape, dtype in fields]
    )


class Groups(NamedTuple):
    """The reduction groups of a learner device's envs (learner_env_blocks): every sum the update takes over samples
    is a sum over groups, each group computed on its own, then added over the groups of all devices. With --exact
    they are added in the order of `keys` (each group's smallest global env id), the same on any layout; otherwise by
    psum. The loop nest of one gradient step: groups (map) -> micro-batches (scan) -> the sum over groups (sum)."""

    columns: jax.Array  # ([env sets,] groups, width): the positions of each group's envs on this device
    keys: jax.Array  # ([env sets,] groups): the place of each group in the global order of sums
    exact: bool
    micro_batches: int  # per group: --gradient-accumulation-steps
    micro_batch_axis: int  # the axis of a group's (rows, width) fields that micro-batches split (SPLIT_AXIS)

    @property
    def width(self) -> int:
        return self.columns.shape[-1]

    def of_env_set(self, k) -> "Groups":
        """The groups of minibatch env set k (env id mod env_sets)."""
        return self._replace(columns=self.columns[k], keys=self.keys[k])

    def take(self, data: dict, time_indices=None) -> dict:
        """Each (rows, n, ...) field of data as (groups, rows, width, ...): every row, or each env's own time steps
        (time_indices: (rows, n))."""
        if time_indices is None:
            return {name: jnp.moveaxis(x[:, self.columns], 1, 0) for name, x in data.items()}
        rows = jnp.moveaxis(time_indices[:, self.columns], 1, 0)
        return {name: x[rows, self.columns[:, None, :]] for name, x in data.items()}

    def map(self, fn, *fields):
        """fn of each group's slice of fields (stacked on axis 0), each on its own: optimization barriers keep XLA
        from fusing or merging work across groups, so that a group's result does not depend on how many groups a
        device holds."""

        def fenced(group):
            return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(group)))

        return jax.lax.map(fenced, fields)

    def sum(self, per_group):
        """The sum of per-group values (stacked on axis 0) over the groups of every learner device. A psum adds in
        an order that follows the layout, and float addition rounds by its order: with --exact, sum_in_key_order."""
        if not self.exact:
            return jax.lax.psum(jax.tree.map(partial(jnp.sum, axis=0), per_group), "learner")
        return sum_in_key_order(per_group, self.keys)

    def total(self, fn, *fields):
        """The sum over all groups of fn of each group's fields."""
        return self.sum(self.map(fn, *fields))

    def gradients(self, loss_fn, params, batch: dict, count):
        """The sum over all groups and their micro-batches of (gradients, metrics) of loss_fn(params, micro_batch,
        count) -> (loss, metrics). batch: (groups, rows, width) per field."""
        grad_fn = jax.grad(lambda p, micro_batch, c: loss_fn(p, MicroBatch(micro_batch), c), has_aux=True)
        split = partial(split_micro_batches, self.micro_batches, self.micro_batch_axis)

        def group_gradients(group):
            return summed_gradients(grad_fn, params, jax.tree.map(split, group), count)

        return self.total(group_gradients, batch)


class MicroBatch(dict):
    """A micro-batch's fields as the loss reads them. A field the loss reads that learn did not put in the batch
    stops the run in one line, naming where the field goes: the update is traced (compiled) at the start of a run,
    before any thread starts, so this is where a fork learns of it."""

    def __missing__(self, name):
        from cleanba.flags import fail

        fail(
            f"the loss reads batch[{name!r}], which the minibatches do not have (they have {', '.join(self)}): "
            f"put {name}=... in the data dict that learn builds from the rollout (docs/forking.md)"
        )


def sum_in_key_order(per_group, keys):
    """The groups of every learner device gathered on each and added one at a time in key order: bitwise the same
    sum on any layout."""
    per_group, keys = jax.lax.all_gather((per_group, keys), "learner", tiled=True)
    order = jnp.argsort(keys)

    def add(i, total):
        return jax.tree.map(lambda t, x: t + x[order[i]], total, per_group)

    return jax.lax.fori_loop(0, keys.shape[0], add, jax.tree.map(lambda x: jnp.zeros_like(x[0]), per_group))


def split_micro_batches(micro_batches: int, axis: int, x):
    """A group's (rows, width, ...) field as (micro_batches, ...) parts along axis (0: rows, 1: width). Sizes are
    spelled out, not -1: a field may be empty (a feed-forward network's recurrent state)."""
    if axis == 0:
        return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])
    return x.reshape(x.shape[0], micro_batches, x.shape[1] // micro_batches, *x.shape[2:]).swapaxes(0, 1)


def summed_gradients(grad_fn, params, micro_batches: dict, count):
    """The sum of grad_fn's (gradients, metrics) over micro-batches stacked on axis 0. A scan, so that one
    micro-batch's activations are alive at a time: what makes accumulation save memory."""
    first = jax.tree.map(lambda x: x[0], micro_batches)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first, count))

    def accumulate(sums, micro_batch):
        return jax.tree.map(jnp.add, sums, grad_fn(params, micro_batch, count)), None

    return jax.lax.scan(accumulate, zeros, micro_batches)[0]


def make_groups(args, env_ids, env_sets: int, micro_batches_split: str) -> Groups:
    """The groups of a learner device's envs (env_ids: their global ids, pad envs negative), the one place their
    size is decided: by minibatch env set, then --group-envs envs at a time with --exact, else all of the device's
    envs of that set (learner_env_blocks gives every device whole groups)."""
    width = args.group_envs if args.exact else env_ids.shape[0] // env_sets
    columns = jnp.argsort(env_ids % env_sets, stable=True).reshape(env_sets, -1, width)
    ids = env_ids[columns]
    keys = jnp.min(jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max), axis=-1)  # pad groups last
    split_axis = SPLIT_AXIS[micro_batches_split]
    return Groups(columns, keys, args.exact, args.gradient_accumulation_steps, split_axis)


def chunked_apply(fn, args: tuple, chunk: int):
    """fn(*args) computed `chunk` rows (axis 0 of every argument and output) at a time, each chunk on its own
    (optimization barriers), the arguments padded with zeros to whole chunks. The actor's policy with --exact: an
    env's logits (and recurrent state) then do not depend on how many envs its actor thread steps (XLA:CPU's kernels
    round by batch)."""
    rows = args[0].shape[0]
    pad = -rows % chunk

    def chunks(x):
        padded = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x
        return padded.reshape((rows + pad) // chunk, chunk, *x.shape[1:])  # not -1: x may be empty

    def chunk_fn(xs):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(xs)))

    out = jax.lax.map(chunk_fn, tuple(chunks(x) for x in args))
    return jax.tree.map(lambda o: o.reshape(o.shape[0] * o.shape[1], *o.shape[2:])[:rows], out)
