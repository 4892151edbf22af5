"""--exact: the same seed and global sizes train bitwise the same params on every learner layout.

Each case runs 8 envs three ways and compares, iteration by iteration, the params checksum, the losses and the
episode curves, and the final params sha256 of every run: on a0-l0 as 2 actor threads of 4 envs (the reference); on
a0-l1,2,3 as one thread of 8 envs (the learner split over 3 devices, with masked pad envs, and another split of the
envs over actor threads: either one, broken, changes the bits); and, for PPO and SAC, as two processes of one
thread of 4 each on a0-l1 (d2). The processes' split is the engine's (the learner sees global arrays whatever the
process count, the same code in every script: tests/test_engine.py): PPO's case checks it, SAC's with each process's
replay rings gathered into the checkpoint. The learner on 2 devices without pads (a0-l1,2) is check_fork's layouts
check on an untouched copy of PPO, the continuous PPO and SAC (tests/test_check_fork.py), and the resume below.
IMPALA's learner is checked on Breakout (the ResNet, cleanba/networks.py, and the MLP head) and with --lstm on the
memory task; PPO's on CartPole; PQN's with --lstm (its targets from unrolled sequences, epochs of env sets).

Every process has the same 4 forced host devices, whatever devices its layout uses: XLA:CPU sizes its thread pool
from the device count (on a 2-core machine, 1 to 3 devices gave one set of bits and 4 or 8 another for the same
single-device gradient), and its kernels split their sums by thread. A GPU's kernels do not depend on how many
GPUs the machine has."""

import re
import subprocess
import sys

import numpy as np
import pytest
from support import (
    LLVM_UNOPTIMIZED,
    ROOT,
    check_ok,
    run_dir,
    run_script,
    scalars,
    script_env,
    start_pair,
    stop_once_training,
)

pytestmark = pytest.mark.xla_default  # the bits users get, on every layout

