"""The reduction layer behind --exact and gradient accumulation, shared by cleanba_ppo.py and cleanba_impala.py.

Every sum the learner's update takes over samples is a sum over groups of envs (Groups): each group computed on its
own, its micro-batches accumulated by a scan, then the groups of all learner devices added, by psum or, with --exact,
in a fixed order that is the same on any layout (docs/reproducibility.md). The scripts' losses call `groups.total`
and `groups.gradients`; what the algorithm decides (its minibatch classes, the axis its micro-batches cut) is passed
in. A fork changes the algorithm in its own file and rarely needs to read this one.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def env_blocks(args, classes: int, micro_batch_axis: int) -> tuple:
    """(classes, block): how the learner devices split an actor thread's envs. The envs of a learner device fall in
    `classes` minibatch classes (env id mod classes, the script's minibatch_classes), and in groups within a class
    (make_groups). Devices get whole blocks of `block` consecutive envs: one --exact group of each class, else as
    many envs of each class as a group has micro-batches where those cut envs (micro_batch_axis 1), else one."""
    per_class = args.group_envs if args.exact else args.gradient_accumulation_steps if micro_batch_axis == 1 else 1
    return classes, classes * per_class


def split_envs(env_ids: np.ndarray, num_devices: int, classes: int, block: int) -> list:
    """How one actor thread's envs go to the local learner devices: for each device, the slice of the envs it
    gets and the ids of the pad envs that fill it up to the common width.

    The learner needs the same number of envs on every device, in whole blocks (env_blocks). Where the envs do not
    split so, masked pad envs make up the difference, whatever the number of devices: every step of a pad env is
    invalid, so it adds nothing to any sum, mean or count. Pad ids are negative, congruent to the minibatch class
    they fill (id % classes), and cost at most the padding in learner compute."""
    blocks = math.ceil(len(env_ids) / block)
    width = math.ceil(blocks / num_devices) * block  # whole blocks, as many on every device
    shards = []
    for start in range(0, width * num_devices, width):
        counts = np.bincount(env_ids[start : start + width] % classes, minlength=classes)
        pad_ids = [np.full(width // classes - count, c - classes, np.int32) for c, count in enumerate(counts)]
        shards.append((slice(start, start + width), np.concatenate(pad_ids)))
    return shards


class Groups(NamedTuple):
    """The reduction groups of a learner device's envs (env_blocks): every sum the update takes over samples is a sum
    over groups, each group computed on its own, then added over the groups of all devices. With --exact they are
    added in the order of `keys` (each group's smallest global env id), the same on any layout; otherwise by psum.
    The loop nest of one gradient step: groups (map) -> micro-batches (scan) -> the sum over groups (sum)."""

    columns: jax.Array  # ([classes,] groups, width): the positions of each group's envs on this device
    keys: jax.Array  # ([classes,] groups): the place of each group in the global order of sums
    exact: bool
    micro_batches: int  # per group: --gradient-accumulation-steps
    micro_batch_axis: int  # the axis of a group's (rows, width) fields that micro-batches cut

    @property
    def width(self) -> int:
        return self.columns.shape[-1]

    def of_class(self, k) -> "Groups":
        """The groups of minibatch class k (env id mod classes)."""
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
        an order that follows the layout, and float addition rounds by its order. With --exact the groups are
        gathered on every device and added one at a time in key order: bitwise the same sum on any layout."""
        if not self.exact:
            return jax.lax.psum(jax.tree.map(partial(jnp.sum, axis=0), per_group), "learner")
        per_group, keys = jax.lax.all_gather((per_group, self.keys), "learner", tiled=True)
        order = jnp.argsort(keys)

        def add(i, total):
            return jax.tree.map(lambda t, x: t + x[order[i]], total, per_group)

        return jax.lax.fori_loop(0, keys.shape[0], add, jax.tree.map(lambda x: jnp.zeros_like(x[0]), per_group))

    def total(self, fn, *fields):
        """The sum over all groups of fn of each group's fields."""
        return self.sum(self.map(fn, *fields))

    def split_micro_batches(self, x):
        """A group's (rows, width, ...) field as (micro_batches, ...) parts along micro_batch_axis."""
        if self.micro_batch_axis == 0:
            return x.reshape(self.micro_batches, -1, *x.shape[1:])
        return x.reshape(x.shape[0], self.micro_batches, -1, *x.shape[2:]).swapaxes(0, 1)

    def gradients(self, loss_fn, params, batch: dict, count):
        """The sum over all groups and their micro-batches of (gradients, metrics) of loss_fn(params, micro_batch,
        count) -> (loss, metrics). batch: (groups, rows, width) per field."""
        grad_fn = jax.grad(loss_fn, has_aux=True)

        def group_gradients(group):
            return summed_gradients(grad_fn, params, jax.tree.map(self.split_micro_batches, group), count)

        return self.total(group_gradients, batch)


def summed_gradients(grad_fn, params, micro_batches: dict, count):
    """The sum of grad_fn's (gradients, metrics) over micro-batches stacked on axis 0. A scan, so that one
    micro-batch's activations are alive at a time: what makes accumulation save memory."""
    first = jax.tree.map(lambda x: x[0], micro_batches)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first, count))

    def accumulate(sums, micro_batch):
        return jax.tree.map(jnp.add, sums, grad_fn(params, micro_batch, count)), None

    return jax.lax.scan(accumulate, zeros, micro_batches)[0]


def make_groups(args, env_ids, classes: int, micro_batch_axis: int) -> Groups:
    """The groups of a learner device's envs (env_ids: their global ids, pad envs negative), the one place their
    size is decided: by minibatch class, then --group-envs envs at a time with --exact, else all of the device's envs
    of that class (env_blocks gives every device whole groups)."""
    width = args.group_envs if args.exact else env_ids.shape[0] // classes
    columns = jnp.argsort(env_ids % classes, stable=True).reshape(classes, -1, width)
    ids = env_ids[columns]
    keys = jnp.min(jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max), axis=-1)  # pad groups last
    return Groups(columns, keys, args.exact, args.gradient_accumulation_steps, micro_batch_axis)


def chunked_apply(fn, x, chunk: int):
    """fn of x computed `chunk` rows (axis 0) at a time, each chunk on its own (optimization barriers), x padded with
    zeros to whole chunks. The actor's policy with --exact: an env's logits then do not depend on how many envs its
    actor thread steps (XLA:CPU's kernels round by batch)."""
    pad = -x.shape[0] % chunk
    padded = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x

    def chunk_fn(o):
        return jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(o)))

    out = jax.lax.map(chunk_fn, padded.reshape(-1, chunk, *x.shape[1:]))
    return out.reshape(-1, *out.shape[2:])[: x.shape[0]]
