"""Faults, signals, checkpoints and resume. Every wait is bounded, so a hang fails a test instead of CI."""

import importlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import typing

import flax
import jax
import numpy as np
import pandas as pd
import pytest
from support import (
    FAULTY_ENVPOOL,
    SCRIPTS,
    TINY,
    check_ok,
    run_dir,
    run_script,
    scalars,
    script_env,
    start_pair,
    start_script,
)

from cleanba import events
from cleanba.check_fork import MEMORYLESS_ENVPOOL

# MEMORYLESS_ENVPOOL: a training script run on envs whose observations never change and whose episodes never end
# (cleanba/check_fork.py, whose resume check uses it too): a resumed run sees what the straight run saw.


def long_args(script, iterations=100_000):
    steps = 16 if script.startswith("ppo") else 8
    return [*TINY[script], "--local-num-envs", 8, "--num-actor-threads", 1, "--total-timesteps", iterations * 8 * steps]


def wait_for_training(process) -> list:
    """Read output until the first progress line (training is under way)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("step "):
            return lines
    raise AssertionError("the run ended before training started:\n" + "".join(lines))


def stop_and_wait(process, signum, timeout=30) -> str:
    process.send_signal(signum)
    sent = time.time()
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired as error:
        process.kill()
        raise AssertionError(f"still running {timeout} s after signal {signum}") from error
    assert time.time() - sent < timeout
    return output


def load_checkpoint_file(path):
    payload = flax.serialization.msgpack_restore(path.read_bytes())
    return payload


# the engine's (tests/test_engine.py holds it the same in every script): one script runs it
@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala"])
def test_actor_fault_ends_the_run(script, tmp_path):
    start_time = time.time()
    command = [sys.executable, "-c", FAULTY_ENVPOOL, str(SCRIPTS[script]), *map(str, long_args(script))]
    process = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 1, process.stdout + process.stderr
    assert "Traceback" in process.stderr and "RuntimeError: injected actor fault" in process.stderr
    assert "the run stopped on an error (RuntimeError)" in process.stderr
    assert "did not stop" not in process.stderr
    # Startup and compilation included (22 s measured next to another test's processes); the run itself is
    # 100,000 iterations long, so only the fault ends it this soon, and a hang hits the 120 s timeout.
    assert time.time() - start_time < 60


# the engine's signal handling: each signal on one script
@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "signum"), [("ppo", signal.SIGINT), ("impala", signal.SIGTERM)], ids=["ppo-SIGINT", "impala-SIGTERM"]
)
def test_signal_stops_promptly_with_a_checkpoint(script, signum, tmp_path):
    process = start_script(
        script, [*long_args(script), "--checkpoint-frequency", 10_000, "--run-name", "sig"], tmp_path
    )
    wait_for_training(process)
    output = stop_and_wait(process, signum)
    assert process.returncode == 128 + signum, output
    completed = int(re.search(r"stopped by signal \d+ after iteration (\d+)", output).group(1))
    payload = load_checkpoint_file(tmp_path / "runs" / "sig" / "checkpoint.msgpack")
    assert payload["iteration"] == completed >= 1
    assert not list((tmp_path / "runs" / "sig").glob("*.tmp"))


def test_a_signal_stops_an_actor_in_the_middle_of_a_long_rollout(tmp_path):
    """SIGTERM while the actor plays its first rollout, a minute or more of env steps (800k of CartPole; Procgen's
    16k steps of PPO take as long on a 2-core CPU): the actor stops between two steps rather than at the rollout's
    end, and the run exits at once, with no iteration trained and so no checkpoint."""
    args = [*TINY["ppo"], "--num-steps", 100_000, "--local-num-envs", 8, "--num-actor-threads", 1]
    args += ["--total-timesteps", 1_600_000, "--checkpoint-frequency", 1, "--run-name", "long"]
    process = start_script("ppo", args, tmp_path)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "logs in runs/long" in line:
            break
    time.sleep(3)  # the actor is under way in its rollout
    output = "".join(lines) + stop_and_wait(process, signal.SIGTERM, timeout=20)
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "step " not in output and not (tmp_path / "runs" / "long" / "checkpoint.msgpack").exists(), output


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "receivers"),
    [(signal.SIGINT, (0, 1)), (signal.SIGTERM, (0,))],
    ids=["SIGINT-both ranks", "SIGTERM-rank 0 only"],
)
def test_distributed_signal_stops_all_ranks_at_one_iteration(signum, receivers, tmp_path):
    """Under jax.distributed, signals go through JAX's preemption sync point: all ranks stop after the same
    iteration, also those that got no signal, and rank 0 saves the checkpoint."""
    args = [
        *long_args("ppo"),
        "--actor-device-ids",
        0,
        "--learner-device-ids",
        1,
        "--local-num-envs",
        4,
        "--checkpoint-frequency",
        10_000,
        "--run-name",
        "sig",
    ]
    processes = start_pair("ppo", tmp_path, args)
    try:
        wait_for_training(processes[0])
        for rank in receivers:
            processes[rank].send_signal(signum)
        outputs = [process.communicate(timeout=30)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    received = [signum if rank in receivers else signal.SIGTERM for rank in range(2)]
    stopped = [re.search(rf"stopped by signal {s} after iteration (\d+)", o) for s, o in zip(received, outputs)]
    assert all(stopped), outputs
    assert [p.returncode for p in processes] == [128 + s for s in received]
    assert stopped[0].group(1) == stopped[1].group(1)
    payload = load_checkpoint_file(tmp_path / "rank0" / "runs" / "sig" / "checkpoint.msgpack")
    assert payload["iteration"] == int(stopped[0].group(1))
    assert not (tmp_path / "rank1" / "runs").exists()


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    from cleanba import checkpoint as module

    path = tmp_path / "checkpoint.msgpack"
    module.write_atomically(path, {"iteration": 1, "data": np.arange(1000)})

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(module.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        module.write_atomically(path, {"iteration": 2, "data": np.arange(1000) * 2})
    payload = flax.serialization.msgpack_restore(path.read_bytes())
    assert payload["iteration"] == 1 and np.array_equal(payload["data"], np.arange(1000))


@pytest.mark.slow
def test_kill_during_checkpointing_leaves_a_readable_checkpoint(tmp_path):
    """kill -9 at arbitrary moments of a run that checkpoints every iteration: the checkpoint always loads."""
    path = tmp_path / "runs" / "kill" / "checkpoint.msgpack"
    for delay in [0.0, 0.05, 0.13]:
        process = start_script(
            "ppo", [*long_args("ppo"), "--checkpoint-frequency", 1, "--run-name", "kill", "--hidden-dim", 256], tmp_path
        )
        wait_for_training(process)
        deadline = time.time() + 30
        while not path.exists() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(delay)  # then kill somewhere in the following saves (one per iteration)
        process.kill()
        process.wait(timeout=30)
        payload = load_checkpoint_file(path)
        assert payload["iteration"] >= 1
        path.unlink()


# the engine's (tests/test_engine.py holds it the same in every script): one script runs it
@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo"])
def test_resume_continues_the_run(script, tmp_path):
    module = importlib.import_module(f"cleanba.cleanba_{script}")
    iterations = 120
    args = [*long_args(script, iterations), "--checkpoint-frequency", 7, "--run-name", "resume"]
    process = start_script(script, args, tmp_path)
    wait_for_training(process)
    for line in process.stdout:  # until a game has ended, so that the checkpoint has some in its window
        if re.search(r"\| return \d", line):
            break
    stop_and_wait(process, signal.SIGTERM)
    assert process.returncode == 143
    payload = load_checkpoint_file(tmp_path / "runs" / "resume" / "checkpoint.msgpack")
    saved_iteration = payload["iteration"]
    assert 1 <= saved_iteration < iterations

    # Changing a hyperparameter is refused; the same command resumes.
    conflict = run_script(script, [*args, "--resume", "--learning-rate", 1e-3], tmp_path)
    assert conflict.returncode == 2 and "learning_rate=" in conflict.stderr and "Traceback" not in conflict.stderr
    resumed = run_script(script, [*args, "--resume"], tmp_path)
    check_ok(resumed)

    # The state at resume is the saved one: the line's digests are of the state as placed on the learner devices
    # (a resume that lost the optimizer state between the file and the devices fails here).
    saved_args = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(payload["args"]).items()}
    run_args = module.Args(**saved_args)
    agent = module.Agent(2, run_args.channels, run_args.hidden_dim)
    template = module.TrainState.create(
        apply_fn=None, params=agent.init(jax.random.key(0), np.zeros((1, 4))), tx=module.make_optimizer(run_args)
    )
    restored = flax.serialization.from_state_dict(template, payload["train_state"])
    line = re.search(
        r"resumed .* at iteration (\d+) \(global step (\d+)\): params sha256 (\w+), opt_state "
        r"sha256 (\w+), optimizer step (\d+)",
        resumed.stdout,
    )
    assert line, resumed.stdout
    assert int(line.group(1)) == saved_iteration
    assert int(line.group(2)) == saved_iteration * run_args.batch_size
    assert line.group(3) == module.digest(restored.params)
    assert line.group(4) == module.digest(restored.opt_state)
    updates_per_iteration = int(restored.step) // saved_iteration
    assert int(line.group(5)) == saved_iteration * updates_per_iteration

    # The curves continue: every iteration logged exactly once, the learning rate on its schedule.
    logged = scalars(run_dir(tmp_path))
    steps = [step for step, _ in logged["stats/learner_policy_version"]]
    assert steps == [i * run_args.batch_size for i in range(1, iterations + 1)]
    versions = [value for _, value in logged["stats/learner_policy_version"]]
    assert versions == list(range(iterations))
    learning_rates = dict(logged["charts/learning_rate"])
    after = (saved_iteration + 1) * run_args.batch_size
    expected = run_args.learning_rate * (1 - saved_iteration / iterations)  # what iteration K + 1 used
    assert learning_rates[after] == pytest.approx(expected, rel=1e-5)

    # The checkpoint keeps the window of the last 20 games behind the return curve, and the resumed run starts
    # from it (an empty window would make the first point after a resume average only the shortest games).
    window = payload["episode_window"]
    assert 1 <= len(window["returns"]) == len(window["lengths"]) <= 20
    returns = dict(logged["charts/episodic_return"])
    assert returns[saved_iteration * run_args.batch_size] == pytest.approx(np.mean(window["returns"]), rel=1e-6)
    assert f"its last games' returns {window['returns'].tolist()}" in resumed.stdout


@pytest.mark.slow
def test_a_stop_loses_no_test_of_the_test_curve(tmp_path):
    """SIGTERM while the test curve's games of iteration 2 are played (100,000 of them) and the learner waits to
    hand over later tests: the checkpoint keeps every test not yet logged, and the resumed run plays them first, with
    the params of their iterations: its test curve, the straight run's, with no point missing."""
    args = [*long_args("ppo", 12), "--learning-rate", 0.03, "--exact", "--checkpoint-frequency", 1]
    args += ["--test-frequency", 2, "--run-name", "stopped"]
    process = start_script("ppo", [*args, "--eval-episodes", 100_000], tmp_path)
    for line in process.stdout:  # iteration 5 logged: the learner hands over test 6 while test 4 waits for test 2
        if line.startswith("step 640/"):
            break
    time.sleep(2)
    stop_and_wait(process, signal.SIGTERM)
    assert process.returncode == 128 + signal.SIGTERM
    payload = load_checkpoint_file(tmp_path / "runs" / "stopped" / "checkpoint.msgpack")
    saved = payload["iteration"]
    assert saved >= 4 and sorted(payload["episode_window"]["tests"], key=int) == [*map(str, range(2, saved + 1, 2))]

    check_ok(run_script("ppo", [*args, "--eval-episodes", 8, "--resume"], tmp_path))
    check_ok(run_script("ppo", [*args, "--eval-episodes", 8, "--run-name", "straight"], tmp_path))
    resumed, straight = (events.read_run(tmp_path / "runs" / name).scalars for name in ["stopped", "straight"])
    batch = 8 * 16
    assert straight["test/episodic_return"].step.tolist() == [*range(2 * batch, 12 * batch + 1, 2 * batch)]
    assert len(set(straight["test/episodic_return"].value)) > 2  # the params change from test to test
    # The resumed run's envs start afresh (a checkpoint has no env state): its games follow the straight run's only
    # up to the checkpoint, its iterations all the way.
    followed = {"test/episodic_return": saved, "charts/episodic_return": saved, "stats/learner_policy_version": 12}
    for tag, last in followed.items():
        before = [frame[frame.step <= last * batch][["step", "value"]] for frame in (resumed[tag], straight[tag])]
        pd.testing.assert_frame_equal(*before)
    assert resumed["test/episodic_return"].step.tolist() == straight["test/episodic_return"].step.tolist()
    tensorboard = scalars(tmp_path / "runs" / "stopped")  # TensorBoard's own reading of the resumed run's files
    test_curve = resumed["test/episodic_return"]
    assert sorted(tensorboard["test/episodic_return"]) == list(zip(test_curve.step, test_curve.value))


