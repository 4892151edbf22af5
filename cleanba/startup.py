"""What a training process sets and checks before it imports JAX and EnvPool. The scripts import this module first.

- XLA's environment, decided here once for every script and tool: the memory fraction that leaves a shared GPU
  room for the actor's inference, and the XLA:CPU flag of the jaxlib it was checked with. JAX reads both when its
  first backend starts, so they are set before any import of jax. The scripts' start line prints XLA_FLAGS.
- A Python the project does not support, or an EnvPool that cannot load a system library it links against, ends
  the process with one line naming what to install (exit status 1), instead of a traceback from inside an import.
- EnvPool, imported with the env families the scripts train on registered (import_envpool), and rlax without the
  distribution libraries that the scripts do not use (import_rlax).
- NVIDIA GPUs as the machine shows them (nvidia_gpus): where it shows none, JAX's CUDA plugin is hidden from JAX
  (hide_cuda_plugin), as it could only fail and print its failure; where it shows some, the scripts refuse to train
  on the CPU (devices.check_gpu_backend).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
import typing
import warnings
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PYTHONS = ((3, 11), (3, 14))  # the oldest and newest minor versions pyproject.toml's requires-python admits
MEM_FRACTION = "0.6"  # of an accelerator's memory for this process's allocator, unless the user sets one
# The Debian and Ubuntu packages of the system libraries that EnvPool's wheels link against and a minimal system
# lacks: envpool 1.2.6 and later load EGL and OpenGL when their gfootball family is registered (envpool.entry).
LIBRARY_PACKAGES = {
    "libEGL.so.1": "libegl1",
    "libOpenGL.so.0": "libopengl0",
    "libGL.so.1": "libgl1",
    "libGLX.so.0": "libglx0",
}


# `import envpool` registers every env family EnvPool ships (its envpool/entry.py), and one of them, Jumanji, imports
# matplotlib's pyplot and its renderers, a large part of a script's start (docs/performance.md#a-scripts-start). These
# are the families the scripts train on; import_envpool registers them alone, and any other env id registers the rest
# (flags.check_flags imports envpool.entry for it).
ENVPOOL_FAMILIES = ("envpool.atari.registration", "envpool.classic_control.registration")


def known_env(env_id: str) -> bool:
    """Whether EnvPool has env_id: among the families import_envpool registered or, for another id, among every
    family EnvPool ships (registered then, by importing envpool.entry)."""
    import envpool

    if env_id not in envpool.list_all_envs():
        importlib.import_module("envpool.entry")
    return env_id in envpool.list_all_envs()


def import_envpool():
    """Import EnvPool with ENVPOOL_FAMILIES registered; `import envpool.entry` registers all the others."""
    if "envpool" in sys.modules:
        return
    sys.modules["envpool.entry"] = types.ModuleType("envpool.entry")  # what envpool/__init__ imports: a stand-in
    try:
        import envpool  # noqa: F401
    finally:
        del sys.modules["envpool.entry"]  # the real one stays importable
    for family in ENVPOOL_FAMILIES:
        importlib.import_module(family)


# `import rlax` imports its distribution helpers, which import distrax and TensorFlow Probability's JAX substrate, a
# large part of a script's start (docs/performance.md#a-scripts-start). The scripts use rlax's GAE and V-trace, which
# need neither; rlax reads one name of distrax as it imports, in annotations (policy_targets:
# distrax.DistributionLike). import_rlax imports rlax with a stand-in for distrax, which imports the real one the first
# time rlax uses it.
class ImportOnUse(types.ModuleType):
    """A stand-in for the module of its name: any name read from it comes from the real module, imported then."""

    def __getattr__(self, name: str):
        if sys.modules.get(self.__name__) is self:  # still standing in: the real module must replace it
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def import_rlax():
    """Import rlax without distrax and TensorFlow Probability; rlax imports them when a function of it uses them."""
    if "rlax" in sys.modules or "distrax" in sys.modules:
        return
    stand_in = ImportOnUse("distrax")
    stand_in.DistributionLike = typing.Any  # what rlax reads as it imports (annotations)
    sys.modules["distrax"] = stand_in
    try:
        import rlax  # noqa: F401
    finally:
        if sys.modules.get("distrax") is stand_in:
            del sys.modules["distrax"]  # the real one stays importable


# ---- NVIDIA GPUs, as the machine shows them before JAX starts

CUDA_PLUGINS = ("cuda12", "cuda13")  # JAX's CUDA plugins: jax_plugins.xla_<cuda> (PJRT) and jax_<cuda>_plugin (kernels)
# The README's GPU install: JAX's CUDA 12 build runs on NVIDIA drivers 525 and later (CUDA's minor-version
# compatibility), its CUDA 13 build on 580 and later (pyproject.toml's cuda12 and cuda13 groups).
GPU_INSTALL = "poetry install --compile --with cuda12"
GPU_DRIVERS = "NVIDIA driver 525 or later; --with cuda13 for driver 580 or later"
# The values of CUDA_VISIBLE_DEVICES that hide every GPU: a user who sets one has chosen no GPU.
NO_GPU_VALUES = ("", "-1", "none", "NoDevFiles")


def nvidia_gpus() -> list:
    """The NVIDIA GPUs this machine shows, one name each where it gives names ("NVIDIA H100 80GB HBM3"), else one
    line saying where it shows them: the driver's /proc files, nvidia-smi, the driver's device files, or GPUs given to
    this process by SLURM or CUDA_VISIBLE_DEVICES. Empty where it shows none, or where CUDA_VISIBLE_DEVICES hides
    them all. The cheap signs first: on a GPU machine nvidia-smi runs only when the driver's files give no names."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in NO_GPU_VALUES:
        return []
    names = []
    for information in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in information.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    if names:
        return names
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listing = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            listing = ""
        names = [line.strip() for line in listing.splitlines() if line.strip()]
        if names:
            return names
    devices = sorted(str(d) for d in Path("/dev").glob("nvidia[0-9]*"))
    devices += [d for d in ("/dev/nvidiactl", "/dev/dxg", "/proc/driver/nvidia") if os.path.exists(d)]
    if devices:
        return [f"an NVIDIA GPU ({devices[0]})"]
    for variable in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        if os.environ.get(variable, "").strip() not in NO_GPU_VALUES:
            return [f"GPUs given to this process ({variable}={os.environ[variable]})"]
    return []


