"""Training across two real nodes (tests/two_nodes.py: two network namespaces with their own addresses, hostnames and
/etc/hosts, and a SLURM cluster over them). Each process has 2 forced host devices, actor on 0 and learner on 1, one
actor thread of 4 envs; the d1 run a user compares with is one process with one thread of 8 envs. With --exact, every
rank of the two-node run ends with the d1 run's params, bit for bit.

Faults end in bounded time with a non-zero exit: a process killed, a link taken down, SIGTERM to one node only
(both stop after the same iteration with a checkpoint, and the resumed run finishes with nothing logged twice)."""

import itertools
import os
import re
import signal
import subprocess
import sys
import time

import flax.serialization
import pytest
from support import (
    ROOT,
    SCRIPTS,
    TINY,
    assert_lost_its_peer,
    check_ok,
    run_dir,
    run_script,
    scalars,
    script_command,
    script_env,
)
from two_nodes import NODES, TwoNodes

pytestmark = [pytest.mark.slow, pytest.mark.needs_root("network namespaces and a 2-node SLURM cluster")]

ITERATIONS = 4
PORTS = itertools.count(47100)  # coordinator ports on node0, a new one per run


def steps(script: str) -> int:
    return 16 if script == "ppo" else 8


def flags(script: str, envs: int, iterations: int = ITERATIONS) -> list:
    """--exact tiny CartPole, 8 envs in all (2 processes x 4, or 1 x 8)."""
    return [
        *TINY[script],
        "--local-num-envs",
        envs,
        "--num-actor-threads",
        1,
        "--actor-device-ids",
        0,
        "--learner-device-ids",
        1,
        "--exact",
        "--group-envs",
        2,
        "--seed",
        7,
        "--total-timesteps",
        iterations * 8 * steps(script),
    ]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    cluster = TwoNodes(tmp_path_factory.mktemp("two-nodes"))
    try:
        cluster.start().start_slurm()
    except RuntimeError as error:
        cluster.stop()
        if os.environ.get("CI") == "true":
            pytest.fail(f"the two-node cluster must run in CI: {error}")
        pytest.skip(f"no two-node cluster here: {error}")
    yield cluster
    cluster.stop()


