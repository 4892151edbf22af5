"""What the tests share: run a training script as a subprocess with tiny settings, in the environment the suite sets
(importing this module sets it: the CPU platform and XLA_FLAGS), and read back what it logged. conftest.py imports it
first, before any test module."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from cleanba.events import scalar_events
from cleanba.family import SCRIPTS

# The suite runs on the CPU. With the gpu-compile group installed, JAX would otherwise try the CUDA plugin first and
# print its "no CUDA" traceback in every process (this one, the scripts, SLURM's tasks, which inherit it).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
# .ci/run sets CI=true: there a test that lacks a tool or root fails instead of skipping (docs/tests.md).
IN_CI = os.environ.get("CI") == "true"

LOSS_TAGS = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/entropy"]

# Tiny settings: CartPole (Hopper for Box actions) with a small MLP, a few iterations. Sizes are per script so that the
# same layouts work for every script (IMPALA needs local_num_envs divisible by learner devices x minibatches).
TINY = {
    "ppo": [
        "--env-id",
        "CartPole-v1",
        "--hidden-dim",
        "16",
        "--num-steps",
        "16",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
        "--log-frequency",
        "1",
    ],
    "impala": [
        "--env-id",
        "CartPole-v1",
        "--hidden-dim",
        "16",
        "--num-steps",
        "8",
        "--num-minibatches",
        "2",
        "--log-frequency",
        "1",
    ],
    "ppo_continuous": [
        "--env-id",
        "Hopper-v4",
        "--hidden-dim",
        "16",
        "--num-steps",
        "16",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
        "--log-frequency",
        "1",
    ],
    "pqn": [
        "--env-id",
        "CartPole-v1",
        "--mlp-widths",
        "16",
        "16",
        "--num-steps",
        "16",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
        "--log-frequency",
        "1",
    ],
    # learning from the first rollout, 2 critic updates per 16 env steps, as many samples of 1 to 16 envs
    "sac": [
        *["--env-id", "Hopper-v4", "--hidden-dim", "16", "--num-steps", "16", "--log-frequency", "1"],
        *[
            "--learning-starts",
            "0",
            "--updates-per-step",
            "0.125",
            "--replay-batch-size",
            "16",
            "--buffer-size",
            "4096",
        ],
    ],
}


# Runs a training script with EnvPool's recv() failing on its 40th call in every actor thread: a real error in
# the actor, injected from outside the script.
FAULTY_ENVPOOL = """
import runpy, sys, envpool
make = envpool.make
class FaultyEnv:
    def __init__(self, env):
        self.env, self.calls = env, 0
    def __getattr__(self, name):
        return getattr(self.env, name)
    def recv(self):
        self.calls += 1
        if self.calls == 40:
            raise RuntimeError("injected actor fault")
        return self.env.recv()