def test_logger_starts_from_the_saved_window(tmp_path):
    from cleanba.cleanba_ppo import Args
    from cleanba.logs import IterationLogger

    args = Args()
    saved = {"returns": np.arange(20.0), "lengths": np.arange(20.0) * 10}
    logger = IterationLogger(args, tmp_path / "window", purge_step=None, episode_window=saved)
    logger.recent_returns.extend([100.0, 101.0])  # two more games: the two oldest leave the window
    logger.recent_lengths.extend([1000.0, 1010.0])
    window = logger.episode_window()
    logger.close()
    assert window["returns"].tolist() == [*range(2, 20), 100.0, 101.0]
    assert window["lengths"].tolist() == [*range(20, 200, 10), 1000.0, 1010.0]


# What a resumed run may change (flag(..., may_change_on_resume=True)): where and how it computes, logs and saves,
# never what it learns. A flag added here must be one that changes no bit of a run's params (tests/test_exact.py
# resumes across layouts bit for bit); every other flag of the command line must match the checkpoint's.
MAY_CHANGE_ON_RESUME = {
    *["actor_device_ids", "learner_device_ids", "local_num_envs", "num_actor_threads", "memory_check"],
    *["distributed", "coordinator_address", "num_processes", "process_id", "heartbeat_timeout", "stall_timeout"],
    *["exp_name", "run_name", "resume", "log_frequency", "track", "wandb_project_name", "wandb_entity"],
    *["checkpoint_frequency", "save_model", "eval_episodes", "capture_video", "upload_model", "hf_repo_id"],
    *["world_size", "process_index", "local_batch_size", "local_minibatch_size"],  # run-time sizes of a layout
    *["test_frequency", "test_env_kwargs"],  # the test curve
}
LEARNED = {  # every other flag: what is learned
    "common": [
        *["env_id", "atari_protocol", "frame_stack", "total_timesteps", "seed", "learning_rate", "anneal_lr"],
        *["num_steps", "gamma"],
        *["num_minibatches", "ent_coef", "vf_coef", "max_grad_norm", "channels", "hidden_dim", "conv_dtype"],
        *["concurrency", "gradient_accumulation_steps", "exact", "group_envs", "env_kwargs"],
    ],
    "ppo": ["gae_lambda", "update_epochs", "norm_adv", "clip_coef"],
    "impala": ["rmsprop_decay", "rmsprop_eps", "lstm", "lstm_size"],
}


