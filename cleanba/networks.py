"""The network blocks the training scripts share: the IMPALA ResNet's conv sequence (Espeholt et al. 2018, fig. 3),
its convolution and max pool taken on XLA:CPU from cleanba/xla_cpu.py (fast inside the learner's loops:
docs/performance.md), and an LSTM core over time. Each script composes them in its own Agent."""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp


def convolution(xla_cpu: bool):
    """The convolution for nn.Conv: on a CPU, xla_cpu.py's, fast inside the learner's loops at any stride."""
    if not xla_cpu:
        return jax.lax.conv_general_dilated
    from cleanba import xla_cpu

    return xla_cpu.conv_general_dilated


def conv_layer(xla_cpu: bool, *args, **kwargs) -> nn.Conv:
    """nn.Conv(*args, **kwargs) with convolution(xla_cpu)."""
    return nn.Conv(*args, conv_general_dilated=convolution(xla_cpu), **kwargs)


def conv_and_pool(channels: int, xla_cpu: bool, dtype):
    """A 3x3 convolution and a 3x3, stride-2 max pool: on a CPU, xla_cpu.py's (docs/performance.md)."""
    conv = conv_layer(xla_cpu, channels, (3, 3), dtype=dtype)
    if not xla_cpu:
        return conv, partial(nn.max_pool, window_shape=(3, 3), strides=(2, 2), padding="SAME")
    from cleanba import xla_cpu

    return conv, xla_cpu.max_pool


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
    """(T, n, features) -> (T, n, size) from each env's state (n, 2 * size: cell, then hidden),
    restarting from zeros where starts (T, n)."""

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
