"""The benchmark's phases that run in a child process (python -m cleanba.benchmark runs each in one): each returns a
dict of figures. The layers phase is in layers.py."""

import json
import runpy
import sys
import threading
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np

from cleanba import spaces
from cleanba.benchmark.common import BenchmarkArgs, median, total_iterations, window_boundaries, window_sps


def layout(args) -> str:
    return (
        f"a{','.join(map(str, args.actor_device_ids))}-l{','.join(map(str, args.learner_device_ids))}, "
        f"{args.num_actor_threads} actor thread(s) per actor device x {args.local_num_envs} envs"
    )


def actor_devices_and_ids(args) -> list:
    """(device index, actor_id) of every actor thread, numbered as the script's make_actor_threads (one process)."""
    return [
        (d, d * args.num_actor_threads + t)
        for d in range(len(args.actor_device_ids))
        for t in range(args.num_actor_threads)
    ]


def random_actions(rng: np.random.Generator, space, n: int) -> np.ndarray:
    """n uniform actions of a Discrete or Box action space."""
    if type(space).__name__ == "Discrete":
        return rng.integers(space.n, size=n, dtype=np.int32)
    return rng.uniform(space.low, space.high, (n, *space.shape)).astype(space.dtype)


def random_actor(module, args, actor_id: int, bench: BenchmarkArgs, barrier: threading.Barrier, stop: threading.Event):
    """Steps one pool like an actor thread does (send, then recv), with random actions instead of a policy."""
    first_env = actor_id * args.local_num_envs
    envs = module.make_env(args, args.local_num_envs, seed=args.seed + first_env)  # the actor's seeds
    try:
        rng = np.random.default_rng([args.seed, actor_id])
        space = envs.action_space
        envs.async_reset()
        *_, info = envs.recv()
        for iteration in range(total_iterations(bench)):
            if iteration >= bench.warmup_iterations and (iteration - bench.warmup_iterations) % bench.iterations == 0:
                barrier.wait()  # all threads start each window together
            if stop.is_set():
                raise module.StopTraining
            for _ in range(args.num_steps):
                envs.send(random_actions(rng, space, args.local_num_envs), info["env_id"])
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
    barrier = threading.Barrier(len(actor_devices_and_ids(args)), action=lambda: starts.append(time.time()))
    from cleanba.lifetime import stops_run_on_error

    stop = module.Stop()
    threads = [
        threading.Thread(
            target=stops_run_on_error(random_actor),
            daemon=True,
            name=f"env-{actor_id}",
            args=(module, args, actor_id, bench, barrier, stop),
        )
        for _, actor_id in actor_devices_and_ids(args)
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

    from cleanba.devices import check_devices

    check_devices(args)
    local_devices = jax.local_devices()
    learner_devices = [local_devices[i] for i in args.learner_device_ids]
    mesh = Mesh(np.array(learner_devices), ("learner",))
    spec = envpool.make_spec(args.env_id, **module.env_kwargs(args))
    if shapes_only:
        agent = module.make_network(args, spec.action_space, mesh.devices.flat[0].platform)
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

    from cleanba.lifetime import stops_run_on_error

    model = build_model(module, args)
    params = module.unreplicate(model["state"].params)  # where main() hands params over
    policy = module.make_policy(args, model["agent"], model["action_key"])
    stop = module.Stop()
    param_queues, rollout_queues, threads = module.make_actor_threads(args, 1, model["mesh"], policy, stop)
    for actor_id, param_queue in enumerate(param_queues):  # a feeder per actor: params as fast as it takes them
        feeder = partial(stops_run_on_error(feed_params), module, param_queue, params, stop)
        threads.append(threading.Thread(target=feeder, name=f"feeder-{actor_id}", daemon=True))
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


def synthetic_rollout(module, args, spec, actor_id: int, rng: np.random.Generator):
    """One actor thread's rollout with the real shapes and dtypes: random obs and actions, few episode ends."""
    T, n = args.num_steps, args.local_num_envs
    (shape, dtype), (action_shape, _) = (
        spaces.observation_field(spec.observation_space),
        spaces.action_field(spec.action_space),
    )
    if np.issubdtype(dtype, np.integer):
        obs = rng.integers(0, 256, size=(T + 1, n, *shape)).astype(dtype)
    else:
        obs = rng.standard_normal((T + 1, n, *shape)).astype(dtype)
    if action_shape:  # a Box: Gaussian samples, log-probabilities near those of a unit Gaussian's
        actions = rng.standard_normal((T, n, *action_shape)).astype(np.float32)
        logprobs = -0.5 * np.sum(actions**2 + np.log(2 * np.pi), axis=-1).astype(np.float32)
    else:
        actions = rng.integers(spec.action_space.n, size=(T, n)).astype(np.int32)
        logprobs = np.full((T, n), -np.log(spec.action_space.n), np.float32)
    first_env = actor_id * args.local_num_envs  # as rollout_actor numbers its envs
    return module.Rollout(
        obs=obs,
        actions=actions,
        logprobs=logprobs + rng.normal(0, 0.1, (T, n)).astype(np.float32),
        rewards=rng.choice(np.array([-1, 0, 1], np.float32), size=(T, n), p=[0.05, 0.9, 0.05]),
        terminations=rng.random((T, n)) < 0.01,
        truncations=rng.random((T, n)) < 0.001,
        valid=np.ones((T, n), bool),
        env_ids=np.arange(first_env, first_env + n, dtype=np.int32)[None],
        recurrent_state=rng.normal(0, 0.5, (1, n, module.recurrent_state_size(args))).astype(np.float32),
    )


def learner_rollouts(module, args, model) -> tuple:
    """One iteration's synthetic rollouts, one per actor thread, on the learner devices as the learner gets them."""
    rng = np.random.default_rng(args.seed)
    return tuple(
        module.put_on_learners(
            synthetic_rollout(module, args, model["spec"], actor_id, rng), model["mesh"], module.learner_blocks(args)
        )
        for _, actor_id in actor_devices_and_ids(args)
    )


def rollout_structs(module, args, model) -> tuple:
    """One iteration's rollouts as the learner receives them (padded and sharded over the learner devices), as
    shapes and dtypes only: for compiling at sizes that would not fit in this machine's memory or time."""
    fields = module.rollout_fields(args, model["spec"])
    shapes = module.learner_shapes(fields, args.local_num_envs, model["mesh"], module.learner_blocks(args))
    return (shapes,) * len(actor_devices_and_ids(args))


def replay_memory(module, args, model, rollouts: tuple, shapes_only: bool = True) -> dict:
    """The script's replay memory for rollouts (cleanba/replay.py; {} for the on-policy scripts): its shapes, or
    zeros on the learner devices."""
    from cleanba import replay

    blocks = module.learner_blocks(args)
    shapes = replay.memory_shapes(args, module.replay_fields(args, model["spec"]), rollouts, blocks)
    return shapes if shapes_only else replay.place(args, shapes, blocks)


def compile_learner(
    module, args, model, rollouts: tuple, compiler_options: dict | None = None, minibatch_step: bool = True
):
    """The script's learner update compiled for rollouts (arrays or ShapeDtypeStructs), and XLA's own memory
    analysis of it and, with minibatch_step (a second compile), of one minibatch gradient step (the gradients of
    the groups, cleanba/reductions.py's Groups.gradients, on the batch shapes that the update hands it, recorded
    while tracing, then the optimizer's step). Nothing runs: the figures are what XLA plans to allocate on the
    learner device. compiler_options: XLA options for both compiles (jax's Lowered.compile), such as the tests' LLVM
    optimization level, which leaves XLA's buffer assignment, hence these figures, as they are."""
    import jax
    from jax.sharding import PartitionSpec as P

    from cleanba.reductions import Groups

    recorded, original = [], Groups.gradients

    def recording(groups, loss_fn, params, batch: dict, count):
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), (batch, groups.columns, groups.keys))
        recorded.append((shapes, groups, loss_fn, (count.shape, count.dtype), jax.tree.structure(params)))
        return original(groups, loss_fn, params, batch, count)

    update = module.make_learner_update(model["agent"], args, model["shuffle_key"], model["mesh"], len(rollouts))
    Groups.gradients = recording
    try:
        compiled = update.lower(model["state"], replay_memory(module, args, model, rollouts), rollouts).compile(
            compiler_options
        )
    finally:
        Groups.gradients = original
    analysis = compiled.memory_analysis()
    mib = 1 / 2**20
    memory = dict(
        update_temp_mib=analysis.temp_size_in_bytes * mib,
        update_argument_mib=analysis.argument_size_in_bytes * mib,
        update_output_mib=analysis.output_size_in_bytes * mib,
    )
    if not minibatch_step or recorded[0][4] != jax.tree.structure(model["state"].params):
        return compiled, memory  # a gradient of a part of the params (SAC's critics): no one-step program to compare
    # The gradients' batch and groups are per device, every array (groups, ...): the global ones have groups x
    # devices. The groups' static fields (exact, micro-batches) and the loss are those recorded.
    shapes, groups, loss_fn, count_shape, _ = recorded[0]
    sharding = jax.sharding.NamedSharding(model["mesh"], P("learner"))
    batch, columns, keys = jax.tree.map(
        lambda sd: jax.ShapeDtypeStruct((sd[0][0] * model["mesh"].size, *sd[0][1:]), sd[1], sharding=sharding),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple),
    )
    count = jax.ShapeDtypeStruct(*count_shape, sharding=jax.sharding.NamedSharding(model["mesh"], P()))

    def minibatch_step(state, batch, columns, keys, count):
        step_groups = groups._replace(columns=columns, keys=keys)
        grads, metrics = original(step_groups, loss_fn, state.params, batch, count)
        return state.apply_gradients(grads=grads), metrics

    step = jax.jit(
        jax.shard_map(
            minibatch_step,
            mesh=model["mesh"],
            in_specs=(P(), P("learner"), P("learner"), P("learner"), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    step_analysis = step.lower(model["state"], batch, columns, keys, count).compile(compiler_options)
    step_analysis = step_analysis.memory_analysis()
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
    replay = replay_memory(module, args, model, rollouts, shapes_only=False)
    ends = []
    for _ in range(args.num_iterations):
        state, replay, _ = learner_update(state, replay, rollouts)
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
