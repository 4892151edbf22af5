"""The throughput benchmark (python -m cleanba.benchmark) on tiny settings: every phase runs and reports positive
figures, the table has a row per phase, a two-device layout works, and bad input is refused."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, TINY, check_ok, script_env

# These tests check the tool (its phases, figures and ratios consistent with each other), not the speeds themselves:
# their runs compile with LLVM's optimizations off like the other tests of what a run does (the layers phase and the
# tiny settings: 168 -> 94 s of CPU). Figures worth reading come from `python -m cleanba.benchmark` as users run it.

BENCHMARK = [sys.executable, "-m", "cleanba.benchmark"]
QUICK = ["--repeats", "2", "--warmup-iterations", "1", "--iterations", "2"]
SIZES = ["--local-num-envs", "4", "--num-actor-threads", "1"]
REFERENCE = "echo 'step 64/64 (100%) | SPS 1,234 | return 9.0'"  # a console line like the scripts print

# The figures each phase must report, all positive (seconds, steps per second, MiB).
FIELDS = {
    "ceiling": ["sps", "cores", "peak_rss_mib", "wall_s"],
    "actor": ["sps", "cores", "peak_rss_mib", "wall_s", "rollout_time_s", "compile_s"],
    "learner": ["sps", "cores", "peak_rss_mib", "wall_s", "update_time_s", "updates_per_s", "compile_s"],
    "sync": [
        "sps",
        "cores",
        "peak_rss_mib",
        "wall_s",
        "compile_s",
        "actor_compile_s",
        "learner_update_time_s",
        "actor_rollout_time_s",
        "learner_wait_s",
        "actor_wait_s",
    ],
    "reference": ["sps", "peak_rss_mib", "wall_s"],
}
FIELDS["concurrent"] = FIELDS["sync"]
RATIOS = [
    "actor_over_ceiling",
    "learner_over_ceiling",
    "sync_over_ceiling",
    "concurrent_over_ceiling",
    "concurrent_over_sync",
    "overlap_efficiency",
    "sync_efficiency",
    "concurrent_over_serial",
    "ours_over_reference",
]


def benchmark(args: list, tmp_path, devices: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    # PYTHONPATH: the checkout, whatever the current directory (tmp_path, where the JSON file goes).
    env = script_env(devices, {"PYTHONPATH": str(ROOT)})
    return subprocess.run(
        [*BENCHMARK, *map(str, args)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def check_phase(name: str, figures: dict, batch_size: int, repeats: int, cores_available: int):
    for key in FIELDS[name]:
        assert math.isfinite(figures[key]) and figures[key] > 0, (name, key, figures)
    if name != "reference":
        assert len(figures["window_sps"]) == repeats and min(figures["window_sps"]) > 0, (name, figures)
        # CPU seconds per wall second: a unit slip (ticks, ns) or windows on another clock would break this.
        assert len(figures["window_cores"]) == repeats and min(figures["window_cores"]) > 0, (name, figures)
        assert max(figures["window_cores"]) <= 1.25 * cores_available, (name, figures)
        assert "cpu_samples" not in figures
        assert figures["device_peak_mib"] is None  # CPU devices report no memory statistics
    if name == "learner":
        assert figures["sps"] == pytest.approx(batch_size / figures["update_time_s"])
        memory = figures["learner_memory"]  # XLA's analysis of the update it ran
        assert memory["update_temp_mib"] >= memory["minibatch_step_temp_mib"] > 0, memory
    if name in ("actor", "sync", "concurrent"):  # the script's stats/actor_*_time, per rollout: at most its time
        timings = figures["actor_timings_s"]
        rollout = figures["rollout_time_s" if name == "actor" else "actor_rollout_time_s"]
        assert set(timings) == {"inference", "device_to_host", "env_send", "env_recv", "storage", "host_to_device"}
        assert min(timings.values()) > 0 and sum(timings.values()) <= 1.25 * rollout, figures


@pytest.mark.slow
def test_every_phase_on_tiny_settings(tmp_path):
    process = benchmark(
        [*QUICK, "--json", "figures.json", "--reference-command", REFERENCE, "--", *TINY["ppo"], *SIZES], tmp_path
    )
    check_ok(process)
    report = json.loads((tmp_path / "figures.json").read_text())
    assert report["batch_size"] == 4 * 16 and report["num_iterations"] == 1 + 2 * 2
    assert report["layout"].startswith("a0-l0")
    assert list(report["phases"]) == ["ceiling", "actor", "learner", "sync", "concurrent", "reference"]
    for name, figures in report["phases"].items():
        check_phase(name, figures, report["batch_size"], repeats=2, cores_available=report["cpu_cores_available"])
    assert report["phases"]["reference"]["sps"] == 1234
    for key in RATIOS:
        assert math.isfinite(report["ratios"][key]) and report["ratios"][key] > 0, (key, report["ratios"])
    phases = report["phases"]
    assert report["ratios"]["ours_over_reference"] == pytest.approx(phases["concurrent"]["sps"] / 1234)
    assert report["ratios"]["overlap_efficiency"] == pytest.approx(
        phases["concurrent"]["sps"] / min(phases["actor"]["sps"], phases["learner"]["sps"])
    )
    serial = 1 / (1 / phases["actor"]["sps"] + 1 / phases["learner"]["sps"])
    assert report["ratios"]["concurrent_over_serial"] == pytest.approx(phases["concurrent"]["sps"] / serial)
    rows = [line.split()[0] for line in process.stdout.splitlines() if line.split()]
    for name in report["phases"]:
        assert name in rows, process.stdout
    assert "overlap efficiency" in process.stdout and "concurrent / sync" in process.stdout
    assert not list(tmp_path.glob("runs"))  # the training runs wrote to a temporary directory, now removed


@pytest.mark.slow
def test_actor_and_learner_on_separate_devices(tmp_path):
    """a0-l1 with IMPALA: the actor phase puts rollouts on another device, the learner runs its mesh there."""
    process = benchmark(
        [
            *QUICK,
            "--script",
            "impala",
            "--phases",
            "actor",
            "learner",
            "--json",
            "figures.json",
            "--",
            *TINY["impala"],
            *SIZES,
            "--actor-device-ids",
            "0",
            "--learner-device-ids",
            "1",
        ],
        tmp_path,
        devices=2,
    )
    check_ok(process)
    report = json.loads((tmp_path / "figures.json").read_text())
    assert report["layout"].startswith("a0-l1") and report["script"].endswith("cleanba_impala.py")
    assert list(report["phases"]) == ["actor", "learner"]
    for name, figures in report["phases"].items():
        check_phase(name, figures, report["batch_size"], repeats=2, cores_available=report["cpu_cores_available"])
    assert report["ratios"] == {}  # every ratio needs a phase that did not run


@pytest.mark.slow
def test_layers_phase_profiles_every_convolution(tmp_path):
    """--phases layers on a small IMPALA ResNet: every convolution found (3 sequences x 5), timed at the learner's
    micro-batch, grouped by shape, its flops counted from its shapes; no input gradient for the first one."""
    atari = [
        "--env-id",
        "Breakout-v5",
        "--channels",
        "4",
        "8",
        "8",
        "--hidden-dim",
        "16",
        "--num-steps",
        "8",
        "--num-minibatches",
        "2",
        "--gradient-accumulation-steps",
        "2",
        *SIZES,
    ]
    process = benchmark([*QUICK, "--phases", "layers", "--json", "figures.json", "--", *atari], tmp_path)
    check_ok(process)
    report = json.loads((tmp_path / "figures.json").read_text())
    figures = report["phases"]["layers"]
    assert list(report["phases"]) == ["layers"] and report["ratios"] == {}
    assert figures["batch"] == 4 * 8 // 2 // 2  # a minibatch of 16 samples in 2 micro-batches
    layers = figures["layers"]
    paths = [path for layer in layers for path in layer["paths"]]
    assert len(paths) == len(set(paths)) == 15 and sum(layer["count"] for layer in layers) == 15
    first = layers[0]
    assert first["paths"] == ["ConvSequence_0/Conv_0"] and first["input_shape"] == [8, 84, 84, 4]
    assert first["output_shape"] == [8, 84, 84, 4] and first["dx_s"] is None
    assert first["gflop"] == pytest.approx(2 * 8 * 84 * 84 * 4 * 3 * 3 * 4 / 1e9)
    for layer in layers:
        assert layer["count"] == len(layer["paths"]) and layer["gflop"] > 0, layer
        assert all(layer[key] > 0 for key in ["forward_s", "dk_s"] + ["dx_s"] * (layer is not first)), layer
    # (input, output) channels and sizes: the pool halves the image after each sequence's first convolution.
    shapes = [(layer["input_shape"][1:], layer["output_shape"][-1], layer["count"]) for layer in layers]
    assert shapes == [
        ([84, 84, 4], 4, 1),
        ([42, 42, 4], 4, 4),
        ([42, 42, 4], 8, 1),
        ([21, 21, 8], 8, 5),
        ([11, 11, 8], 8, 4),
    ]
    # Timings are only checked to be measured: a machine under load may time the gradient below the forward pass.
    assert figures["network_gradient_s"] > 0 and figures["network_forward_s"] > 0 and figures["matmul_gflops"] > 0
    # The traced learner update: XLA:CPU named its operations (the benchmark added the trace flag to this phase).
    operations = figures["traced_operations_s"]
    assert figures["traced_update_s"] > 0 and any("fusion" in kind for kind in operations), figures
    cores = report["cpu_cores_available"]  # operations on several threads at once: at most one per core
    assert 0 < sum(operations.values()) <= 1.25 * cores * figures["traced_update_s"], figures
    table = process.stdout[process.stdout.index("layers at batch 8 on cpu") :]
    assert "ConvSequence_0/ResidualBlock_*/Conv_*" in table and "convolutions in all" in table, process.stdout
    assert "one learner update under the profiler" in table, process.stdout

    # A network without convolutions (CartPole's MLP) has no rows but the network's figures; --layer-batch sets it.
    process = benchmark(
        [*QUICK, "--phases", "layers", "--layer-batch", "5", "--json", "mlp.json", "--", *TINY["ppo"], *SIZES], tmp_path
    )
    check_ok(process)
    figures = json.loads((tmp_path / "mlp.json").read_text())["phases"]["layers"]
    assert figures["batch"] == 5 and figures["layers"] == [] and figures["network_gradient_s"] > 0


BAD_INPUT = {
    "unknown script": (["--script", "no_such_script.py"], "no_such_script.py is not a file"),
    "not a training script": (["--script", "not_cleanba.py"], "has no Args"),
    "no iterations": (["--iterations", "0"], "--iterations=0 must be positive"),
    "no layer batch": (["--phases", "layers", "--layer-batch", "0"], "--layer-batch=0 must be positive"),
    "refused by the script": (["--", "--env-id", "CartPole-v1", "--local-num-envs", "0"], "--local-num-envs=0"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_refused(case, tmp_path):
    (tmp_path / "not_cleanba.py").write_text("x = 1\n")
    args, fragment = BAD_INPUT[case]
    process = benchmark(args, tmp_path, timeout=60)
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr and "error:" in process.stderr
    assert fragment in process.stderr, process.stderr
    assert not list(tmp_path.glob("*.json"))


# benchmark.sh's learning mode at tiny sizes: the time-to-score run made to run once on a lent GPU, here on CartPole
# (ENV_ID), whose games end within seconds at random; the Atari scores' normalization is test_score_report's.
LEARNING_TINY = ["--hidden-dim", "16", "--num-steps", "8", "--num-minibatches", "2", "--local-num-envs", "4"]
LEARNING_TINY += ["--num-actor-threads", "1", "--log-frequency", "1", "--eval-episodes", "1"]


@pytest.mark.slow
def test_learning_mode_brings_back_the_run_and_its_score(tmp_path):
    """`bash benchmark.sh learning OUTDIR`: the run's event files, checkpoint, log and score table land in OUTDIR. A run
    past LIMIT seconds (here 15, a run of more steps than fit) is SIGTERMed, checkpoints and still leaves its curve
    and score: what a time-boxed GPU call brings back. (A run that ends within the limit saves its model and
    evaluates it: the scripts' own --save-model, tests/test_evaluate.py.)"""
    limit = 15
    env = script_env(1, {"LIMIT": str(limit), "STEPS": str(4 * 8 * 10**6), "PYTHONPATH": str(ROOT)})
    env |= {"ENV_ID": "CartPole-v1", "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}  # `python`: this env's
    out = tmp_path / "out"
    process = subprocess.run(
        ["bash", str(ROOT / "benchmark.sh"), "learning", str(out), *LEARNING_TINY],
        env=env,
        capture_output=True,
        text=True,
        timeout=limit + 300,
    )
    check_ok(process)
    log = (out / "train.log").read_text()
    run = out / "runs" / "learning"
    assert list(run.glob("events.out.tfevents*")), log
    assert "training exit status 124" in log and "stopped by signal 15" in log, log
    assert (run / "checkpoint.msgpack").exists() and "checkpoint of iteration" in log, log
    scores = (out / "report" / "scores.csv").read_text().splitlines()
    assert scores[0].startswith("variant,env_id,seed,final_step,score") and len(scores) == 2, scores
    assert scores[1].startswith("cleanba_impala,CartPole-v1,1,"), scores