def other_value(value, hint):
    """A value of a flag's type other than value."""
    if typing.get_origin(hint) is typing.Literal:
        return next(choice for choice in typing.get_args(hint) if choice != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 + 1e-3
    if isinstance(value, str):
        return f"{value}-other"
    if isinstance(value, list | tuple):
        return [*value, value[-1]] if value else ["num_levels=1"]
    assert value is None, value
    return "other"


def test_a_resume_refuses_every_flag_that_changes_what_is_learned(script, tmp_path):
    """The checkpoint's check of the resuming command's flags (checkpoint.load_checkpoint, called by the scripts'
    --resume and by a requeued SLURM job): which flags it lets change (MAY_CHANGE_ON_RESUME, the same for both
    scripts); each other flag, changed on its own, refused naming it; each one that may change, changed on its own,
    let through. tests/test_resume_continues_the_run takes a real run's checkpoint through the command line."""
    from dataclasses import asdict, fields, replace

    from cleanba import checkpoint
    from cleanba.flags import flags_that_may_change_on_resume

    module = importlib.import_module(f"cleanba.cleanba_{script}")
    hints = typing.get_type_hints(module.Args, include_extras=True)
    flags = {f.name for f in fields(module.Args) if "Suppress" not in repr(hints[f.name])}
    assert flags_that_may_change_on_resume(module.Args) == MAY_CHANGE_ON_RESUME
    assert flags - MAY_CHANGE_ON_RESUME == set(LEARNED["common"] + LEARNED[script])
    args = module.Args()
    module.fill_runtime_sizes(args, 1, 0)
    path, state = tmp_path / "checkpoint.msgpack", {"w": np.arange(3.0)}
    checkpoint.save_checkpoint(path, asdict(args), state, 5, {"returns": np.zeros(0), "lengths": np.zeros(0)})
    for name in sorted(flags):
        other = replace(args, **{name: other_value(getattr(args, name), hints[name])})
        if name in MAY_CHANGE_ON_RESUME:
            iteration, restored, *_ = checkpoint.load_checkpoint(path, asdict(other), state, MAY_CHANGE_ON_RESUME)
            assert iteration == 5 and restored["w"].tolist() == [0.0, 1.0, 2.0], name
        else:
            with pytest.raises(ValueError, match=rf"was trained with {name}="):
                checkpoint.load_checkpoint(path, asdict(other), state, MAY_CHANGE_ON_RESUME)
    # A checkpoint older than a flag: trained at the flag's default, so resumed at it and refused at another value.
    older = {name: value for name, value in asdict(args).items() if name != "env_kwargs"}
    checkpoint.save_checkpoint(path, older, state, 5, {"returns": np.zeros(0), "lengths": np.zeros(0)})
    defaults = asdict(module.Args())
    assert checkpoint.load_checkpoint(path, asdict(args), state, MAY_CHANGE_ON_RESUME, defaults)[0] == 5
    other = replace(args, env_kwargs=("num_levels=1",))
    with pytest.raises(ValueError, match=r"was trained with env_kwargs=\[\] \(now \['num_levels=1'\]\)"):
        checkpoint.load_checkpoint(path, asdict(other), state, MAY_CHANGE_ON_RESUME, defaults)


# Both lag settings, each resumed one of the two ways (the way does not change what follows the resume), each on
# one script (the engine's resume is the same in every script: tests/test_engine.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "concurrency", "how", "env"),
    [("ppo", "--concurrency", ["--resume"], None), ("impala", "--no-concurrency", [], {"SLURM_RESTART_COUNT": "1"})],
    ids=["ppo-concurrency, --resume", "impala-no concurrency, SLURM requeue"],
)
def test_resuming_a_finished_run_ends_at_once(script, concurrency, how, env, tmp_path):
    """A checkpoint of the last iteration (saved on schedule, or by a stop during that iteration), resumed by --resume
    or by a requeued SLURM job: nothing is left to train, so the run ends at once with exit 0 and the straight run's
    final params. The learner once queued params for rollouts that no actor would play, and waited forever (issue
    40); the timeout fails the test on such a hang."""
    iterations = 3
    args = [*long_args(script, iterations), concurrency, "--checkpoint-frequency", iterations, "--run-name", "done"]
    straight = run_script(script, args, tmp_path, timeout=120)
    check_ok(straight)
    final = re.search(r"final params sha256 \w+", straight.stdout).group(0)
    resumed = run_script(script, [*args, *how], tmp_path, timeout=120, env=env)
    check_ok(resumed)
    assert f"resumed runs/done/checkpoint.msgpack at iteration {iterations} " in resumed.stdout, resumed.stdout
    assert "nothing to train" in resumed.stdout and final in resumed.stdout, resumed.stdout


