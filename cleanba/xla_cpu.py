"""A max pool for XLA:CPU: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME") with the same values and bitwise
the same gradients, without XLA:CPU's slow select_and_scatter.

The training scripts' IMPALA ResNet imports it only when JAX runs on the CPU; on accelerators they use nn.max_pool.
XLA:CPU's max-pool gradient was 30% of the default network's gradient time; this one costs at most a third of that
(README "Performance"). tests/test_network.py checks it against flax, ties included.
"""
from functools import reduce

import jax
import jax.numpy as jnp


def pool_windows(x):
    """The 9 strided views of a 3x3, stride-2, SAME max pool over NHWC x (padded with -inf), and the padding."""
    out_h, out_w = -(-x.shape[1] // 2), -(-x.shape[2] // 2)
    pad_h, pad_w = 2 * out_h + 1 - x.shape[1], 2 * out_w + 1 - x.shape[2]
    pads = ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
    x = jnp.pad(x, pads, constant_values=-jnp.inf)
    return [x[:, i:i + 2 * out_h:2, j:j + 2 * out_w:2] for i in range(3) for j in range(3)], pads


def interleave(even, odd, axis: int):
    """e0 o0 e1 o1 ... en along axis, from even (n + 1 long) and odd (n long)."""
    both = jnp.stack([even, jnp.pad(odd, [(0, int(a == axis)) for a in range(odd.ndim)])], axis=axis + 1)
    shape = list(even.shape)
    shape[axis] *= 2
    return jax.lax.slice_in_dim(both.reshape(shape), 0, shape[axis] - 1, axis=axis)


@jax.custom_vjp
def max_pool(x):
    """The maxima of every 3x3 window at stride 2 (SAME padding), with the custom gradient below."""
    return reduce(jnp.maximum, pool_windows(x)[0])


def max_pool_forward(x):
    y = max_pool(x)
    return y, (x, y)


def max_pool_backward(residuals, dy):
    # Like select_and_scatter, each window's gradient goes to its first maximum in row-major order. Padded input
    # row 2m gets shares from window rows m - 1 (offset 2) and m (offset 0), row 2m + 1 from window row m
    # (offset 1), and likewise for columns; shares are added in row-major window order, as XLA adds them, so the
    # sums round the same way.
    x, y = residuals
    windows, pads = pool_windows(x)
    first = reduce(jnp.minimum, [jnp.where(window == y, k, 9) for k, window in enumerate(windows)])
    share = [jnp.where(first == k, dy, 0.0) for k in range(9)]  # share[3 * row offset + column offset]

    def place(k, rows, cols):  # (1, 0): offset 2 lands one window later; (0, 1): offset 0
        return jnp.pad(share[k], ((0, 0), rows, cols, (0, 0)))

    late, early, none = (1, 0), (0, 1), (0, 0)
    even_even = place(8, late, late) + place(6, late, early) + place(2, early, late) + place(0, early, early)
    even_odd = place(7, late, none) + place(1, early, none)
    odd_even = place(5, none, late) + place(3, none, early)
    dx = interleave(interleave(even_even, even_odd, 2), interleave(odd_even, share[4], 2), 1)
    return (dx[:, pads[1][0]:pads[1][0] + x.shape[1], pads[2][0]:pads[2][0] + x.shape[2]],)


max_pool.defvjp(max_pool_forward, max_pool_backward)

