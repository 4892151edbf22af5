"""The benchmark's layers phase (python -m cleanba.benchmark --phases layers): where the learner's compute goes, timed
in a child process, and its table."""

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from cleanba.benchmark.common import BenchmarkArgs, median
from cleanba.benchmark.phases import build_model, compile_learner, learner_rollouts, replay_memory


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
    agent, params = model["agent"], module.unreplicate(model["state"]).params
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
    state, replay = model["state"], replay_memory(module, args, model, rollouts, shapes_only=False)
    state, replay, _ = update(state, replay, rollouts)  # the first call allocates what later ones reuse
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            start = time.perf_counter()
            jax.block_until_ready(update(state, replay, rollouts))
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
