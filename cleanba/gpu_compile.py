"""Compile what each GPU of a training run executes, for a named NVIDIA GPU, on a machine without one.

    python -m cleanba.gpu_compile --target a100-40gb --script ppo -- --actor-device-ids 0 --learner-device-ids 1 2 3
    python -m cleanba.gpu_compile --target h100 --script impala --processes 2 -- --actor-device-ids 0 \\
        --learner-device-ids 1 2 3 --exact

XLA compiles for a GPU target with no GPU present ("deviceless" ahead-of-time compilation): the real program (PTX
for the target's compute capability through ptxas, convolutions as cuDNN calls, collectives as all-reduces) and
that program's own memory analysis per device. Everything after `--` is the training script's own flags, sized as a
real run of `--processes` processes would be (one host per process, each with the devices the flags name). For each
GPU of host 0 (the other hosts run the same programs) it prints:
    learner    the script's learner update (make_learner_update, the function the script jits), sharded over
               the learner devices of every host: XLA's temporaries, arguments (train state and rollouts) and
               outputs per device, plus the next rollouts that wait in the queues meanwhile;
    actor      the script's policy step (make_policy) at one actor thread's batch, once per actor thread: the
               params copy, the observations and the actions;
and their sum against the device's memory at the scripts' memory fraction (XLA_CLIENT_MEM_FRACTION, default
cleanba/startup.py's MEM_FRACTION).
Where actor and learner share a GPU (a0-l0), both count. Also the flops of one update (XLA's cost analysis of the
same update compiled for the CPU: after GPU optimization, cuDNN and cuBLAS calls count no flops), per env step,
and the learner's compute bound in env steps per second at the target's dense TF32 peak.

Not covered: no autotuning runs without a GPU (cuDNN algorithms and their workspaces, Triton tilings are XLA's
defaults), so the real figures are higher: for the default PPO update on an H100, the autotuned temporaries were
1.31x this figure and the device's peak 1.85x the total (docs/gpu.md, "Keep a margin"). Needs the CUDA plugin
and ptxas from PyPI: `poetry install --with gpu-compile`. Exit status: 0 when every GPU fits, 1 when one does
not, 2 on bad input.
"""

import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

# The CUDA plugin would try to start a GPU (and print a cuInit error) unless JAX stays on the CPU; the GPU target
# is reached through a topology below, not through a backend.
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # before cleanba's modules, which hide the CUDA plugin from JAX where the machine shows no GPU
import tyro

from cleanba import replay, spaces, startup
from cleanba.benchmark.common import load_script, resolve_script, split_argv
from cleanba.flags import actor_threads, fail
from cleanba.reductions import learner_shapes

SPECS = Path(__file__).with_name("gpu_targets")
# Dense TF32 tensor-core peaks (NVIDIA data sheets): XLA's default precision for float32 convolutions and matmuls
# on these GPUs. The memory comes from the target's own spec (device_memory_size).
TARGETS = {
    "a100-40gb": ("a100_sxm_40.txtpb", 156e12),
    "a100-80gb": ("a100_sxm_80.txtpb", 156e12),
    "h100": ("h100_sxm.txtpb", 494.7e12),
}
GPUS_PER_HOST = 8  # an SXM board (DGX, HGX) holds 8 of these GPUs


@dataclass
class CompileArgs:
    target: Literal["a100-40gb", "a100-80gb", "h100"] = "h100"
    """the GPU to compile for (specs: cleanba/gpu_targets/, from XLA's own target configs)"""
    script: str = "ppo"
    """ppo, impala, ppo_continuous, pqn, or the path of a training script with the same functions (a fork)"""
    processes: int = 1
    """processes (hosts) of the run: 2 for a -d2 layout"""


