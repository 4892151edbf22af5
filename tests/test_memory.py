"""Learner memory at the default Atari sizes, from XLA's own analysis of the update as this machine's XLA:CPU compiles
it for training (shapes only, nothing runs): it must follow the minibatch, not the rollout.

The compiles here run with LLVM's optimizations off (support.LLVM_UNOPTIMIZED), as the tests of what a run does:
XLA plans its buffers before LLVM sees the program, so the figures are those of the default compile (the PPO
default update: 10588.14 MiB of temporaries either way, 28.2 against 15.6 s of CPU), which
test_memory_figures_do_not_depend_on_llvm_optimizations checks at a small size."""

import contextlib
import importlib
import os
import re
import uuid
from pathlib import Path

import pytest
import tyro
from support import LLVM_UNOPTIMIZED, check_ok, script_command, script_env

from cleanba.benchmark.phases import learner_memory

GIB = 2**30
# LLVM_UNOPTIMIZED as a compile option (this process has it in its XLA_FLAGS too: support.py), and XLA's default level
UNOPTIMIZED = dict([LLVM_UNOPTIMIZED.removeprefix("--").split("=")])
OPTIMIZED = {"xla_backend_optimization_level": "3"}


def default_memory(script: str, *flags, compiler_options: dict = UNOPTIMIZED, minibatch_step: bool = True) -> dict:
    module = importlib.import_module(f"cleanba.cleanba_{script}")
    args = tyro.cli(module.Args, args=["--actor-device-ids", "0", "--learner-device-ids", "0", *flags])
    module.check_args(args)
    module.fill_runtime_sizes(args, 1, 0)
    return learner_memory(module, args, compiler_options, minibatch_step)