ITERATIONS = 20  # Breakout's first episodes end at the 16th (seed 3, 8 envs of 8 steps): its curves have returns
ENVS = 4  # per actor thread
CURVES = [
    "stats/params_checksum",
    "losses/loss",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "charts/episodic_return",
    "charts/episodic_length",
    "test/episodic_return",
    "test/episodic_length",
]
SIZES = {  # per (script, env): flags, steps per env per iteration
    # 32 time rows per minibatch: with 8, a fused reduce of the value loss was not yet summed in another order in
    # one group position (the 128-step README demo logged last-bit differences before the masked sums became dots).
    # The test curve too: 6 games every 5th iteration, by process 0 of every layout.
    ("ppo", "CartPole-v1"): (
        [
            *["--hidden-dim", "16", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
            *["--test-frequency", "5", "--eval-episodes", "6"],
        ],
        64,
    ),
    ("ppo", "Breakout-v5"): (
        ["--channels", "4", "--hidden-dim", "16", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs", "1"],
        8,
    ),
    ("impala", "Breakout-v5"): (
        ["--channels", "4", "--hidden-dim", "16", "--num-steps", "8", "--num-minibatches", "2"],
        8,
    ),
    # The learner's normalizer too: its statistics are over every env of the run, whatever the layout. dm_control's
    # episodes last 1,000 steps: 64 steps a rollout for some to end within the 20 iterations.
    **{
        ("ppo_continuous", env): (
            ["--hidden-dim", "16", "--num-steps", str(steps), "--num-minibatches", "2", "--update-epochs", "2"],
            steps,
        )
        for env, steps in [("CheetahRun-v1", 64)]
    },
    # IMPALA's LSTM on the memory task (a Dict observation): 16 steps a rollout, so that episodes end (the step limit
    # is 245) and the recurrent state restarts within the run.
    ("impala", "MiniGrid-MemoryS7-v0"): (
        ["--lstm", "--lstm-size", "16", "--hidden-dim", "16", "--num-steps", "16", "--num-minibatches", "2"],
        16,
    ),
    # PQN's LSTM: the learner's Q(lambda) targets from every env's unrolled sequence, epochs of env sets.
    ("pqn", "MiniGrid-MemoryS7-v0"): (
        ["--lstm", "--lstm-size", "16", "--mlp-widths", "16", "--num-steps", "16", "--num-minibatches", "2"],
        16,
    ),
    # SAC's replay memory: rings of 100 transitions per env that wrap, learning from the 6th iteration, 2 samples of
    # every env per critic step; Pendulum's episodes end at 200 steps, within the run.
    ("sac", "Pendulum-v1"): (
        [
            *["--hidden-dim", "16", "--num-steps", "16", "--buffer-size", "800", "--replay-batch-size", "16"],
            *["--learning-starts", "640", "--updates-per-step", "0.125", "--checkpoint-frequency", "20"],
        ],
        16,
    ),
}
NORMALIZER_CURVES = ["normalizer/return_std", "normalizer/obs_std_mean", "normalizer/obs_count"]
PQN_CURVES = ["losses/q_values", "losses/targets"]  # PQN's loss has no policy, value or entropy terms
SAC_CURVES = ["losses/qf_loss", "losses/qf1_values", "losses/actor_loss", "losses/alpha", "losses/alpha_loss"]
DEVICES = 4
LAYOUTS = {
    "a0-l0": [],
    "a0-l1,2": ["--actor-device-ids", "0", "--learner-device-ids", "1", "2"],
    "a0-l1,2,3": ["--actor-device-ids", "0", "--learner-device-ids", "1", "2", "3"],
}
# name: (learner layout, actor threads of the run's 2 x ENVS envs)
RUNS = {"a0-l0": ("a0-l0", 2), "a0-l1,2,3-t1": ("a0-l1,2,3", 1)}


def exact_args(script, env_id, threads, envs=ENVS):
    flags, steps = SIZES[script, env_id]
    total = ITERATIONS * 2 * ENVS * steps  # 2 x ENVS envs in all, on every layout
    return [
        *flags,
        "--env-id",
        env_id,
        "--exact",
        "--group-envs",
        "2",
        "--log-frequency",
        "1",
        "--seed",
        "3",
        "--local-num-envs",
        envs,
        "--num-actor-threads",
        threads,
        "--total-timesteps",
        total,
    ]


def curves(directory) -> dict:
    logged = scalars(directory)
    tags = [tag for tag in CURVES + PQN_CURVES + SAC_CURVES + NORMALIZER_CURVES if tag in logged]
    return {tag: np.array([value for _, value in logged[tag]], np.float32) for tag in tags}


def final_digests(output: str) -> list:
    return re.findall(r"rank \d: final params sha256 (\w+)", output)


PROCESSES = {"ppo", "sac"}  # the scripts whose cases run the two processes (d2) too


def layout_runs(script, env_id, tmp_path) -> dict:
    """{run: (curves, final digests)} of the RUNS (on a0-l0, 2 actor threads of ENVS envs; on a0-l1,2,3, one thread of
    2 x ENVS envs) and, for the PROCESSES scripts, of two processes of one thread of ENVS envs each (d2)."""
    runs = {}
    for name, (layout, threads) in RUNS.items():
        args = [*exact_args(script, env_id, threads, envs=2 * ENVS // threads), *LAYOUTS[layout]]
        process = run_script(script, args, tmp_path / name, devices=DEVICES, timeout=600)
        check_ok(process)
        # What XLA is told: deterministic GPU kernels (a flag XLA:CPU also parses, or it would abort at start), and
        # the default optimizations, as users run (tests not marked xla_default turn LLVM's off: support.py).
        assert "XLA_FLAGS:" in process.stdout and "--xla_gpu_deterministic_ops=true" in process.stdout
        assert LLVM_UNOPTIMIZED not in process.stdout, process.stdout
        assert "on any split of the envs over actor threads and processes" in process.stdout, process.stdout
        runs[name] = curves(run_dir(tmp_path / name)), final_digests(process.stdout)
    if script not in PROCESSES:
        return runs
    pair = start_pair(
        script,
        tmp_path / "d2",
        [*exact_args(script, env_id, 1), "--actor-device-ids", "0", "--learner-device-ids", "1"],
        devices=DEVICES,
    )
    outputs = [process.communicate(timeout=600)[0] for process in pair]
    for process, output in zip(pair, outputs):
        assert process.returncode == 0, output
    runs["a0-l1-d2"] = curves(run_dir(tmp_path / "d2" / "rank0")), final_digests(outputs[0] + outputs[1])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "env_id"),
    [("ppo", "CartPole-v1"), ("impala", "Breakout-v5"), ("pqn", "MiniGrid-MemoryS7-v0"), ("sac", "Pendulum-v1")],
)
def test_bitwise_identical_on_every_layout(script, env_id, tmp_path):
    check_every_layout(script, env_id, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["CheetahRun-v1"])
def test_continuous_bitwise_identical_on_every_layout(env_id, tmp_path):
    """cleanba_ppo_continuous.py on a dm_control task (MuJoCo physics, Dict observations): params, losses, curves
    and the normalizer's statistics, bit for bit. A Box observation's runs (Pendulum-v1) are check_fork's on an
    untouched copy, a0-l0 against a0-l1,2 and 2 x 4 envs against 1 x 8 (tests/test_check_fork.py)."""
    check_every_layout("ppo_continuous", env_id, tmp_path)


@pytest.mark.slow
def test_lstm_bitwise_identical_on_every_layout(tmp_path):
    """cleanba_impala.py --lstm: each env's recurrent state carried by the actor, stored at each rollout's start and
    unrolled by the learner leaves params, losses and curves the same bit for bit on every layout and thread split
    (the actor's chunks of --group-envs envs step their states on their own)."""
    check_every_layout("impala", "MiniGrid-MemoryS7-v0", tmp_path)


def check_every_layout(script, env_id, tmp_path):
    for name in [*RUNS, "d2"]:
        (tmp_path / name).mkdir()
    runs = layout_runs(script, env_id, tmp_path)
    assert len(runs) == len(RUNS) + (script in PROCESSES), runs.keys()
    reference, (digest,) = runs.pop("a0-l0")
    checksums = reference["stats/params_checksum"]
    changed = ITERATIONS - 4 if script == "sac" else ITERATIONS  # SAC's learn from the 6th iteration on
    assert len(checksums) == ITERATIONS and len(set(checksums)) == changed  # the params changed every time
    assert len(reference["charts/episodic_return"]) > 0
    if (script, env_id) == ("ppo", "CartPole-v1"):
        assert len(reference["test/episodic_return"]) == ITERATIONS // 5, reference  # the test curve, on every layout
    if script == "sac":  # the last iteration's checkpoint: the memory gathered from every device and process
        paths = [run_dir(tmp_path / name) / "checkpoint.msgpack" for name in [*RUNS, "d2/rank0"]]
        (memory, state), *others = [(replay_of(path), train_state_of(path)) for path in paths]
        assert memory["filled"][0].tolist() == [ITERATIONS * SIZES[script, env_id][1] - 1] * 2 * ENVS  # one reset
        for path, (other_memory, other_state) in zip(paths[1:], others):
            assert memory.keys() == other_memory.keys(), path
            for name in memory:
                assert memory[name].tobytes() == other_memory[name].tobytes(), (path, name)
            assert state.tobytes() == other_state.tobytes(), path
    if script == "ppo_continuous":
        assert len(set(reference["normalizer/obs_count"])) == ITERATIONS, reference  # updated every iteration
    for name, (logged, digests) in runs.items():
        assert logged.keys() == reference.keys(), (name, logged.keys())
        for tag in reference:  # bitwise: the float32 values as logged, every iteration
            assert logged[tag].tobytes() == reference[tag].tobytes(), (name, tag, logged[tag], reference[tag])
        assert set(digests) == {digest}, (name, digests, digest)
    if script != "ppo":  # the report is a tool of its own: PPO's case runs it
        return
    # The report a user runs on two such runs says so.
    compared = [tag for tag in CURVES + PQN_CURVES + SAC_CURVES if tag in reference]
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "cleanba.compare_layouts",
            run_dir(tmp_path / "a0-l0"),
            run_dir(tmp_path / "d2" / "rank0"),
            "--tags",
            *compared,
            "--out",
            tmp_path / "cmp.png",
        ],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(report)
    assert report.stdout.count("max |a - b| = 0,") == len(compared), report.stdout
    assert "bitwise identical" in report.stdout, report.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "env_id"),
    [("ppo", "CartPole-v1"), ("pqn", "MiniGrid-MemoryS7-v0"), ("sac", "Pendulum-v1")],
    ids=["ppo", "pqn-lstm", "sac"],
)
def test_resume_on_another_layout_is_exact(script, env_id, tmp_path):
    """A checkpoint resumed on a0-l1,2 trains what it trains resumed on a0-l0, bit for bit: a requeued job may land
    on another device count (--learner-device-ids may change on resume). With --lstm the actors start every env's
    recurrent state from zeros at a resume, as the envs restart from a reset. The resume is the engine's, the same
    in every script (tests/test_engine.py): PPO's runs check it, PQN's with --lstm the recurrent state besides,
    SAC's its replay memory (each env's ring placed in the new layout's columns)."""
    import shutil

    iterations = 60 if env_id == "CartPole-v1" else 24
    args = [*exact_args(script, env_id, 2), "--checkpoint-frequency", "1000", "--run-name", "r"]
    args[args.index("--total-timesteps") + 1] = iterations * 2 * ENVS * SIZES[script, env_id][1]
    stopped_at = stop_once_training(script, args, tmp_path, DEVICES)[1]
    assert 1 <= stopped_at < iterations
    runs, outputs = {}, {}
    for name, flags in [("a0-l0", []), ("a0-l1,2", LAYOUTS["a0-l1,2"])]:
        shutil.copytree(tmp_path / "runs", tmp_path / name / "runs")
        process = run_script(script, [*args, "--resume", *flags], tmp_path / name, devices=DEVICES, timeout=300)
        check_ok(process)
        runs[name] = curves(run_dir(tmp_path / name)), final_digests(process.stdout)
        outputs[name] = process.stdout
    if script == "sac":  # every env's ring resumed: counts that go on, and the file's contents read back as placed
        first, last = (
            replay_of(d / "runs" / "r" / "checkpoint.msgpack")["filled"][0] for d in (tmp_path, tmp_path / "a0-l1,2")
        )
        steps = SIZES[script, env_id][1]
        assert first.tolist() == [steps * stopped_at] * 8  # no game ended before the stop
        assert last.tolist() == [steps * iterations - 1] * 8  # each env's steps but its auto-reset step after 200
        file_digest, placed = re.findall(r"replay memory sha256 (\w+)", outputs["a0-l1,2"])
        assert file_digest == placed, outputs["a0-l1,2"]
        # Saved in global env order from both layouts: on a0-l1,2 each device holds envs of both threads.
        memory = replay_of(tmp_path / "a0-l0" / "runs" / "r" / "checkpoint.msgpack")
        other = replay_of(tmp_path / "a0-l1,2" / "runs" / "r" / "checkpoint.msgpack")
        assert all(memory[name].tobytes() == other[name].tobytes() for name in memory), memory.keys()
    (reference, digest), (logged, digests) = runs["a0-l0"], runs["a0-l1,2"]
    assert len(reference["stats/params_checksum"]) == iterations  # the stopped run's iterations, then the resumed
    for tag in reference:
        assert logged[tag].tobytes() == reference[tag].tobytes(), (tag, logged[tag], reference[tag])
    assert digests == digest and len(digest) == 1


