"""cleanba/xla_cpu.py's convolution and max pool against flax's: the same values and gradients, and the
convolutions XLA:CPU compiles inside a loop all in the layout of its fast kernels."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleanba import cleanba_ppo, xla_cpu


def flax_max_pool(x):
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


@pytest.mark.parametrize("shape", [(2, 84, 84, 4), (2, 11, 10, 3), (1, 2, 3, 1), (1, 1, 1, 2)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_max_pool_matches_flax(shape, ties):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:  # ReLU-like inputs: most windows hold several equal maxima, whose order decides the gradient
        x = np.round(x).clip(0, None)
    expected, flax_vjp = jax.vjp(flax_max_pool, x)
    got, ours_vjp = jax.jit(lambda x: jax.vjp(xla_cpu.max_pool, x))(x)
    np.testing.assert_array_equal(got, expected)
    dy = rng.standard_normal(expected.shape).astype(np.float32)
    expected_dx, dx = flax_vjp(dy)[0], jax.jit(lambda dy: ours_vjp(dy)[0])(dy)
    assert np.abs(expected_dx).sum() > 0
    np.testing.assert_array_equal(dx, expected_dx)  # bitwise: same routing at ties, same summation order


def test_network_gradients_match_flax_pooling():
    """The whole ResNet's parameter gradients with either pool, on uint8 frames with flat (tied) regions."""
    agent = cleanba_ppo.Agent(num_actions=4, channels=(4, 8, 8), hidden_dim=32, xla_cpu=True)
    obs = np.zeros((4, 4, 42, 42), np.uint8)
    obs[:, :, 10:30, 5:35] = np.random.default_rng(0).integers(0, 255, (4, 4, 20, 30))
    params = agent.init(jax.random.key(0), obs[:1])

    def gradient():  # and its HLO: XLA's own max-pool gradient is select_and_scatter
        grad = jax.jit(jax.grad(lambda p: sum(jnp.sum(out**2) for out in agent.apply(p, obs))))
        return grad(params), grad.lower(params).as_text()

    (ours, ours_hlo), original = gradient(), xla_cpu.max_pool
    xla_cpu.max_pool = flax_max_pool
    try:
        reference, reference_hlo = gradient()
    finally:
        xla_cpu.max_pool = original
    # On the CPU the network uses this module's pool (the scripts import it there), whose gradient is not XLA's.
    assert jax.default_backend() == "cpu"
    assert "select_and_scatter" not in ours_hlo and "select_and_scatter" in reference_hlo
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(a, b)


def conv_loss(conv, padding):
    def loss(x, kernel):
        return jnp.sum(jnp.sin(conv(x, kernel, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("padding", ["SAME", "VALID", ((2, 0), (0, 1))])
@pytest.mark.parametrize("shape", [(3, 12, 11, 4, 5, 3), (2, 7, 9, 1, 2, 1), (1, 5, 5, 3, 2, 5)])
def test_conv_matches_lax(shape, padding):
    """Values, and the input and kernel gradients, against XLA's own gradient of the same convolution."""
    batch, height, width, features, out, k = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((batch, height, width, features)).astype(np.float32)
    kernel = rng.standard_normal((k, k, features, out)).astype(np.float32)
    (value, grads), (expected, expected_grads) = (
        conv_loss(f, padding)(x, kernel) for f in (xla_cpu.conv_general_dilated, jax.lax.conv_general_dilated)
    )
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape and np.abs(want).sum() > 0
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def loop_convolutions(conv) -> list:
    """The dim_labels of every convolution in the CPU program of the ResNet's gradient inside a rolled lax.scan."""
    agent = cleanba_ppo.Agent(num_actions=4, channels=(4, 8), hidden_dim=16, xla_cpu=True)
    obs = np.random.default_rng(0).integers(0, 255, (3, 2, 4, 42, 42)).astype(np.uint8)  # 3 steps of 2 frames
    params = agent.init(jax.random.key(0), obs[0, :1])
    grad = jax.grad(lambda p, o: jnp.sum(agent.apply(p, o)[0]))

    def update(params, obs):
        return jax.lax.scan(lambda p, o: (jax.tree.map(lambda a, g: a - 1e-3 * g, p, grad(p, o)), None), params, obs)[0]

    original = xla_cpu.conv_general_dilated
    xla_cpu.conv_general_dilated = conv
    try:
        text = jax.jit(update).lower(params, obs).compile().as_text()
    finally:
        xla_cpu.conv_general_dilated = original
    return re.findall(r"convolution\(.*dim_labels=([^,\s]+)", text)


def test_convolutions_in_a_loop_are_in_eigen_layout():
    """What makes a rolled gradient loop fast on XLA:CPU: every convolution already in Eigen's layout (batch first,
    features last, HWIO kernel), since XLA:CPU moves convolutions into it only outside loops (jax issue 12868). With
    lax's own gradient, the loop holds convolutions in other layouts, which fall back to a naive kernel."""
    ours, lax_own = loop_convolutions(xla_cpu.conv_general_dilated), loop_convolutions(jax.lax.conv_general_dilated)
    assert len(ours) >= 3 * 4 and set(ours) == {"b01f_01io->b01f"}, ours
    assert set(lax_own) - {"b01f_01io->b01f"}, lax_own
