"""The devices a process trains on and the processes of a run: the device ids the flags name exist, on the GPU where
the machine shows one (check_devices); the multi-process start-up (initialize_distributed, with every local device the
flags name visible); and the gather of the episodes of all processes through the learner devices.
"""

import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cleanba.flags import fail
from cleanba.replicas import unreplicate
from cleanba.startup import GPU_DRIVERS, GPU_INSTALL, cuda_plugin_installed, describe_gpus, nvidia_gpus


def check_gpu_backend():
    """Refuse to train on the CPU of a machine that shows NVIDIA GPUs (a GPU node with the CPU install, or a CUDA
    plugin that failed to start): such a run would take days and say nothing. JAX_PLATFORMS=cpu trains on the CPU
    anyway. Without a CUDA plugin this fails before JAX starts a backend, so JAX's own fallback warning
    does not print."""
    gpus = nvidia_gpus()
    if not gpus or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return
    if not cuda_plugin_installed():
        why = "no CUDA plugin is installed"
    elif jax.default_backend() == "cpu":
        why = "its CUDA plugin did not start: see JAX's message above"
    else:
        return
    fail(
        f"this machine shows {describe_gpus(gpus)}, but JAX has no GPU backend ({why}), so this run would train on "
        f"the CPU: install JAX for CUDA with `{GPU_INSTALL}` ({GPU_DRIVERS}), or set JAX_PLATFORMS=cpu to train on "
        f"the CPU anyway"
    )


def check_devices(args):
    """The device ids the flags name exist in this process, on the GPU where the machine shows one."""
    check_gpu_backend()
    num_local_devices = len(jax.local_devices())
    for flag, ids in [("--actor-device-ids", args.actor_device_ids), ("--learner-device-ids", args.learner_device_ids)]:
        if max(ids) >= num_local_devices:
            fail(
                f"{flag} {' '.join(map(str, ids))}: this process has {num_local_devices} local device(s), "
                f"ids 0..{num_local_devices - 1}; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N"
            )


def local_device_ids(args) -> list | None:
    """The local device ids for jax.distributed.initialize: all up to the highest one the flags use. Without them,
    JAX under srun makes only GPU number SLURM_LOCALID visible to each process ("single process per device",
    jax/_src/clusters/cluster.py): a task given 4 GPUs would see one. JAX_LOCAL_DEVICE_IDS overrides (None)."""
    if "JAX_LOCAL_DEVICE_IDS" in os.environ:
        return None
    return list(range(max(args.actor_device_ids + args.learner_device_ids) + 1))


def initialize_distributed(args):
    """jax.distributed.initialize, with every local device the flags name visible to this process."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        local_device_ids=local_device_ids(args),
        heartbeat_timeout_seconds=args.heartbeat_timeout,
    )
    print_rank()


def print_rank():
    """After jax.distributed.initialize, on every process: which GPUs JAX was told to make visible."""
    print(
        f"rank {jax.process_index()} of {jax.process_count()}: GPUs visible to JAX (jax_cuda_visible_devices) "
        f"{jax.config.read('jax_cuda_visible_devices')}",
        flush=True,
    )


def make_process_gather(mesh):
    """x (..., envs) of every process, concatenated along the envs in process order, through the learner devices
    (an actor's device may be busy with inference: no collective runs there). For the episodes of all processes'
    envs, on every process; x itself where there is one process. As float32 on any number of processes (what JAX
    moves between them): a continuous task's float64 scores then round the same in a run of one process."""
    if jax.process_count() == 1:
        return lambda x: x.astype(np.float32)
    replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    local_devices = mesh.local_devices

    def gather(x: np.ndarray) -> np.ndarray:
        parts = [jax.device_put(x[None], device) for device in local_devices]
        stacked = jax.make_array_from_single_device_arrays(
            (mesh.size, *x.shape), NamedSharding(mesh, P("learner")), parts
        )
        return np.concatenate(list(np.asarray(unreplicate(replicate(stacked)))[:: len(local_devices)]), axis=-1)

    return gather