envpool.make = lambda *args, **kwargs: FaultyEnv(make(*args, **kwargs))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# Most tests check what a run does (its logs, checkpoints, signals, processes and layouts), not the last bits of its
# numbers: their runs compile with LLVM's optimizations off (xla_backend_optimization_level=0: the same programs,
# buffers, threads and collectives; other bits, as in any change of compiler flags), a run's compiles taking half the
# CPU. Tests of the numbers a user gets (bitwise across layouts, learning, XLA's memory figures, the benchmark) are
# marked `xla_default` and run as users do; so does any run outside a test (tests/digest_matrix.py).
LLVM_UNOPTIMIZED = "--xla_backend_optimization_level=0"
xla_default = [True]  # of the test now running in this process (set for each test by conftest.py's xla_optimization)
# pytest's own processes compile so too (the learner references, the network's values, the bfloat16 update, XLA's
# memory figures: half their CPU, docs/benchmarks/2026-12-04-ci-time): their XLA_FLAGS, read once as JAX starts in
# them, get LLVM_UNOPTIMIZED, and what they start gets the user's (USER_XLA_FLAGS, kept in the environment for the
# xdist workers, which start from the main process's).
USER_XLA_FLAGS = os.environ.setdefault("CLEANBA_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{USER_XLA_FLAGS} {LLVM_UNOPTIMIZED}".strip()


def user_environment(**extra) -> dict:
    """What a script, a tool or a daemon starts with: this process's environment, the user's XLA_FLAGS, and extra."""
    environment = {name: value for name, value in os.environ.items() if name != "CLEANBA_TEST_USER_XLA_FLAGS"}
    return dict(environment, XLA_FLAGS=USER_XLA_FLAGS, **extra)


def script_env(devices: int = 1, env: dict | None = None) -> dict:
    """The environment of a script run: `devices` forced host CPU devices, appended to the user's XLA_FLAGS, and
    outside tests marked xla_default, LLVM_UNOPTIMIZED."""
    environment = user_environment(**(env or {}))
    flags = environment["XLA_FLAGS"]
    if not xla_default[0]:
        flags = f"{flags} {LLVM_UNOPTIMIZED}"
    environment["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    environment.setdefault("JAX_PLATFORMS", "cpu")
    # Runs of the same tiny programs share compiled executables across the suite (same results, less time), one
    # cache for both pytest-xdist workers. A size limit turns on JAX's file lock around each read and write of an
    # entry (jax._src.lru_cache), so that no run reads an entry another process is writing.
    environment.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax-compilation-cache"))
    environment.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))
    environment.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the tiny programs compile in < 1 s
    environment["PYTHONUNBUFFERED"] = "1"
    return environment


def script_command(script: str, args: list) -> list:
    return [sys.executable, str(SCRIPTS[script]), *map(str, args)]


# The subprocess timeouts below bound a hang; they are sized for the suite alone on the 2-core CI machine. A run that
# shares the machine (CI's Debian roots run their tests niced beside the host's suite) multiplies them by
# CLEANBA_TEST_SLOWDOWN.
SLOWDOWN = float(os.environ.get("CLEANBA_TEST_SLOWDOWN", "1"))


