"""python -m cleanba.check_fork: an untouched copy of each script passes all six checks; a fork that edits the engine,
one whose algorithm breaks layout invariance, one whose sampling breaks the thread split and one with a wrong head
each fail the check that names it, in one line, and the command exits 1."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support import SCRIPTS, script_env

from cleanba.check_fork import CHECKS

# check_fork's runs compile with LLVM's optimizations off here (support.py), as the tests of what a run does: what is
# tested is the tool's checks; the bits users get on every layout are tests/test_exact.py's.


def check_fork(fork, tmp_path, *flags) -> subprocess.CompletedProcess:
    # script_env(1): the suite's compilation cache and XLA flags; check_fork appends its own forced device count.
    return subprocess.run(
        [sys.executable, "-m", "cleanba.check_fork", str(fork), "--work-dir", str(tmp_path / "work"), *flags],
        cwd=tmp_path,
        env=script_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )


def fork_of(script: str, tmp_path, edits=()) -> str:
    """A copy of the stock script beside a user's other files, with the (old, new) text edits applied."""
    text = SCRIPTS[script].read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    fork = tmp_path / "my_fork" / f"my_{script}.py"
    fork.parent.mkdir(parents=True)
    fork.write_text(text)
    return fork


def verdicts(output: str) -> dict:
    """{check: PASS, FAIL or SKIP} from check_fork's lines."""
    return dict((check, verdict) for verdict, check in re.findall(r"^(PASS|FAIL|SKIP) (\w+):", output, re.M))


# Every check on the discrete PPO: the checks are the engine's, on one script. IMPALA's, PQN's and the continuous
# scripts' layouts, thread splits and resumes are test_exact's; their copies pass the checks that train nothing below,
# and SAC's the resume check too (a Box-action fork, its replay memory through the checkpoint).
@pytest.mark.slow
def test_an_untouched_copy_passes_every_check(tmp_path):
    process = check_fork(fork_of("ppo", tmp_path), tmp_path)
    assert process.returncode == 0, process.stdout + process.stderr
    assert verdicts(process.stdout) == dict.fromkeys(CHECKS, "PASS"), process.stdout
    assert f"a fork of {SCRIPTS['ppo'].name}, on " in process.stdout
    assert "all 6 checks passed" in process.stdout
    # Each comparison is of runs that trained: params changed, games ended, every logged value compared.
    digests = re.findall(r"params sha256 (\w+)", process.stdout)
    assert len(digests) == 3 and digests[0] == digests[1] != digests[2], process.stdout  # resume: other envs
    counts = [int(n) for n in re.findall(r"the same (\d+) logged values", process.stdout)]
    assert counts[0] == counts[1] >= 12 and counts[2] >= 10, process.stdout  # PPO's loss logs 6 values
    lag = re.search(r"PASS lag: the logged lag is (.*)", process.stdout).group(1)
    assert "0 with --no-concurrency" in lag and "1 with --concurrency" in lag


@pytest.mark.slow
def test_an_untouched_sac_copy_passes_the_resume_check(tmp_path):
    process = check_fork(fork_of("sac", tmp_path), tmp_path, "--checks", "resume")
    assert process.returncode == 0, process.stdout + process.stderr
    assert verdicts(process.stdout) == {"resume": "PASS"}, process.stdout
    assert "all 1 checks passed" in process.stdout
    (count,) = [int(n) for n in re.findall(r"the same (\d+) logged values", process.stdout)]
    assert count >= 10, process.stdout


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_an_untouched_copy_passes_the_checks_that_train_nothing(script, tmp_path):
    process = check_fork(fork_of(script, tmp_path), tmp_path, "--checks", "engine", "network")
    assert process.returncode == 0, process.stdout + process.stderr
    assert verdicts(process.stdout) == {"engine": "PASS", "network": "PASS"}, process.stdout


def test_an_engine_edit_is_named_with_its_lines(tmp_path):
    # a fork that "fixes" the engine's lag: one line of an ENGINE block changed
    edit = ("    lag = int(args.concurrency)\n", "    lag = 1\n")
    process = check_fork(fork_of("ppo", tmp_path, [edit]), tmp_path, "--checks", "engine")
    assert process.returncode == 1, process.stdout + process.stderr
    assert verdicts(process.stdout) == {"engine": "FAIL"}, process.stdout
    assert "FAIL engine: 2 lines of the ENGINE blocks differ from cleanba_ppo.py's" in process.stdout
    assert "    -    lag = int(args.concurrency)\n    +    lag = 1\n" in process.stdout, process.stdout


