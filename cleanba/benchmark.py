"""Throughput benchmark of a Cleanba training script: how fast each side runs alone, and how well they overlap.

    python -m cleanba.benchmark --script ppo -- --env-id Breakout-v5 --num-actor-threads 1 --local-num-envs 8 \\
        --num-steps 32 --actor-device-ids 0 --learner-device-ids 0
    python -m cleanba.benchmark --script impala --reference-command "python other/impala.py --env-id Breakout-v5" \\
        -- --env-id Breakout-v5 --actor-device-ids 0 --learner-device-ids 1 2 3     # a GPU machine with 4 GPUs
    bash benchmark.sh throughput --actor-device-ids 0 --learner-device-ids 0      # PPO and IMPALA on Breakout-v5

Everything after `--` goes to the training script's own flags (its tyro Args), so every phase sizes envs, actor
threads, batches and devices exactly like a real single-process run of that command: `local_num_envs` envs per
actor thread, `num_actor_threads` threads per id of `--actor-device-ids`, the learner data-parallel over
`--learner-device-ids`. `--script` is ppo, impala, or the path of a fork that keeps the scripts' functions. On a
GPU pass the device ids as for training (a0-l0: actor and learner share GPU 0; a0-l1,2,3: actor on GPU 0);
on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices. The environment (XLA_FLAGS,
JAX_PLATFORMS, ...) is passed on to every phase unchanged.

Phases, each in a child process of its own, so that XLA state does not carry over from one to the next and
the peak host memory of each is measured alone (ru_maxrss of the child, from os.wait4):
    ceiling     EnvPool alone: one Python thread per actor thread, each stepping its own pool (same env
                config, envs and seeds as the actors) with random valid actions, no policy, no JAX
                computation. The fastest the actors could ever go on this machine.
    actor       the script's own actor threads (rollout_actor: policy inference, rollout storage, transfer to
                the learner devices), fed the initial params without waiting and drained at once: no learning.
                Also where an actor's time goes, from the script's own stats/actor_*_time (perf_counter sums per
                rollout): inference (dispatch), device_to_host (waits for the inference result), env_send,
                env_recv, storage (rollout and episode bookkeeping), host_to_device (put_on_learners).
    learner     the script's jitted update on synthetic rollouts of the real global size (random observations
                and actions, env ids as a real run assigns them), no envs.
                Before running it, XLA's own memory analysis of the compiled update and of one minibatch gradient
                step (update_minibatch on the batch the update hands it): what the learner allocates on its
                device besides params and rollouts. The update should need little more than one minibatch step,
                and --gradient-accumulation-steps should lower both.
    sync        the training script itself with --no-concurrency: actor and learner alternate.
    concurrent  the training script itself with --concurrency: they overlap, the actor one policy behind.
    reference   optional (--reference-command): any command, run in a shell in the current directory; its
                figure is the last "SPS <number>" it printed, its wall time and peak memory are reported too.
    layers      only when asked for (--phases layers): where the learner's compute goes. Every convolution of
                the script's network (each nn.Conv call, found while tracing its forward pass) timed alone on the
                first learner device at the learner's micro-batch (minibatch / gradient accumulation steps /
                learner devices, or --layer-batch): forward, input gradient (dx) and weight gradient (dk), each
                in ms and GFLOP/s; then the whole network's forward and gradient at that batch, the share of the
                gradient the convolutions account for, and a large float32 matmul's GFLOP/s on the same device as
                the practical peak to read them against. The first convolution's dx is left out of the sums: its
                input is the observation, and the learner never computes it. Last, one learner update (as in
                the learner phase) under JAX's profiler: the share of its time in each kind of XLA operation that
                the trace names (layout transposes, pooling, ...; XLA:CPU's Eigen convolutions mostly go unnamed).

An iteration is one rollout of num_steps steps of every env: batch_size env steps. Every phase runs
--warmup-iterations iterations first, which are not measured (compilation, first env resets), then --repeats
windows of --iterations iterations; each figure is the median over the windows (these machines are noisy, so
compare ratios measured in one run rather than absolute figures across runs). sync and concurrent train for
exactly warmup + repeats x iterations iterations (the benchmark sets --total-timesteps and --run-name, and runs
them in a temporary directory), and their figures come from the TensorBoard stats/ the script logs every
iteration, timed by the events' wall times.

Figures (one table row per phase; all of them, per window too, in the JSON file):
    SPS            env steps per second. ceiling, actor: steps of all actor threads together per second of a
                   window. learner: batch_size / median update time. sync, concurrent: batch_size x iterations of
                   a window / the wall time between the end of the window's first and last iterations.
    / ceiling      SPS over the ceiling's: the share of raw EnvPool speed that the phase keeps.
    compile s      actor: the first rollout's time minus the median rollout time (the policy's compilation).
                   learner: from the start of the ahead-of-time compile to the end of the first update, less
                   the median update time. sync, concurrent: the script's own stats/learner_compile_time (it
                   compiles the update ahead of time, so its first update waits for no compile).
    learner wait   sync, concurrent: median seconds per iteration the learner waited for rollouts
                   (stats/rollout_queue_wait; large: the actor is the bottleneck).
    actor wait     sync, concurrent: median seconds per iteration an actor waited for params plus to hand over
                   its rollout (stats/param_queue_wait + stats/actor_rollout_queue_wait; large: the learner is).
    cores          CPU seconds per wall second of the phase's process in a window: all its threads (actors,
                   learner, EnvPool's workers, XLA's pools), sampled every 50 ms. Next to the cores the machine
                   has (cpu_cores_available in the JSON) it says whether a phase is compute-bound: a ceiling
                   that keeps every core busy leaves no room for a policy on the same cores.
    host MiB       peak resident memory of the phase's process (with its JAX, EnvPool and, for sync and
                   concurrent, the whole training run).
    device MiB     the largest peak_bytes_in_use of the local devices (memory_stats(); GPUs). n/a on CPU.
Ratio lines:
    concurrent / sync      what overlapping buys.
    overlap efficiency     concurrent SPS / min(actor SPS, learner SPS): 1 means the overlap is perfect and
                           the run goes as fast as its slower side alone allows.
    sync efficiency        sync SPS / (1 / (1 / actor SPS + 1 / learner SPS)): the same for alternating sides.
    concurrent / serial bound
                           concurrent SPS over that same serial bound. Where the actor and the learner share
                           the same compute (one CPU, one GPU for both), the slower side alone is out of reach:
                           the other side's work takes cores from it. Then this ratio says what the overlap
                           gains over taking turns: at most 1 + (faster side's time per iteration / slower side's).
    ours / reference       concurrent SPS (sync SPS without a concurrent phase) over the reference's.
"""