def replay_of(path) -> dict:
    from cleanba.checkpoint import read_payload

    return read_payload(path, ("train_state",))["replay"]


def train_state_of(path) -> np.ndarray:
    """The checkpoint's train state (params, optimizer states, step) as one array of its leaves' bytes."""
    import jax

    from cleanba.checkpoint import read_payload

    leaves = jax.tree.leaves(read_payload(path, ("train_state",))["train_state"])
    return np.concatenate([np.asarray(leaf).ravel().view(np.uint8) for leaf in leaves])


def test_a_split_that_cannot_be_exact_says_so(tmp_path):
    """IMPALA's groups take --group-envs envs of each of the num_minibatches classes: 2 threads of 8 envs cut groups
    of 4 classes x 8 differently from 1 thread of 16 (pads fill each thread's block). The run says what holds."""
    process = run_script(
        "impala",
        [
            "--env-id",
            "CartPole-v1",
            "--hidden-dim",
            16,
            "--num-steps",
            8,
            "--exact",
            "--local-num-envs",
            8,
            "--num-actor-threads",
            2,
            "--total-timesteps",
            128,
        ],
        tmp_path,
    )
    check_ok(process)
    assert "XLA_FLAGS:" in process.stdout and LLVM_UNOPTIMIZED not in process.stdout, process.stdout
    assert (
        "but not on another split of the envs over actor threads or processes (--local-num-envs is not a "
        "multiple of 32, a block of groups)" in process.stdout
    ), process.stdout
