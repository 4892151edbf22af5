"""The GPU programs of both scripts, compiled for real NVIDIA targets without a GPU (python -m cleanba.gpu_compile):
the default Breakout sizes on the headline layouts compile to GPU code and fit at the scripts' memory fraction.

Needs the CUDA plugin and ptxas from PyPI (`poetry install --with gpu-compile`, as the README's test command does);
skipped without them, except under CI=true, where that fails."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from support import ROOT, SLOWDOWN, check_ok, user_environment

if importlib.util.find_spec("jax_cuda12_plugin") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("the gpu-compile dependency group is not installed: poetry install --with gpu-compile")
    pytest.skip("needs `poetry install --with gpu-compile`", allow_module_level=True)

LAYOUTS = {
    "a0-l0": ["--actor-device-ids", "0", "--learner-device-ids", "0"],
    "a0-l1,2,3": ["--actor-device-ids", "0", "--learner-device-ids", "1", "2", "3"],
}
GIB = 2**30


def gpu_compile(target: str, script: str, flags: list, processes: int = 1) -> tuple:
    """(the finished process, {GPU id: (roles, total GiB, fits)}, the learner's per-device line)."""
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "cleanba.gpu_compile",
            "--target",
            target,
            "--script",
            script,
            "--processes",
            str(processes),
            "--",
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900 * SLOWDOWN,
        env=user_environment(PYTHONUNBUFFERED="1"),
    )
    rows = {
        int(m[0]): (m[1], float(m[2]), m[3] == "yes")
        for m in re.findall(
            r"^\s*(\d+)\s+(\S+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+(yes|NO)$", process.stdout, re.M
        )
    }
    return process, rows


def network_flops(channels=(16, 32, 32), hidden=256, side=84, stack=4, actions=4) -> tuple:
    """(forward flops of one Breakout frame stack through the IMPALA ResNet and its heads, of its first convolution),
    from the shapes: 2 x outputs x inputs x 9 per 3x3 convolution; each max pool halves the side."""
    total, first, inputs = 0, 0, stack
    for c in channels:
        conv = 2 * side * side * inputs * c * 9
        first, total = first or conv, total + conv
        side = (side + 1) // 2
        total += 4 * 2 * side * side * c * c * 9  # two residual blocks of two convolutions
        inputs = c
    return total + 2 * side * side * inputs * hidden + 2 * hidden * (actions + 1), first


def update_flops_per_step(script: str) -> float:
    """One update's flops per env step at the default sizes: a gradient is about 3 forward passes (the first
    convolution's input gradient is not needed); IMPALA takes one per sample, over T + 1 observations per env; PPO
    one forward pass for the values, then one per sample per epoch."""
    from cleanba import cleanba_impala, cleanba_ppo, cleanba_pqn

    forward, first = network_flops()
    if script == "pqn":  # the Nature CNN: 8x8 stride 4, 4x4 stride 2, 3x3, then 512 units; PPO's update structure
        convs = [(20, 4, 32, 8), (9, 32, 64, 4), (7, 64, 64, 3)]  # (output side, inputs, outputs, kernel)
        first = 2 * 20 * 20 * 32 * 8 * 8 * 4
        forward = sum(2 * side * side * c * o * k * k for side, c, o, k in convs) + 2 * 3136 * 512 + 2 * 512 * 4
        steps, epochs = cleanba_pqn.Args.num_steps, cleanba_pqn.Args.update_epochs
        return forward * (steps + 1) / steps + epochs * (3 * forward - first)
    if script == "impala":
        steps = cleanba_impala.Args.num_steps
        return (3 * forward - first) * (steps + 1) / steps
    steps, epochs = cleanba_ppo.Args.num_steps, cleanba_ppo.Args.update_epochs
    return forward * (steps + 1) / steps + epochs * (3 * forward - first)


def actor_gib(stdout: str, gpu: int) -> float:
    return float(re.search(rf"^\s*{gpu}\s+\S+\s+[\d.]+\s+([\d.]+)\s", stdout, re.M).group(1))


def temporaries(stdout: str) -> float:
    return float(re.search(r"learner per device: temporaries ([\d.]+) GiB", stdout).group(1))


HEADLINE = {  # name: (flags, processes)
    "a0-l0": (LAYOUTS["a0-l0"], 1),
    "a0-l1,2,3": (LAYOUTS["a0-l1,2,3"], 1),
    "a0-l1,2,3-d2": (LAYOUTS["a0-l1,2,3"], 2),
}


