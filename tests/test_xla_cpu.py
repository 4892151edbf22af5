"""cleanba/xla_cpu.py's convolution and max pool against flax's: the same values and gradients, and the
convolutions XLA:CPU compiles inside a loop all in the layout of its fast kernels."""

import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import SLOWDOWN

from cleanba import cleanba_ppo, cleanba_pqn, xla_cpu


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


def require_kernels():
    """cpu_kernels.cc needs a C++ compiler: without one these tests skip, except under CI (.ci/run installs g++)."""
    status = xla_cpu.cpu_kernels()
    if not status.startswith("native"):
        if os.environ.get("CI") == "true":
            pytest.fail(f"the CPU kernels must build under CI: {status}")
        pytest.skip(status)


def conv_and_gradients(conv, padding, x, kernel, dy, strides=(1, 1)):
    def apply(x, kernel):
        return conv(x, kernel, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    y, vjp = jax.vjp(apply, x, kernel)
    return y, *vjp(dy)


@contextmanager
def without_kernels():
    """The module's other path, as where cpu_kernels.cc cannot be built: XLA's convolutions in Eigen's layout."""
    saved = dict(xla_cpu.kernel_state)
    xla_cpu.kernel_state["status"] = "XLA's (this test)"
    try:
        yield
    finally:
        xla_cpu.kernel_state.clear()
        xla_cpu.kernel_state.update(saved)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "xla"])
@pytest.mark.parametrize("padding", ["SAME", "VALID", ((2, 0), (0, 1))])
@pytest.mark.parametrize(
    "shape",
    [(3, 12, 11, 4, 5, 3), (2, 7, 9, 1, 2, 1), (1, 5, 5, 3, 2, 5), (5, 13, 13, 16, 32, 3), (2, 9, 8, 33, 40, 4)],
)
def test_conv_matches_lax(shape, padding, kernels):
    """Values, and the input and kernel gradients, against XLA's own convolution and gradients: the same up to
    float32 rounding (other summation orders), on the kernels of cpu_kernels.cc and on XLA's path without them."""
    if kernels:
        require_kernels()
    batch, height, width, features, out, k = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((batch, height, width, features)).astype(np.float32)
    kernel = rng.standard_normal((k, k, features, out)).astype(np.float32)
    expected = jax.jit(partial(conv_and_gradients, jax.lax.conv_general_dilated, padding))
    y_shape = jax.eval_shape(
        lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), padding, dimension_numbers=xla_cpu.EIGEN_LAYOUT),
        x,
        kernel,
    )
    dy = rng.standard_normal(y_shape.shape).astype(np.float32)
    ours = jax.jit(partial(conv_and_gradients, xla_cpu.conv_general_dilated, padding))
    with nullcontext() if kernels else without_kernels():
        got, text = ours(x, kernel, dy), ours.lower(x, kernel, dy).as_text()
    assert ("cleanba_conv" in text) == kernels, text[-2000:]
    for name, a, b in zip(("y", "dx", "dk"), got, expected(x, kernel, dy)):
        assert a.shape == b.shape and np.abs(b).sum() > 0, name
        # each element is a sum of up to k * k * features (y, dx) or batch * height * width (dk) products
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()), err_msg=name)


@pytest.mark.parametrize(
    ("shape", "strides", "padding"),
    [
        ((2, 84, 84, 4, 32, 8), (4, 4), "VALID"),  # the Nature CNN's first two convolutions
        ((3, 20, 20, 32, 64, 4), (2, 2), "VALID"),
        ((2, 13, 11, 3, 5, 3), (2, 2), "SAME"),  # a kernel that is not a multiple of the stride
        ((2, 9, 10, 2, 3, 5), (3, 2), ((1, 2), (0, 1))),
        ((2, 10, 9, 2, 3, 3), (2, 3), ((-1, 0), (2, -1))),  # negative padding crops
    ],
)
def test_strided_conv_matches_lax(shape, strides, padding):
    """A strided convolution folded into a stride-1 one (space to depth), the kernels computing it: the same values
    and gradients as XLA's strided convolution, up to float32 rounding."""
    require_kernels()
    batch, height, width, features, out, k = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((batch, height, width, features)).astype(np.float32)
    kernel = rng.standard_normal((k, k, features, out)).astype(np.float32)
    lax = partial(jax.lax.conv_general_dilated, dimension_numbers=xla_cpu.EIGEN_LAYOUT)
    dy = rng.standard_normal(jax.eval_shape(lambda x, k: lax(x, k, strides, padding), x, kernel).shape)
    dy = dy.astype(np.float32)
    ours = jax.jit(partial(conv_and_gradients, xla_cpu.conv_general_dilated, padding, strides=strides))
    assert "cleanba_conv" in ours.lower(x, kernel, dy).as_text()
    expected = conv_and_gradients(jax.lax.conv_general_dilated, padding, x, kernel, dy, strides)
    for name, a, b in zip(("y", "dx", "dk"), ours(x, kernel, dy), expected):
        assert a.shape == b.shape and np.abs(b).sum() > 0, name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()), err_msg=name)


