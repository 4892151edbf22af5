"""Throughput benchmark of a Cleanba training script: how fast each side runs alone, and how well they overlap.

    python -m cleanba.benchmark --script ppo -- --env-id Breakout-v5 --num-actor-threads 1 --local-num-envs 8 \\
        --num-steps 32 --actor-device-ids 0 --learner-device-ids 0
    python -m cleanba.benchmark --script impala --reference-command "python other/impala.py --env-id Breakout-v5" \\
        -- --env-id Breakout-v5 --actor-device-ids 0 --learner-device-ids 1 2 3     # a GPU machine with 4 GPUs
    bash benchmark.sh throughput --actor-device-ids 0 --learner-device-ids 0      # PPO and IMPALA on Breakout-v5

Everything after `--` goes to the training script's own flags (its tyro Args), so every phase sizes envs, actor
threads, batches and devices exactly like a real single-process run of that command: `local_num_envs` envs per
actor thread, `num_actor_threads` threads per id of `--actor-device-ids`, the learner data-parallel over
`--learner-device-ids`. `--script` is ppo, impala, or the path of a fork that keeps the scripts' functions. On a
GPU pass the device ids as for training (a0-l0: actor and learner share GPU 0; a0-l1,2,3: actor on GPU 0);
on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices. The environment (XLA_FLAGS,
JAX_PLATFORMS, ...) is passed on to every phase unchanged.

Phases, each in a child process of its own, so that XLA state does not carry over from one to the next and
the peak host memory of each is measured alone (ru_maxrss of the child, from os.wait4):
    ceiling     EnvPool alone: one Python thread per actor thread, each stepping its own pool (same env
                config, envs and seeds as the actors) with random valid actions, no policy, no JAX
                computation. The fastest the actors could ever go on this machine.
    actor       the script's own actor threads (rollout_actor: policy inference, rollout storage, transfer to
                the learner devices), fed the initial params without waiting and drained at once: no learning.
                Also where an actor's time goes, from the script's own stats/actor_*_time (perf_counter sums per
                rollout): inference (dispatch), device_to_host (waits for the inference result), env_send,
                env_recv, storage (rollout and episode bookkeeping), host_to_device (put_on_learners).
    learner     the script's jitted update on synthetic rollouts of the real global size (random observations
                and actions, env ids as a real run assigns them), no envs.
                Before running it, XLA's own memory analysis of the compiled update and of one minibatch gradient
                step (update_minibatch on the batch the update hands it): what the learner allocates on its
                device besides params and rollouts. The update should need little more than one minibatch step,
                and --gradient-accumulation-steps should lower both.
    sync        the training script itself with --no-concurrency: actor and learner alternate.
    concurrent  the training script itself with --concurrency: they overlap, the actor one policy behind.
    reference   optional (--reference-command): any command, run in a shell in the current directory; its
                figure is the last "SPS <number>" it printed, its wall time and peak memory are reported too.
    layers      only when asked for (--phases layers): where the learner's compute goes. Every convolution of
                the script's network (each nn.Conv call, found while tracing its forward pass) timed alone on the
                first learner device at the learner's micro-batch (minibatch / gradient accumulation steps /
                learner devices, or --layer-batch): forward, input gradient (dx) and weight gradient (dk), each
                in ms and GFLOP/s; then the whole network's forward and gradient at that batch, the share of the
                gradient the convolutions account for, and a large float32 matmul's GFLOP/s on the same device as
                the practical peak to read them against. The first convolution's dx is left out of the sums: its
                input is the observation, and the learner never computes it. Last, one learner update (as in
                the learner phase) under JAX's profiler: the share of its time in each kind of XLA operation that
                the trace names (layout transposes, pooling, ...; XLA:CPU's Eigen convolutions mostly go unnamed).

An iteration is one rollout of num_steps steps of every env: batch_size env steps. Every phase runs
--warmup-iterations iterations first, which are not measured (compilation, first env resets), then --repeats
windows of --iterations iterations; each figure is the median over the windows (these machines are noisy, so
compare ratios measured in one run rather than absolute figures across runs). sync and concurrent train for
exactly warmup + repeats x iterations iterations (the benchmark sets --total-timesteps and --run-name, and runs
them in a temporary directory), and their figures come from the TensorBoard stats/ the script logs every
iteration, timed by the events' wall times.

Figures (one table row per phase; all of them, per window too, in the JSON file):
    SPS            env steps per second. ceiling, actor: steps of all actor threads together per second of a
                   window. learner: batch_size / median update time. sync, concurrent: batch_size x iterations of
                   a window / the wall time between the end of the window's first and last iterations.
    / ceiling      SPS over the ceiling's: the share of raw EnvPool speed that the phase keeps.
    compile s      actor: the first rollout's time minus the median rollout time (the policy's compilation).
                   learner: from the start of the ahead-of-time compile to the end of the first update, less
                   the median update time. sync, concurrent: the script's own stats/learner_compile_time (it
                   compiles the update ahead of time, so its first update waits for no compile).
    learner wait   sync, concurrent: median seconds per iteration the learner waited for rollouts
                   (stats/rollout_queue_wait; large: the actor is the bottleneck).
    actor wait     sync, concurrent: median seconds per iteration an actor waited for params plus to hand over
                   its rollout (stats/param_queue_wait + stats/actor_rollout_queue_wait; large: the learner is).
    cores          CPU seconds per wall second of the phase's process in a window: all its threads (actors,
                   learner, EnvPool's workers, XLA's pools), sampled every 50 ms. Next to the cores the machine
                   has (cpu_cores_available in the JSON) it says whether a phase is compute-bound: a ceiling
                   that keeps every core busy leaves no room for a policy on the same cores.
    host MiB       peak resident memory of the phase's process (with its JAX, EnvPool and, for sync and
                   concurrent, the whole training run).
    device MiB     the largest peak_bytes_in_use of the local devices (memory_stats(); GPUs). n/a on CPU.
Ratio lines:
    concurrent / sync      what overlapping buys.
    overlap efficiency     concurrent SPS / min(actor SPS, learner SPS): 1 means the overlap is perfect and
                           the run goes as fast as its slower side alone allows.
    sync efficiency        sync SPS / (1 / (1 / actor SPS + 1 / learner SPS)): the same for alternating sides.
    concurrent / serial bound
                           concurrent SPS over that same serial bound. Where the actor and the learner share
                           the same compute (one CPU, one GPU for both), the slower side alone is out of reach:
                           the other side's work takes cores from it. Then this ratio says what the overlap
                           gains over taking turns: at most 1 + (faster side's time per iteration / slower side's).
    ours / reference       concurrent SPS (sync SPS without a concurrent phase) over the reference's.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cleanba.startup import hide_cuda_plugin

if __name__ == "__main__":  # the program, not a module imported by a test or a tool
    hide_cuda_plugin()  # before anything imports JAX: no CUDA plugin noise where the machine has no GPU

import tyro

from cleanba.benchmark_common import (
    PHASES,
    BenchmarkArgs,
    fail,
    load_script,
    parse_script_args,
    resolve_script,
    total_iterations,
)
from cleanba.benchmark_layers import layers_phase
from cleanba.benchmark_phases import (
    actor_phase,
    ceiling_phase,
    device_peak_mib,
    learner_phase,
    plan,
    sample_cpu,
    training_phase,
)

# Re-exported, not used here: the probes in docs/benchmarks and tests/test_memory.py call benchmark.build_model and
# benchmark.learner_memory ("X as X" marks a re-export for ruff).
from cleanba.benchmark_phases import build_model as build_model
from cleanba.benchmark_phases import learner_memory as learner_memory
from cleanba.benchmark_report import busy_cores, derived_ratios, table, training_figures

SPS_PATTERN = re.compile(r"SPS[^0-9]*([0-9][0-9,]*\.?[0-9]*)")
CHILD_FLAG = "--phase-child"  # internal: `--phase-child PHASE RESULT_FILE` runs one phase in this process


def split_argv(argv: list) -> tuple:
    """The benchmark's own flags, and the training script's (everything after the first `--`)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def parse_benchmark_args(argv: list) -> BenchmarkArgs:
    bench = tyro.cli(BenchmarkArgs, args=argv, prog="python -m cleanba.benchmark", description=__doc__)
    for name in ["repeats", "warmup_iterations", "iterations"]:
        if getattr(bench, name) <= 0:
            # At least one warm-up iteration: the first includes compilation, and windows start at its end.
            fail(f"--{name.replace('_', '-')}={getattr(bench, name)} must be positive")
    if bench.timeout <= 0:
        fail(f"--timeout={bench.timeout} must be positive")
    if bench.layer_batch is not None and bench.layer_batch <= 0:
        fail(f"--layer-batch={bench.layer_batch} must be positive")
    if not bench.phases and not bench.reference_command:
        fail("--phases is empty and there is no --reference-command: nothing to measure")
    return bench


