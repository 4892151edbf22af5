"""Where one actor step's inference time goes: the script's own policy at its default sizes, timed piece by piece.

    python docs/benchmarks/2026-11-26-h200/actor_probe.py [--script impala] [-- training flags]

Prints the median microseconds per call of each piece, in one thread and in two threads at once (as the
default 2 actor threads call it)."""

import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from cleanba import benchmark

own, flags = benchmark.split_argv(sys.argv[1:])
script = own[own.index("--script") + 1] if "--script" in own else "impala"
module = benchmark.load_script(benchmark.resolve_script(script))
args = benchmark.parse_script_args(module, ["--env-id", "Breakout-v5", *flags], 10)
import jax  # noqa: E402

model = benchmark.build_model(module, args)
device = model["actor_devices"][0]
params = jax.device_put(module.first_replica(model["state"].params), device)
policy = module.make_policy(args, model["agent"], model["action_key"])
n = args.local_num_envs
ids = jax.device_put(np.arange(n, dtype=np.int32), device)
rng = np.random.default_rng(0)
obs = rng.integers(0, 256, (n, *model["spec"].observation_space.shape)).astype(np.uint8)
trivial = jax.jit(lambda p, o: o[:, 0, 0, 0])


def pieces(step):
    """Seconds of each piece of one step."""
    t = {}
    t0 = time.perf_counter()
    out = policy(params, obs, ids, step)
    t["dispatch, numpy obs (as the actor)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.device_get(out)
    t["device_get of the result"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    on_device = jax.device_put(obs, device)
    on_device.block_until_ready()
    t["device_put of the obs, waited"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = policy(params, on_device, ids, step)
    t["dispatch, obs already on device"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(out)
    t["wait for the result (compute)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.asarray(out[0]), np.asarray(out[1])
    t["two D2H copies of ready arrays"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(trivial(params, on_device))
    t["trivial jit with the params, waited"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    obs.copy()
    t["host copy of the obs"] = time.perf_counter() - t0
    return t


def run(calls, results, offset):
    for i in range(calls):
        results.append(pieces(offset + i))


for threads in (1, 2):
    for _ in range(2):  # the first round compiles
        results, workers = [], []
        workers = [threading.Thread(target=run, args=(200, results, 1000 * k)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    print(f"{script}, {n} envs, {threads} thread(s), {device}: median us per call")
    for name in results[0]:
        print(f"  {name:<40}{1e6 * np.median([r[name] for r in results]):>10.0f}")
