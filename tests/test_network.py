"""cleanba/xla_cpu.py's max pool against flax's: the same maxima and bitwise the same gradients, ties included."""
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
    agent = cleanba_ppo.Agent(num_actions=4, channels=(4, 8, 8), hidden_dim=32)
    obs = np.zeros((4, 4, 42, 42), np.uint8)
    obs[:, :, 10:30, 5:35] = np.random.default_rng(0).integers(0, 255, (4, 4, 20, 30))
    params = agent.init(jax.random.key(0), obs[:1])

    def gradient():  # and its HLO: XLA's own max-pool gradient is select_and_scatter
        grad = jax.jit(jax.grad(lambda p: sum(jnp.sum(out ** 2) for out in agent.apply(p, obs))))
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