# ---------------------------------------------------------------------------------------------------------------
# The child: runs one phase in this process (the phases are in benchmark_phases.py and benchmark_layers.py).


def child_main(phase: str, result_path: Path, argv: list):
    own, flags = split_argv(argv)
    bench = parse_benchmark_args(own)
    script = resolve_script(bench.script)
    samples, stop_sampling = [], threading.Event()
    threading.Thread(target=sample_cpu, args=(samples, stop_sampling), daemon=True, name="cpu-sampler").start()
    if phase in ("sync", "concurrent"):
        result = training_phase(script, flags)  # flags already hold the benchmark's run settings
    else:
        module = load_script(script)
        args = parse_script_args(module, flags, total_iterations(bench))
        phase_function = {
            "plan": plan,
            "ceiling": ceiling_phase,
            "actor": actor_phase,
            "learner": learner_phase,
            "layers": layers_phase,
        }
        result = phase_function[phase](module, args, bench)
    stop_sampling.set()
    samples.append((time.time(), time.process_time()))
    if phase != "plan":
        result["cpu_samples"] = samples
        # The ceiling uses no device: reading memory stats would start a JAX backend (and take GPU memory).
        result["device_peak_mib"] = None if phase == "ceiling" else device_peak_mib()
    result_path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# The parent: runs each phase as a child, reads what it measured, prints and writes the figures. It imports
