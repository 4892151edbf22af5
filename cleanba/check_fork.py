"""Does a fork keep Cleanba's promises? One command, about a minute on a 2-core CPU:

    python -m cleanba.check_fork cleanba/my_ppo.py
    python -m cleanba.check_fork cleanba/my_impala.py --env-id Breakout-v5 -- --channels 4 4 4

Six checks, each reported in one line (PASS, FAIL and why, or SKIP), exit 0 only when all pass:
  engine   the ENGINE blocks are the stock script's, byte for byte (else the differing lines follow, indented)
  network  the network's contract for the env's spaces: apply(params, obs) -> policy (batch, width), values (batch,)
  layouts  two --exact runs, the learner on a0-l0 and on a0-l1,2, log the same values at every iteration, bit for
           bit (every scalar but the timings), and end with the same params
  threads  the same for 2 actor threads of 4 envs against 1 thread of 8
  lag      the lag the runs log is the one their concurrency flag asks for: 0 without --concurrency, and with it 1
           from the second iteration on (the first rollout is played with the initial params, update 0's)
  resume   a run resumed from the checkpoint of its 2nd iteration logs the straight run's values from there on and
           ends with its params, bit for bit, on envs whose state is their last observation (EnvPool's cannot be
           saved, so real envs restart from a reset at a resume: docs/faults.md)
The runs are tiny (the fork's stock script's sizes, 4 iterations) and use 4 forced host CPU devices each, whatever
the machine has, so that every run's XLA:CPU sums alike (tests/test_exact.py says why). Flags after `--` go to every
run, after check_fork's own; a fork whose flags differ from its stock script's says what to pass there. The runs'
directories are kept, and named, when a check fails, or always with --work-dir."""

import difflib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from cleanba.startup import hide_cuda_plugin

if __name__ == "__main__":  # the command, not a module imported by a test
    hide_cuda_plugin()  # before anything imports JAX: no CUDA plugin noise where the machine has no GPU

import numpy as np
import tyro

from cleanba import flags
from cleanba.family import SCRIPTS as STOCK  # the stock scripts a fork is compared with

MARKER = re.compile(r"^[ \t]*# ======== (ENGINE|ALGORITHM):", re.M)  # each block's first line
ITERATIONS, CHECKPOINT_AT, DEVICES = 4, 2, 4
SIZES = {  # the stock scripts' tiny sizes: flags, env steps per env and rollout
    "ppo": (["--hidden-dim", "16", "--num-minibatches", "2", "--update-epochs", "2"], 64),
    "impala": (["--hidden-dim", "16", "--num-minibatches", "2"], 8),
    "ppo_continuous": (["--hidden-dim", "16", "--num-minibatches", "2", "--update-epochs", "2"], 64),
    "pqn": (["--mlp-widths", "16", "16", "--num-minibatches", "2", "--update-epochs", "2"], 64),
    "sac": (
        ["--hidden-dim", "16", "--learning-starts", "0", "--updates-per-step", "0.125", "--buffer-size", "4096"],
        64,
    ),
}
DEFAULT_ENVS = {"Discrete": "CartPole-v1", "Box": "Pendulum-v1"}  # classic control: no ROMs, no physics engine
SMALL_CNN = (["--channels", "4", "4", "4"], 8)  # image observations: the ResNet at its narrowest, short rollouts
CHECKS = ("engine", "network", "layouts", "threads", "lag", "resume")
LAYOUTS = {"a0-l0": [], "a0-l1,2": ["--actor-device-ids", "0", "--learner-device-ids", "1", "2"]}
TWO_THREADS = ["--num-actor-threads", "2", "--local-num-envs", "4"]
TIMING = re.compile(r"(^charts/SPS$|_time$|_wait$)")  # wall-clock figures: never the same twice

