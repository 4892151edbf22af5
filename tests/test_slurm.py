"""SLURM: the launcher renders the template, and submits to a real single-node cluster a 2-task job whose
processes find each other through jax.distributed.initialize()'s SLURM detection."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster
from support import ROOT, SCRIPTS, TINY, run_dir, scalars, script_env

LAUNCH = [sys.executable, "-m", "cleanba.launch_slurm"]


def launch(args, env=None, **kwargs):
    return subprocess.run(
        [*LAUNCH, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, **kwargs
    )


def test_dry_run_renders_an_array_over_envs_and_seeds(tmp_path):
    result = launch(
        [
            "--command",
            "python cleanba/cleanba_ppo.py --distributed",
            "--env-ids",
            "Breakout-v5",
            "Pong-v5",
            "--seeds",
            1,
            2,
            3,
            "--ntasks-per-node",
            2,
            "--gpus-per-task",
            4,
            "--partition",
            "gpu",
            "--workdir",
            tmp_path,
            "--dry-run",
        ]
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --array=0-5\n" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --gpus-per-task=4" in script and "#SBATCH --partition=gpu" in script
    assert "--account" not in script and "--cpus-per-task" not in script  # unset: the cluster's defaults
    assert "{{" not in script
    # Run the array-index arithmetic of the rendered script for every index.
    assert f"#SBATCH --chdir={tmp_path}" in script
    prologue = script.split("set -euo pipefail")[1].split("echo")[0]
    for index, expected in enumerate([(e, s) for e in ["Breakout-v5", "Pong-v5"] for s in [1, 2, 3]]):
        out = subprocess.run(
            ["bash", "-c", prologue + 'echo "$env_id $seed"'],
            capture_output=True,
            text=True,
            env={"SLURM_ARRAY_TASK_ID": str(index)},
        )
        assert out.stdout.split() == [expected[0], str(expected[1])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    except RuntimeError as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM must run in CI: {error}")
        pytest.skip(f"no SLURM here: {error}")
    yield cluster
    cluster.stop()


# the engine's (tests/test_engine.py holds it the same in every script): one script runs it
@pytest.mark.needs_root("a SLURM cluster of its own daemons")
@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo"])
def test_two_task_job_on_real_slurm(cluster, script, tmp_path):
    """Each task uses ids 0 to 3 of its 4 forced devices (a0-l1,2,3-d2), as a GPU job with --gpus-per-task 4 would:
    srun's SLURM_LOCALID must not hide the others (jax.distributed.initialize's default)."""
    steps = 16 if script == "ppo" else 8
    total = 3 * 2 * 4 * steps  # iterations x processes x envs x steps
    command = " ".join(
        [
            sys.executable,
            str(SCRIPTS[script]),
            "--distributed",
            *TINY[script],
            "--local-num-envs",
            "4",
            "--num-actor-threads",
            "1",
            "--actor-device-ids",
            "0",
            "--learner-device-ids",
            "1",
            "2",
            "3",
            "--total-timesteps",
            str(total),
        ]
    )
    env = dict(script_env(4), SLURM_CONF=str(cluster.conf))
    result = launch(
        [
            "--command",
            command,
            "--env-ids",
            "CartPole-v1",
            "--seeds",
            7,
            "--ntasks-per-node",
            2,
            "--srun-options=--overcommit",
            "--job-name",
            f"cleanba-{script}",
            "--workdir",
            tmp_path,
        ],
        env=env,
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    tasks = cluster.wait(job_id, timeout=240)
    outputs = "\n".join(path.read_text() for path in (tmp_path / "slurm").glob("*.out"))
    assert [(task["JobState"], task["ExitCode"]) for task in tasks] == [("COMPLETED", "0:0")], outputs + cluster.logs()
    digests = re.findall(r"rank (\d): final params sha256 (\w+)", outputs)
    assert sorted(rank for rank, _ in digests) == ["0", "1"] and len({d for _, d in digests}) == 1, outputs
    visible = re.findall(r"rank (\d) of 2: GPUs visible to JAX \(jax_cuda_visible_devices\) (\S+)", outputs)
    assert sorted(visible) == [("0", "0,1,2,3"), ("1", "0,1,2,3")], outputs
    directory = run_dir(tmp_path)
    assert directory.name.startswith("CartPole-v1__") and "__7__" in directory.name
    assert scalars(directory)["stats/learner_policy_version"][-1] == (total, 2)


def test_benchmark_renders_the_paper_experiments(tmp_path):
    inside_project_env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(
        ["bash", str(ROOT / "benchmark.sh"), "--dry-run", "--partition", "gpu"],
        cwd=tmp_path,
        env=inside_project_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    scripts = result.stdout.split("#!/bin/bash")[1:]
    assert len(scripts) == 4  # PPO and IMPALA, each on two layouts
    for script in scripts:
        assert "#SBATCH --array=0-170\n" in script  # 57 games x 3 seeds
        assert "#SBATCH --partition=gpu" in script and "#SBATCH --requeue" in script
    assert sum("--ntasks-per-node=2" in s and "--learner-device-ids 1 2 3" in s for s in scripts) == 2


def slurm_task_pid(job_name: str) -> int | None:
    """The pid of the training process of the job named job_name (its environment names the job; not srun's, whose
    command line holds the script too)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if f"SLURM_JOB_NAME={job_name}" in environ and argv[:2] == [sys.executable, str(SCRIPTS["impala"])]:
            return int(pid)
    return None