# the engine's (tests/test_engine.py holds it the same in every script): one script runs it
@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala"])
def test_signal_after_the_last_iteration_leaves_its_checkpoint(script, tmp_path):
    """SIGTERM while the trained model is evaluated, after the last iteration (5, no multiple of the checkpoint
    frequency 3): exit 143 with the checkpoint of iteration 5, so that the requeue that follows ends at once with the
    same final params instead of training again from iteration 3."""
    iterations = 5
    args = [*long_args(script, iterations), "--checkpoint-frequency", 3, "--save-model", "--run-name", "e"]
    process = start_script(script, [*args, "--eval-episodes", 1_000_000], tmp_path)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("model saved to"):  # then the evaluation of a million games, which the signal stops
            break
    time.sleep(1)
    output = "".join(lines) + stop_and_wait(process, signal.SIGTERM)
    assert process.returncode == 128 + signal.SIGTERM, output
    assert f"stopped by signal {signal.SIGTERM} after iteration {iterations}" in output, output
    assert load_checkpoint_file(tmp_path / "runs" / "e" / "checkpoint.msgpack")["iteration"] == iterations
    final = re.search(r"final params sha256 \w+", output).group(0)
    resumed = run_script(script, [*args, "--eval-episodes", 0], tmp_path, timeout=120, env={"SLURM_RESTART_COUNT": "1"})
    check_ok(resumed)
    assert "nothing to train" in resumed.stdout and final in resumed.stdout, resumed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo", "ppo_continuous"])  # the engine's resume, and the normalizer's
