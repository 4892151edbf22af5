"""The IMPALA ResNet's convolution and max pool for XLA:CPU, with the same values and gradients as flax's, and fast
inside loops.

The training scripts' IMPALA ResNet uses them only when JAX runs on the CPU; on accelerators it uses nn.Conv and
nn.max_pool as they are. tests/test_network.py checks both against flax.

- conv_general_dilated: XLA:CPU hands a convolution to Eigen's fast kernels only in the layout Eigen wants (batch
  first, features last, an HWIO kernel), and it transposes other convolutions into that layout only in the entry
  computation, not inside a loop's body (jax issue 12868). The gradients of a convolution never come in that
  layout, so a gradient step inside lax.scan fell back to a naive kernel, 25-40x slower, and the scripts had to
  unroll their minibatch loops on the CPU, where XLA:CPU then kept the buffers of every unrolled step alive at
  once (openxla/xla issue 35719: 23.5 GB for the default PPO update). Here the two gradients are convolutions
  written in that layout from the start, so loops stay rolled on every platform and memory follows the minibatch.
- max_pool: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME") without XLA:CPU's slow select_and_scatter, whose
  gradient was 30% of the default network's gradient time; this one costs at most a third of that.
"""

from functools import partial, reduce

import jax
import jax.numpy as jnp

EIGEN_LAYOUT = ("NHWC", "HWIO", "NHWC")


def conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
    **kwargs,
):
    """jax.lax.conv_general_dilated, with the gradients below for what the IMPALA ResNet uses (stride 1, no
    dilation, no feature groups, NHWC inputs and HWIO kernels, as nn.Conv passes them); anything else unchanged."""
    plain = (
        tuple(window_strides) == (1, 1)
        and all(d in (None, 1, (1, 1)) for d in (lhs_dilation, rhs_dilation))
        and feature_group_count == 1
        and not kwargs
        and lhs.ndim == 4
        and jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        == jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, EIGEN_LAYOUT)
    )
    if not plain:
        return jax.lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            precision=precision,
            **kwargs,
        )
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], (1, 1), padding)
    return eigen_conv(lhs, rhs, tuple(tuple(int(p) for p in pair) for pair in padding), precision)


def conv(x, kernel, padding, precision):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), padding, dimension_numbers=EIGEN_LAYOUT, precision=precision)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def eigen_conv(x, kernel, padding, precision):
    """A stride-1 NHWC x HWIO convolution whose gradients are stride-1 NHWC x HWIO convolutions too."""
    return conv(x, kernel, padding, precision)


def eigen_conv_forward(x, kernel, padding, precision):
    return conv(x, kernel, padding, precision), (x, kernel)


def eigen_conv_backward(padding, precision, residuals, dy):
    # y[o] = sum_j x[o + j - lo] k[j] along each spatial axis (lo, hi: the padding, K: the kernel size), so
    # dx[i] = sum_j dy[i + j - (K - 1 - lo)] k[K - 1 - j]: dy convolved with the flipped kernel, in and out features
    # swapped, padded (K - 1 - lo, K - 1 - hi); and dk[j] = sum_o x[o + j - lo] dy[o]: x convolved with dy as the
    # kernel, the input features as the batch and the batch as the features, padded (lo, hi).
    x, kernel = residuals
    flipped = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)
    dx = conv(dy, flipped, [(k - 1 - lo, k - 1 - hi) for k, (lo, hi) in zip(kernel.shape[:2], padding)], precision)
    dk = conv(x.transpose(3, 1, 2, 0), dy.transpose(1, 2, 0, 3), padding, precision)  # (in, K, K, out)
    return dx, dk.transpose(1, 2, 0, 3)


eigen_conv.defvjp(eigen_conv_forward, eigen_conv_backward)


def pool_windows(x):
    """The 9 strided views of a 3x3, stride-2, SAME max pool over NHWC x (padded with -inf), and the padding."""
    out_h, out_w = -(-x.shape[1] // 2), -(-x.shape[2] // 2)
    pad_h, pad_w = 2 * out_h + 1 - x.shape[1], 2 * out_w + 1 - x.shape[2]
    pads = ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
    x = jnp.pad(x, pads, constant_values=-jnp.inf)
    return [x[:, i : i + 2 * out_h : 2, j : j + 2 * out_w : 2] for i in range(3) for j in range(3)], pads


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
    return (dx[:, pads[1][0] : pads[1][0] + x.shape[1], pads[2][0] : pads[2][0] + x.shape[2]],)


max_pool.defvjp(max_pool_forward, max_pool_backward)
