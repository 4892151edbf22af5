"""The actor's policy step with and without the CUDA graph, timed alone: the script's own policy at its default
sizes (Breakout, one actor thread's 64 envs), median microseconds of 300 calls per variant.

    python docs/benchmarks/2026-11-27-h100/policy_probe.py [--script impala] [-- training flags]

Variants: the network's kernels and cuDNN calls launched one by one (the policy jitted without the script's
compiler options, as before the change), the script's policy (one CUDA graph), and that graph returning actions
and log-probs as one array (one device-to-host copy instead of two). Each is checked to give the same actions
and log-probs, bit for bit, as the first."""

import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from cleanba import benchmark

own, flags = benchmark.split_argv(sys.argv[1:])
script = own[own.index("--script") + 1] if "--script" in own else "impala"
module = benchmark.load_script(benchmark.resolve_script(script))
args = benchmark.parse_script_args(module, ["--env-id", "Breakout-v5", *flags], 10)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

model = benchmark.build_model(module, args)
device = model["actor_devices"][0]
params = jax.device_put(module.first_replica(model["state"].params), device)
graph = module.make_policy(args, model["agent"], model["action_key"])
launches = jax.jit(graph.__wrapped__)  # the same step, compiled with XLA's defaults


@partial(
    jax.jit, compiler_options={"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONVOLUTION"}
)
def packed(params, obs, env_ids, step):
    actions, logprobs = graph.__wrapped__(params, obs, env_ids, step)
    return jnp.stack([actions.astype(jnp.float32), logprobs], axis=1)


def unpack(out):
    out = np.asarray(out)
    return out[:, 0].astype(np.int32), out[:, 1]


n = args.local_num_envs
ids = jax.device_put(np.arange(n, dtype=np.int32), device)
rng = np.random.default_rng(0)
observations = [rng.integers(0, 256, (n, *model["spec"].observation_space.shape)).astype(np.uint8) for _ in range(4)]
variants = {
    "kernels launched one by one (before)": (launches, jax.device_get),
    "one CUDA graph (the scripts now)": (graph, jax.device_get),
    "one CUDA graph, one output array": (packed, unpack),
}
print(f"{script}, {n} envs, {device}: median us per call of 300 (after 20 warm-up calls)")
print(f"  {'variant':<40}{'dispatch':>10}{'to host':>10}{'step':>10}{'waited':>10}")
reference = None
for name, (policy, fetch) in variants.items():
    times = []
    for i in range(320):
        obs = observations[i % 4]
        t0 = time.perf_counter()
        out = policy(params, obs, ids, i)
        t1 = time.perf_counter()
        result = fetch(out)
        t2 = time.perf_counter()
        jax.block_until_ready(policy(params, jax.device_put(obs, device), ids, i))
        t3 = time.perf_counter()
        if i >= 20:
            times.append((t1 - t0, t2 - t1, t2 - t0, t3 - t2))
        if i == 0:
            reference = reference or result
            same = all(np.array_equal(a, b) for a, b in zip(result, reference))
    d, h, s, w = (1e6 * np.median(x) for x in zip(*times))
    print(f"  {name:<40}{d:>10.0f}{h:>10.0f}{s:>10.0f}{w:>10.0f}   same result as the first: {same}", flush=True)