SMALL_ATARI = ["--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "32", "--total-timesteps", "256"]
NARROW = ["--channels", "4", "4", "4", "--hidden-dim", "16"]


@pytest.mark.slow
def test_memory_figures_do_not_depend_on_llvm_optimizations():
    """The same figures from the default compile and from one with LLVM's optimizations off (PPO on Breakout through
    a narrow ResNet, 8 envs x 32 steps, 2 micro-batches)."""
    flags = [*SMALL_ATARI, *NARROW, "--gradient-accumulation-steps", "2"]
    default, unoptimized = (default_memory("ppo", *flags, compiler_options=o) for o in (OPTIMIZED, UNOPTIMIZED))
    assert default == unoptimized and default["update_temp_mib"] > 0, (default, unoptimized)


@pytest.mark.slow
@pytest.mark.parametrize(("script", "extra"), [("ppo", []), ("impala", ["--lstm"])], ids=["ppo", "impala-lstm"])
def test_learner_memory_follows_the_minibatch(script, extra):
    """IMPALA's with --lstm: its minibatches, micro-batches and --exact groups are those of the feed-forward update
    (the same code), and its unroll over each env's sequence keeps the update's memory that of one minibatch step."""
    whole = default_memory(script, *extra)
    accumulated = default_memory(script, *extra, "--gradient-accumulation-steps", "4")
    print(script, whole, accumulated)
    # The whole update (PPO: value pass over the rollout, 16 minibatch steps) needs little more than one step.
    assert whole["update_temp_mib"] <= 1.25 * whole["minibatch_step_temp_mib"], whole
    assert accumulated["update_temp_mib"] <= 1.25 * accumulated["minibatch_step_temp_mib"], accumulated
    # Gradient accumulation really saves memory: 4 micro-batches, well under half.
    assert accumulated["update_temp_mib"] < 0.5 * whole["update_temp_mib"], (whole, accumulated)
    # The paper's GPU, a 40 GB A100, with the scripts' default XLA_CLIENT_MEM_FRACTION of 0.6.
    assert (whole["update_temp_mib"] + whole["update_argument_mib"]) / 1024 < 0.6 * 40e9 / GIB, whole
    # --exact computes the groups of --group-envs envs one after the other, so it needs a fraction of the whole
    # minibatch's memory.
    exact = default_memory(script, *extra, "--exact", minibatch_step=False)
    print(script, "exact", exact)
    assert exact["update_temp_mib"] < 0.5 * whole["update_temp_mib"], (exact, whole)


@pytest.mark.slow
def test_continuous_memory_counts_its_rollout():
    """The continuous script's learner figures (Hopper-v4, an MLP): twice the steps per rollout add exactly the bytes
    of the extra rollout fields, as rollout_fields gives them for the env's spaces, to the update's arguments."""
    import envpool
    import numpy as np

    from cleanba import cleanba_ppo_continuous as script

    figures = {T: default_memory("ppo_continuous", "--env-id", "Hopper-v4", "--num-steps", T) for T in ("256", "512")}
    args = tyro.cli(script.Args, args=["--env-id", "Hopper-v4", "--num-steps", "256"])
    fields = script.rollout_fields(args, envpool.make_spec("Hopper-v4"))
    per_step = sum(np.prod(shape[1:]) * np.dtype(dtype).itemsize for shape, dtype in fields if shape[0] > 1)
    extra = 256 * per_step * args.num_actor_threads / 2**20
    grown = figures["512"]["update_argument_mib"] - figures["256"]["update_argument_mib"]
    print(figures, extra)
    assert abs(grown - extra) < 1e-3 * extra and figures["256"]["update_temp_mib"] > 0, (figures, extra)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh memory cgroup with this limit (cgroup v2 memory.max, else v1 memory.limit_in_bytes), as SLURM's --mem
    or a container sets one; yields the command prefix that starts a program in it. Needs root; skipped without it
    except under CI=true."""
    name = f"cleanba-test-{uuid.uuid4().hex[:8]}"
    candidates = [
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/unified"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ]
    for root, limit_file in candidates:
        controllers = root / "cgroup.subtree_control"
        if limit_file == "memory.max" and not (controllers.exists() and "memory" in controllers.read_text().split()):
            continue
        directory = root / name
        try:
            directory.mkdir()
            (directory / limit_file).write_text(str(limit_bytes))
        except OSError:
            with contextlib.suppress(OSError):
                directory.rmdir()
            continue
        try:
            yield ["sh", "-c", f'echo $$ > {directory / "cgroup.procs"} && exec "$@"', "sh"]
        finally:
            directory.rmdir()
        return
    if os.environ.get("CI") == "true":
        pytest.fail("no writable memory cgroup (v2 with the memory controller, or v1): run CI as root")
    pytest.skip("needs a writable memory cgroup (root)")


def run_limited(prefix: list, flags: list, tmp_path: Path):
    import subprocess

    return subprocess.run(
        [*prefix, *script_command("ppo", flags)],
        cwd=tmp_path,
        env=script_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.needs_root("a memory cgroup")
@pytest.mark.slow
def test_a_learner_that_cannot_fit_is_refused_before_training(tmp_path):
    """The default PPO update (XLA's analysis: about 11.9 GiB with its rollouts) in a job limited to 4 GiB: refused
    with exit 2 before any env steps, with the figures and an accumulation that XLA says fits; a small Atari run
    (a narrow ResNet: 22.5 s of CPU for the test against 30.5 at the default widths) passes the same check and trains;
    --no-memory-check skips it."""
    with memory_cgroup(4 * 2**30) as prefix:
        refused = run_limited(prefix, ["--total-timesteps", "16384"], tmp_path)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr and "cgroup" in refused.stderr, refused.stderr
        message = refused.stderr.strip().splitlines()[-1]
        print(message)
        assert re.search(r"the learner needs 1\d\.\d\d GiB but \d\.\d\d GiB is left", message), message
        steps = int(re.search(r"--gradient-accumulation-steps (\d+)", message).group(1))
        assert steps in (8, 16) and "--no-memory-check" in message and "--local-num-envs" in message, message
        assert not (tmp_path / "runs").exists() and "iterations of batch_size" not in refused.stdout

        small = run_limited(prefix, [*SMALL_ATARI, *NARROW], tmp_path)
        check_ok(small)
        pattern = r"learner memory per device .*needs [\d.]+ [MG]iB of \d\.\d\d GiB \(the memory limit of cgroup"
        assert re.search(pattern, small.stdout), small.stdout
        skipped = run_limited(prefix, [*SMALL_ATARI, *NARROW, "--no-memory-check", "--run-name", "skipped"], tmp_path)
        check_ok(skipped)
        assert "learner memory" not in skipped.stdout and "final params sha256" in skipped.stdout