def start_on_nodes(
    nodes: TwoNodes, script: str, args: list, tmp_path, heartbeat_timeout: int = 100, shared: bool = False
) -> list:
    """One process per node, by hand: the coordinator given as node0's hostname. Each runs in a directory of its
    own, or with shared in tmp_path itself, as on a cluster's shared filesystem (where every rank finds the
    checkpoint that rank 0 wrote)."""
    port, processes = next(PORTS), []
    for rank, node in enumerate(NODES):
        directory = tmp_path if shared else tmp_path / node
        directory.mkdir(exist_ok=True)
        command = script_command(
            script,
            [
                *args,
                "--distributed",
                "--coordinator-address",
                f"node0:{port}",
                "--num-processes",
                2,
                "--process-id",
                rank,
                "--heartbeat-timeout",
                heartbeat_timeout,
            ],
        )
        processes.append(
            nodes.popen(
                node,
                command,
                cwd=directory,
                env=script_env(2),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return processes


def outputs_of(processes: list, timeout: float) -> list:
    try:
        return [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()


def final_digests(output: str) -> dict:
    return dict(re.findall(r"rank (\d): final params sha256 (\w+)", output))


def d1_digest(script: str, tmp_path) -> str:
    (tmp_path / "d1").mkdir()
    process = run_script(script, flags(script, 8), tmp_path / "d1", devices=2)
    check_ok(process)
    return final_digests(process.stdout)["0"]


def reasons(output: str) -> list:
    """The lines of a failed run's output that say why (JAX's abort, the watchdog), for the printed timings."""
    return [
        line[:240]
        for line in output.splitlines()
        if re.search(r"(?i)terminating|heartbeat|stall-timeout|unavailable|deadline", line)
    ][:3]


def wait_for_training(process: subprocess.Popen) -> str:
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("step "):
            return "".join(seen)
    raise AssertionError("the run ended before training:\n" + "".join(seen))


@pytest.mark.xla_default  # --exact's bits across processes, as users get them
# the engine's (tests/test_engine.py holds it the same in every script): one script runs it
@pytest.mark.parametrize("script", ["ppo"])
def test_distributed_by_hand_across_two_nodes_equals_one_node(nodes, script, tmp_path):
    processes = start_on_nodes(nodes, script, flags(script, 4), tmp_path)
    outputs = outputs_of(processes, timeout=300)
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output
    digests = {**final_digests(outputs[0]), **final_digests(outputs[1])}
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"] == d1_digest(script, tmp_path), outputs
    two_nodes, one_node = scalars(run_dir(tmp_path / "node0")), scalars(run_dir(tmp_path / "d1"))
    for tag in ["stats/params_checksum", "losses/loss", "charts/episodic_return"]:
        assert two_nodes[tag] == one_node[tag], tag
    assert not (tmp_path / "node1" / "runs").exists()  # only rank 0 writes logs


# the engine's (tests/test_engine.py holds it the same in every script): one script runs it
@pytest.mark.parametrize("script", ["impala"])
@pytest.mark.xla_default  # --exact's bits across processes (and SLURM's job has the cluster's environment)
def test_slurm_job_across_two_nodes_equals_one_node(nodes, script, tmp_path):
    """launch_slurm --nodes 2 --ntasks-per-node 1: JAX's own SLURM detection finds the coordinator on node0."""
    command = " ".join(map(str, [sys.executable, SCRIPTS[script], "--distributed", *flags(script, 4)]))
    env = dict(script_env(2), SLURM_CONF=str(nodes.conf))
    launched = nodes.slurm(
        [
            sys.executable,
            "-m",
            "cleanba.launch_slurm",
            "--command",
            command,
            "--env-ids",
            "CartPole-v1",
            "--seeds",
            7,
            "--nodes",
            2,
            "--ntasks-per-node",
            1,
            "--job-name",
            f"two-nodes-{script}",
            "--workdir",
            tmp_path,
        ],
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert launched.returncode == 0, launched.stderr
    job_id = re.search(r"submitted job (\d+)", launched.stdout).group(1)
    (task,) = nodes.wait(job_id, timeout=300)
    output = "\n".join(path.read_text() for path in (tmp_path / "slurm").glob("*.out"))
    assert (task["JobState"], task["ExitCode"], task["NodeList"]) == ("COMPLETED", "0:0", "node[0-1]"), (
        output + nodes.logs()
    )
    digests = final_digests(output)
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"] == d1_digest(script, tmp_path), output


def test_a_killed_node_process_ends_the_run(nodes, tmp_path):
    """kill -9 of the process on node1: rank 0 ends within the heartbeat timeout plus a margin, by its collective's
    error or by JAX's abort on the missed heartbeats."""
    heartbeat_timeout = 10
    processes = start_on_nodes(nodes, "ppo", flags("ppo", 4, iterations=100_000), tmp_path, heartbeat_timeout)
    seen = wait_for_training(processes[0])
    processes[1].send_signal(signal.SIGKILL)
    killed = time.time()
    rest = outputs_of(processes[:1], timeout=heartbeat_timeout + 60)[0]
    took = time.time() - killed
    print(
        f"node1 killed: rank 0 ended {took:.1f} s later (heartbeat timeout {heartbeat_timeout} s), exit "
        f"{processes[0].returncode}; it said:",
        *reasons(rest),
        sep="\n  ",
    )
    assert took < heartbeat_timeout + 60, seen + rest
    assert_lost_its_peer(processes[0].returncode, rest)


def test_a_network_partition_ends_the_run(nodes, tmp_path):
    """node1's link taken down mid-run: collectives and heartbeats stop; both ranks end non-zero, in bounded time,
    with a complete checkpoint on node0."""
    heartbeat_timeout, stall_timeout = 10, 20
    args = [
        *flags("ppo", 4, iterations=100_000),
        "--stall-timeout",
        stall_timeout,
        "--checkpoint-frequency",
        1,
        "--run-name",
        "partition",
    ]
    processes = start_on_nodes(nodes, "ppo", args, tmp_path, heartbeat_timeout)
    wait_for_training(processes[0])
    nodes.set_link("node1", up=False)
    try:
        cut = time.time()
        outputs = outputs_of(processes, timeout=stall_timeout + heartbeat_timeout + 90)
        took = time.time() - cut
    finally:
        nodes.set_link("node1", up=True)
    print(
        f"partition: both ranks ended {took:.1f} s after the link went down (heartbeat {heartbeat_timeout} s, "
        f"stall {stall_timeout} s); exit {[p.returncode for p in processes]}"
    )
    for rank, output in enumerate(outputs):
        print(f"rank {rank} said:", *reasons(output), sep="\n  ")
    assert all(process.returncode != 0 for process in processes), outputs
    assert all("JAX distributed service detected fatal errors" in output for output in outputs), outputs
    # Rank 0 checkpoints every iteration and had logged one before the cut: the file is there, and complete.
    checkpoint = tmp_path / "node0" / "runs" / "partition" / "checkpoint.msgpack"
    assert flax.serialization.msgpack_restore(checkpoint.read_bytes())["iteration"] >= 1


def test_sigterm_to_one_node_stops_both_and_the_resumed_run_finishes(nodes, tmp_path):
    """A preemption that reaches node1 first: both ranks stop after the same iteration, rank 0 saves the
    checkpoint; the same command with --resume on the two nodes trains the planned iterations, none logged twice."""
    iterations = 40
    args = [*flags("ppo", 4, iterations), "--checkpoint-frequency", 1000, "--run-name", "preempted"]
    processes = start_on_nodes(nodes, "ppo", args, tmp_path, shared=True)
    wait_for_training(processes[0])
    processes[1].send_signal(signal.SIGTERM)
    sent = time.time()
    outputs = outputs_of(processes, timeout=120)
    print(f"SIGTERM to node1: both ranks stopped {time.time() - sent:.1f} s later")
    stopped = [re.search(r"stopped by signal 15 after iteration (\d+)", output) for output in outputs]
    assert all(stopped) and stopped[0].group(1) == stopped[1].group(1), outputs
    assert [process.returncode for process in processes] == [143, 143]
    assert f"checkpoint of iteration {stopped[0].group(1)} saved" in outputs[0]
    assert int(stopped[0].group(1)) < iterations
    resumed = start_on_nodes(nodes, "ppo", [*args, "--resume"], tmp_path, shared=True)
    outputs = outputs_of(resumed, timeout=300)
    for process, output in zip(resumed, outputs):
        assert process.returncode == 0, output
    assert f"at iteration {stopped[0].group(1)}" in outputs[0]
    logged = [step for step, _ in scalars(run_dir(tmp_path))["stats/params_checksum"]]
    assert logged == [i * 8 * steps("ppo") for i in range(1, iterations + 1)], logged


def task_pids(marker: str) -> dict:
    """{SLURM_NODEID: pid} of the running training processes whose command line holds marker."""
    found = {}
    for pid in subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split():
        try:
            items = open(f"/proc/{pid}/environ").read().split("\0")
            environ = dict(item.split("=", 1) for item in items if "=" in item)
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if "SLURM_NODEID" in environ and "cleanba_ppo.py" in cmdline:
            found[environ["SLURM_NODEID"]] = int(pid)
    return found


def test_preempted_slurm_job_requeued_on_two_nodes_finishes(nodes, tmp_path):
    """SIGTERM reaches the task on node1 only: both tasks stop after the same iteration and rank 0 checkpoints; the
    job, requeued (SLURM_RESTART_COUNT=1), resumes from that checkpoint on the two nodes and trains the planned
    iterations, each logged once."""
    iterations = 40
    marker = f"requeue-{os.getpid()}"
    command = " ".join(
        map(
            str,
            [
                sys.executable,
                SCRIPTS["ppo"],
                "--distributed",
                *flags("ppo", 4, iterations),
                "--checkpoint-frequency",
                1000,
                "--run-name",
                marker,
            ],
        )
    )
    env = dict(script_env(2), SLURM_CONF=str(nodes.conf))
    launched = nodes.slurm(
        [
            sys.executable,
            "-m",
            "cleanba.launch_slurm",
            "--command",
            command,
            "--env-ids",
            "CartPole-v1",
            "--seeds",
            7,
            "--nodes",
            2,
            "--ntasks-per-node",
            1,
            "--job-name",
            marker,
            "--workdir",
            tmp_path,
        ],
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert launched.returncode == 0, launched.stderr
    job_id = re.search(r"submitted job (\d+)", launched.stdout).group(1)
    deadline = time.time() + 120
    while time.time() < deadline and "step " not in "".join(p.read_text() for p in (tmp_path / "slurm").glob("*.out")):
        time.sleep(0.5)
    pids = task_pids(marker)
    assert set(pids) == {"0", "1"}, pids
    os.kill(pids["1"], signal.SIGTERM)
    (task,) = nodes.wait(job_id, timeout=120)
    first = "".join(p.read_text() for p in (tmp_path / "slurm").glob("*.out"))
    stopped = re.findall(r"stopped by signal 15 after iteration (\d+)", first)
    assert len(stopped) == 2 and len(set(stopped)) == 1, first + nodes.logs()
    assert task["JobState"] != "COMPLETED" and f"checkpoint of iteration {stopped[0]} saved" in first
    # SLURM delays a requeued job's start (its begin time) until the old job's credential expires (the cluster's
    # cred_expire, 10 s); starting it at once (StartTime=now) got it killed once with "Job credential revoked".
    requeued = nodes.slurm(["scontrol", "requeue", job_id])
    assert requeued.returncode == 0, requeued.stderr
    (task,) = nodes.wait(job_id, timeout=300)
    second = "".join(p.read_text() for p in (tmp_path / "slurm").glob("*.out"))
    assert (task["JobState"], task["Restarts"], task["NodeList"]) == ("COMPLETED", "1", "node[0-1]"), (
        second + nodes.logs()
    )
    assert f"resumed runs/{marker}/checkpoint.msgpack at iteration {stopped[0]}" in second, second
    logged = [step for step, _ in scalars(tmp_path / "runs" / marker)["stats/params_checksum"]]
    assert logged == [i * 8 * steps("ppo") for i in range(1, iterations + 1)], logged