def shape_on(sharding, x):
    """x's shape and dtype, placed on sharding: an argument of a program compiled from shapes."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def ptxas_dir() -> str:
    """The CUDA directory of the nvidia-cuda-nvcc-cu12 wheel (bin/ptxas), which the gpu-compile group installs with
    JAX's CUDA plugin. Without the group: one line naming it (exit 2)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:  # not even the nvidia namespace: no NVIDIA wheel is installed
        spec = None
    if spec is None or not spec.submodule_search_locations or not startup.cuda_plugin_installed():
        fail(
            "compiling for a GPU needs JAX's CUDA plugin and ptxas, which this environment lacks: install the "
            "gpu-compile group (`poetry install --compile --with gpu-compile`)"
        )
    return next(iter(spec.submodule_search_locations))


def memory_fraction() -> float:
    return float(startup.memory_fraction())


def device_memory(spec_text: str) -> int:
    """device_memory_size of a GpuTargetConfig text proto."""
    for line in spec_text.splitlines():
        if line.strip().startswith("device_memory_size:"):
            return int(line.split(":", 1)[1])
    raise ValueError("no device_memory_size in the target spec")


def hosts_of(topology) -> list:
    """The topology's devices as one list per host (process), in local device order."""
    hosts = {}
    for device in topology.devices:
        hosts.setdefault(device.process_index, []).append(device)
    return [sorted(devices, key=lambda d: d.id) for _, devices in sorted(hosts.items())]


def compile_run(module, args, compile_args: CompileArgs, topology) -> dict:
    """The script's learner update and policy step compiled for the topology's GPUs, and what each GPU needs."""
    import envpool
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from cleanba.memory import learner_memory_needs

    hosts = hosts_of(topology)
    local = hosts[0]
    learner_devices = [host[i] for host in hosts for i in args.learner_device_ids]
    mesh = Mesh(np.array(learner_devices), ("learner",))
    spec = envpool.make_spec(args.env_id, **module.env_kwargs(args))
    space = spaces.observation_field(spec.observation_space)  # (shape, dtype) of one env's stored observation
    agent = module.make_network(args, spec.action_space, platform="gpu")
    _, action_key, shuffle_key = jax.random.split(jax.random.key(args.seed), 3)
    state = jax.eval_shape(partial(module.initial_state, agent, args, spec), jax.random.key(args.seed))
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    fields = module.rollout_fields(args, spec)
    num_actors = actor_threads(args)
    rollouts = (learner_shapes(fields, args.local_num_envs, mesh, module.learner_blocks(args)),) * num_actors

    start = time.time()
    update = module.make_learner_update(agent, args, shuffle_key, mesh, num_actors)
    memory = replay.memory_shapes(args, module.replay_fields(args, spec), rollouts, module.learner_blocks(args))
    lowered = update.lower(state, memory, rollouts)
    compiled = lowered.compile()
    learner_seconds = time.time() - start
    queued = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(rollouts)) // mesh.size
    replay_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(memory)) // mesh.size
    learner = learner_memory_needs(compiled.memory_analysis(), queued, replay_bytes)

    actors, actor_seconds = compile_actors(module, args, agent, action_key, state.params, space, local)

    text = compiled.as_text()
    return dict(
        learner=learner,
        actors=actors,
        learner_compile_s=learner_seconds,
        actor_compile_s=actor_seconds,
        cudnn_convolutions=text.count("__cudnn$conv"),
        all_reduces=text.count("all-reduce"),
        update_flops=update_flops(module, args, agent, shuffle_key, state, memory, rollouts, len(learner_devices)),
        local_devices=len(local),
        compute_capability=local[0].compute_capability,
    )


