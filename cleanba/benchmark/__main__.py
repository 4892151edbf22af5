"""The benchmark as a program, `python -m cleanba.benchmark` (what it measures and each figure: __init__.py): the parent
checks the flags, runs each phase in a child process of its own (`--phase-child`, phases.py and layers.py), reads what
it measured, prints the table and writes the JSON file (report.py)."""

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

from cleanba import benchmark
from cleanba.benchmark.common import (
    PHASES,
    BenchmarkArgs,
    fail,
    load_script,
    parse_script_args,
    resolve_script,
    split_argv,
    total_iterations,
)
from cleanba.benchmark.layers import layers_phase
from cleanba.benchmark.phases import (
    actor_phase,
    ceiling_phase,
    device_peak_mib,
    learner_phase,
    plan,
    sample_cpu,
    training_phase,
)
from cleanba.benchmark.report import busy_cores, derived_ratios, table, training_figures

SPS_PATTERN = re.compile(r"SPS[^0-9]*([0-9][0-9,]*\.?[0-9]*)")
CHILD_FLAG = "--phase-child"  # internal: `--phase-child PHASE RESULT_FILE` runs one phase in this process


def parse_benchmark_args(argv: list) -> BenchmarkArgs:
    bench = tyro.cli(BenchmarkArgs, args=argv, prog="python -m cleanba.benchmark", description=benchmark.__doc__)
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
# The child: runs one phase in this process (the phases are in phases.py and layers.py).


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
    root = str(Path(__file__).resolve().parents[2])
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
