"""The policy step compiled with each kind of XLA command buffer (CUDA graph) setting, timed alone: the script's
own policy at its default sizes (Breakout, one actor thread's 64 envs), median microseconds of 1000 calls.

    python docs/benchmarks/2026-11-27-h100/launch_probe.py [--script impala] [-- training flags]

The second probe of the session, after policy_probe.py found the step slower as one graph. Variants, each the
same traced step compiled with other compiler options: XLA's default command buffers (the tail of the network,
after the last convolution, as one graph), none (every kernel launched on its own), the convolutions too (one
graph), and each of the first two returning actions and log-probs as one array. The first is repeated last, to
show the drift of the machine over the probe."""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from cleanba import benchmark

own, flags = benchmark.split_argv(sys.argv[1:])
script = own[own.index("--script") + 1] if "--script" in own else "impala"
calls = int(own[own.index("--calls") + 1]) if "--calls" in own else 1000
module = benchmark.load_script(benchmark.resolve_script(script))
args = benchmark.parse_script_args(module, ["--env-id", "Breakout-v5", *flags], 10)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

model = benchmark.build_model(module, args)
device = model["actor_devices"][0]
params = jax.device_put(module.first_replica(model["state"].params), device)
step_fn = module.make_policy(args, model["agent"], model["action_key"]).__wrapped__
GRAPH_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONVOLUTION"


def packed(params, obs, env_ids, step):
    actions, logprobs = step_fn(params, obs, env_ids, step)
    return jnp.stack([actions.astype(jnp.float32), logprobs], axis=1)


def unpack(out):
    out = np.asarray(out)
    return out[:, 0].astype(np.int32), out[:, 1]


variants = {
    "XLA default (the tail as one graph)": (jax.jit(step_fn), jax.device_get),
    "no command buffers": (jax.jit(step_fn, compiler_options={"xla_gpu_enable_command_buffer": ""}), jax.device_get),
    "one graph, convolutions included": (
        jax.jit(step_fn, compiler_options={"xla_gpu_enable_command_buffer": GRAPH_ALL}),
        jax.device_get,
    ),
    "XLA default, one output array": (jax.jit(packed), unpack),
    "no command buffers, one output array": (
        jax.jit(packed, compiler_options={"xla_gpu_enable_command_buffer": ""}),
        unpack,
    ),
    "XLA default again": (jax.jit(step_fn), jax.device_get),
}
n = args.local_num_envs
ids = jax.device_put(np.arange(n, dtype=np.int32), device)
rng = np.random.default_rng(0)
observations = [rng.integers(0, 256, (n, *model["spec"].observation_space.shape)).astype(np.uint8) for _ in range(4)]
print(f"{script}, {n} envs, {device}: median us per call of {calls} (after 20 warm-up calls)")
print(f"  {'variant':<40}{'dispatch':>10}{'to host':>10}{'step':>10}")
reference = None
for name, (policy, fetch) in variants.items():
    times = []
    for i in range(calls + 20):
        obs = observations[i % 4]
        t0 = time.perf_counter()
        out = policy(params, obs, ids, i)
        t1 = time.perf_counter()
        result = fetch(out)
        t2 = time.perf_counter()
        if i >= 20:
            times.append((t1 - t0, t2 - t1, t2 - t0))
        if i == 0:
            reference = reference or result
            same = all(np.array_equal(a, b) for a, b in zip(result, reference))
    d, h, s = (1e6 * np.median(x) for x in zip(*times))
    print(f"  {name:<40}{d:>10.0f}{h:>10.0f}{s:>10.0f}   same result as the first: {same}", flush=True)