def test_resume_continues_the_straight_run_bit_for_bit(script, tmp_path):
    """A run resumed from the checkpoint of iteration k ends with the straight run's final params, bit for bit: the
    checkpoint restores the straight run's params, optimizer state and step (which also keys the minibatch
    shuffles), and the actors continue the action keys' step count. The envs hide nothing of their past
    (MEMORYLESS_ENVPOOL), so the resumed rollouts are the straight run's; the continuous PPO's normalizer statistics
    (each env's discounted return among them) come back with the params. Without concurrency: with it, the first
    rollout after a resume is played with the checkpoint's params, one version newer than in the straight run."""
    iterations, k = 6, 4
    args = [*long_args(script, iterations), "--no-concurrency", "--checkpoint-frequency", k, "--run-name", "r"]
    command = [sys.executable, "-c", MEMORYLESS_ENVPOOL, str(SCRIPTS[script])]
    runs = []
    for extra in [[], ["--resume"]]:  # the straight run saves iterations k and 6; the resume starts from k's
        if extra:
            shutil.copyfile(
                tmp_path / "runs" / "r" / f"checkpoint.msgpack.{k}", tmp_path / "runs" / "r" / "checkpoint.msgpack"
            )
        process = subprocess.run(
            [*command, *map(str, [*args, *extra])],
            cwd=tmp_path,
            env=script_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        check_ok(process)
        runs.append(process.stdout)
    straight, resumed = runs
    assert f"resumed runs/r/checkpoint.msgpack at iteration {k} " in resumed, resumed
    final = re.findall(r"final params sha256 (\w+)", straight)
    assert len(final) == 1 and re.findall(r"final params sha256 (\w+)", resumed) == final, (straight, resumed)