import importlib.util
import itertools
import json
import os
import queue
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from cleanba.startup import hide_cuda_plugin

if __name__ == "__main__":  # the program, not a module imported by a test or a tool
    hide_cuda_plugin()  # before anything imports JAX: no CUDA plugin noise where the machine has no GPU

import numpy as np
import tyro

PHASES = ("ceiling", "actor", "learner", "layers", "sync", "concurrent")
THROUGHPUT_PHASES = ["ceiling", "actor", "learner", "sync", "concurrent"]  # the default: all but the layer profile
SCRIPTS = {"ppo": Path(__file__).with_name("cleanba_ppo.py"), "impala": Path(__file__).with_name("cleanba_impala.py")}
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
    "put_on_learners",
    "make_learner_update",
    "make_optimizer",
    "Rollout",
    "first_replica",
    "queue_get",
    "queue_put",
    "StopTraining",
    "learner_shards",
    "update_minibatch",
    "rollout_fields",
    "learner_rollout_shapes",
)
SPS_PATTERN = re.compile(r"SPS[^0-9]*([0-9][0-9,]*\.?[0-9]*)")
CHILD_FLAG = "--phase-child"  # internal: `--phase-child PHASE RESULT_FILE` runs one phase in this process


@dataclass
class BenchmarkArgs:
    script: str = "ppo"
    """ppo, impala, or the path of a training script with the same functions (a fork)"""
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


def fail(message: str):
    """Refuse bad input before any phase runs: exit status 2, no traceback."""
    print(f"benchmark: error: {message}", file=sys.stderr)
    sys.exit(2)


def split_argv(argv: list) -> tuple:
    """The benchmark's own flags, and the training script's (everything after the first `--`)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def parse_benchmark_args(argv: list) -> BenchmarkArgs:
    bench = tyro.cli(BenchmarkArgs, args=argv, prog="python -m cleanba.benchmark", description=__doc__)
    for name in ["repeats", "warmup_iterations", "iterations"]:
        if getattr(bench, name) <= 0:
            # At least one warm-up iteration: the first includes compilation, and windows start at its end.
            fail(f"--{name.replace('_', '-')}={getattr(bench, name)} must be positive")
    if bench.timeout <= 0:
        fail(f"--timeout={bench.timeout} must be positive")
    if bench.layer_batch is not None and bench.layer_batch <= 0:
        fail(f"--layer-batch={bench.layer_batch} must be positive")
    if not bench.phases and not bench.reference_command:
        fail("--phases is empty and there is no --reference-command: nothing to measure")
    return bench


def resolve_script(name: str) -> Path:
    path = SCRIPTS.get(name, Path(name))
    if not path.is_file() or path.suffix != ".py":
        fail(f"--script {name}: give ppo, impala or the path of a training script (.py); {path} is not a file")
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
            f"(a fork of cleanba/cleanba_ppo.py or cleanba_impala.py that keeps these names)"
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


def layout(args) -> str:
    return (
        f"a{','.join(map(str, args.actor_device_ids))}-l{','.join(map(str, args.learner_device_ids))}, "
        f"{args.num_actor_threads} actor thread(s) per actor device x {args.local_num_envs} envs"
    )


def median(values) -> float:
    return float(np.median(values))


def window_sps(boundaries: list, steps_per_window: int) -> list:
    """Env steps per second of consecutive windows; boundaries[j] is when window j starts (and j - 1 ends)."""
    return [steps_per_window / (end - start) for start, end in itertools.pairwise(boundaries)]


def window_boundaries(ends: list, bench: BenchmarkArgs) -> list:
    """ends[i]: when iteration i + 1 ended. Windows start at the end of the last warm-up iteration."""
    first = bench.warmup_iterations - 1
    return [ends[first + j * bench.iterations] for j in range(bench.repeats + 1)]


# ---------------------------------------------------------------------------------------------------------------
# Phases run in a child process: each returns a dict of figures.


def thread_slots(args) -> list:
    """(device index, thread_index) of every actor thread, numbered as main() numbers them (one process)."""
    return [
        (d, d * args.num_actor_threads + t)
        for d in range(len(args.actor_device_ids))
        for t in range(args.num_actor_threads)
    ]


def random_actor(
    module, args, thread_index: int, bench: BenchmarkArgs, barrier: threading.Barrier, stop: threading.Event
):
    """Steps one pool like an actor thread does (send, then recv), with random actions instead of a policy."""
    first_env = thread_index * args.local_num_envs
    envs = module.make_env(args, args.local_num_envs, seed=args.seed + first_env)  # the actor's seeds
    try:
        rng = np.random.default_rng([args.seed, thread_index])
        num_actions = envs.action_space.n
        envs.async_reset()
        *_, info = envs.recv()
        for iteration in range(total_iterations(bench)):
            if iteration >= bench.warmup_iterations and (iteration - bench.warmup_iterations) % bench.iterations == 0:
                barrier.wait()  # all threads start each window together
            if stop.is_set():
                raise module.StopTraining
            for _ in range(args.num_steps):
                envs.send(rng.integers(num_actions, size=args.local_num_envs, dtype=np.int32), info["env_id"])
                *_, info = envs.recv()
        barrier.wait()  # the end of the last window
    except BaseException:
        barrier.abort()  # free the threads waiting for this one
        raise
    finally:
        envs.close()


def first_error(errors: list):
    """The error that stopped a phase, not the BrokenBarrierErrors it caused in the other threads."""
    return next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])


def join_all(threads: list):
    for thread in threads:
        thread.join(timeout=30)
    if any(thread.is_alive() for thread in threads):
        print("warning: a thread did not stop within 30 s", file=sys.stderr)


def ceiling_phase(module, args, bench: BenchmarkArgs) -> dict:
    starts = []  # barrier j releases when every thread has finished window j - 1
    barrier = threading.Barrier(len(thread_slots(args)), action=lambda: starts.append(time.time()))
    from cleanba.plumbing import stops_run_on_error

    stop = module.Stop()
    threads = [
        threading.Thread(
            target=stops_run_on_error(random_actor),
            daemon=True,
            name=f"env-{thread_index}",
            args=(module, args, thread_index, bench, barrier, stop),
        )
        for _, thread_index in thread_slots(args)
    ]
    for thread in threads:
        thread.start()
    join_all(threads)
    if stop.errors:
        raise first_error(stop.errors)
    windows = window_sps(starts, args.batch_size * bench.iterations)
    return dict(sps=median(windows), window_sps=windows, window_bounds=starts)


def build_model(module, args, shapes_only: bool = False):
    """Devices, mesh, agent, initial train state and keys exactly as main() builds them for one process. shapes_only:
    the state as shapes on the learner devices (jax.eval_shape), for compiling only: nothing is initialized or
    compiled for it (the initializers' program alone compiles in about 14 s of CPU at the default Atari sizes)."""
    import envpool
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cleanba.plumbing import check_devices

    check_devices(args)
    local_devices = jax.local_devices()
    learner_devices = [local_devices[i] for i in args.learner_device_ids]
    mesh = Mesh(np.array(learner_devices), ("learner",))
    spec = envpool.make_spec(args.env_id, **module.env_kwargs(args))
    if shapes_only:
        agent = module.make_network(args, spec.action_space.n, mesh.devices.flat[0].platform)
        _, action_key, shuffle_key = jax.random.split(jax.random.key(args.seed), 3)  # as make_agent splits them
        shapes = jax.eval_shape(lambda: module.make_agent(args, spec, mesh)[1])
        replicated = NamedSharding(mesh, P())
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), shapes)
    else:
        agent, state, action_key, shuffle_key = module.make_agent(args, spec, mesh)
    return dict(
        actor_devices=[local_devices[i] for i in args.actor_device_ids],
        learner_devices=learner_devices,
        mesh=mesh,
        spec=spec,
        agent=agent,
        state=state,
        action_key=action_key,
        shuffle_key=shuffle_key,
    )