def compile_actors(module, args, agent, action_key, params, space, local: list) -> tuple:
    """({actor device id: what its actor threads need in memory}, compile seconds) of the script's policy step
    compiled for each actor device of the flags (local: the first host's GPUs)."""
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    actor_seconds, actors = 0.0, {}
    policy = module.make_policy(args, agent, action_key)
    for i in args.actor_device_ids:
        place = SingleDeviceSharding(local[i])
        device_params = jax.tree.map(partial(shape_on, place), params)
        obs = jax.ShapeDtypeStruct((args.local_num_envs, *space[0]), space[1], sharding=place)
        env_ids = jax.ShapeDtypeStruct((args.local_num_envs,), np.int32, sharding=place)
        width = module.recurrent_state_size(args)
        state = jax.ShapeDtypeStruct((args.local_num_envs, width), np.float32, sharding=place)
        starts = jax.ShapeDtypeStruct((args.local_num_envs,), bool, sharding=place)
        step = jax.ShapeDtypeStruct((), np.int32, sharding=place)
        start = time.time()
        analysis = policy.lower(device_params, obs, state, starts, env_ids, step).compile().memory_analysis()
        actor_seconds += time.time() - start
        # Each actor thread of the device holds its own params copy and runs its own steps.
        actors[i] = {
            name: value * args.num_actor_threads
            for name, value in dict(
                temporaries=analysis.temp_size_in_bytes,
                arguments=analysis.argument_size_in_bytes,
                outputs=analysis.output_size_in_bytes,
            ).items()
        }
    return actors, actor_seconds


