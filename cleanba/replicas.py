"""The learner's replicated arrays read back, one copy of them on a device or on the host (unreplicate, host_copy),
and their fingerprints, so that replicas, layouts and resumed runs can be compared (digest, params_checksum).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np


def unreplicate(tree):
    """The learner's replicated arrays as arrays on one local device (its first), for the actors and for saving."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def host_copy(tree):
    """The learner's replicated arrays as numpy arrays, for checkpoints and saved models."""
    return jax.device_get(unreplicate(tree))


def digest(tree) -> str:
    """A short sha256 of a pytree's values, printed so that replicas and resumed states can be compared."""
    leaves = jax.device_get(jax.tree.leaves(tree))
    return hashlib.sha256(b"".join(np.ascontiguousarray(leaf).tobytes() for leaf in leaves)).hexdigest()[:16]


@jax.jit
def params_checksum(params):
    """A 24-bit checksum of the params' bits, exact as a logged float (stats/params_checksum): runs that learn the
    same params log the same value. Integer sums do not depend on the order of their additions."""
    words = jnp.concatenate(
        [jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).ravel() for x in jax.tree.leaves(params)]
    )
    total = jnp.sum(words * (2 * jnp.arange(words.size, dtype=jnp.uint32) + 1))  # weighted: positions count
    return (total ^ (total >> 24)) & 0xFFFFFF