def test_a_wrong_head_fails_the_network_check_and_nothing_trains(tmp_path):
    edit = ("nn.Dense(self.num_actions, kernel_init", "nn.Dense(self.hidden_dim, kernel_init")
    process = check_fork(fork_of("ppo", tmp_path, [edit]), tmp_path)
    assert process.returncode == 1, process.stdout + process.stderr
    assert verdicts(process.stdout) == {"engine": "PASS", "network": "FAIL", **dict.fromkeys(CHECKS[2:], "SKIP")}
    line = re.search(r"^FAIL network: (.*)$", process.stdout, re.M).group(1)
    assert "shapes (2, 16) and (2,) for a batch of 2 observations" in line, line
    assert not (tmp_path / "work" / "a0-l0").exists()


BREAKS = {  # an algorithm edit of cleanba_ppo.py that still trains: (edit, the check it fails, the one it passes)
    # advantages normalized over this learner device's envs: a0-l1,2's two devices each see half of them
    "device-local advantages": (
        (
            "    data = dict(\n        obs=rollout.obs[:-1],",
            "    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)\n"
            "    data = dict(\n        obs=rollout.obs[:-1],",
        ),
        "layouts",
        "threads",
    ),
    # every env of an actor thread sampled from the thread's first env's key: the draws depend on the split
    "one key per thread": (
        (
            "    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:]))(keys)",
            "    gumbel = jax.random.gumbel(keys[0], logits.shape)",
        ),
        "threads",
        "layouts",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BREAKS))
def test_an_algorithm_that_breaks_invariance_fails_its_check(case, tmp_path):
    edit, fails, passes = BREAKS[case]
    process = check_fork(fork_of("ppo", tmp_path, [edit]), tmp_path, "--checks", "layouts", "threads")
    assert process.returncode == 1, process.stdout + process.stderr
    assert verdicts(process.stdout) == {fails: "FAIL", passes: "PASS"}, process.stdout
    line = re.search(rf"^FAIL {fails}: (.*)$", process.stdout, re.M).group(1)
    assert re.search(r"differ \((losses|charts|stats)/\w+ differs at its logged value \d", line), line
    assert f"1 of 2 checks did not pass ({fails}); the runs are in {tmp_path / 'work'}" in process.stdout


def test_refuses_a_file_that_is_not_a_fork(tmp_path):
    (tmp_path / "notes.py").write_text("print('hello')\n")
    process = check_fork(tmp_path / "notes.py", tmp_path)
    assert process.returncode == 2 and "has no '# ======== ENGINE:' block" in process.stderr, process.stderr
    process = check_fork(SCRIPTS["ppo"], tmp_path, "--checks", "engine", "speed")
    assert process.returncode == 2 and "--checks speed: not a check; choose among engine" in process.stderr


@pytest.mark.slow
def test_a_signal_stops_its_runs_too(tmp_path):
    """SIGTERM to check_fork alone (as a batch system sends it) ends its training runs as well, promptly: none is
    left training on its own."""
    fork = fork_of("ppo", tmp_path)
    command = [sys.executable, "-m", "cleanba.check_fork", str(fork), "--work-dir", str(tmp_path / "work")]
    command += ["--checks", "layouts", "--", "--total-timesteps", "100000000"]  # runs that would train for hours
    process = subprocess.Popen(command, cwd=tmp_path, env=script_env(1), stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list((tmp_path / "work").glob("a0-l*/runs/*/events.out.tfevents*")):  # training has begun
            assert process.poll() is None and time.time() < deadline, process.communicate()
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
        assert process.returncode == 128 + signal.SIGTERM
        deadline = time.time() + 60
        while children(fork) and time.time() < deadline:
            time.sleep(0.5)
        assert not children(fork), children(fork)
    finally:
        process.kill()
        for pid in children(fork):
            os.kill(pid, signal.SIGKILL)


def children(fork) -> list:
    """The processes running the fork."""
    found = subprocess.run(["pgrep", "-f", str(fork)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid()]