def update_flops(module, args, agent, shuffle_key, state, memory, rollouts, num_learner_devices: int) -> float:
    """Flops of one update on one learner device: XLA's cost analysis of the same update (the GPU's network), for one
    device's share of the rollouts, lowered for the CPU (before optimization; nothing is compiled). The GPU program
    has no cost analysis, and after optimization its cuDNN and cuBLAS calls would count no flops."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cpu_mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("learner",))

    def on_cpu(x, spec):
        shape = list(x.shape)
        if spec != P():  # the env axis: one device's share
            axis = 0 if len(spec) == 1 else 1
            shape[axis] //= num_learner_devices
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=NamedSharding(cpu_mesh, spec))

    cpu_state = jax.tree.map(lambda x: on_cpu(x, P()), state)
    cpu_rollouts = jax.tree.map(lambda x: on_cpu(x, x.sharding.spec), rollouts)
    cpu_memory = jax.tree.map(lambda x: on_cpu(x, x.sharding.spec), memory)
    # The GPU's network (XLA's convolutions), lowered for the CPU: the CPU's network would have the CPU kernels'
    # custom calls in their place, which count no flops.
    update = module.make_learner_update(agent, args, shuffle_key, cpu_mesh, len(rollouts))
    # XLA's cost analysis counts a loop body once, whatever its trip count: the learner's loops (minibatches,
    # groups, micro-batches, value chunks) are unrolled while this one copy is traced.
    scan, loop_map = jax.lax.scan, jax.lax.map
    jax.lax.scan = partial(scan, unroll=True)
    jax.lax.map = lambda f, xs: scan(lambda carry, x: (carry, f(x)), None, xs, unroll=True)[1]
    try:
        return float(update.lower(cpu_state, cpu_memory, cpu_rollouts).cost_analysis()["flops"])
    finally:
        jax.lax.scan, jax.lax.map = scan, loop_map


def report(compile_args: CompileArgs, args, figures: dict, memory_bytes: int, peak_flops: float) -> bool:
    """Prints one row per GPU of host 0; True when every one fits."""
    budget = memory_bytes * memory_fraction()
    gib = 2**30
    print(
        f"{compile_args.script} on {compile_args.processes} x {figures['local_devices']} {compile_args.target} "
        f"(compute capability {figures['compute_capability']}; memory fraction {memory_fraction()}: "
        f"{budget / gib:.1f} of {memory_bytes / gib:.1f} GiB per GPU); "
        f"learner compiled in {figures['learner_compile_s']:.1f} s, policy in {figures['actor_compile_s']:.1f} s; "
        f"{figures['cudnn_convolutions']} cuDNN convolution calls, {figures['all_reduces']} all-reduces"
    )
    fits = True
    used = set(args.actor_device_ids) | set(args.learner_device_ids)
    print(f"{'GPU':>4}  {'role':<14}{'learner GiB':>12}{'actor GiB':>10}{'total GiB':>10}{'budget GiB':>11}  fits")
    for i in sorted(used):
        learner = sum(figures["learner"].values()) if i in args.learner_device_ids else 0
        actor = sum(figures["actors"].get(i, {}).values())
        roles = "+".join(
            role for role, ids in [("actor", args.actor_device_ids), ("learner", args.learner_device_ids)] if i in ids
        )
        ok = learner + actor <= budget
        fits &= ok
        print(
            f"{i:>4}  {roles:<14}{learner / gib:>12.2f}{actor / gib:>10.3f}{(learner + actor) / gib:>10.2f}"
            f"{budget / gib:>11.1f}  {'yes' if ok else 'NO'}"
        )
    learner = figures["learner"]
    print("learner per device: " + ", ".join(f"{k.replace('_', ' ')} {v / gib:.2f} GiB" for k, v in learner.items()))
    devices = len(args.learner_device_ids) * compile_args.processes
    per_step = figures["update_flops"] * devices / args.batch_size
    bound = peak_flops * devices / per_step
    print(
        f"flops: {figures['update_flops'] / 1e12:.2f} TFLOP per update per learner device, "
        f"{per_step / 1e6:.2f} MFLOP per env step; compute bound at the {compile_args.target}'s dense TF32 peak "
        f"({peak_flops / 1e12:.0f} TFLOP/s) on {devices} learner GPU(s): {bound:,.0f} env steps/s"
    )
    figures.update(fits=fits, budget_bytes=budget, flops_per_env_step=per_step, compute_bound_sps=bound)
    return fits


def main(argv: list):
    own, flags = split_argv(argv)
    compile_args = tyro.cli(CompileArgs, args=own, prog="python -m cleanba.gpu_compile", description=__doc__)
    if compile_args.processes < 1:
        fail(f"--processes={compile_args.processes}: give 1 or more")
    ptxas = ptxas_dir()  # before the script loads: without the gpu-compile group nothing below can run
    module = load_script(resolve_script(compile_args.script))
    args = tyro.cli(module.Args, args=flags, prog=f"{compile_args.script} flags")
    module.check_args(args)
    flags = [f"--xla_gpu_cuda_data_dir={ptxas}"]  # the lock's ptxas, not one a CUDA toolkit put on PATH
    if args.exact:  # as the scripts' main does, before the backend starts
        flags.append("--xla_gpu_deterministic_ops=true")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    print(f"XLA_FLAGS: {os.environ['XLA_FLAGS']}", flush=True)
    spec_file, peak_flops = TARGETS[compile_args.target]
    spec_text = (SPECS / spec_file).read_text()
    per_host = max(args.actor_device_ids + args.learner_device_ids) + 1
    if per_host > GPUS_PER_HOST:
        fail(
            f"device ids up to {per_host - 1} need {per_host} GPUs per host; a host of {compile_args.target} GPUs "
            f"holds at most {GPUS_PER_HOST} (ids 0..{GPUS_PER_HOST - 1}): use more --processes instead"
        )
    try:
        import jax
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="cuda", target_config=spec_text, topology=f"1x{compile_args.processes}x{per_host}"
        )
    except Exception as error:  # no CUDA plugin, or a topology it refuses
        fail(
            f"cannot build a {compile_args.processes} x {per_host} {compile_args.target} topology ({error}); "
            f"known targets: {', '.join(TARGETS)}; the CUDA plugin comes with `poetry install --with gpu-compile`"
        )
    module.fill_runtime_sizes(args, compile_args.processes, 0)
    print(f"jax {jax.__version__}: deviceless compile for {compile_args.target}", flush=True)
    figures = compile_run(module, args, compile_args, topology)
    fits = report(compile_args, args, figures, device_memory(spec_text), peak_flops)
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
