"""EnvPool's options from the command line (--env-kwargs, cleanba/spaces.py's env_options): typed by the env's
config, refused in one line where they are not the env's or where the engine, the env id or the Atari protocol sets
them; they reach the training envs, the test curve's envs (--test-frequency, --test-env-kwargs over them) and a saved
model's evaluation (python -m cleanba.evaluate --env-kwargs). Procgen, whose levels are such options, loads with the
README's system package (Qt 5) and is refused in one line on a machine without it."""

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from support import (
    ROOT,
    TINY,
    check_ok,
    in_mount_namespace,
    qt5_libraries,
    require_qt5,
    run_dir,
    run_script,
    scalars,
    script_command,
    script_env,
)

from cleanba import spaces

REFUSED = {  # (env id, --env-kwargs, --test-env-kwargs): what the one line says
    "an unknown key names the env's": (
        "StarpilotEasy-v0",
        ["num_level=200"],
        [],
        "--env-kwargs: num_level cannot be set (not StarpilotEasy-v0's); StarpilotEasy-v0 takes center_agent, "
        "max_episode_steps, num_levels,",
    ),
    "a value of another type": ("StarpilotEasy-v0", ["num_levels=many"], [], "num_levels=many is not an integer"),
    "a bool": ("StarpilotEasy-v0", ["use_backgrounds=maybe"], [], "use_backgrounds=maybe is not true or false"),
    "no value": ("StarpilotEasy-v0", ["num_levels"], [], "'num_levels' is not KEY=VALUE"),
    "a key twice": ("StarpilotEasy-v0", ["num_levels=1", "num_levels=2"], [], "'num_levels=2' is not KEY=VALUE"),
    "the engine's seeds": ("StarpilotEasy-v0", ["seed=3"], [], "seed cannot be set (the engine sets it)"),
    "the engine's env count": ("CartPole-v1", ["num_envs=3"], [], "num_envs cannot be set (the engine sets it)"),
    "the frames' layout": ("StarpilotEasy-v0", ["channel_first=false"], [], "channel_first cannot be set"),
    "what the id names": (
        "StarpilotEasy-v0",
        ["distribution_mode=1"],
        [],
        "distribution_mode cannot be set (--env-id=StarpilotEasy-v0 sets it; choose another id)",
    ),
    "the Atari protocol's": (
        "Breakout-v5",
        ["repeat_action_probability=0"],
        [],
        "repeat_action_probability cannot be set (the Atari protocol sets it (--atari-protocol))",
    ),
    "a bad test option": ("StarpilotEasy-v0", ["num_levels=200"], ["start_level=x"], "--test-env-kwargs: start_level"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_options_refused_in_one_line(case, capsys):
    env_id, train, test, message = REFUSED[case]
    args = SimpleNamespace(env_id=env_id, env_kwargs=train, test_env_kwargs=test)
    protocol = {"repeat_action_probability": 0.25, "noop_max": 1} if env_id == "Breakout-v5" else {}
    with pytest.raises(SystemExit) as stop:
        spaces.env_options(args, protocol)
    error = capsys.readouterr().err
    assert stop.value.code == 2 and message in error and len(error.strip().splitlines()) == 1, error


def test_options_typed_and_layered():
    args = SimpleNamespace(
        env_id="StarpilotEasy-v0",
        env_kwargs=["num_levels=200", "start_level=0", "use_backgrounds=False"],
        test_env_kwargs=["num_levels=0", "paint_vel_info=1"],
    )
    assert spaces.env_options(args, {}) == dict(num_levels=200, start_level=0, use_backgrounds=False)
    test = dict(num_levels=0, start_level=0, use_backgrounds=False, paint_vel_info=True)
    assert spaces.env_options(args, {}, test=True) == test
    assert spaces.env_options(SimpleNamespace(env_id="Breakout-v5", env_kwargs=[]), {"noop_max": 1}) == {"noop_max": 1}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--env-kwargs", "max_episode_step=30"], "--env-kwargs: max_episode_step cannot be set (not CartPole-v1's)"),
        (["--test-frequency", "2", "--test-env-kwargs", "max_episode_steps=x"], "--test-env-kwargs: max_episode_"),
        (["--test-env-kwargs", "max_episode_steps=5"], "--test-env-kwargs sets the test envs of the test curve"),
    ],
)
def test_a_script_refuses_them_before_it_starts(flags, message, tmp_path):
    process = run_script("ppo", [*TINY["ppo"], *flags], tmp_path, timeout=60)
    assert process.returncode == 2 and message in process.stderr and "Traceback" not in process.stderr, process.stderr
    assert "iterations of batch_size" not in process.stdout and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_options_reach_the_training_the_test_and_the_evaluation_envs(tmp_path):
    """CartPole's episode cap as the option: 12 steps for training, 6 for the test curve's games, 9 and the run's
    12 for the saved model's evaluation. A random policy's games last about 20 steps, so each cap shows."""
    flags = ["--env-kwargs", "max_episode_steps=12", "--test-frequency", 2, "--test-env-kwargs", "max_episode_steps=6"]
    flags += ["--eval-episodes", "3", "--total-timesteps", 5 * 4 * 16, "--local-num-envs", "4", "--save-model"]
    process = run_script("ppo", [*TINY["ppo"], "--num-actor-threads", "1", *flags, "--run-name", "r"], tmp_path)
    check_ok(process)
    logged = scalars(run_dir(tmp_path))
    assert [step for step, _ in logged["test/episodic_return"]] == [128, 256, 320]  # iterations 2, 4 and the last
    assert [length for _, length in logged["test/episodic_length"]] == [6.0] * 3
    assert process.stdout.count("test at step") == 3 and "3 episodes, return 6.00 +- 0.00" in process.stdout
    training = [length for _, length in logged["charts/episodic_length"]]
    assert max(training) <= 12, training  # the window's mean of games capped at 12
    model = run_dir(tmp_path) / "cleanba_ppo.cleanba_model"
    lengths = {}
    for name, options in [("capped at 9", ["--env-kwargs", "max_episode_steps=9"]), ("the run's", [])]:
        command = [sys.executable, "-m", "cleanba.evaluate", model, "--episodes", "8", *options]
        evaluation = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
        check_ok(evaluation)
        lengths[name] = [int(line.split("length ")[1]) for line in evaluation.stdout.splitlines() if "length " in line]
    assert len(lengths["capped at 9"]) == 8 and set(lengths["capped at 9"]) == {9}, lengths
    assert max(lengths["the run's"]) == 12 and np.mean(lengths["the run's"]) > 9, lengths
    command = [sys.executable, "-m", "cleanba.evaluate", model, "--env-kwargs", "seed=1"]
    evaluation = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert evaluation.returncode == 2 and "--env-kwargs: seed cannot be set" in evaluation.stderr, evaluation.stderr


PROCGEN = ["--env-id", "StarpilotEasy-v0", "--channels", "4", "4", "4", "--hidden-dim", "16", "--num-steps", "16"]
PROCGEN += ["--local-num-envs", "4", "--num-actor-threads", "1", "--total-timesteps", 4 * 64, "--log-frequency", "1"]


@pytest.mark.slow
def test_procgen_trains_on_its_training_levels(tmp_path):
    """The README's Qt 5 in place: IMPALA on StarPilot's first 200 levels, tested on the whole distribution."""
    require_qt5()
    flags = ["--env-kwargs", "num_levels=200", "start_level=0", "--test-frequency", "2"]
    flags += ["--test-env-kwargs", "num_levels=0", "--eval-episodes", "2"]
    process = run_script("impala", [*PROCGEN, *flags], tmp_path, timeout=600)
    check_ok(process)
    assert "final params sha256" in process.stdout and process.stdout.count("test at step") == 2, process.stdout


@pytest.mark.needs_root("a mount namespace")
def test_procgen_without_qt_is_refused_in_one_line(tmp_path):
    """The same command where Qt 5 cannot load (its library replaced by an empty file in a private mount
    namespace): exit 2, one line naming the family and Qt 5, before anything starts."""
    require_qt5()
    hide = [f"mount --bind /dev/null {path}" for path in qt5_libraries()]
    command = in_mount_namespace(script_command("ppo", PROCGEN), tmp_path, cpu_install=False, setup=hide)
    process = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=120)
    errors = [line for line in process.stderr.splitlines() if "error:" in line]
    assert process.returncode == 2 and len(errors) == 1, process.stderr
    assert "EnvPool's envpool.procgen cannot make it here" in errors[0] and "Qt 5" in errors[0], errors
    assert "Traceback" not in process.stderr and "iterations of batch_size" not in process.stdout
