"""Memory, before training: what the host and each device may still allocate, what the compiled learner update needs
on one learner device (XLA's memory analysis, with the rollouts queued meanwhile), and the check that refuses a learner
that cannot fit, naming the --gradient-accumulation-steps or the replay's --buffer-size that would (docs/gpu.md).
"""

from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from cleanba.flags import fail
from cleanba.startup import memory_fraction

GIB = 2**30


def host_memory_available() -> tuple:
    """(bytes, where from) this process may still allocate on the host: the kernel's MemAvailable, or less where a
    cgroup of this process (a SLURM job's --mem, a container) has a lower limit left, cgroup v2 or v1."""
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    best = (int(fields["MemAvailable"].split()[0]) * 1024, "available host memory (MemAvailable)")
    with open("/proc/self/cgroup") as cgroups:
        lines = [line.rstrip("\n").split(":", 2) for line in cgroups]
    for _, controllers, path in lines:
        if controllers == "":  # v2: memory.max / memory.current, wherever the unified hierarchy is mounted
            roots, limit_file, usage_file = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"], "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            roots, limit_file, usage_file = ["/sys/fs/cgroup/memory"], "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for root in roots:
            directory = Path(root + path)
            while directory != Path(root).parent:  # a limit set on any ancestor applies too
                try:
                    limit = (directory / limit_file).read_text().strip()
                    usage = int((directory / usage_file).read_text())
                except (OSError, ValueError):
                    limit = "max"
                if limit != "max" and int(limit) < 2**60 and int(limit) - usage < best[0]:
                    best = (int(limit) - usage, f"the memory limit of cgroup {directory} less its usage")
                directory = directory.parent
    return best


def device_memory_available(device) -> tuple | None:
    """(bytes, where from) the device's allocator may use (an accelerator's limit at XLA_CLIENT_MEM_FRACTION), or
    None where the device reports no memory (XLA:CPU, whose devices share the host's memory)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    limit = f"{device.device_kind} {device.id}'s allocator limit (memory fraction {memory_fraction()})"
    return stats["bytes_limit"], limit


def learner_memory_needs(analysis, queued_rollout_bytes: int, replay_bytes: int = 0) -> dict:
    """Bytes one learner device needs during an update, by part: XLA's analysis of the compiled update (its inputs,
    i.e. the train state, the replay memory (replay_bytes of them, its outputs alias it) and this iteration's
    rollouts; its outputs; its temporaries) and the next rollouts, which wait in the rollout queues meanwhile."""
    needs = dict(
        temporaries=analysis.temp_size_in_bytes,
        arguments=analysis.argument_size_in_bytes - replay_bytes,
        outputs=analysis.output_size_in_bytes - analysis.alias_size_in_bytes,
        queued_rollouts=queued_rollout_bytes,
    )
    return dict(needs, replay_memory=replay_bytes) if replay_bytes else needs


def format_size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def describe_memory(needs: dict) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {format_size(value)}" for name, value in needs.items())


def memory_shortfall(needs: dict, learner_devices: list, host_bytes: int) -> tuple:
    """(bytes needed, bytes available, where from, fits) of the place that is shortest: each accelerator on its own;
    XLA:CPU's devices all on the host, with the actors' rollout storage (host_bytes)."""
    places = []
    for device in learner_devices:
        limit = device_memory_available(device)
        if limit is not None:
            places.append((sum(needs.values()), *limit))
    if not places:
        places.append((sum(needs.values()) * len(learner_devices) + host_bytes, *host_memory_available()))
    needed, available, source = max(places, key=lambda place: place[0] - place[1])
    return needed, available, source, needed <= available


def check_memory(
    needs: dict, learner_devices: list, host_bytes: int, accumulation_needs, current_accumulation: int, args=None
):
    """Refuse, before any env steps, a learner that cannot fit (exit status 2, one message, the flags that help).
    needs: learner_memory_needs of one learner device. accumulation_needs(n): the same with
    --gradient-accumulation-steps n (XLA compiles it), tried for the message only. With a replay memory, the largest
    of a few smaller --buffer-size (of args, a multiple of its num_envs) that fits is named first."""
    needed, available, source, fits = memory_shortfall(needs, learner_devices, host_bytes)
    print(
        f"learner memory per device (XLA's analysis of the compiled update): {describe_memory(needs)}; "
        f"needs {format_size(needed)} of {format_size(available)} ({source})",
        flush=True,
    )
    if fits:
        return
    # Each try compiles the update. Temporaries shrink at most in proportion to the micro-batches (the rest of the
    # update stays), so fewer steps than that bound cannot fit and the tries start at it; none fits where the
    # temporaries are less than the shortfall.
    fixes, steps, shortfall = [], current_accumulation * 2, needed - available
    for fraction in (0.75, 0.5, 0.25, 0.1, 0.01) if needs.get("replay_memory") else ():
        smaller = dict(needs, replay_memory=needs["replay_memory"] * fraction)
        buffer_size = int(args.buffer_size * fraction) // args.num_envs * args.num_envs
        if buffer_size and memory_shortfall(smaller, learner_devices, host_bytes)[3]:
            fixes.append(f"--buffer-size {buffer_size} (replay memory {format_size(smaller['replay_memory'])})")
            break
    temporaries = needed - memory_shortfall(dict(needs, temporaries=0), learner_devices, host_bytes)[0]
    while temporaries > shortfall and steps < current_accumulation * temporaries / (temporaries - shortfall):
        steps *= 2
    while temporaries > shortfall and steps <= 64 * current_accumulation and not fixes:
        try:
            other = accumulation_needs(steps)
        except (ValueError, TypeError):  # micro-batches that do not split this rollout evenly
            other = None
        if other is not None and memory_shortfall(other, learner_devices, host_bytes)[3]:
            fixes.append(f"--gradient-accumulation-steps {steps} (temporaries {format_size(other['temporaries'])})")
        steps *= 2
    if needs.get("replay_memory"):  # the replay holds --buffer-size transitions whatever the env count: more devices
        fixes.append("more --learner-device-ids (each holds its envs' share of the replay)")
    else:
        fixes.append("fewer envs per learner device (a smaller --local-num-envs or more --learner-device-ids)")
    fail(
        f"the learner needs {format_size(needed)} but {format_size(available)} is left ({source}); per learner device: "
        f"{describe_memory(needs)}. Lower it with {' or '.join(fixes)}; or skip this check with --no-memory-check"
    )


def check_learner_memory(args, update, compile_update, rollouts: tuple, fields, replay_memory: dict):
    """Refuse a learner that cannot fit in memory, before training (check_memory). update: the compiled learner
    update; compile_update(args): the same for other args, tried with more --gradient-accumulation-steps for the
    advice. rollouts: the update's rollout shapes (one per actor thread); fields: one actor thread's host storage;
    replay_memory: the learner's shapes (replay.py)."""
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    mesh_size = args.world_size * len(learner_devices)
    queued = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(rollouts)) // mesh_size
    replay_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(replay_memory)) // mesh_size
    host_storage = len(rollouts) * sum(np.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in fields)

    def accumulation_needs(steps: int) -> dict:
        other = compile_update(replace(args, gradient_accumulation_steps=steps))
        return learner_memory_needs(other.memory_analysis(), queued, replay_bytes)

    needs = learner_memory_needs(update.memory_analysis(), queued, replay_bytes)
    check_memory(needs, learner_devices, host_storage, accumulation_needs, args.gradient_accumulation_steps, args)