def describe_gpus(gpus: list) -> str:
    """nvidia_gpus() in a few words: "4 x NVIDIA H100 80GB HBM3"."""
    return ", ".join(f"{count} x {name}" if count > 1 else name for name, count in Counter(gpus).items())


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (the CPU install, `poetry install`, has none): looked up on disk, where
    hide_cuda_plugin's stand-ins do not hide it."""
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is None:
        return False
    return any(
        importlib.machinery.PathFinder.find_spec(f"jax_plugins.xla_{cuda}", namespace.submodule_search_locations)
        for cuda in CUDA_PLUGINS
    )


def hide_cuda_plugin():
    """Where the machine shows no NVIDIA GPU, hide JAX's CUDA plugin (the gpu-compile group installs it, without the
    CUDA runtime) from JAX: it could only fail, and it prints its failure into every run (absl warnings as jaxlib
    imports its kernels, a traceback as JAX starts the plugin). JAX then starts its CPU backend as it does without
    the plugin. Left alone where JAX_PLATFORMS names another platform than the CPU, or JAX is already imported
    (gpu_compile imports it first: it compiles for GPUs through the plugin)."""
    platforms = (os.environ.get("JAX_PLATFORMS") or "cpu").strip().lower()
    if platforms != "cpu" or "jax" in sys.modules or "jaxlib" in sys.modules or nvidia_gpus():
        return
    for cuda in CUDA_PLUGINS:
        sys.modules.setdefault(f"jax_{cuda}_plugin", None)  # jaxlib then imports none of its kernels (ImportError)
        stand_in = types.ModuleType(f"jax_plugins.xla_{cuda}")  # what JAX imports and starts: a plugin that is not
        stand_in.initialize = lambda: None
        sys.modules.setdefault(stand_in.__name__, stand_in)