def loop_program(conv, dtype=jnp.float32, agent=None) -> str:
    """The CPU program of the ResNet's gradient inside a rolled lax.scan, with conv as the network's convolution."""
    agent = agent or cleanba_ppo.Agent(num_actions=4, channels=(4, 8), hidden_dim=16, xla_cpu=True, dtype=dtype)
    obs = np.random.default_rng(0).integers(0, 255, (3, 2, 4, 42, 42)).astype(np.uint8)  # 3 steps of 2 frames
    params = agent.init(jax.random.key(0), obs[0, :1])
    grad = jax.grad(lambda p, o: jnp.sum(agent.apply(p, o)[0]))

    def update(params, obs):
        return jax.lax.scan(lambda p, o: (jax.tree.map(lambda a, g: a - 1e-3 * g, p, grad(p, o)), None), params, obs)[0]

    original = xla_cpu.conv_general_dilated
    xla_cpu.conv_general_dilated = conv
    try:
        return jax.jit(update).lower(params, obs).compile().as_text()
    finally:
        xla_cpu.conv_general_dilated = original


def convolution_layouts(text: str) -> list:
    return re.findall(r"convolution\(.*dim_labels=([^,\s]+)", text)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_convolutions_in_a_loop_are_kernels_or_in_eigen_layout(dtype):
    """What makes a rolled gradient loop fast on XLA:CPU. With cpu_kernels.cc built, every convolution, weight
    gradient and max-pool gradient is one of its custom calls. Without it, every convolution is already in Eigen's
    layout (batch first, features last, HWIO kernel), since XLA:CPU moves convolutions into it only outside loops (jax
    issue 12868). With lax's own gradient, the loop holds convolutions in other layouts, which fall back to a naive
    kernel. The same with --conv-dtype bfloat16 (the kernels take its arrays widened to float32)."""
    require_kernels()
    ours = loop_program(xla_cpu.conv_general_dilated, dtype)
    calls = re.findall(r'custom_call_target="(cleanba_[a-z_]+)"', ours)
    # 10 convolutions (channels (4, 8): 5 per stage): their forward, their weight gradient, and the input gradient of
    # all but the first (the observation's is never computed); one max pool per stage
    assert calls.count("cleanba_conv") == 10 + 9 and calls.count("cleanba_conv_weight_gradient") == 10, calls
    assert calls.count("cleanba_max_pool_gradient") == 2 and not convolution_layouts(ours), calls
    with without_kernels():
        fallback = loop_program(xla_cpu.conv_general_dilated, dtype)
    layouts = convolution_layouts(fallback)
    assert len(layouts) == 3 * 10 - 1 and set(layouts) == {"b01f_01io->b01f"}, layouts
    assert "custom_call_target" not in fallback
    assert set(convolution_layouts(loop_program(jax.lax.conv_general_dilated, dtype))) - {"b01f_01io->b01f"}


def test_the_nature_cnn_in_a_loop_is_kernels():
    """PQN's Nature CNN (strides 4, 2, 1) in a rolled gradient loop: each convolution, its weight gradient and the
    input gradients of the last two are cpu_kernels.cc's custom calls, no XLA convolution (47x the learner's speed
    on Breakout: docs/performance.md)."""
    require_kernels()
    agent = cleanba_pqn.Agent(num_actions=4, channels=(), hidden_dim=16, mlp_widths=(), xla_cpu=True)
    calls = re.findall(
        r'custom_call_target="(cleanba_[a-z_]+)"', text := loop_program(xla_cpu.conv_general_dilated, agent=agent)
    )
    assert calls.count("cleanba_conv") == 3 + 2 and calls.count("cleanba_conv_weight_gradient") == 3, calls
    assert not convolution_layouts(text), convolution_layouts(text)


def kernels_child(code: str, **env) -> str:
    """Runs code in a fresh Python (its own kernel build state and thread affinity) and returns what it printed."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300 * SLOWDOWN, env={**os.environ, **env}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


GRADIENTS = """
import hashlib, os, sys, jax, numpy as np
from cleanba import xla_cpu
rng = np.random.default_rng(0)
x = rng.standard_normal((9, 21, 21, 16)).astype(np.float32)
k = rng.standard_normal((3, 3, 16, 32)).astype(np.float32)
conv = lambda x, k: xla_cpu.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=xla_cpu.EIGEN_LAYOUT)
loss = lambda x, k: (conv(x, k) ** 3).sum()
pool = lambda x: (xla_cpu.max_pool(x) ** 3).sum()
grads = [*jax.jit(jax.grad(loss, argnums=(0, 1)))(x, k), jax.jit(jax.grad(pool))(np.round(x))]
digest = hashlib.sha256(b"".join(np.asarray(g).tobytes() for g in grads)).hexdigest()
print("threads", len(os.sched_getaffinity(0)), "digest", digest)
"""


def test_kernels_give_the_same_bits_on_any_number_of_cores():
    """--exact compares layouts whose devices run with different numbers of free cores: the kernels' sums must not
    depend on how many threads share the work. Here 1 core against all of them (2 on CI), in fresh processes."""
    require_kernels()
    one = kernels_child(f"import os; os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})\n{GRADIENTS}")
    every = kernels_child(GRADIENTS)
    assert "native" in one and "threads 1 " in one, one
    assert one.split("digest")[1] == every.split("digest")[1], (one, every)


def test_without_a_compiler_the_network_falls_back_to_xla():
    """No C++ compiler: the gradients are XLA's (the same values up to rounding), and the run says why."""
    out = kernels_child(GRADIENTS, CXX="no-such-c++-compiler", CLEANBA_CACHE=tempfile.mkdtemp())
    assert "XLA's (no C++ compiler 'no-such-c++-compiler' on PATH" in out, out
    off = kernels_child(GRADIENTS, CLEANBA_CPU_KERNELS="xla")
    assert "XLA's (CLEANBA_CPU_KERNELS=xla)" in off and off.split("digest")[1] == out.split("digest")[1], (off, out)