# neither JAX nor the script: a child's ru_maxrss starts from the RSS of the process it was forked from.


def child_env() -> dict:
    """The parent's environment, with this checkout importable by `python -m cleanba.benchmark` from any cwd."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def kill_group(pid: int):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_measured(
    command, cwd: Path, log_path: Path, timeout: float, shell: bool = False, xla_flags: list = ()
) -> tuple:
    """Runs a command in its own process group, output to log_path; returns (exit status, wall s, peak RSS MiB).
    os.wait4 gives the child's ru_maxrss, which includes the descendants it waited for (e.g. a shell's command).
    xla_flags: appended to the command's XLA_FLAGS."""
    env = child_env()
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *xla_flags]).strip()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, shell=shell, start_new_session=True
        )
    timer = threading.Timer(timeout, kill_group, (process.pid,))
    timer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    except BaseException:  # e.g. Ctrl-C: the child is in its own session and did not get it
        kill_group(process.pid)
        raise
    finally:
        timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    kill_group(process.pid)  # threads or daemons the command may have left behind
    return process.returncode, time.perf_counter() - start, usage.ru_maxrss / 1024  # KiB on Linux


def report_failure(what: str, status: int, log_path: Path, timeout: float):
    print(flush=True)  # end the progress line
    output = log_path.read_text(errors="replace")
    print(f"--- output of {what}\n{output[-20000:]}--- end of output", file=sys.stderr)
    reason = f"was killed after --timeout={timeout:g} s" if status == -signal.SIGKILL else f"exited with {status}"
    print(f"benchmark: {what} {reason}; output above, files in {log_path.parent}", file=sys.stderr)
    # A refusal of the script's flags (exit 2, e.g. a device id this machine lacks) is bad input here too.
    sys.exit(2 if status == 2 else 1)


def child_command(phase: str, result_path: Path, own: list, script: Path, flags: list) -> list:
    # The script's absolute path last (tyro keeps the last value): children run in other directories.
    return [
        sys.executable,
        "-m",
        "cleanba.benchmark",
        CHILD_FLAG,
        phase,
        str(result_path),
        *own,
        "--script",
        str(script),
        "--",
        *flags,
    ]


def plan_run(own: list, script: Path, flags: list, workdir: Path) -> dict:
    """Checks the script and its flags in a child; its refusals (exit 2) go straight to the user."""
    result_path = workdir / "plan.json"
    process = subprocess.run(child_command("plan", result_path, own, script, flags), env=child_env())
    if process.returncode or not result_path.exists():  # refused, or the script's --help was asked for
        shutil.rmtree(workdir)
        sys.exit(process.returncode)
    return json.loads(result_path.read_text())


