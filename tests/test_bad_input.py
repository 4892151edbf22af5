"""Bad input is refused right after parsing: exit 2, a message naming the flag and the fix, no traceback. A machine
that cannot run the scripts (a Python the project does not support, EnvPool or a system library it needs missing)
gets one line naming what to install: exit 1 (cleanba/startup.py)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import envpool
import pytest
from support import ROOT, SCRIPTS, TINY, in_mount_namespace, run_script, script_env

from cleanba import startup

CASES = {
    "learner device out of range": (["--learner-device-ids", "3"], 1, "--learner-device-ids 3", "local device"),
    "actor device out of range": (["--actor-device-ids", "0", "5"], 2, "--actor-device-ids 0 5", "ids 0..1"),
    "duplicate learner devices": (["--learner-device-ids", "1", "1"], 2, "--learner-device-ids 1 1", "distinct"),
    "negative device id": (["--actor-device-ids", "-1"], 1, "--actor-device-ids -1", "non-negative"),
    "total timesteps below one batch": (["--total-timesteps", "100"], 1, "--total-timesteps=100", "batch"),
    "unknown env id": (["--env-id", "Breakout-v99"], 1, "--env-id=Breakout-v99", "envpool.list_all_envs"),
    "zero envs": (["--local-num-envs", "0"], 1, "--local-num-envs=0", "[1, inf)"),
    "zero minibatches": (["--num-minibatches", "0"], 1, "--num-minibatches=0", "[1, inf)"),
    "negative steps": (["--num-steps", "-4"], 1, "--num-steps=-4", "[1, inf)"),
    "discount above 1": (["--gamma", "1.5"], 1, "--gamma=1.5", "[0, 1]"),
    "NaN learning rate": (["--learning-rate", "nan"], 1, "--learning-rate=nan", "(0, inf)"),
    "a channel count of zero": (["--channels", "16", "0", "32"], 1, "--channels 16 0 32", "positive channel counts"),
    "a negative channel count": (["--channels", "-4"], 1, "--channels -4", "positive channel counts"),
    "no channels": (["--channels"], 1, "--channels", "one or more positive"),
    "coordinator without --distributed": (
        ["--coordinator-address", "127.0.0.1:1234"],
        1,
        "--coordinator-address only apply",
        "add --distributed",
    ),
    "process count without --distributed": (
        ["--num-processes", "2", "--process-id", "0"],
        1,
        "--num-processes --process-id only apply",
        "add --distributed",
    ),
    "process count alone": (["--distributed", "--num-processes", "2"], 1, "--num-processes and --process-id together"),
    "process id alone": (["--distributed", "--process-id", "0"], 1, "--num-processes and --process-id together"),
    "process id out of range": (  # would wait forever in jax.distributed.initialize for a rank that never comes
        ["--distributed", "--num-processes", "2", "--process-id", "2"],
        1,
        "--process-id=2 must be in 0..1",
    ),
    "negative process id": (["--distributed", "--num-processes", "2", "--process-id", "-1"], 1, "--process-id=-1"),
    "resume without a run name": (["--resume"], 1, "--resume needs --run-name"),
    "resume with no checkpoint": (["--resume", "--run-name", "never-saved"], 1, "--resume: no checkpoint at"),
}
MINIBATCH_CASE = {  # the constraint each algorithm puts on minibatch sizes
    "ppo": (["--num-steps", "10", "--num-minibatches", "4"], "--num-steps=10", "multiple of 4"),
    "impala": (
        ["--local-num-envs", "3", "--num-actor-threads", "2", "--num-minibatches", "8"],
        "--num-minibatches=8",
        "at most 6",
    ),
}


def check_refused(process, *fragments):
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    assert "error:" in process.stderr
    for fragment in fragments:
        assert fragment in process.stderr, (fragment, process.stderr)
    # Refused before anything started: no start line, no iteration (run_script's timeout bounds a hang; a
    # wall-clock bound here failed on a loaded 2-core machine, 14-17 s against 10).
    assert "iterations of batch_size" not in process.stdout and "step " not in process.stdout, process.stdout


# The engine's checks (tests/test_engine.py holds them the same in every script): each case on one script, the two
# scripts in turn.
@pytest.mark.parametrize(("script", "case"), [(("ppo", "impala")[i % 2], case) for i, case in enumerate(CASES)])
def test_refused(script, case, tmp_path):
    flags, devices, *fragments = CASES[case]
    process = run_script(script, ["--env-id", "CartPole-v1", *flags], tmp_path, devices=devices, timeout=60)
    check_refused(process, *fragments)
    assert not (tmp_path / "runs").exists()


def test_minibatch_sizes_refused(script, tmp_path):
    flags, *fragments = MINIBATCH_CASE[script]
    process = run_script(script, ["--env-id", "CartPole-v1", "--learner-device-ids", "0", *flags], tmp_path, timeout=60)
    check_refused(process, *fragments)


ENV_CASES = {  # an env whose spaces the script does not train, or that EnvPool cannot make here (cleanba/spaces.py)
    "box actions to ppo": ("ppo", "HalfCheetah-v4", "has Box actions", "use cleanba_ppo_continuous.py"),
    "box actions to impala": ("impala", "CheetahRun-v1", "has Box actions", "use cleanba_ppo_continuous.py"),
    "discrete actions to the continuous ppo": (
        "ppo_continuous",
        "CartPole-v1",
        "has Discrete actions",
        "use cleanba_ppo.py or cleanba_impala.py",
    ),
    "integer box actions": ("impala", "RobotWarehouse-v0", "integer Box (int32) actions", "no Cleanba script"),
    "a game of two players": ("ppo", "Go9x9-v1", "a game of 2 players", "one agent"),
    "a family whose envs do not start in a run": ("ppo_continuous", "Basic-v1", "envpool.vizdoom", "hangs"),
    "videos of an env EnvPool cannot render": (
        "ppo_continuous",
        "Hopper-v4",
        "--capture-video: EnvPool's envpool.mujoco.gym envs",
        "leave out --capture-video",
        "--save-model",
        "--capture-video",
    ),
}


@pytest.mark.parametrize("case", list(ENV_CASES))
def test_env_spaces_refused(case, tmp_path):
    script, env_id, *fragments = ENV_CASES[case]
    flags = [fragment for fragment in fragments if fragment.startswith("--") and " " not in fragment]
    process = run_script(script, ["--env-id", env_id, *flags], tmp_path, timeout=60)
    check_refused(process, env_id, *fragments[: len(fragments) - len(flags)])
    assert len(process.stderr.strip().splitlines()) == 1, process.stderr


ALGORITHM_CASES = {  # what each algorithm's check_algorithm refuses besides MINIBATCH_CASE
    "ppo micro-batches that do not divide the steps": (
        "ppo",
        ["--num-steps", "16", "--num-minibatches", "2", "--gradient-accumulation-steps", "3"],
        "--num-steps=16 must be divisible by --num-minibatches x --gradient-accumulation-steps = 6",
    ),
    "impala exact groups that micro-batches do not divide": (
        "impala",
        ["--exact", "--group-envs", "3", "--gradient-accumulation-steps", "2"],
        "--group-envs=3 must be divisible by --gradient-accumulation-steps=2",
    ),
}


@pytest.mark.parametrize("case", list(ALGORITHM_CASES))
def test_algorithm_flags_refused(case, tmp_path):
    script, flags, *fragments = ALGORITHM_CASES[case]
    process = run_script(script, ["--env-id", "CartPole-v1", *flags], tmp_path, timeout=60)
    check_refused(process, *fragments)


def check_one_line(process, *fragments):
    """Ended before JAX started, with one line naming what to install, last on stderr (EnvPool's modules may log
    before it), and no traceback."""
    errors = [line for line in process.stderr.splitlines() if "error" in line.lower()]
    assert process.returncode == 1 and len(errors) == 1, process.stderr
    assert process.stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in process.stderr, process.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    assert process.stdout == "", process.stdout


def test_missing_envpool_library_is_one_line(script, tmp_path):
    """The installed EnvPool wheel, with one NEEDED entry more in its Atari module (patchelf), which every run
    imports: what envpool 1.2.6 and later are on a machine without libEGL.so.1 (their gfootball module, once every
    family is registered), here with a library no machine has."""
    installed = Path(envpool.__file__).parent
    site = tmp_path / "site"
    (site / "envpool").mkdir(parents=True)
    (site / "envpool.libs").symlink_to(installed.with_name("envpool.libs"))  # the wheel's $ORIGIN/../envpool.libs
    for entry in installed.iterdir():
        if entry.name != "atari":
            (site / "envpool" / entry.name).symlink_to(entry)
    (site / "envpool" / "atari").mkdir()
    for entry in (installed / "atari").iterdir():
        (site / "envpool" / "atari" / entry.name).symlink_to(entry)
    module = site / "envpool" / "atari" / "atari_envpool.so"
    module.unlink()
    module.write_bytes((installed / "atari" / module.name).read_bytes())
    patchelf = Path(sys.executable).with_name("patchelf")
    subprocess.run([patchelf, "--add-needed", "libcleanba-absent.so.1", module], check=True)
    process = run_script(
        script,
        ["--env-id", "CartPole-v1"],
        tmp_path,
        timeout=60,
        env={"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"},
    )
    check_one_line(process, "EnvPool 1.2", "libcleanba-absent.so.1", "the system package that provides it")


def test_envpool_registers_the_scripts_families_and_the_rest_on_demand():
    """startup.import_envpool: Atari and classic control registered without EnvPool's other families, whose Jumanji
    module imports matplotlib's pyplot (a quarter of a training process's imports); an env id of another family
    (MuJoCo's HalfCheetah) passes the --env-id check, which registers them all; an unknown one is refused."""
    program = """
import sys
import tyro
from cleanba import cleanba_ppo
from cleanba.flags import check_flags
import envpool
print("registered", len(envpool.list_all_envs()), "matplotlib" in sys.modules, "CartPole-v1" in envpool.list_all_envs())
for env_id in ["Breakout-v5", "HalfCheetah-v5", "Breakout-v99"]:
    try:
        check_flags(tyro.cli(cleanba_ppo.Args, args=["--env-id", env_id]))
        print(env_id, "accepted", len(envpool.list_all_envs()))
    except SystemExit:
        print(env_id, "refused")
"""
    process = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    registered = int(lines[0].split()[1])
    assert lines[0] == f"registered {registered} False True", process.stdout
    assert lines[1] == f"Breakout-v5 accepted {registered}", process.stdout
    everything = int(lines[2].split()[-1])
    assert lines[2] == f"HalfCheetah-v5 accepted {everything}" and everything > registered, process.stdout
    assert lines[3] == "Breakout-v99 refused", process.stdout


def test_rlax_loads_its_distribution_libraries_on_first_use():
    """startup.import_rlax: a script's imports leave out distrax and TensorFlow Probability, which rlax's GAE and
    V-trace do not use; rlax's functions that use distrax still work (it is imported then), as does `import distrax`."""
    program = """
import sys
import jax.numpy as jnp
from cleanba import cleanba_impala
import rlax
print("loaded", "distrax" in sys.modules, "tensorflow_probability" in sys.modules)
print("softmax", rlax.softmax(1.0).probs(jnp.array([0.0, 0.0])).tolist(), "tensorflow_probability" in sys.modules)
import distrax
print("distrax", distrax.Categorical(logits=jnp.zeros(4)).entropy().round(4))
"""
    process = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.splitlines() == ["loaded False False", "softmax [0.5, 0.5] True", "distrax 1.3863"], (
        process.stdout
    )


def test_missing_envpool_is_one_line(script, tmp_path):
    """No EnvPool at all: a Python without this environment's site-packages (-S), the project on PYTHONPATH."""
    process = subprocess.run(
        [sys.executable, "-S", SCRIPTS[script], "--env-id", "CartPole-v1"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    check_one_line(process, "No module named 'envpool'", "poetry install")


def test_the_lines_name_what_to_install():
    """The messages themselves, for inputs this machine does not have: other Pythons, envpool 1.2.7's libraries."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert (
        requires
        == f">={startup.PYTHONS[0][0]}.{startup.PYTHONS[0][1]},<{startup.PYTHONS[1][0]}.{startup.PYTHONS[1][1] + 1}"
    )
    assert startup.python_problem((3, 11, 0)) is None and startup.python_problem((3, 14, 8)) is None
    for version in [(3, 10, 12), (3, 15, 0), (2, 7, 18)]:
        problem = startup.python_problem(version)
        assert problem and "3.11 to 3.14" in problem and ".".join(map(str, version)) in problem, problem
    for library, package in [("libEGL.so.1", "libegl1"), ("libOpenGL.so.0", "libopengl0")]:
        error = OSError(f"{library}: cannot open shared object file: No such file or directory")
        assert f"sudo apt-get install {package}" in startup.library_problem(error)


def numeric_flags(module) -> dict:
    """{field: type} of every int or float command-line flag of a script's Args (run-time sizes excluded)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(module.Args)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(module.Args)
        if hints[f.name] in (int, float) and f.name not in RUNTIME_SIZES
    }


RUNTIME_SIZES = {
    "world_size",
    "process_index",
    "num_envs",
    "local_batch_size",
    "local_minibatch_size",
    "batch_size",
    "minibatch_size",
    "num_iterations",
}


def outside(interval: str, kind: type) -> list:
    """Values just outside an interval written like "[0, 1)" (and NaN for floats)."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    step = 1 if kind is int else 1e-3
    values = [low - step if interval[0] == "[" else low]
    if high != float("inf"):
        values.append(high + step if interval[-1] == "]" else high)
    if kind is float:
        values += [float("nan"), float("inf")] if high == float("inf") else [float("nan")]
    return [kind(v) if kind is int else v for v in values]


def test_every_numeric_flag_has_a_checked_range(script, capsys):
    """Table-driven over every int and float flag of the script: each has a range, and values outside it (NaN too)
    are refused with exit 2, the flag and the range, before anything starts; the defaults are inside."""
    import importlib

    import tyro

    from cleanba.flags import flag_ranges, in_range

    module = importlib.import_module(f"cleanba.cleanba_{script}")
    flags, ranges = numeric_flags(module), flag_ranges(module.Args)
    assert set(flags) == set(ranges), "every numeric flag needs a range, and only those"
    defaults = module.Args()
    for name, kind in flags.items():
        interval = ranges[name]
        assert in_range(getattr(defaults, name), interval), (name, "default outside its range")
        for value in outside(interval, kind):
            args = tyro.cli(module.Args, args=["--env-id", "CartPole-v1", f"--{name.replace('_', '-')}", str(value)])
            with pytest.raises(SystemExit) as refused:
                module.check_args(args)
            assert refused.value.code == 2, (name, value)
            message = capsys.readouterr().err
            assert f"--{name.replace('_', '-')}={value}" in message and interval in message, message


def test_help_names_the_algorithm_an_example_and_every_range(script):
    """--help opens with what the script trains and a command to run it; each flag with a range shows the docstring
    under its field, then the range; no flag shows two defaults."""
    import importlib

    from cleanba.flags import flag_ranges

    module = importlib.import_module(f"cleanba.cleanba_{script}")
    env = dict(script_env(), COLUMNS="1000")  # one line per flag
    process = subprocess.run(
        [sys.executable, SCRIPTS[script], "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 0 and process.stderr == "", process.stderr
    head, options = process.stdout.split("╭─ options", 1)
    assert f"Cleanba {script.upper()}:" in head and f"e.g. python cleanba/cleanba_{script}.py --env-id" in head, head
    lines, flag = {}, None  # each flag's text: its line and those under it (a long flag's help starts below it)
    for line in options.splitlines():
        flag = line.split()[1] if line.startswith("│ --") else flag
        if flag and line.startswith("│ "):
            lines[flag] = " ".join([lines.get(flag, ""), line.strip("│ ")])
    for name, interval in flag_ranges(module.Args).items():
        text = lines[f"--{name.replace('_', '-')}"]
        assert f"; in {interval} (default: " in text, name
        # before the range: the flag, its type (e.g. FLOAT) and the docstring under its field, at least a word
        assert len(text.split("; in ")[0].split()) >= 3, (name, text)
    assert all(line.count("(default:") <= 1 for line in lines.values()), [x for x in lines.values() if "(default:" in x]


def check_tool_refused(process, *fragments):
    """A tool (python -m cleanba.X) refused before it started: exit 2, one line on stderr naming the fix."""
    assert process.returncode == 2, process.stderr
    (line,) = process.stderr.strip().splitlines()
    assert "error:" in line and "Traceback" not in process.stderr and process.stdout == "", process.stderr
    for fragment in fragments:
        assert fragment in line, (fragment, line)


@pytest.mark.needs_root("a mount namespace")
def test_gpu_compile_without_its_group_is_one_line(tmp_path):
    """python -m cleanba.gpu_compile after the CPU install: JAX's CUDA plugin and NVIDIA's wheels hidden in a mount
    namespace, as if never installed."""
    command = [sys.executable, "-m", "cleanba.gpu_compile", "--script", "ppo", "--", "--env-id", "CartPole-v1"]
    process = subprocess.run(
        in_mount_namespace(command, tmp_path), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120
    )
    check_tool_refused(process, "JAX's CUDA plugin and ptxas", "`poetry install --compile --with gpu-compile`")


def test_evaluate_upload_without_a_hub_login_is_one_line(tmp_path):
    model = tmp_path / "trained.cleanba_model"
    model.write_bytes(b"")  # refused before it is read
    env = script_env(env={"HF_TOKEN": "", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    command = [sys.executable, "-m", "cleanba.evaluate", str(model), "--upload-model"]
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    check_tool_refused(process, "--upload-model needs a Hugging Face token", "hf auth login")


IMPALA_MODEL = ROOT / "docs" / "runs" / "breakout-impala-cpu" / "cleanba_impala.cleanba_model"
NOT_MODELS = {  # what the file holds -> what the refusal says of it
    "empty": (lambda: b"", "is not a Cleanba model or checkpoint"),
    "truncated": (lambda: IMPALA_MODEL.read_bytes()[:1000], "is not a Cleanba model or checkpoint"),
    "another format": (lambda: b"PK\x03\x04 a zip archive", "is not a Cleanba model or checkpoint"),
    "msgpack without args": (lambda: b"\x81\xa1a\x01", "is not a Cleanba model or checkpoint (KeyError: 'args')"),
    "another script's params": (IMPALA_MODEL.read_bytes, "'s params do not fit cleanba_pqn.py's network"),
}


@pytest.mark.parametrize("case", list(NOT_MODELS))
def test_a_file_that_is_not_a_model_is_refused(case, tmp_path):
    """The evaluation CLI given a model file that is not one, or a model whose params the named script's network does
    not take: exit 2, one line naming the file, no traceback."""
    content, fragment = NOT_MODELS[case]
    model = tmp_path / "given.cleanba_model"
    model.write_bytes(content())
    command = [sys.executable, "-m", "cleanba.evaluate", str(model), "--script", str(SCRIPTS["pqn"])]
    process = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
    check_refused(process, str(model), fragment)
    assert [line for line in process.stderr.splitlines() if "error" in line] == process.stderr.splitlines()[-1:]


def test_a_checkpoint_that_is_not_one_is_refused_and_kept(tmp_path):
    """--resume of a run whose checkpoint is cut short: exit 2 in one line naming it, and the file left as it was."""
    checkpoint = tmp_path / "runs" / "cut" / "checkpoint.msgpack"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(IMPALA_MODEL.read_bytes()[:5000])
    process = run_script("pqn", [*TINY["pqn"], "--resume", "--run-name", "cut"], tmp_path, timeout=120)
    path = checkpoint.relative_to(tmp_path)
    check_refused(
        process, f"--resume: {path} is not a Cleanba model or checkpoint", "move it away to start the run over"
    )
    assert checkpoint.read_bytes() == IMPALA_MODEL.read_bytes()[:5000]