def add_xla_flags(*flags: str):
    """Append XLA flags the user has not set (XLA reads them when a backend starts). The only place that edits them."""
    for xla_flag in flags:
        if xla_flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flag}".strip()


def memory_fraction() -> str:
    """The fraction of an accelerator's memory this process's allocator takes: the user's, else MEM_FRACTION."""
    return os.environ.get("XLA_CLIENT_MEM_FRACTION", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION))


def python_problem(version_info=sys.version_info) -> str | None:
    """Why this Python cannot run the project, or None."""
    if PYTHONS[0] <= tuple(version_info[:2]) <= PYTHONS[1]:
        return None
    supported = f"{PYTHONS[0][0]}.{PYTHONS[0][1]} to {PYTHONS[1][0]}.{PYTHONS[1][1]}"
    found = ".".join(str(part) for part in version_info[:3])
    return (
        f"Python {found} is not supported: cleanba needs Python {supported} (its dependencies have no wheels for"
        f" others); install one of those and run the README's quick start with it"
    )


def library_problem(error: Exception) -> str:
    """The line for an EnvPool whose import failed to load a shared library (dlopen's message)."""
    library = re.search(r"([\w.+-]+\.so[\w.]*): cannot open shared object file", str(error)).group(1)
    lacks = f"EnvPool {envpool_version()} needs the system library {library}, which this machine lacks"
    if library not in LIBRARY_PACKAGES:
        return f"{lacks}: install the system package that provides it"
    return (
        f"{lacks}: install it (Debian, Ubuntu: sudo apt-get install {LIBRARY_PACKAGES[library]}), or envpool 1.2.5,"
        f" which poetry.lock pins and which loads no graphics library"
    )


def envpool_version() -> str:
    try:
        return version("envpool")
    except PackageNotFoundError:
        return "(not installed)"


def prepare_process(main: bool = True):
    """Check the Python and EnvPool, then set XLA's environment. Exits with one line where something is missing.
    main: the script runs as the program (not imported by a test or a tool, which decide about JAX's plugins)."""
    if main:
        hide_cuda_plugin()  # before anything imports JAX (rlax does)
    problem = python_problem()
    if problem is None:
        try:
            import_envpool()  # the scripts' own `import envpool` and `import rlax` then find them loaded
            import_rlax()
        except ModuleNotFoundError as error:
            if error.name != "envpool":
                raise
            problem = f"{error}: install the project first (README's quick start: poetry install --compile)"
        except (ImportError, OSError) as error:  # a shared library one of its modules links against is missing
            if "cannot open shared object file" not in str(error):
                raise
            problem = library_problem(error)
    if problem is not None:
        print(f"{os.path.basename(sys.argv[0]) or 'cleanba'}: error: {problem}", file=sys.stderr)
        sys.exit(1)
    # EnvPool's classic-control specs give float64 bounds to float32 boxes; gymnasium warns of it at every make.
    warnings.filterwarnings("ignore", message=r".*Box (low|high)'s precision lowered by casting", category=UserWarning)
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:  # the old and new names conflict when both are set
        os.environ.setdefault("XLA_CLIENT_MEM_FRACTION", MEM_FRACTION)
    # XLA:CPU computes the weight gradients of convolutions many times slower than the convolutions themselves;
    # routing reductions through YNNPACK brings them to the forward's cost (docs/performance.md, the ResNet update on
    # XLA:CPU). The flag is experimental and XLA aborts on flags it does not know, so it is only added for the jaxlib
    # it was checked with.
    if version("jaxlib").startswith("0.10."):
        add_xla_flags("--xla_cpu_experimental_ynn_fusion_type=reduce")
