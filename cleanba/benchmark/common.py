"""What every part of the benchmark (python -m cleanba.benchmark) shares: its phases and flags, the training script
it measures (found, loaded as a module, its Args checked and sized), and the figures of measurement windows."""

import importlib.util
import itertools
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

from cleanba import flags
from cleanba.family import SCRIPTS

PHASES = ("ceiling", "actor", "learner", "layers", "sync", "concurrent")
THROUGHPUT_PHASES = ["ceiling", "actor", "learner", "sync", "concurrent"]  # the default: all but the layer profile
# What the benchmark calls in a training script; a fork must keep these names and signatures.
SCRIPT_FUNCTIONS = (
    "Args",
    "check_args",
    "fill_runtime_sizes",
    "make_env",
    "env_kwargs",
    "Agent",
    "make_policy",
    "rollout_actor",
    "make_actor_threads",
    "put_on_learners",
    "make_learner_update",
    "make_optimizer",
    "Rollout",
    "unreplicate",
    "queue_get",
    "queue_put",
    "StopTraining",
    "learner_blocks",
    "rollout_fields",
    "recurrent_state_size",
    "learner_shapes",
)


@dataclass
class BenchmarkArgs:
    script: str = "ppo"
    """a training script by name (ppo, impala, ppo_continuous, pqn), or the path of a fork with the same functions"""
    phases: list[Literal["ceiling", "actor", "learner", "layers", "sync", "concurrent"]] = field(
        default_factory=lambda: list(THROUGHPUT_PHASES)
    )
    """the phases to run (always in the order ceiling, actor, learner, layers, sync, concurrent)"""
    repeats: int = 3
    """measurement windows per phase; every figure is the median over them"""
    warmup_iterations: int = 2
    """iterations each phase runs before measuring (compilation, first resets)"""
    iterations: int = 5
    """iterations (rollouts of num_steps steps of every env) per measurement window"""
    json: Path | None = None
    """where to write all figures (default: benchmark-<script>-<env id>.json in the current directory)"""
    reference_command: str | None = None
    """a shell command to compare with (e.g. another implementation); its last printed "SPS <number>" is read"""
    timeout: float = 1800.0
    """seconds one phase may take before it is killed and the benchmark fails"""
    layer_batch: int | None = None
    """the batch of the layers phase (default: the learner's micro-batch per device)"""


fail = partial(flags.fail, program="benchmark")  # bad input, refused before any phase runs


def split_argv(argv: list) -> tuple:
    """The benchmark's own flags, and the training script's (everything after the first `--`)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def resolve_script(name: str) -> Path:
    path = SCRIPTS.get(name, Path(name))
    if not path.is_file() or path.suffix != ".py":
        fail(f"--script {name}: give {', '.join(SCRIPTS)} or the path of a training script (.py); {path} is not a file")
    return path.resolve()


def load_script(path: Path):
    """The training script as a module (not as __main__: its main() does not run)."""
    name = f"benchmarked_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and tyro resolve the Args annotations through sys.modules
    spec.loader.exec_module(module)
    missing = [name for name in SCRIPT_FUNCTIONS if not hasattr(module, name)]
    if missing:
        fail(
            f"--script {path}: it has no {', '.join(missing)}; the benchmark needs a Cleanba training script "
            "(a fork of a script in cleanba/ that keeps these names)"
        )
    return module


def total_iterations(bench: BenchmarkArgs) -> int:
    return bench.warmup_iterations + bench.repeats * bench.iterations


def parse_script_args(module, flags: list, iterations: int):
    """The script's Args, checked as the script checks them and sized like one process running `iterations`."""
    args = tyro.cli(module.Args, args=flags, prog=f"{Path(module.__file__).name} (after --)")
    module.check_args(args)
    if args.distributed or args.resume:
        fail(
            "--distributed and --resume do not apply: the benchmark measures one process from scratch (run it on "
            "one node with that node's layout)"
        )
    args.total_timesteps = sys.maxsize  # only to learn batch_size
    module.fill_runtime_sizes(args, 1, 0)
    args.total_timesteps = args.batch_size * iterations
    module.fill_runtime_sizes(args, 1, 0)
    return args


def median(values) -> float:
    return float(np.median(values))


def window_sps(boundaries: list, steps_per_window: int) -> list:
    """Env steps per second of consecutive windows; boundaries[j] is when window j starts (and j - 1 ends)."""
    return [steps_per_window / (end - start) for start, end in itertools.pairwise(boundaries)]


def window_boundaries(ends: list, bench: BenchmarkArgs) -> list:
    """ends[i]: when iteration i + 1 ended. Windows start at the end of the last warm-up iteration."""
    first = bench.warmup_iterations - 1
    return [ends[first + j * bench.iterations] for j in range(bench.repeats + 1)]