# A training script run on envs whose observations never change (a fixed one per env, drawn from the real env's
# space) and whose episodes never end, the reward 1 when an env's action (a Box action's first value above 0.5) is
# its env id mod 2: nothing an env shows depends on its past, so a resumed run sees what the straight run saw,
# although EnvPool's envs restart from a reset. Each checkpoint is also kept as checkpoint.msgpack.<iteration>.
MEMORYLESS_ENVPOOL = """
import runpy, shutil, sys, envpool
import numpy as np
from cleanba import checkpoint
def fixed(space, rng, n):
    if hasattr(space, "spaces"):  # a Dict observation
        return {key: fixed(value, rng, n) for key, value in space.spaces.items()}
    return rng.uniform(-1, 1, (n, *space.shape)).astype(space.dtype)
def copy(obs):
    return {key: copy(value) for key, value in obs.items()} if isinstance(obs, dict) else obs.copy()
class MemorylessEnv:
    def __init__(self, task_id, num_envs, seed, **kwargs):
        self.obs = fixed(envpool.make_spec(task_id, **kwargs).observation_space, np.random.default_rng(seed), num_envs)
        self.env_ids = np.arange(num_envs, dtype=np.int32)
        self.actions = None
    def async_reset(self):
        self.actions = None
    def send(self, actions, env_ids):
        self.actions = np.asarray(actions)
    def recv(self):
        n = len(self.env_ids)
        first = None if self.actions is None else self.actions.reshape(n, -1)[:, 0] > 0.5
        rewards = np.zeros(n, np.float32) if first is None else first == self.env_ids % 2
        done = np.zeros(n, bool)
        return copy(self.obs), rewards.astype(np.float32), done, done, {"env_id": self.env_ids}
    def close(self):
        pass
envpool.make = lambda task_id, env_type, num_envs, batch_size, seed, **kwargs: MemorylessEnv(
    task_id, num_envs, seed, **kwargs
)
save = checkpoint.save_run_checkpoint
def save_and_keep(run):
    written = save(run)
    if written:
        path = checkpoint.checkpoint_path(run.run_dir)
        shutil.copyfile(path, f"{path}.{run.iterations_done}")
    return written
checkpoint.save_run_checkpoint = save_and_keep
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class Args:
    fork: tyro.conf.Positional[Path]
    """the forked training script (a copy of one of cleanba/'s training scripts, cleanba_ppo.py, ...)"""
    env_id: str | None = None
    """the env of the runs (default: CartPole-v1 for a discrete-action fork, Pendulum-v1 for a continuous one)"""
    work_dir: Path | None = None
    """keep the runs' directories here (default: a temporary folder, kept and named only if a check fails)"""
    checks: tuple[str, ...] = CHECKS
    """the checks to run (engine and network alone take seconds)"""


fail = partial(flags.fail, program="check_fork")


def split(text: str) -> tuple:
    """(the algorithm, the engine) of a training script's text: the engine is its ENGINE blocks, each from its
    marker line to the next ALGORITHM marker or the end; the algorithm is the rest after the module docstring."""
    marks = list(MARKER.finditer(text))
    if not any(mark.group(1) == "ENGINE" for mark in marks):
        return None, None
    docstring_end = text.index('"""', text.index('"""') + 3) + 3 if text.lstrip().startswith('"""') else 0
    blocks = {"ALGORITHM": [text[docstring_end : marks[0].start()]], "ENGINE": []}
    for mark, end in zip(marks, [*(m.start() for m in marks[1:]), len(text)]):
        blocks[mark.group(1)].append(text[mark.start() : end])
    return "".join(blocks["ALGORITHM"]), "".join(blocks["ENGINE"])


def closest_stock(algorithm: str) -> str:
    """The stock script whose algorithm the fork's is most like: its sizes and default env are the runs'."""

    def similarity(name: str) -> float:
        stock = split(STOCK[name].read_text())[0].splitlines()
        return difflib.SequenceMatcher(None, stock, algorithm.splitlines(), autojunk=False).ratio()

    return max(STOCK, key=similarity)


def check_engine(engine: str, base: str) -> tuple:
    stock = split(STOCK[base].read_text())[1]
    if engine == stock:
        return True, f"the ENGINE blocks are {STOCK[base].name}'s, byte for byte", []
    diff = list(difflib.unified_diff(stock.splitlines(), engine.splitlines(), STOCK[base].name, "fork", lineterm=""))
    changed = sum(line[:1] in "+-" and line[:3] not in ("+++", "---") for line in diff)
    return (
        False,
        f"{changed} lines of the ENGINE blocks differ from {STOCK[base].name}'s (keep the engine as is):",
        diff,
    )


def child_env(directory: Path | None = None) -> dict:
    """The runs' environment: DEVICES forced host CPU devices, appended to the user's XLA_FLAGS, and unless the user
    has one, a compilation cache in the work directory that the runs share (the same executables: the same bits)."""
    environment = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    if directory is not None:
        environment.setdefault("JAX_COMPILATION_CACHE_DIR", str(directory / "jax-compilation-cache"))
        environment.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    flags = environment.get("XLA_FLAGS", "")
    environment["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    return environment


CHILDREN = set()  # the child processes running now: a signal that stops check_fork stops them too
STOPPED = []  # the signal that stopped check_fork: no child starts after it


def run_child(command: list, cwd: Path | None = None, directory: Path | None = None) -> subprocess.CompletedProcess:
    if STOPPED:
        return subprocess.CompletedProcess(command, 128 + STOPPED[0], "", "stopped by a signal")
    process = subprocess.Popen(
        command, cwd=cwd, env=child_env(directory), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    CHILDREN.add(process)
    if STOPPED:  # the signal came while this one started
        process.terminate()
    try:
        stdout, stderr = process.communicate()
    finally:
        CHILDREN.discard(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stop_children(signum, frame):
    """SIGTERM or SIGINT: the runs stopped (each saves nothing: no --checkpoint-frequency but the resume's, whose
    checkpoints are written whole), then exit 128 + the signal's number."""
    STOPPED.append(signum)
    for process in list(CHILDREN):
        process.terminate()
    print(f"check_fork: stopped by signal {signum}; the runs are stopped", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def network_child(argv: list):
    """In a child process: the fork's flags parsed and checked as its own run does, then its network's contract from
    shapes alone (spaces.check_network, as every run checks it at start). Exit 2 with the refusal, or 0."""
    import envpool
    import jax
    import numpy as np

    from cleanba import spaces
    from cleanba.evaluate import load_script

    module = load_script(Path(argv[0]))
    args = tyro.cli(module.Args, args=argv[1:], prog=Path(argv[0]).name)
    module.check_args(args)
    spec = envpool.make_spec(args.env_id, **module.env_kwargs(args))
    obs_shape, obs_dtype = spaces.observation_field(spec.observation_space)
    agent = module.make_network(args, spec.action_space)
    params = jax.eval_shape(agent.init, jax.random.key(0), np.zeros((1, *obs_shape), obs_dtype))
    spaces.check_network(module, args, params)
    width = int(spaces.policy_width(module, spec.action_space))
    print(f"policy (batch, {width}) and values (batch,) for {args.env_id}'s {spec.action_space}")
    print(f"concurrency {args.concurrency}")  # the fork's default: the lag check runs it and its opposite


def check_network_contract(fork: Path, flags: list) -> tuple:
    """(passed, line, [], the fork's default --concurrency)."""
    process = run_child([sys.executable, "-m", "cleanba.check_fork", "--network-child", str(fork), *flags])
    if process.returncode == 0:
        contract, concurrency = process.stdout.strip().splitlines()[-2:]
        return True, contract, [], concurrency == "concurrency True"
    return False, last_line(process.stderr), [], None


@dataclass
class Run:
    name: str
    flags: list
    memoryless: bool = False
    process: subprocess.CompletedProcess | None = None
    scalars: dict | None = None  # {tag: float32 values}, timings left out

    def ok(self) -> bool:
        return self.process is not None and self.process.returncode == 0

    def digest(self) -> str | None:
        found = re.findall(r"rank 0: final params sha256 (\w+)", self.process.stdout) if self.ok() else []
        return found[-1] if found else None

    def failure(self, directory: Path) -> str:
        return f"the {self.name} run exited {self.process.returncode}: {last_line(self.process.stderr)} ({directory})"


def run_fork(fork: Path, run: Run, directory: Path, extra: list = ()) -> Run:
    """Train the fork in directory/<run name>; read what it logged."""
    cwd = directory / run.name
    cwd.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", MEMORYLESS_ENVPOOL] if run.memoryless else [sys.executable]
    run.process = run_child([*command, str(fork), *run.flags, *extra], cwd=cwd, directory=directory)
    if run.ok():
        run.scalars = logged_values(cwd)
    return run


def logged_values(directory: Path) -> dict:
    from cleanba.events import read_run

    (run_dir,) = (directory / "runs").iterdir()
    scalars = read_run(run_dir).scalars
    return {tag: frame.value.to_numpy(np.float32) for tag, frame in scalars.items() if not TIMING.search(tag)}


def same_values(a: Run, b: Run, first: int = 0) -> str | None:
    """None if both runs logged the same tags with the same values (b what a logged from its value `first` on, as a
    resumed run logs what follows its checkpoint), else what differs."""
    if a.scalars.keys() != b.scalars.keys():
        return f"the {a.name} run logged {sorted(a.scalars.keys() ^ b.scalars.keys())} and the {b.name} run did not"
    for tag in sorted(a.scalars):
        x, y = a.scalars[tag][first:], b.scalars[tag]
        if x.tobytes() != y.tobytes():
            where = next((i for i, (u, v) in enumerate(zip(x, y)) if u.tobytes() != v.tobytes()), min(len(x), len(y)))
            return f"{tag} differs at its logged value {first + where + 1}: {x.tolist()} vs {y.tolist()}"
    return None


def compare(a: Run, b: Run, what: str, directory: Path, first: int = 0) -> tuple:
    for run in (a, b):
        if not run.ok():
            return False, run.failure(directory / run.name), []
    difference = same_values(a, b, first)
    if difference is None and a.digest() == b.digest():
        count = len(a.scalars)
        return True, f"{what}: the same {count} logged values, bit for bit, and params sha256 {a.digest()}", []
    if difference is None:
        difference = f"final params sha256 {a.digest()} vs {b.digest()}"
    return False, f"{what} differ ({difference}): see docs/reproducibility.md", []


def lag_of(run: Run, directory: Path) -> tuple:
    if not run.ok():
        return None, run.failure(directory / run.name)
    lag = run.scalars["stats/learner_policy_version"] - run.scalars["stats/actor_policy_version"]
    return lag.astype(int).tolist(), None


def check_lag(runs: list, directory: Path) -> tuple:
    lines = []
    for run in runs:
        lag, failure = lag_of(run, directory)
        if failure:
            return False, failure, []
        concurrency = "--concurrency" in run.flags
        expected = [0] + [int(concurrency)] * (len(lag) - 1)
        flag = "--concurrency" if concurrency else "--no-concurrency"
        if lag != expected:
            return False, f"with {flag} the runs should log the lag {expected}, this one logged {lag}", []
        lines.append(f"{lag[-1]} with {flag}")
    return True, f"the logged lag is {' and '.join(lines)} (the first rollout: the initial params)", []


def common_flags(base: str, env_id: str, image: bool, argv: list) -> list:
    """Every run's flags: the stock script's tiny sizes, --exact, ITERATIONS iterations of 8 envs."""
    flags, steps = ([*SIZES[base][0], *SMALL_CNN[0]], SMALL_CNN[1]) if image else SIZES[base]
    if "--num-steps" in argv:  # the user's: the runs' length in iterations stays ITERATIONS
        steps = int(argv[len(argv) - argv[::-1].index("--num-steps")])
    common = [*flags, "--num-steps", str(steps), "--env-id", env_id, "--seed", "1", "--log-frequency", "1"]
    return [*common, "--total-timesteps", str(ITERATIONS * 8 * steps), "--exact", "--group-envs", "2"]


def the_runs(common: list, concurrency: bool, argv: list) -> dict:
    """The runs the checks compare, by name, with the fork's default --concurrency (the lag check's second run: the
    opposite); the user's flags (argv) after check_fork's own."""
    mode, flipped = ("--concurrency", "--no-concurrency")[:: 1 if concurrency else -1]
    resume = ["--num-actor-threads", "1", "--local-num-envs", "8", "--no-concurrency", "--run-name", "r"]
    return {
        "a0-l0": Run("a0-l0", [*common, *TWO_THREADS, mode, *argv]),
        "a0-l1,2": Run("a0-l1,2", [*common, *TWO_THREADS, mode, *LAYOUTS["a0-l1,2"], *argv]),
        "1 x 8": Run("1 x 8", [*common, "--num-actor-threads", "1", "--local-num-envs", "8", mode, *argv]),
        "flipped": Run("flipped", [*common, *TWO_THREADS, flipped, *argv]),
        "straight": Run(
            "straight", [*common, *resume, "--checkpoint-frequency", str(CHECKPOINT_AT), *argv], memoryless=True
        ),
    }


def resume_run(fork: Path, straight: Run, directory: Path) -> Run:
    """The straight run resumed from its CHECKPOINT_AT-th iteration's checkpoint, in the same directory."""
    resumed = Run("resumed", [*straight.flags, "--resume"], memoryless=True)
    if straight.ok():
        # A directory of its own, with the checkpoint only: what the resumed run logs is its own.
        saved, checkpoints = directory / straight.name / "runs" / "r", directory / resumed.name / "runs" / "r"
        checkpoints.mkdir(parents=True)
        shutil.copyfile(saved / f"checkpoint.msgpack.{CHECKPOINT_AT}", checkpoints / "checkpoint.msgpack")
        run_fork(fork, resumed, directory)
    return resumed


NEEDED = {"layouts": ["a0-l0", "a0-l1,2"], "threads": ["a0-l0", "1 x 8"], "lag": ["a0-l0", "flipped"]}


def run_checks(fork: Path, wanted: list, runs: dict, directory: Path) -> dict:
    """The checks that train: their runs, two at a time (each is mostly one core's work), then the comparisons."""
    names = sorted({name for check in wanted for name in NEEDED.get(check, ["straight"])}, key=list(runs).index)
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(names, pool.map(lambda name: run_fork(fork, runs[name], directory), names)))
    if "resume" in wanted:
        done["resumed"] = resume_run(fork, done["straight"], directory)
    checks = {
        "layouts": lambda: compare(done["a0-l0"], done["a0-l1,2"], "a0-l0 and a0-l1,2", directory),
        "threads": lambda: compare(done["a0-l0"], done["1 x 8"], "2 actor threads x 4 envs and 1 x 8", directory),
        "lag": lambda: check_lag([done["a0-l0"], done["flipped"]], directory),
        "resume": lambda: compare(
            done["straight"],
            done["resumed"],
            f"straight and resumed at iteration {CHECKPOINT_AT}",
            directory,
            first=CHECKPOINT_AT,
        ),
    }
    return {check: checks[check]() for check in wanted}


def main(args: Args, argv: list) -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_children)
    fork = args.fork.resolve()
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        fail(f"--checks {' '.join(unknown)}: not a check; choose among {' '.join(CHECKS)}")
    if not fork.is_file() or fork.suffix != ".py":
        fail(f"{args.fork} is not a Python file; give the path of a forked training script")
    algorithm, engine = split(fork.read_text())
    if engine is None:
        fail(f"{args.fork} has no '# ======== ENGINE:' block: it is not a fork of a Cleanba training script")
    base = closest_stock(algorithm)
    env_id = args.env_id or DEFAULT_ENVS["Box" if 'ACTION_SPACE = "Box"' in algorithm else "Discrete"]
    import envpool.entry  # every family's ids (the scripts register two)

    from cleanba import spaces

    with warnings.catch_warnings():  # gymnasium's, on the float64 bounds of some spaces
        warnings.simplefilter("ignore")
        image = len(spaces.observation_field(envpool.make_spec(env_id).observation_space)[0]) == 3
    print(f"check_fork {args.fork}: a fork of {STOCK[base].name}, on {env_id}", flush=True)

    results = {}
    if "engine" in args.checks:
        results["engine"] = check_engine(engine, base)
        report("engine", results["engine"])
    common = common_flags(base, env_id, image, argv)
    *network, concurrency = check_network_contract(fork, [*common, *TWO_THREADS, *argv])
    if "network" in args.checks:
        results["network"] = network
        report("network", network)
    directory = args.work_dir or Path(tempfile.mkdtemp(prefix="check_fork-"))
    wanted = [check for check in CHECKS[2:] if check in args.checks]
    if network[0]:
        for check, result in run_checks(fork, wanted, the_runs(common, concurrency, argv), directory).items():
            results[check] = result
            report(check, result)
    else:  # every run would stop at its start, on the same refusal
        for check in wanted:
            results[check] = None
            print(f"SKIP {check}: not run, the network check failed", flush=True)
    failed = [check for check, result in results.items() if not (result and result[0])]
    if not failed:
        print(f"all {len(results)} checks passed", flush=True)
        if args.work_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
        return 0
    print(f"{len(failed)} of {len(results)} checks did not pass ({', '.join(failed)}); the runs are in {directory}")
    return 1


def report(check: str, result: tuple):
    passed, line, details = result
    print(f"{'PASS' if passed else 'FAIL'} {check}: {line}", flush=True)
    for detail in details[:60]:
        print(f"    {detail}", flush=True)
    if len(details) > 60:
        print(f"    ... {len(details) - 60} more lines", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--network-child"]:
        network_child(sys.argv[2:])
        sys.exit(0)
    own, argv = (
        (sys.argv[1 : sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1 :])
        if "--" in sys.argv
        else (sys.argv[1:], [])
    )
    sys.exit(main(tyro.cli(Args, args=own, prog="python -m cleanba.check_fork", description=__doc__), argv))