# Each script on a0-l0 (its flops), and one on a multi-GPU layout: the sharding over learner GPUs is the engine's,
# the same in every script; a0-l1,2,3-d2 has it on each host, and the learner's all-reduce across two hosts.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "layout"), [("ppo", "a0-l0"), ("impala", "a0-l0"), ("impala", "a0-l1,2,3-d2"), ("pqn", "a0-l0")]
)
def test_default_sizes_compile_for_a100_on_every_headline_layout(script, layout):
    """A100 40GB, the paper's GPU: a0-l0 (actor and learner share the GPU: both count), and a0-l1,2,3-d2 (two hosts
    of four GPUs, the learner's all-reduce across them)."""
    flags, processes = HEADLINE[layout]
    process, rows = gpu_compile("a100-40gb", script, flags, processes)
    check_ok(process)
    print(layout, process.stdout)
    assert "compute capability 8.0" in process.stdout, process.stdout  # sm_80 code, through the lock's ptxas
    assert re.search(r"[1-9]\d* cuDNN convolution calls", process.stdout), process.stdout
    if layout == "a0-l0":
        assert rows == {0: ("actor+learner", rows[0][1], True)}, rows
        # The flops are the GPU network's: within 15% of a count from the convolutions' and dense layers' shapes
        # (a count on the CPU's network, whose convolutions are custom calls, gave 8.3 MFLOP for IMPALA).
        counted = float(re.search(r"([\d.]+) MFLOP per env step", process.stdout)[1]) * 1e6
        assert 0.9 < counted / update_flops_per_step(script) < 1.15, process.stdout
    else:
        assert set(rows) == {0, 1, 2, 3} and rows[0][0] == "actor", rows
        assert all(rows[i][0] == "learner" and rows[i][2] for i in (1, 2, 3)), rows
        assert re.search(r"[1-9]\d* all-reduces", process.stdout), process.stdout
    assert re.search(r"compute bound .*: [\d,]+ env steps/s", process.stdout), process.stdout


@pytest.mark.slow
def test_lstm_compiles_for_a100():
    """IMPALA --lstm on Breakout at the defaults, a0-l0: GPU code that fits, whose flops are the ResNet's and the
    LSTM's (4 gates of 256 over the torso's 256 features and the hidden 256, per observation, T + 1 per env)."""
    process, rows = gpu_compile("a100-40gb", "impala", [*LAYOUTS["a0-l0"], "--lstm"])
    check_ok(process)
    print(process.stdout)
    assert "compute capability 8.0" in process.stdout, process.stdout
    assert re.search(r"[1-9]\d* cuDNN convolution calls", process.stdout), process.stdout
    assert rows == {0: ("actor+learner", rows[0][1], True)}, rows
    from cleanba import cleanba_impala

    size, steps = cleanba_impala.Args.lstm_size, cleanba_impala.Args.num_steps
    lstm = 2 * (cleanba_impala.Args.hidden_dim + size) * 4 * size * 3 * (steps + 1) / steps
    counted = float(re.search(r"([\d.]+) MFLOP per env step", process.stdout)[1]) * 1e6
    assert 0.9 < counted / (update_flops_per_step("impala") + lstm) < 1.15, process.stdout


def mlp_update_flops_per_step(obs: int = 11, actions: int = 3) -> float:
    """The continuous script's update flops per env step at its defaults (Hopper-v4: 11 observations, 3 actions):
    two MLPs of two hidden layers (policy and value), 2 x inputs x outputs per dense layer; a gradient is about 3
    forward passes; one forward pass for the values, then one per sample per epoch."""
    from cleanba import cleanba_ppo_continuous as script

    hidden = script.Args.hidden_dim
    forward = sum(2 * (obs * hidden + hidden * hidden + hidden * out) for out in (actions, 1))
    steps, epochs = script.Args.num_steps, script.Args.update_epochs
    return forward * (steps + 1) / steps + epochs * 3 * forward


@pytest.mark.slow
def test_continuous_script_compiles_for_a100():
    """cleanba_ppo_continuous.py on Hopper-v4 at its defaults, a0-l0: GPU code that fits, no convolutions, and the
    flops of its two MLPs."""
    process, rows = gpu_compile("a100-40gb", "ppo_continuous", [*LAYOUTS["a0-l0"], "--env-id", "Hopper-v4"])
    check_ok(process)
    print(process.stdout)
    assert "compute capability 8.0" in process.stdout and "0 cuDNN convolution calls" in process.stdout
    assert rows == {0: ("actor+learner", rows[0][1], True)}, rows
    counted = float(re.search(r"([\d.]+) MFLOP per env step", process.stdout)[1]) * 1e6
    assert 0.85 < counted / mlp_update_flops_per_step() < 1.15, process.stdout


