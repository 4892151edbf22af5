"""A GPU user's path, tested on the CPU: JAX's CUDA build from the lock (pyproject.toml's cuda12 and cuda13 groups); a
GPU node never training on the CPU by mistake (the NVIDIA driver's files, nvidia-smi, GPUs given by SLURM or
CUDA_VISIBLE_DEVICES, faked as a node shows them, the CPU install in a mount namespace); and a CPU run, with the CUDA
plugin of the gpu-compile group installed, printing only its own lines."""

import subprocess
import sys
import tomllib

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support import (
    FAKE_GPU,
    ROOT,
    TINY,
    in_mount_namespace,
    script_command,
    script_env,
)

from cleanba import startup

PYTHONS = ["3.11", "3.12", "3.13", "3.14"]  # pyproject.toml's requires-python (tests/test_bad_input.py checks it)
TINY_RUN = ["--num-actor-threads", "1", "--local-num-envs", "4", "--total-timesteps", "256"]


def marker_env(python: str) -> dict:
    """What a marker sees on Linux x86_64 with this CPython."""
    return dict(
        python_version=python,
        python_full_version=f"{python}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )


def locked_group(lock: dict, group: str, python: str) -> dict:
    """{name: version} of the lock's packages that `poetry install --with group` takes on this Python (the group's
    own and the main group's), one version each."""
    taken = {}
    for package in lock["package"]:
        for member in {group, "main"} & set(package["groups"]):
            marker = package.get("markers")
            marker = marker.get(member) if isinstance(marker, dict) else marker
            if marker is None or Marker(marker).evaluate(marker_env(python)):
                name = canonicalize_name(package["name"])
                assert taken.get(name, package["version"]) == package["version"], (name, python)
                taken[name] = package["version"]
    return taken


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("cuda", ["cuda12", "cuda13"])
def test_cuda_groups_lock_the_plugin_of_jaxlibs_version(cuda, python):
    """`poetry install --with cudaNN` on each Python takes JAX's CUDA plugin and PJRT plugin of its jaxlib's version,
    with every NVIDIA runtime wheel the plugin's with-cuda extra names, at a version it allows: all from the lock."""
    lock = tomllib.loads((ROOT / "poetry.lock").read_text())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["poetry"]["group"][cuda]["optional"] is True  # a CPU install takes no CUDA
    taken = locked_group(lock, cuda, python)
    jaxlib = taken["jaxlib"]
    assert taken["jax"] == jaxlib and taken[f"jax-{cuda}-plugin"] == jaxlib and taken[f"jax-{cuda}-pjrt"] == jaxlib
    (asked,) = [
        r for r in map(Requirement, pyproject["dependency-groups"][cuda]) if r.marker.evaluate(marker_env(python))
    ]
    assert asked.name == "jax" and asked.extras == {cuda} and jaxlib in asked.specifier, asked
    (plugin,) = [p for p in lock["package"] if p["name"] == f"jax-{cuda}-plugin" and p["version"] == jaxlib]
    runtime = [Requirement(r) for r in plugin["extras"]["with-cuda"]]
    assert len(runtime) >= 10, runtime  # CUDA, cuDNN, cuBLAS, cuFFT, cuSOLVER, cuSPARSE, NCCL, nvJitLink, ptxas...
    for requirement in runtime:
        if requirement.marker is None or requirement.marker.evaluate(marker_env(python)):
            name = canonicalize_name(requirement.name)
            assert name in taken and taken[name] in requirement.specifier, (requirement, taken.get(name))


def gpu_node_env(tmp_path, sign: str) -> tuple:
    """The command prefix and environment of a run on a node that shows an NVIDIA GPU by `sign`, with no
    JAX_PLATFORMS (the suite's default, support.py) and no GPU variable but the sign's."""
    env = script_env()
    for variable in ["JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"]:
        env.pop(variable, None)
    if sign == "nvidia-smi":  # the driver's tool, listing one GPU
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "nvidia-smi").write_text(f"#!/bin/sh\necho '{FAKE_GPU}'\n")
        (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    elif sign == "slurm":
        env["SLURM_JOB_GPUS"] = "0"
    elif sign == "cuda-visible":
        env["CUDA_VISIBLE_DEVICES"] = "0,1"
    return (FAKE_GPU if sign == "driver" else None), env


SIGNS = {
    "driver": FAKE_GPU,  # /proc/driver/nvidia/gpus/*/information
    "nvidia-smi": FAKE_GPU,
    "slurm": "SLURM_JOB_GPUS=0",
    "cuda-visible": "CUDA_VISIBLE_DEVICES=0,1",
}


@pytest.mark.needs_root("a mount namespace")
@pytest.mark.parametrize(("sign", "script"), [(sign, "ppo") for sign in SIGNS] + [("driver", "impala")])
def test_gpu_node_with_the_cpu_install_stops_before_training(sign, script, tmp_path):
    """The README's training line on a GPU node after the CPU install: one line naming the GPU it saw, the GPU
    install line (the README's) and JAX_PLATFORMS=cpu; exit 2; nothing started."""
    gpu, env = gpu_node_env(tmp_path, sign)
    command = in_mount_namespace(script_command(script, [*TINY[script], *TINY_RUN]), tmp_path, gpu=gpu)
    process = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2, process.stderr
    (line,) = process.stderr.strip().splitlines()
    assert SIGNS[sign] in line and "no CUDA plugin is installed" in line, line
    assert f"`{startup.GPU_INSTALL}`" in line and "JAX_PLATFORMS=cpu" in line, line
    assert process.stdout == "" and not (tmp_path / "runs").exists(), process.stdout
    quick_start = (ROOT / "README.md").read_text().split("## Quick start")[1].split("```")[1]
    assert startup.GPU_INSTALL in quick_start, quick_start  # the line names the README's own command


@pytest.mark.needs_root("a mount namespace")
@pytest.mark.parametrize("choice", [{"JAX_PLATFORMS": "cpu"}, {"CUDA_VISIBLE_DEVICES": ""}])
def test_a_gpu_node_trains_on_the_cpu_when_told(choice, tmp_path):
    """JAX_PLATFORMS=cpu (the way the refusal names), or every GPU hidden: the run trains, and its start line says
    on what."""
    gpu, env = gpu_node_env(tmp_path, "driver")
    env.update(choice)
    command = in_mount_namespace(script_command("ppo", [*TINY["ppo"], *TINY_RUN]), tmp_path, gpu=gpu)
    process = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stderr
    assert "learner on 1 x cpu, logs in" in process.stdout, process.stdout


def without_jax_platforms() -> dict:
    env = script_env()
    env.pop("JAX_PLATFORMS")
    return env


def run_plainly(command: list, cwd) -> subprocess.CompletedProcess:
    """command as a user runs it on a CPU machine: no JAX_PLATFORMS, the gpu-compile group's plugin installed."""
    assert startup.cuda_plugin_installed(), "the README's test line installs the gpu-compile group"
    process = subprocess.run(command, cwd=cwd, env=without_jax_platforms(), capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stderr
    return process


def test_a_cpu_run_prints_only_its_own_lines(script, tmp_path):
    """With JAX's CUDA plugin installed and no GPU: a CartPole run (with its saved model's evaluation) writes nothing
    to stderr (no absl warnings, no plugin traceback, no gymnasium precision warnings) and names its device."""
    flags = [*TINY[script], *TINY_RUN, "--save-model", "--eval-episodes", "1", "--run-name", "plain"]
    process = run_plainly(script_command(script, flags), tmp_path)
    assert process.stderr == "", process.stderr
    assert "learner on 1 x cpu, logs in" in process.stdout and "cuda" not in process.stdout.lower(), process.stdout


def test_cpu_tools_print_only_their_own_lines(tmp_path):
    """--help, python -m cleanba.evaluate and the benchmark, with the CUDA plugin installed and no GPU."""
    assert run_plainly(script_command("impala", ["--help"]), tmp_path).stderr == ""
    run_plainly(script_command("ppo", [*TINY["ppo"], *TINY_RUN, "--save-model", "--run-name", "m"]), tmp_path)
    model = tmp_path / "runs" / "m" / "cleanba_ppo.cleanba_model"
    evaluate = run_plainly([sys.executable, "-m", "cleanba.evaluate", model, "--episodes", "1"], tmp_path)
    assert evaluate.stderr == "" and "CartPole-v1: 1 episodes" in evaluate.stdout, evaluate.stdout
    benchmark = [sys.executable, "-m", "cleanba.benchmark", "--phases", "ceiling", "--repeats", "2"]
    benchmark += ["--iterations", "2", "--json", "b.json", "--", *TINY["ppo"], *TINY_RUN]
    assert run_plainly(benchmark, tmp_path).stderr == ""


PLUGIN = """
import sys
from cleanba import startup
startup.prepare_process()
import jax
print(jax.default_backend(), getattr(sys.modules.get("jax_plugins.xla_cuda12"), "__file__", None))
"""


@pytest.mark.needs_root("a mount namespace")
@pytest.mark.parametrize(("gpu", "platforms"), [(None, None), (None, "cpu"), (FAKE_GPU, None)])
def test_the_scripts_leave_the_cuda_plugin_to_jax_where_the_machine_shows_a_gpu(gpu, platforms, tmp_path):
    """What a script's start-up tells JAX: where the machine shows no GPU (JAX_PLATFORMS unset or cpu), a stand-in
    for the CUDA plugin (nothing to start, nothing printed); where it shows one, JAX imports and starts the installed
    plugin (here without the CUDA runtime, so it fails, says so, and JAX falls back to the CPU). gpu_compile's use of
    the plugin: tests/test_gpu_compile.py."""
    assert startup.cuda_plugin_installed(), "the README's test line installs the gpu-compile group"
    command = in_mount_namespace([sys.executable, "-c", PLUGIN], tmp_path, gpu=gpu, cpu_install=False)
    env = without_jax_platforms()
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    backend, plugin = process.stdout.split()
    assert backend == "cpu", process.stdout
    if gpu is None:
        assert plugin == "None" and process.stderr == "", process.stderr
    else:
        assert plugin.endswith("xla_cuda12/__init__.py") and "Unable to load CUDA" in process.stderr, process.stderr