def feed_params(module, param_queue, params, stop):
    """Keeps an actor's param queue full, as a learner that is never late would (versions increasing)."""
    version = 0
    while True:
        version += 1
        module.queue_put(param_queue, (version, params), stop)


def actor_phase(module, args, bench: BenchmarkArgs) -> dict:
    import jax

    from cleanba.plumbing import stops_run_on_error

    model = build_model(module, args)
    params = module.first_replica(model["state"].params)  # where main() hands params over
    policy = module.make_policy(args, model["agent"], model["action_key"])
    slots = thread_slots(args)
    param_queues = [queue.Queue(maxsize=1) for _ in slots]
    rollout_queues = [queue.Queue(maxsize=1) for _ in slots]
    stop, threads = module.Stop(), []
    for slot, (d, thread_index) in enumerate(slots):
        threads.append(
            threading.Thread(
                target=module.rollout_actor,
                daemon=True,
                name=f"actor-{thread_index}",
                args=(
                    args,
                    1,
                    thread_index,
                    model["actor_devices"][d],
                    model["mesh"],
                    policy,
                    param_queues[slot],
                    rollout_queues[slot],
                    stop,
                ),
            )
        )
        threads.append(
            threading.Thread(
                target=stops_run_on_error(feed_params),
                daemon=True,
                name=f"feeder-{thread_index}",
                args=(module, param_queues[slot], params, stop),
            )
        )
    ends, rollout_times, timings = [], [], []
    try:
        for thread in threads:
            thread.start()
        for _ in range(args.num_iterations):  # drain as a learner with instant updates would
            items = [module.queue_get(q, stop) for q in rollout_queues]
            jax.block_until_ready([rollout for rollout, _ in items])
            ends.append(time.time())
            rollout_times.append(median([info.rollout_time for _, info in items]))
            timings.append({name: median([info.timings[name] for _, info in items]) for name in items[0][1].timings})
    except module.StopTraining:
        pass  # an actor failed: raised below
    finally:
        stop.set()
        join_all(threads)
    if stop.errors:
        raise stop.errors[0]
    bounds = window_boundaries(ends, bench)
    windows = window_sps(bounds, args.batch_size * bench.iterations)
    rollout_time = median(rollout_times[bench.warmup_iterations :])
    measured = timings[bench.warmup_iterations :]
    return dict(
        sps=median(windows),
        window_sps=windows,
        window_bounds=bounds,
        rollout_time_s=rollout_time,
        compile_s=rollout_times[0] - rollout_time,
        actor_timings_s={name: median([t[name] for t in measured]) for name in measured[0]},
    )


def synthetic_rollout(module, args, spec, thread_index: int, rng: np.random.Generator):
    """One actor thread's rollout with the real shapes and dtypes: random obs and actions, few episode ends."""
    T, n, shape = args.num_steps, args.local_num_envs, spec.observation_space.shape
    dtype = spec.observation_space.dtype
    if np.issubdtype(dtype, np.integer):
        obs = rng.integers(0, 256, size=(T + 1, n, *shape)).astype(dtype)
    else:
        obs = rng.standard_normal((T + 1, n, *shape)).astype(dtype)
    num_actions = spec.action_space.n
    first_env = thread_index * args.local_num_envs  # as rollout_actor numbers its envs
    return module.Rollout(
        obs=obs,
        actions=rng.integers(num_actions, size=(T, n)).astype(np.int32),
        logprobs=np.full((T, n), -np.log(num_actions), np.float32) + rng.normal(0, 0.1, (T, n)).astype(np.float32),
        rewards=rng.choice(np.array([-1, 0, 1], np.float32), size=(T, n), p=[0.05, 0.9, 0.05]),
        terminations=rng.random((T, n)) < 0.01,
        truncations=rng.random((T, n)) < 0.001,
        valid=np.ones((T, n), bool),
        env_ids=np.arange(first_env, first_env + n, dtype=np.int32)[None],
    )