def run_script(
    script: str, args: list, tmp_path: Path, devices: int = 1, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run a training script in tmp_path and wait for it; returns the finished process."""
    return subprocess.run(
        script_command(script, args),
        cwd=tmp_path,
        env=script_env(devices, env),
        capture_output=True,
        text=True,
        timeout=timeout * SLOWDOWN,
    )


def start_script(script: str, args: list, cwd: Path, devices: int = 1, output=None) -> subprocess.Popen:
    """Start a training script in cwd without waiting for it: its stdout and stderr in one pipe, or in the open file
    `output` (for runs waited on together, so that none blocks on a full pipe)."""
    return subprocess.Popen(
        script_command(script, args),
        cwd=cwd,
        env=script_env(devices),
        text=True,
        stdout=output or subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


# JAX's CUDA plugin and NVIDIA's wheels, as the gpu-compile and cuda groups install them (the README's test line
# installs the first), with their metadata.
CUDA_PACKAGES = ("jax_plugins", "jax_cuda1*", "nvidia", "nvidia_*")
FAKE_GPU = "NVIDIA H100 80GB HBM3"


def in_mount_namespace(
    command: list, scratch: Path, gpu: str | None = None, cpu_install: bool = True, setup: list = ()
) -> list:
    """command in a private mount namespace (root; nothing outside it sees its mounts): with gpu, the NVIDIA driver's
    /proc files naming one GPU of that model, as a GPU node shows them; with cpu_install, this environment's
    site-packages without CUDA_PACKAGES (an overlay over it, their files removed in the overlay's layer in scratch), as
    after the README's CPU install; then the shell lines of setup."""
    import jax

    lines = ["set -e"]
    if gpu is not None:
        information = "/proc/driver/nvidia/gpus/0000:00:04.0"
        lines += [
            "mount -t tmpfs tmpfs /proc/driver",
            f"mkdir -p {information}",
            f"printf 'Model: \\t\\t %s\\nIRQ: \\t\\t 42\\n' '{gpu}' > {information}/information",
        ]
    if cpu_install:
        site = Path(jax.__file__).parents[1]
        layer = scratch / "overlay"
        layer.mkdir()
        lines += [
            f"mount -t tmpfs tmpfs '{layer}'",
            f"mkdir '{layer}/upper' '{layer}/work'",
            f"mount -t overlay overlay -o 'lowerdir={site},upperdir={layer}/upper,workdir={layer}/work' '{site}'",
            f"(cd '{site}' && rm -rf {' '.join(CUDA_PACKAGES)})",
        ]
    lines += [*setup, 'exec "$@"']
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh", *map(str, command)]


def qt5_libraries() -> list:
    """The system's Qt 5 libraries that EnvPool's Procgen module loads (the README's libqt5gui5), if installed."""
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    return sorted({line.split(" => ")[1] for line in listed.splitlines() if "libQt5Gui.so.5 " in line})


def require_qt5():
    """Skip, in one line, a Procgen test where the system's Qt 5 is missing; under CI=true fail, as CI installs it."""
    if not qt5_libraries():
        import pytest

        message = "needs the system's Qt 5 for Procgen (the README's libqt5gui5)"
        pytest.fail(message) if IN_CI else pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(script, tmp_path, args, explicit=True, heartbeat_timeout=100, devices=2):
    """Start ranks 0 and 1, each in its own directory; explicit flags or simulated SLURM variables."""
    port = free_port()
    processes = []
    for rank in range(2):
        directory = tmp_path / f"rank{rank}"
        directory.mkdir()
        if explicit:
            flags = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", rank]
            env = {}
        else:  # what srun sets for a 2-task step on one node; jax.distributed.initialize() detects it
            flags = []
            env = {
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "JAX_COORDINATOR_PORT": str(port),
            }
        command = script_command(script, [*args, "--distributed", "--heartbeat-timeout", heartbeat_timeout, *flags])
        processes.append(
            subprocess.Popen(
                command,
                cwd=directory,
                env=script_env(devices, env),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return processes


def run_dir(tmp_path: Path) -> Path:
    (directory,) = (tmp_path / "runs").iterdir()
    return directory


def first_losses(logged: dict, tags: list, iterations: int) -> np.ndarray:
    """(tags, iterations) array of the first logged values of each tag."""
    return np.array([[value for _, value in logged[tag][:iterations]] for tag in tags])


def scalars(directory: Path) -> dict:
    """{tag: [(step, value), ...]} of every scalar in the run's event files."""
    return {tag: [(e.step, e.value) for e in events] for tag, events in scalar_events(directory).items()}


def check_ok(process: subprocess.CompletedProcess):
    output = f"--- stdout\n{process.stdout}\n--- stderr\n{process.stderr}"
    assert process.returncode == 0, f"exit {process.returncode}\n{output}"


def assert_lost_its_peer(returncode: int, output: str):
    """How rank 0 ends when its peer is gone: a gloo collective fails (exit 1, with the traceback, at once), or JAX's
    coordination service misses the peer's heartbeats and aborts the process (after --heartbeat-timeout)."""
    if returncode == 1:
        assert re.search(r"Gloo .* failed: .*Connection (reset|closed) by peer", output), output
        assert "the run stopped on an error (JaxRuntimeError)" in output, output
    else:
        assert returncode == -signal.SIGABRT, output
        assert "stopped sending heartbeats" in output or "heartbeat timeout" in output, output
        assert "JAX distributed service detected fatal errors" in output, output


def stop_once_training(script: str, args: list, cwd: Path, devices: int) -> tuple:
    """A run stopped by SIGTERM once training is under way (its first progress line): (its output, the iteration its
    checkpoint holds, the last whole one)."""
    import re
    import signal

    first = start_script(script, args, cwd, devices=devices)
    for line in first.stdout:
        if line.startswith("step "):
            first.send_signal(signal.SIGTERM)
            break
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 143, output
    return output, int(re.search(r"checkpoint of iteration (\d+) saved", output).group(1))
