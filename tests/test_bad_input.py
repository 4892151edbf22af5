"""Bad input is refused right after parsing: exit 2, a message naming the flag and the fix, no traceback."""
import time

import pytest

from conftest import run_script

CASES = {
    "learner device out of range": (["--learner-device-ids", "3"], 1, "--learner-device-ids 3", "local device"),
    "actor device out of range": (["--actor-device-ids", "0", "5"], 2, "--actor-device-ids 0 5", "ids 0..1"),
    "duplicate learner devices": (["--learner-device-ids", "1", "1"], 2, "--learner-device-ids 1 1", "distinct"),
    "negative device id": (["--actor-device-ids", "-1"], 1, "--actor-device-ids -1", "non-negative"),
    "envs not divisible by learners": (["--local-num-envs", "5", "--learner-device-ids", "0", "1"], 2,
                                       "--local-num-envs=5", "multiple of 2"),
    "total timesteps below one batch": (["--total-timesteps", "100"], 1, "--total-timesteps=100", "batch"),
    "unknown env id": (["--env-id", "Breakout-v99"], 1, "--env-id=Breakout-v99", "envpool.list_all_envs"),
    "zero envs": (["--local-num-envs", "0"], 1, "--local-num-envs=0", "positive"),
    "zero minibatches": (["--num-minibatches", "0"], 1, "--num-minibatches=0", "positive"),
    "negative steps": (["--num-steps", "-4"], 1, "--num-steps=-4", "positive"),
}
MINIBATCH_CASE = {  # the constraint each algorithm puts on minibatch sizes
    "ppo": (["--num-steps", "10", "--num-minibatches", "4"], "--num-steps=10", "multiple of 4"),
    "impala": (["--local-num-envs", "6", "--num-minibatches", "4"], "--local-num-envs=6", "multiple of 4"),
}


def check_refused(process, seconds, *fragments):
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    assert "error:" in process.stderr
    for fragment in fragments:
        assert fragment in process.stderr, (fragment, process.stderr)
    assert seconds < 10


@pytest.mark.parametrize("case", list(CASES))
def test_refused(script, case, tmp_path):
    flags, devices, *fragments = CASES[case]
    start = time.time()
    process = run_script(script, ["--env-id", "CartPole-v1", *flags], tmp_path, devices=devices, timeout=60)
    check_refused(process, time.time() - start, *fragments)
    assert not (tmp_path / "runs").exists()


def test_minibatch_sizes_refused(script, tmp_path):
    flags, *fragments = MINIBATCH_CASE[script]
    start = time.time()
    process = run_script(script, ["--env-id", "CartPole-v1", "--learner-device-ids", "0", *flags], tmp_path,
                         timeout=60)
    check_refused(process, time.time() - start, *fragments)