def sac_update_flops_per_step(obs: int = 17, actions: int = 6) -> float:
    """SAC's update flops per env step at its defaults (HalfCheetah-v4: 17 observations, 6 actions; one critic update
    per env step of 256 samples, on average one policy and one temperature step per critic step): the critic step is
    the policy and both target critics forward on the next obs, and both critics' gradient (3 forward passes); the
    policy step the policy's gradient through both critics; the temperature's one policy forward pass."""
    from cleanba import cleanba_sac as script

    hidden = script.Args.hidden_dim

    def forward(inputs: int, outputs: int) -> float:
        return 2 * (inputs * hidden + hidden * hidden + hidden * outputs)

    policy, critics = forward(obs, 2 * actions), 2 * forward(obs + actions, 1)
    per_sample = (policy + critics + 3 * critics) + 3 * (policy + critics) + policy
    return per_sample * script.Args.replay_batch_size * script.Args.updates_per_step


@pytest.mark.slow
def test_sac_compiles_for_a100():
    """cleanba_sac.py on HalfCheetah-v4 at its defaults, a0-l0: GPU code that fits with its replay memory of 1M
    transitions on the GPU, and the flops of its updates (0.70 GFLOP per env step; CleanRL's: about 0.67)."""
    process, rows = gpu_compile("a100-40gb", "sac", [*LAYOUTS["a0-l0"], "--env-id", "HalfCheetah-v4"])
    check_ok(process)
    print(process.stdout)
    assert "compute capability 8.0" in process.stdout and "0 cuDNN convolution calls" in process.stdout
    assert rows == {0: ("actor+learner", rows[0][1], True)}, rows
    assert re.search(r"replay memory 0\.1[5-7] GiB", process.stdout), process.stdout  # 1M x (2 x 17 + 6 + 2) x 4 B
    counted = float(re.search(r"([\d.]+) MFLOP per env step", process.stdout)[1]) * 1e6
    assert 0.85 < counted / sac_update_flops_per_step() < 1.15, (counted, sac_update_flops_per_step())


@pytest.mark.slow
def test_h100_memory_levers():
    """H100 on a0-l0: PPO fits, with 4 accumulation steps it needs clearly less, and --exact (deterministic GPU ops)
    compiles and fits too, its policy the one the run uses: --group-envs (8) envs at a time, not the thread's 64.
    --conv-dtype bfloat16 needs less than 0.6 of float32's temporaries (10.14 GiB against 5.50 planned here; on an
    H200, autotuned, 13.4 against 6.5)."""
    base, rows = gpu_compile("h100", "ppo", LAYOUTS["a0-l0"])
    check_ok(base)
    accumulated, accumulated_rows = gpu_compile(
        "h100", "ppo", [*LAYOUTS["a0-l0"], "--gradient-accumulation-steps", "4"]
    )
    check_ok(accumulated)
    exact, exact_rows = gpu_compile("h100", "ppo", [*LAYOUTS["a0-l0"], "--exact"])
    check_ok(exact)
    bf16, bf16_rows = gpu_compile("h100", "ppo", [*LAYOUTS["a0-l0"], "--conv-dtype", "bfloat16"])
    check_ok(bf16)
    print(base.stdout, accumulated.stdout, exact.stdout, bf16.stdout)
    assert "compute capability 9.0" in base.stdout
    assert rows[0][2] and accumulated_rows[0][2] and exact_rows[0][2] and bf16_rows[0][2]
    assert temporaries(accumulated.stdout) < 0.5 * temporaries(base.stdout)
    # bfloat16 convolutions (all of them cuDNN's, as many as with float32): the activations in half the bytes
    convolutions = [re.search(r"(\d+) cuDNN convolution calls", p.stdout)[1] for p in (base, bf16)]
    assert convolutions[0] == convolutions[1] and temporaries(bf16.stdout) < 0.6 * temporaries(base.stdout)
    assert "--xla_gpu_deterministic_ops=true" in exact.stdout
    assert actor_gib(exact.stdout, 0) < 0.5 * actor_gib(base.stdout, 0), (base.stdout, exact.stdout)


def test_unknown_target_and_impossible_layout_are_refused():
    process = subprocess.run(
        [sys.executable, "-m", "cleanba.gpu_compile", "--target", "v100"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2 and "a100-40gb" in process.stderr and "h100" in process.stderr, process.stderr
    process, _ = gpu_compile("h100", "ppo", ["--actor-device-ids", "0", "--learner-device-ids", "8"])
    assert process.returncode == 2 and "at most 8" in process.stderr and "--processes" in process.stderr, process.stderr
    assert "Traceback" not in process.stderr