@pytest.mark.needs_root("a SLURM cluster of its own daemons")
@pytest.mark.slow
def test_requeued_job_with_the_default_run_name_resumes(cluster, tmp_path):
    """As a user submits: no --run-name. The run directory's default name under SLURM holds the array job and task
    ids, which a requeue keeps, so the requeued job (SLURM_RESTART_COUNT=1) finds the checkpoint its SIGTERM left
    and trains on from it into the same directory."""
    iterations = 1500  # the requeued part trained 21 s on a 2-core AMD EPYC Zen 3: SIGTERM lands well before the end
    total = iterations * 4 * 8
    job_name = f"requeue-default-{os.getpid()}"
    command = [sys.executable, SCRIPTS["impala"], "--env-id", "CartPole-v1", "--hidden-dim", "16", "--num-steps", "8"]
    command += ["--num-minibatches", "2", "--local-num-envs", "4", "--num-actor-threads", "1", "--log-frequency", "100"]
    command += ["--total-timesteps", total, "--checkpoint-frequency", "100000"]
    env = dict(script_env(1), SLURM_CONF=str(cluster.conf))
    result = launch(
        [
            *["--command", " ".join(map(str, command)), "--env-ids", "CartPole-v1", "--seeds", 3],
            "--job-name",
            job_name,
            "--workdir",
            tmp_path,
        ],
        env=env,
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    outputs = lambda: "".join(path.read_text() for path in (tmp_path / "slurm").glob("*.out"))  # noqa: E731
    deadline = time.time() + 120
    while time.time() < deadline and "step " not in outputs():
        time.sleep(0.5)
    pid = slurm_task_pid(job_name)
    assert pid is not None, outputs() + cluster.logs()
    os.kill(pid, signal.SIGTERM)  # what SLURM sends a preempted job
    (task,) = cluster.wait(job_id, timeout=120)
    first = outputs()
    saved = re.search(r"checkpoint of iteration (\d+) saved to (\S+)", first)
    assert saved and task["JobState"] != "COMPLETED", first + cluster.logs()
    assert saved.group(2) == f"runs/CartPole-v1__cleanba_impala__3__{job_id}_0/checkpoint.msgpack", first
    requeued = subprocess.run(["scontrol", "requeue", job_id], env=env, capture_output=True, text=True, timeout=60)
    assert requeued.returncode == 0, requeued.stderr
    (task,) = cluster.wait(job_id, timeout=300)
    second = outputs()
    assert (task["JobState"], task["Restarts"]) == ("COMPLETED", "1"), second + cluster.logs()
    assert f"resumed {saved.group(2)} at iteration {saved.group(1)}" in second, second
    (directory,) = (tmp_path / "runs").iterdir()  # the same run directory, not a second one
    steps = [step for step, _ in scalars(directory)["stats/learner_policy_version"]]
    assert steps == [i * 4 * 8 for i in range(1, iterations + 1)]