def learner_rollouts(module, args, model) -> tuple:
    """One iteration's synthetic rollouts, one per actor thread, on the learner devices as the learner gets them."""
    rng = np.random.default_rng(args.seed)
    return tuple(
        module.put_on_learners(
            args,
            synthetic_rollout(module, args, model["spec"], thread_index, rng),
            model["mesh"],
        )
        for _, thread_index in thread_slots(args)
    )


def rollout_structs(module, args, model) -> tuple:
    """One iteration's rollouts as the learner receives them (padded and sharded over the learner devices), as
    shapes and dtypes only: for compiling at sizes that would not fit in this machine's memory or time."""
    space = model["spec"].observation_space
    fields = module.rollout_fields(args, space.shape, space.dtype)
    shapes = module.learner_rollout_shapes(args, fields, model["mesh"])
    return (shapes,) * len(thread_slots(args))


def compile_learner(
    module, args, model, rollouts: tuple, compiler_options: dict | None = None, minibatch_step: bool = True
):
    """The script's learner update compiled for rollouts (arrays or ShapeDtypeStructs), and XLA's own memory
    analysis of it and, with minibatch_step (a second compile), of one minibatch gradient step (update_minibatch on
    the batch shapes that the update hands it, recorded while tracing). Nothing runs: the figures are what XLA plans
    to allocate on the learner device. compiler_options: XLA options for both compiles (jax's Lowered.compile), such
    as the tests' LLVM optimization level, which leaves XLA's buffer assignment, hence these figures, as they are."""
    import jax
    from jax.sharding import PartitionSpec as P

    recorded, original = [], module.update_minibatch

    def recording(agent, args, state, batch, groups):
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), (batch, groups.columns, groups.keys))
        recorded.append((shapes, groups))
        return original(agent, args, state, batch, groups)

    update = module.make_learner_update(model["agent"], args, model["shuffle_key"], model["mesh"], len(rollouts))
    module.update_minibatch = recording
    try:
        compiled = update.lower(model["state"], rollouts).compile(compiler_options)
    finally:
        module.update_minibatch = original
    analysis = compiled.memory_analysis()
    mib = 1 / 2**20
    memory = dict(
        update_temp_mib=analysis.temp_size_in_bytes * mib,
        update_argument_mib=analysis.argument_size_in_bytes * mib,
        update_output_mib=analysis.output_size_in_bytes * mib,
    )
    if not minibatch_step:
        return compiled, memory
    # update_minibatch's batch and groups are per device, every array (groups, ...): the global ones have groups x
    # devices. The groups' static fields (exact, micro-batches) are those recorded.
    shapes, groups = recorded[0]
    sharding = jax.sharding.NamedSharding(model["mesh"], P("learner"))
    batch, columns, keys = jax.tree.map(
        lambda sd: jax.ShapeDtypeStruct((sd[0][0] * model["mesh"].size, *sd[0][1:]), sd[1], sharding=sharding),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple),
    )

    def minibatch_step(state, batch, columns, keys):
        return original(model["agent"], args, state, batch, groups._replace(columns=columns, keys=keys))

    step = jax.jit(
        jax.shard_map(
            minibatch_step,
            mesh=model["mesh"],
            in_specs=(P(), P("learner"), P("learner"), P("learner")),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    step_analysis = step.lower(model["state"], batch, columns, keys).compile(compiler_options).memory_analysis()
    memory["minibatch_step_temp_mib"] = step_analysis.temp_size_in_bytes * mib
    memory["update_over_minibatch_step"] = memory["update_temp_mib"] / memory["minibatch_step_temp_mib"]
    return compiled, memory


def learner_memory(module, args, compiler_options: dict | None = None, minibatch_step: bool = True) -> dict:
    """compile_learner's memory figures from shapes only, for args already checked and sized."""
    model = build_model(module, args, shapes_only=True)
    structs = rollout_structs(module, args, model)
    return compile_learner(module, args, model, structs, compiler_options, minibatch_step)[1]


def learner_phase(module, args, bench: BenchmarkArgs) -> dict:
    import jax

    model = build_model(module, args)
    state = model["state"]
    rollouts = learner_rollouts(module, args, model)
    start = time.time()
    learner_update, memory = compile_learner(module, args, model, rollouts)
    ends = []
    for _ in range(args.num_iterations):
        state, _ = learner_update(state, rollouts)
        jax.block_until_ready(state)
        ends.append(time.time())
    bounds = window_boundaries(ends, bench)
    windows = window_sps(bounds, args.batch_size * bench.iterations)
    update_time = args.batch_size / median(windows)
    return dict(
        sps=median(windows),
        window_sps=windows,
        window_bounds=bounds,
        update_time_s=update_time,
        updates_per_s=1 / update_time,
        compile_s=ends[0] - start - update_time,
        learner_memory=memory,
    )


def timed(function, *args, repeats: int) -> float:
    """Median seconds of `repeats` calls of a jitted function, after one call that compiles it."""
    import jax

    jax.block_until_ready(function(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return median(times)


def network_convolutions(agent, params, obs) -> list:
    """(path, nn.Conv module, input shape) of every convolution the network applies to obs, in call order: the
    calls are intercepted while the forward pass is traced for shapes only (nothing runs)."""
    import flax.linen as nn
    import jax

    found = []

    def record(call, args, kwargs, context):
        conv = context.module
        if isinstance(conv, nn.Conv) and context.method_name == "__call__":
            found.append(("/".join(conv.scope.path), conv.clone(parent=None), args[0].shape))
        return call(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(agent.apply, params, obs)
    return found


def conv_timings(conv, input_shape: tuple, repeats: int) -> dict:
    """Forward, input gradient and weight gradient (kernel and bias) of one convolution, alone, in seconds."""
    import jax

    x = jax.random.normal(jax.random.PRNGKey(0), input_shape)
    params = conv.init(jax.random.PRNGKey(1), x)
    y = conv.apply(params, x)
    dy = jax.random.normal(jax.random.PRNGKey(2), y.shape)
    forward = jax.jit(conv.apply)
    dx = jax.jit(lambda params, x, dy: jax.vjp(lambda x: conv.apply(params, x), x)[1](dy)[0])
    dk = jax.jit(lambda params, x, dy: jax.vjp(lambda params: conv.apply(params, x), params)[1](dy)[0])
    kernel = params["params"]["kernel"]  # (kh, kw, in / groups, out): each output takes kh x kw x in MACs
    flops = 2 * y.size * int(np.prod(kernel.shape[:3]))
    return dict(
        output_shape=list(y.shape),
        gflop=flops / 1e9,
        forward_s=timed(forward, params, x, repeats=repeats),
        dx_s=timed(dx, params, x, dy, repeats=repeats),
        dk_s=timed(dk, params, x, dy, repeats=repeats),
    )


def layers_phase(module, args, bench: BenchmarkArgs) -> dict:
    import jax
    import jax.numpy as jnp

    model = build_model(module, args)
    devices = len(model["learner_devices"]) * args.world_size
    batch = bench.layer_batch or max(1, args.minibatch_size // (args.gradient_accumulation_steps * devices))
    space = model["spec"].observation_space
    agent, params = model["agent"], module.first_replica(model["state"]).params
    repeats = bench.repeats * bench.iterations
    with jax.default_device(model["learner_devices"][0]):
        obs = jax.ShapeDtypeStruct((batch, *space.shape), space.dtype)
        groups = {}  # convolutions of one shape (features, kernel, strides, padding, input) are timed once
        for path, conv, input_shape in network_convolutions(agent, params, obs):
            kind = (conv.features, tuple(conv.kernel_size), str(conv.strides), str(conv.padding), tuple(input_shape))
            groups.setdefault(kind, [[], conv])[0].append(path)
        layers = []
        for index, (kind, (paths, conv)) in enumerate(groups.items()):
            input_shape = kind[-1]
            timings = conv_timings(conv, input_shape, repeats)
            if index == 0 and len(paths) == 1:
                timings["dx_s"] = None  # the observation's gradient: the learner never computes it
            layers.append(dict(paths=paths, count=len(paths), input_shape=list(input_shape), **timings))
        rng = np.random.default_rng(args.seed)
        if np.issubdtype(space.dtype, np.integer):
            observations = jnp.asarray(rng.integers(0, 256, size=obs.shape).astype(space.dtype))
        else:
            observations = jnp.asarray(rng.standard_normal(obs.shape).astype(space.dtype))

        def loss(params, observations):
            return sum(jnp.sum(jnp.square(output)) for output in jax.tree.leaves(agent.apply(params, observations)))

        forward_s = timed(jax.jit(agent.apply), params, observations, repeats=repeats)
        gradient_s = timed(jax.jit(jax.grad(loss)), params, observations, repeats=repeats)
        size = 2048
        matrix = jax.random.normal(jax.random.PRNGKey(3), (size, size))
        matmul_s = timed(jax.jit(jnp.dot), matrix, matrix, repeats=repeats)
    return dict(
        batch=batch,
        platform=model["learner_devices"][0].platform,
        layers=layers,
        network_forward_s=forward_s,
        network_gradient_s=gradient_s,
        matmul_gflops=2 * size**3 / matmul_s / 1e9,
        **traced_update(module, args, model),
    )


def traced_update(module, args, model) -> dict:
    """One learner update (synthetic rollouts, as in the learner phase) under JAX's profiler: the update's wall time
    and the time of the XLA operations the trace names, summed by kind (the fusion's name without its number:
    transpose_copy_fusion, ...). XLA:CPU names each operation it runs in the trace only with the flag
    --xla_cpu_enable_xprof_traceme=true, which the benchmark adds to this phase's XLA_FLAGS; convolutions that
    Eigen runs on its own threads mostly appear under no name."""
    import gzip
    import re

    import jax

    rollouts = learner_rollouts(module, args, model)
    update = compile_learner(module, args, model, rollouts, minibatch_step=False)[0]
    state = model["state"]
    state, _ = update(state, rollouts)  # the first call allocates what later ones reuse
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            start = time.perf_counter()
            jax.block_until_ready(update(state, rollouts))
            update_s = time.perf_counter() - start
        with gzip.open(next(Path(directory).rglob("*.trace.json.gz"))) as file:
            trace = json.load(file)
    kinds = {}
    for event in trace["traceEvents"] if isinstance(trace, dict) else trace:
        name = event.get("name", "")
        if event.get("ph") == "X" and ("fusion" in name or name.split(".")[0] in XLA_OPERATIONS):
            kind = re.sub(r"\.\d+$", "", name)
            kinds[kind] = kinds.get(kind, 0.0) + event["dur"] / 1e6
    return dict(traced_update_s=update_s, traced_operations_s=dict(sorted(kinds.items(), key=lambda kv: -kv[1])))


# Unfused XLA operations that the trace names as they are (fusions all have "fusion" in their name); not while or
# call, whose events would span the operations inside them.
XLA_OPERATIONS = (
    "convolution",
    "conv_general_dilated",
    "dot",
    "dot_general",
    "copy",
    "transpose",
    "all-reduce",
    "reduce",
    "scatter",
    "gather",
    "sort",
)


def training_phase(script: Path, flags: list) -> dict:
    """The script run as `python script flags` would run it, in this process (so that its devices can be read)."""
    sys.argv = [str(script), *flags]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")  # its sys.exit on failure ends this child with that status
    return {}


def device_peak_mib() -> dict | None:
    """{device id: peak MiB} where the platform reports memory (GPUs); None on CPU."""
    import jax

    peaks = {}
    for device in jax.local_devices():
        stats = device.memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            peaks[str(device.id)] = stats["peak_bytes_in_use"] / 2**20
    return peaks or None


def plan(module, args, bench: BenchmarkArgs) -> dict:
    """The checked and sized settings, for the parent (which imports neither JAX nor the script)."""
    return dict(
        env_id=args.env_id,
        layout=layout(args),
        batch_size=args.batch_size,
        num_envs=args.num_envs,
        num_steps=args.num_steps,
        num_iterations=args.num_iterations,
        total_timesteps=args.total_timesteps,
        script_args=json.loads(json.dumps(asdict(args), default=str)),
    )


def sample_cpu(samples: list, stop: threading.Event):
    """(wall time, CPU seconds of this process: all its threads, EnvPool's and XLA's too) every 50 ms."""
    while True:
        samples.append((time.time(), time.process_time()))
        if stop.wait(0.05):
            return


def child_main(phase: str, result_path: Path, argv: list):
    own, flags = split_argv(argv)
    bench = parse_benchmark_args(own)
    script = resolve_script(bench.script)
    samples, stop_sampling = [], threading.Event()
    threading.Thread(target=sample_cpu, args=(samples, stop_sampling), daemon=True, name="cpu-sampler").start()
    if phase in ("sync", "concurrent"):
        result = training_phase(script, flags)  # flags already hold the benchmark's run settings
    else:
        module = load_script(script)
        args = parse_script_args(module, flags, total_iterations(bench))
        phase_function = {
            "plan": plan,
            "ceiling": ceiling_phase,
            "actor": actor_phase,
            "learner": learner_phase,
            "layers": layers_phase,
        }
        result = phase_function[phase](module, args, bench)
    stop_sampling.set()
    samples.append((time.time(), time.process_time()))
    if phase != "plan":
        result["cpu_samples"] = samples
        # The ceiling uses no device: reading memory stats would start a JAX backend (and take GPU memory).
        result["device_peak_mib"] = None if phase == "ceiling" else device_peak_mib()
    result_path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# The parent: runs each phase as a child, reads what it measured, prints and writes the figures. It imports
# neither JAX nor the script: a child's ru_maxrss starts from the RSS of the process it was forked from.


def child_env() -> dict:
    """The parent's environment, with this checkout importable by `python -m cleanba.benchmark` from any cwd."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def kill_group(pid: int):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_measured(
    command, cwd: Path, log_path: Path, timeout: float, shell: bool = False, xla_flags: list = ()
) -> tuple:
    """Runs a command in its own process group, output to log_path; returns (exit status, wall s, peak RSS MiB).
    os.wait4 gives the child's ru_maxrss, which includes the descendants it waited for (e.g. a shell's command).
    xla_flags: appended to the command's XLA_FLAGS."""
    env = child_env()
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *xla_flags]).strip()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, shell=shell, start_new_session=True
        )
    timer = threading.Timer(timeout, kill_group, (process.pid,))
    timer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    except BaseException:  # e.g. Ctrl-C: the child is in its own session and did not get it
        kill_group(process.pid)
        raise
    finally:
        timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    kill_group(process.pid)  # threads or daemons the command may have left behind
    return process.returncode, time.perf_counter() - start, usage.ru_maxrss / 1024  # KiB on Linux


def report_failure(what: str, status: int, log_path: Path, timeout: float):
    print(flush=True)  # end the progress line
    output = log_path.read_text(errors="replace")
    print(f"--- output of {what}\n{output[-20000:]}--- end of output", file=sys.stderr)
    reason = f"was killed after --timeout={timeout:g} s" if status == -signal.SIGKILL else f"exited with {status}"
    print(f"benchmark: {what} {reason}; output above, files in {log_path.parent}", file=sys.stderr)
    # A refusal of the script's flags (exit 2, e.g. a device id this machine lacks) is bad input here too.
    sys.exit(2 if status == 2 else 1)


def child_command(phase: str, result_path: Path, own: list, script: Path, flags: list) -> list:
    # The script's absolute path last (tyro keeps the last value): children run in other directories.
    return [
        sys.executable,
        "-m",
        "cleanba.benchmark",
        CHILD_FLAG,
        phase,
        str(result_path),
        *own,
        "--script",
        str(script),
        "--",
        *flags,
    ]


def plan_run(own: list, script: Path, flags: list, workdir: Path) -> dict:
    """Checks the script and its flags in a child; its refusals (exit 2) go straight to the user."""
    result_path = workdir / "plan.json"
    process = subprocess.run(child_command("plan", result_path, own, script, flags), env=child_env())
    if process.returncode or not result_path.exists():  # refused, or the script's --help was asked for
        shutil.rmtree(workdir)
        sys.exit(process.returncode)
    return json.loads(result_path.read_text())


def run_phase(phase: str, own: list, script: Path, flags: list, workdir: Path, timeout: float) -> dict:
    directory = workdir / phase
    directory.mkdir()
    result_path = directory / "result.json"
    command = child_command(phase, result_path, own, script, flags)
    # The layers phase's trace names XLA:CPU's operations only with this flag (read when JAX starts its backend).
    trace_flag = ["--xla_cpu_enable_xprof_traceme=true"] if phase == "layers" else []
    status, wall, rss = run_measured(command, directory, directory / "output.log", timeout, xla_flags=trace_flag)
    if status != 0:
        report_failure(f"phase {phase}", status, directory / "output.log", timeout)
    return dict(json.loads(result_path.read_text()), peak_rss_mib=rss, wall_s=wall)


def training_flags(flags: list, phase: str, sizes: dict) -> list:
    """The user's flags, then the benchmark's (tyro keeps the last value of a repeated flag)."""
    # stats/ are logged every iteration whatever --log-frequency is; the user's (default) frequency keeps the
    # console line and the metric transfers at the cost a real run pays.
    return [
        *flags,
        "--concurrency" if phase == "concurrent" else "--no-concurrency",
        "--total-timesteps",
        str(sizes["total_timesteps"]),
        "--run-name",
        phase,
    ]


def read_stats(run_dir: Path, batch_size: int) -> dict:
    """{name: (wall times, values)} of the stats/ scalars, ordered by iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    stats = {}
    for tag in accumulator.Tags()["scalars"]:
        if tag.startswith("stats/"):
            events = sorted(accumulator.Scalars(tag), key=lambda e: e.step)
            assert [e.step for e in events] == [batch_size * (i + 1) for i in range(len(events))], tag
            stats[tag[len("stats/") :]] = ([e.wall_time for e in events], np.array([e.value for e in events]))
    return stats


def training_figures(run_dir: Path, sizes: dict, bench: BenchmarkArgs) -> dict:
    stats = read_stats(run_dir, sizes["batch_size"])
    ends = stats["learner_update_time"][0]
    if len(ends) != sizes["num_iterations"]:
        sys.exit(f"benchmark: {run_dir} holds {len(ends)} iterations, expected {sizes['num_iterations']}")
    bounds = window_boundaries(ends, bench)
    windows = window_sps(bounds, sizes["batch_size"] * bench.iterations)
    measured = slice(bench.warmup_iterations, None)

    def measured_median(*names):
        return median(sum(stats[name][1][measured] for name in names))

    update_time = measured_median("learner_update_time")
    rollout_time = measured_median("actor_rollout_time")
    parts = [n for n in stats if n.startswith("actor_") and n.endswith("_time") and n != "actor_rollout_time"]
    return dict(
        sps=median(windows),
        window_sps=windows,
        window_bounds=bounds,
        compile_s=float(stats["learner_compile_time"][1][0]),
        actor_compile_s=float(stats["actor_rollout_time"][1][0]) - rollout_time,
        learner_update_time_s=update_time,
        actor_rollout_time_s=rollout_time,
        learner_wait_s=measured_median("rollout_queue_wait"),
        actor_wait_s=measured_median("param_queue_wait", "actor_rollout_queue_wait"),
        actor_param_wait_s=measured_median("param_queue_wait"),
        actor_rollout_queue_wait_s=measured_median("actor_rollout_queue_wait"),
        # where the actors' rollout time goes while the learner runs beside them (on a shared GPU, say)
        actor_timings_s={name[len("actor_") : -len("_time")]: measured_median(name) for name in parts},
    )


def busy_cores(figures: dict) -> dict:
    """CPU seconds per wall second of the phase's process in each window (all its threads), from the samples."""
    times, cpu = np.array(figures.pop("cpu_samples")).T
    used = np.diff(np.interp(figures["window_bounds"], times, cpu)) / np.diff(figures["window_bounds"])
    return dict(cores=median(used), window_cores=used.tolist())


def run_reference(command: str, workdir: Path, timeout: float) -> dict:
    directory = workdir / "reference"
    directory.mkdir()
    log_path = directory / "output.log"
    # The user's current directory, so that relative paths in the command mean what they mean there.
    status, wall, rss = run_measured(command, Path.cwd(), log_path, timeout, shell=True)
    if status != 0:
        report_failure("--reference-command", status, log_path, timeout)
    figures = SPS_PATTERN.findall(log_path.read_text(errors="replace"))
    if not figures:
        sys.exit(f"benchmark: --reference-command printed no 'SPS <number>'; its output is in {log_path}")
    return dict(sps=float(figures[-1].rstrip(",").replace(",", "")), wall_s=wall, peak_rss_mib=rss, command=command)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def derived_ratios(phases: dict) -> dict:
    sps = {name: figures["sps"] for name, figures in phases.items() if "sps" in figures}
    get = sps.get
    ratios = {f"{name}_over_ceiling": ratio(value, get("ceiling")) for name, value in sps.items() if name != "ceiling"}
    ratios["concurrent_over_sync"] = ratio(get("concurrent"), get("sync"))
    both_sides = get("actor") is not None and get("learner") is not None
    ratios["overlap_efficiency"] = ratio(get("concurrent"), min(get("actor"), get("learner"))) if both_sides else None
    serial = 1 / (1 / get("actor") + 1 / get("learner")) if both_sides else None
    ratios["sync_efficiency"] = ratio(get("sync"), serial)
    ratios["concurrent_over_serial"] = ratio(get("concurrent"), serial)
    ours = get("concurrent") or get("sync")
    ratios["ours_over_reference"] = ratio(ours, get("reference"))
    return {name: value for name, value in ratios.items() if value is not None}


def cell(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if digits == 0 else f"{value:.{digits}f}"


def device_cell(peaks) -> str:
    return "n/a" if not peaks else f"{max(peaks.values()):,.0f}"


def table(phases: dict, ratios: dict) -> str:
    header = (
        f"{'phase':<11}{'SPS':>10}{'/ ceiling':>11}{'compile s':>11}{'learner wait s':>16}{'actor wait s':>14}"
        f"{'cores':>7}{'host MiB':>10}{'device MiB':>12}"
    )
    lines = [header, "-" * len(header)]
    for name, figures in phases.items():
        if name == "layers":
            continue
        lines.append(
            f"{name:<11}{cell(figures['sps'], 0):>10}{cell(ratios.get(f'{name}_over_ceiling')):>11}"
            f"{cell(figures.get('compile_s')):>11}{cell(figures.get('learner_wait_s'), 4):>16}"
            f"{cell(figures.get('actor_wait_s'), 4):>14}{cell(figures.get('cores'), 1):>7}"
            f"{cell(figures['peak_rss_mib'], 0):>10}"
            f"{device_cell(figures.get('device_peak_mib')):>12}"
        )
    labels = {
        "concurrent_over_sync": "concurrent / sync",
        "overlap_efficiency": "overlap efficiency (concurrent / min(actor, learner))",
        "sync_efficiency": "sync efficiency (sync / (1 / (1/actor + 1/learner)))",
        "concurrent_over_serial": "concurrent / serial bound (concurrent / (1 / (1/actor + 1/learner)))",
        "ours_over_reference": "ours / reference",
    }
    lines += [f"{label}: {ratios[key]:.2f}" for key, label in labels.items() if key in ratios]
    for name in ["actor", "sync", "concurrent"]:  # the script's stats/actor_*_time: median s per rollout of a thread
        if name in phases and phases[name].get("actor_timings_s"):
            figures = phases[name]
            rollout = figures.get("rollout_time_s", figures.get("actor_rollout_time_s"))
            lines.append(
                f"actor time per rollout, {name} (s): "
                + ", ".join(f"{part} {value:.3f}" for part, value in figures["actor_timings_s"].items())
                + f" (rollout {rollout:.3f})"
            )
    if "learner" in phases:
        memory = phases["learner"]["learner_memory"]
        lines.append(
            "learner device memory (XLA's analysis): "
            f"update temp {memory['update_temp_mib']:,.0f} MiB, one minibatch step temp "
            f"{memory['minibatch_step_temp_mib']:,.0f} MiB (x{memory['update_over_minibatch_step']:.2f}), "
            f"update arguments {memory['update_argument_mib']:,.0f} MiB"
        )
    if "layers" in phases:
        lines.append(layers_table(phases["layers"]))
    return "\n".join(lines)


def layers_label(paths: list) -> str:
    """One name for convolutions of one shape: their common path with * where they differ."""
    by_depth = {}
    for path in paths:
        by_depth.setdefault(path.count("/"), []).append(path.split("/"))
    return " + ".join(
        "/".join(names[0] if len(set(names)) == 1 else names[0].rsplit("_", 1)[0] + "_*" for names in zip(*parts))
        for parts in by_depth.values()
    )


def layers_table(figures: dict) -> str:
    """The layers phase: a row per convolution shape (ms and GFLOP/s of forward, dx, dk), then the network."""

    def pair(seconds, gflop):
        return f"{'-':>9}{'-':>7}" if seconds is None else f"{seconds * 1e3:>9.1f}{gflop / seconds:>7.0f}"

    def shape(dims):
        return "x".join(map(str, dims[1:]))

    width = max([len("convolution")] + [len(layers_label(layer["paths"])) + 2 for layer in figures["layers"]])
    header = (
        f"{'convolution':<{width}}{'count':>6}{'in -> out':>24}{'fwd ms':>9}{'GF/s':>7}{'dx ms':>9}{'GF/s':>7}"
        f"{'dk ms':>9}{'GF/s':>7}"
    )
    lines = [
        f"layers at batch {figures['batch']} on {figures['platform']} (each timed alone; ms per call, the "
        f"matmul reference reaches {figures['matmul_gflops']:,.0f} GFLOP/s)",
        header,
        "-" * len(header),
    ]
    totals = dict(forward_s=0.0, dx_s=0.0, dk_s=0.0)
    gflop = 0.0
    for layer in figures["layers"]:
        lines.append(
            f"{layers_label(layer['paths']):<{width}}{layer['count']:>6}"
            f"{shape(layer['input_shape']) + ' -> ' + shape(layer['output_shape']):>24}"
            + "".join(pair(layer[key], layer["gflop"]) for key in totals)
        )
        for key in totals:
            totals[key] += layer["count"] * (layer[key] or 0.0)
        gflop += layer["count"] * layer["gflop"] * (3 if layer["dx_s"] is not None else 2)
    convolutions = sum(totals.values())
    gradient = figures["network_gradient_s"]
    lines.append(
        f"convolutions in all: forward {totals['forward_s'] * 1e3:.0f} ms, dx {totals['dx_s'] * 1e3:.0f} ms, "
        f"dk {totals['dk_s'] * 1e3:.0f} ms; the network: forward {figures['network_forward_s'] * 1e3:.0f} "
        f"ms, gradient {gradient * 1e3:.0f} ms ({gflop / gradient:.0f} GFLOP/s of convolution flops), of "
        f"which the convolutions alone would take {convolutions / gradient:.0%}"
    )
    update_s = figures["traced_update_s"]
    top = list(figures["traced_operations_s"].items())[:8]
    named = sum(figures["traced_operations_s"].values())
    lines.append(
        f"one learner update under the profiler: {update_s:.2f} s, of which XLA operations the trace names "
        f"{named / update_s:.0%}: " + ", ".join(f"{kind} {t / update_s:.0%}" for kind, t in top)
    )
    return "\n".join(lines)


def main(argv: list):
    if argv[:1] == [CHILD_FLAG]:
        return child_main(argv[1], Path(argv[2]), argv[3:])
    own, flags = split_argv(argv)
    bench = parse_benchmark_args(own)
    script = resolve_script(bench.script)
    workdir = Path(tempfile.mkdtemp(prefix="cleanba-benchmark-"))
    sizes = plan_run(own, script, flags, workdir)
    json_path = bench.json or Path(f"benchmark-{script.stem}-{sizes['env_id']}.json")
    print(
        f"{script.name} on {sizes['env_id']}, {sizes['layout']}: batch_size={sizes['batch_size']} env steps per "
        f"iteration (num_steps={sizes['num_steps']}); median of {bench.repeats} windows of {bench.iterations} "
        f"iterations after {bench.warmup_iterations} warm-up iterations; {len(os.sched_getaffinity(0))} CPU "
        f"cores",
        flush=True,
    )
    phases = {}
    for phase in [phase for phase in PHASES if phase in bench.phases]:
        print(f"  {phase} ...", end="", flush=True)
        phase_flags = training_flags(flags, phase, sizes) if phase in ("sync", "concurrent") else flags
        phases[phase] = run_phase(phase, own, script, phase_flags, workdir, bench.timeout)
        print(f" done in {phases[phase]['wall_s']:.0f} s", flush=True)
    if bench.reference_command:
        print("  reference ...", end="", flush=True)
        phases["reference"] = run_reference(bench.reference_command, workdir, bench.timeout)
        print(f" done in {phases['reference']['wall_s']:.0f} s", flush=True)
    for phase in ["sync", "concurrent"]:  # read only now: TensorBoard would inflate the children's ru_maxrss
        if phase in phases:
            phases[phase].update(training_figures(workdir / phase / "runs" / phase, sizes, bench))
    for figures in phases.values():
        if "window_bounds" in figures:
            figures.update(busy_cores(figures))
        figures.pop("cpu_samples", None)  # the layers phase has no windows
    shutil.rmtree(workdir)
    ratios = derived_ratios(phases)
    print(table(phases, ratios), flush=True)
    settings = dict(repeats=bench.repeats, warmup_iterations=bench.warmup_iterations, iterations=bench.iterations)
    report = dict(
        script=str(script),
        **sizes,
        cpu_cores_available=len(os.sched_getaffinity(0)),
        settings=settings,
        script_flags=flags,
        phases=phases,
        ratios=ratios,
    )
    json_path.write_text(json.dumps(report, indent=2))
    print(f"figures written to {json_path}")


if __name__ == "__main__":
    main(sys.argv[1:])
