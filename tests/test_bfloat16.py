"""--conv-dtype bfloat16: the ResNet's convolutions in bfloat16, accumulated in float32 (docs/gpu.md). The program a
GPU runs convolves in bfloat16, forward and backward, and the learner's update stays near float32's. (On the CPU
the kernels of cpu_kernels.cc compute it: tests/test_xla_cpu.py.)"""

import re

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from learner_reference import OBS_SHAPE, make_args, make_rollout, script_learner

from cleanba import cleanba_ppo


def frames(batch: int, seed: int = 0):
    return np.random.default_rng(seed).integers(0, 256, (batch, *OBS_SHAPE), dtype=np.uint8)


def loss(agent, params, obs):
    logits, values = agent.apply(params, obs)
    return jnp.sum(jax.nn.log_softmax(logits)[:, 0]) + jnp.sum(values**2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_program_convolves_in_the_flags_dtype(dtype):
    """The network a GPU runs (make_network for platform "gpu"), its gradient lowered here: every convolution, the
    forward ones and those of the backward pass, takes and gives arrays of the flag's dtype. (What XLA then compiles
    for an H100 from it, 74 cuDNN convolutions in bfloat16: docs/gpu.md.)"""
    args = make_args(cleanba_ppo, ["--conv-dtype", dtype])
    agent = cleanba_ppo.make_network(args, gymnasium.spaces.Discrete(18), platform="gpu")
    obs = frames(2)
    params = agent.init(jax.random.key(0), obs)
    text = jax.jit(jax.grad(lambda p: loss(agent, p, obs))).lower(params).as_text()
    convolutions = [line for line in text.splitlines() if "stablehlo.convolution" in line]
    # 5 per conv sequence, each with its kernel gradient and, past the first, its input gradient
    assert len(convolutions) == 3 * 5 * len(args.channels) - 1, len(convolutions)
    element = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    for line in convolutions:
        types = re.findall(r"tensor<[0-9x]+x(\w+)>", line.split(" : ")[-1])
        assert types and set(types) == {element}, line
    # The params, and every matrix product of the dense layers and heads (forward and backward), stay float32.
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 3 * 3, len(dots)  # hidden layer, policy and value heads: forward, input and kernel gradients
    for line in dots:
        types = re.findall(r"tensor<[0-9x]+x(\w+)>", line.split(" : ")[-1])
        assert types and set(types) == {"f32"}, line


def test_the_update_stays_near_float32():
    """PPO's compiled update (the network is the same block in both scripts), one iteration from the same params on
    the same rollout, float32 and bfloat16: the logged losses agree to 2% (of each figure's scale), and the params
    move alike (the updates' directions have a cosine above 0.9) but not identically."""
    script = cleanba_ppo
    losses, steps = {}, {}
    for dtype in ("float32", "bfloat16"):
        args = make_args(script, ["--conv-dtype", dtype])
        agent, _, state, update = script_learner(script, args)
        rollout = make_rollout(script, agent, state.params, seed=1)
        after, logged = update(state, (script.Rollout(*map(jnp.asarray, rollout)),))
        losses[dtype] = {name: float(np.mean(value)) for name, value in logged.items()}
        steps[dtype] = np.concatenate(
            [np.ravel(a - b) for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(state.params))]
        )
    for name in ("loss", "policy_loss", "value_loss", "entropy"):
        f32, bf16 = losses["float32"][name], losses["bfloat16"][name]
        assert abs(f32 - bf16) <= 0.02 * max(abs(f32), 0.1), (name, f32, bf16)
    f32, bf16 = steps["float32"], steps["bfloat16"]
    cosine = float(f32 @ bf16 / np.linalg.norm(f32) / np.linalg.norm(bf16))
    print("cosine of the two updates", cosine)
    assert 0.9 < cosine < 1 - 1e-6, cosine