def run_phase(phase: str, own: list, script: Path, flags: list, workdir: Path, timeout: float) -> dict:
    directory = workdir / phase
    directory.mkdir()
    result_path = directory / "result.json"
    command = child_command(phase, result_path, own, script, flags)
    # The layers phase's trace names XLA:CPU's operations only with this flag (read when JAX starts its backend).
    trace_flag = ["--xla_cpu_enable_xprof_traceme=true"] if phase == "layers" else []
    status, wall, rss = run_measured(command, directory, directory / "output.log", timeout, xla_flags=trace_flag)
    if status != 0:
        report_failure(f"phase {phase}", status, directory / "output.log", timeout)
    return dict(json.loads(result_path.read_text()), peak_rss_mib=rss, wall_s=wall)


def training_flags(flags: list, phase: str, sizes: dict) -> list:
    """The user's flags, then the benchmark's (tyro keeps the last value of a repeated flag)."""
    # stats/ are logged every iteration whatever --log-frequency is; the user's (default) frequency keeps the
    # console line and the metric transfers at the cost a real run pays.
    return [
        *flags,
        "--concurrency" if phase == "concurrent" else "--no-concurrency",
        "--total-timesteps",
        str(sizes["total_timesteps"]),
        "--run-name",
        phase,
    ]


def run_reference(command: str, workdir: Path, timeout: float) -> dict:
    directory = workdir / "reference"
    directory.mkdir()
    log_path = directory / "output.log"
    # The user's current directory, so that relative paths in the command mean what they mean there.
    status, wall, rss = run_measured(command, Path.cwd(), log_path, timeout, shell=True)
    if status != 0:
        report_failure("--reference-command", status, log_path, timeout)
    figures = SPS_PATTERN.findall(log_path.read_text(errors="replace"))
    if not figures:
        sys.exit(f"benchmark: --reference-command printed no 'SPS <number>'; its output is in {log_path}")
    return dict(sps=float(figures[-1].rstrip(",").replace(",", "")), wall_s=wall, peak_rss_mib=rss, command=command)


def main(argv: list):
    if argv[:1] == [CHILD_FLAG]:
        return child_main(argv[1], Path(argv[2]), argv[3:])
    own, flags = split_argv(argv)
    bench = parse_benchmark_args(own)
    script = resolve_script(bench.script)
    workdir = Path(tempfile.mkdtemp(prefix="cleanba-benchmark-"))
    sizes = plan_run(own, script, flags, workdir)
    json_path = bench.json or Path(f"benchmark-{script.stem}-{sizes['env_id']}.json")
    print(
        f"{script.name} on {sizes['env_id']}, {sizes['layout']}: batch_size={sizes['batch_size']} env steps per "
        f"iteration (num_steps={sizes['num_steps']}); median of {bench.repeats} windows of {bench.iterations} "
        f"iterations after {bench.warmup_iterations} warm-up iterations; {len(os.sched_getaffinity(0))} CPU "
        f"cores",
        flush=True,
    )
    phases = {}
    for phase in [phase for phase in PHASES if phase in bench.phases]:
        print(f"  {phase} ...", end="", flush=True)
        phase_flags = training_flags(flags, phase, sizes) if phase in ("sync", "concurrent") else flags
        phases[phase] = run_phase(phase, own, script, phase_flags, workdir, bench.timeout)
        print(f" done in {phases[phase]['wall_s']:.0f} s", flush=True)
    if bench.reference_command:
        print("  reference ...", end="", flush=True)
        phases["reference"] = run_reference(bench.reference_command, workdir, bench.timeout)
        print(f" done in {phases['reference']['wall_s']:.0f} s", flush=True)
    for phase in ["sync", "concurrent"]:  # read only now: TensorBoard would inflate the children's ru_maxrss
        if phase in phases:
            phases[phase].update(training_figures(workdir / phase / "runs" / phase, sizes, bench))
    for figures in phases.values():
        if "window_bounds" in figures:
            figures.update(busy_cores(figures))
        figures.pop("cpu_samples", None)  # the layers phase has no windows
    shutil.rmtree(workdir)
    ratios = derived_ratios(phases)
    print(table(phases, ratios), flush=True)
    settings = dict(repeats=bench.repeats, warmup_iterations=bench.warmup_iterations, iterations=bench.iterations)
    report = dict(
        script=str(script),
        **sizes,
        cpu_cores_available=len(os.sched_getaffinity(0)),
        settings=settings,
        script_flags=flags,
        phases=phases,
        ratios=ratios,
    )
    json_path.write_text(json.dumps(report, indent=2))
    print(f"figures written to {json_path}")


if __name__ == "__main__":
    main(sys.argv[1:])
