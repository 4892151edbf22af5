"""Plumbing shared by cleanba_ppo.py and cleanba_impala.py: what a run needs around its algorithm, and nothing that
changes what it learns or how data moves between actors and learner.

- refusing bad flags before anything starts (the scripts add their own algorithm's checks);
- run names, checksums of params, the stall watchdog;
- where an actor's rollout time goes (Stopwatch) and what the learner logs (IterationLogger, docs/metrics.md);
- a run's start-up and shut-down around its queues and threads: the devices a process sees, the learner's memory
  check, the start line, the stop flag and the queue waits that see it (Stop, queue_get, queue_put), errors in threads
  (stops_run_on_error), signals, the gather of the episodes of all processes, the exit status.

A fork changes the algorithm in its own file and rarely needs to read this one.
"""

import ast
import faulthandler
import hashlib
import importlib
import inspect
import itertools
import os
import queue
import signal
import sys
import textwrap
import threading
import time
from collections import deque
from dataclasses import asdict, field, fields, replace
from functools import partial
from importlib.metadata import version
from pathlib import Path
from traceback import print_exception
from types import MappingProxyType

import envpool
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tensorboardX import SummaryWriter

from cleanba.reductions import split_envs
from cleanba.startup import GPU_DRIVERS, GPU_INSTALL, cuda_plugin_installed, describe_gpus, memory_fraction, nvidia_gpus


def fail(message: str):
    """Refuse bad input before any env, thread or device work: exit status 2, no traceback."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def in_range(value: float, interval: str) -> bool:
    """Whether value lies in an interval written "[low, high)": "[" and "]" include the bound, "(" and ")" not."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    below = value <= high if interval[-1] == "]" else value < high
    return above and below


def flag(default, interval: str | None = None, *, may_change_on_resume: bool = False):
    """A field of a script's Args with what the engine needs to know of it: the interval of meaningful values of a
    numeric flag ("[low, high)": "[" and "]" include the bound), refused outside it before anything starts; and
    whether a resumed run may change it (it changes where or how a run computes or reports, not what it learns)."""
    metadata = dict(range=interval, may_change_on_resume=may_change_on_resume)
    if isinstance(default, list):
        return field(default_factory=partial(list, default), metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_ranges(args) -> dict:
    """{name: interval} of every flag of an Args class or instance that has a range."""
    return {f.name: f.metadata["range"] for f in fields(args) if f.metadata.get("range")}


def flags_that_may_change_on_resume(args) -> set:
    """The names of the flags a resumed run may change (flag(..., may_change_on_resume=True))."""
    return {f.name for f in fields(args) if f.metadata.get("may_change_on_resume")}


def field_docstring(args_class, name: str) -> str:
    """The docstring under a field of args_class or of the class it inherits it from (as tyro reads it)."""
    for klass in args_class.__mro__:
        if name not in vars(klass).get("__annotations__", {}):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in itertools.pairwise(body):
            if isinstance(node, ast.AnnAssign) and node.target.id == name and isinstance(after, ast.Expr):
                return " ".join(str(after.value.value).split())
    return ""


def parse_flags(args_class, doc: str):
    """A script's command line parsed by tyro. Its --help opens with the script's docstring (what it trains, an example
    command), and each flag with a range (flag(default, interval)) says the values it accepts."""
    for f in fields(args_class):
        if f.metadata.get("range") and "help" not in f.metadata:
            help_text = f"{field_docstring(args_class, f.name)}; in {f.metadata['range']}"
            f.metadata = MappingProxyType({**f.metadata, "help": help_text})
    examples = [line.strip() for line in doc.splitlines() if line.startswith("    python ")]
    description = "\n\n".join([doc.split("\n\n")[0], *(f"e.g. {line}" for line in examples), "docs: README.md, docs/"])
    return tyro.cli(args_class, description=description)


def check_flags(args):
    """The checks both scripts share: every numeric flag in its range (NaN is in none), device ids, and the flags
    that only act together with another."""
    for name, interval in flag_ranges(args).items():
        if not in_range(getattr(args, name), interval):
            fail(
                f"--{name.replace('_', '-')}={getattr(args, name)} is outside its meaningful range {interval}; "
                f"give a value in {interval}"
            )
    if (args.capture_video or args.upload_model) and not (args.save_model and args.eval_episodes):
        fail(
            "--capture-video and --upload-model act on the evaluation of the saved model: add --save-model "
            "(and keep --eval-episodes above 0)"
        )
    if args.upload_model:  # a missing Hub token must not surface only at the end of a long run
        check_hub_login()
    if args.resume and args.run_name is None and "SLURM_JOB_ID" not in os.environ:
        fail("--resume needs --run-name (the run directory under runs/ that holds the checkpoint)")
    if not args.channels or min(args.channels) <= 0:
        fail(f"--channels {' '.join(map(str, args.channels))}: give one or more positive channel counts")
    for flag, ids in [("--actor-device-ids", args.actor_device_ids), ("--learner-device-ids", args.learner_device_ids)]:
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            fail(f"{flag} {' '.join(map(str, ids))}: give one or more distinct, non-negative local device ids")
    explicit = {
        "--coordinator-address": args.coordinator_address,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    given = [flag for flag, value in explicit.items() if value is not None]
    if given and not args.distributed:
        fail(f"{' '.join(given)} only apply to multi-process runs; add --distributed")
    if (args.num_processes is None) != (args.process_id is None):
        fail("give --num-processes and --process-id together (or neither, under SLURM)")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        fail(
            f"--process-id={args.process_id} must be in 0..{args.num_processes - 1} for --num-processes="
            f"{args.num_processes}"
        )
    if args.env_id not in envpool.list_all_envs():
        importlib.import_module("envpool.entry")  # every family EnvPool ships; startup registers the scripts' own
    if args.env_id not in envpool.list_all_envs():
        fail(
            f"--env-id={args.env_id} is not an EnvPool env; see envpool.list_all_envs() (e.g. Breakout-v5, CartPole-v1)"
        )


def check_hub_login():
    """Called before a long run starts, so that a missing Hugging Face token is not discovered at its end."""
    from huggingface_hub import get_token

    if get_token() is None:
        fail(
            "--upload-model needs a Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write "
            "access), or leave out --upload-model"
        )


def actor_threads(args) -> int:
    """The actor threads of one process: --num-actor-threads on each of its --actor-device-ids."""
    return len(args.actor_device_ids) * args.num_actor_threads


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


def learner_memory_needs(analysis, queued_rollout_bytes: int) -> dict:
    """Bytes one learner device needs during an update, by part: XLA's analysis of the compiled update (its inputs,
    i.e. the train state and this iteration's rollouts; its outputs; its temporaries) and the next rollouts, which
    wait in the rollout queues meanwhile."""
    return dict(
        temporaries=analysis.temp_size_in_bytes,
        arguments=analysis.argument_size_in_bytes,
        outputs=analysis.output_size_in_bytes,
        queued_rollouts=queued_rollout_bytes,
    )


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


def check_memory(needs: dict, learner_devices: list, host_bytes: int, accumulation_needs, current_accumulation: int):
    """Refuse, before any env steps, a learner that cannot fit (exit status 2, one message, the flags that help).
    needs: learner_memory_needs of one learner device. accumulation_needs(n): the same with
    --gradient-accumulation-steps n (XLA compiles it), tried for the message only."""
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
    fixes.append("fewer envs per learner device (a smaller --local-num-envs or more --learner-device-ids)")
    fail(
        f"the learner needs {format_size(needed)} but {format_size(available)} is left ({source}); per learner device: "
        f"{describe_memory(needs)}. Lower it with {' or '.join(fixes)}; or skip this check with --no-memory-check"
    )


def default_run_name(args) -> str:
    """Deterministic under SLURM, so that a requeued job finds its checkpoint; the start time otherwise."""
    name = f"{args.env_id}__{args.exp_name}__{args.seed}"
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{name}__{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_JOB_ID" in os.environ:
        return f"{name}__{os.environ['SLURM_JOB_ID']}"
    return f"{name}__{int(time.time())}"


def unreplicate(tree):
    """The learner's replicated arrays as arrays on one local device (its first), for the actors and for saving."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def host_copy(tree):
    """The learner's replicated arrays as numpy arrays, for checkpoints and saved models."""
    return jax.device_get(unreplicate(tree))


def digest(tree) -> str:
    """A short sha256 of a pytree's values, printed so that replicas and resumed states can be compared."""
    leaves = jax.device_get(jax.tree.leaves(tree))
    return hashlib.sha256(b"".join(np.ascontiguousarray(leaf).tobytes() for leaf in leaves)).hexdigest()[:16]


@jax.jit
def params_checksum(params):
    """A 24-bit checksum of the params' bits, exact as a logged float (stats/params_checksum): runs that learn the
    same params log the same value. Integer sums do not depend on the order of their additions."""
    words = jnp.concatenate(
        [jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).ravel() for x in jax.tree.leaves(params)]
    )
    total = jnp.sum(words * (2 * jnp.arange(words.size, dtype=jnp.uint32) + 1))  # weighted: positions count
    return (total ^ (total >> 24)) & 0xFFFFFF


def start_watchdog(timeout: float, stop) -> list:
    """[time.time() of the last progress], for the learner to update. With a timeout (--stall-timeout; 0: none), a
    thread aborts the run when no progress is made for that long."""
    last_progress = [time.time()]
    if timeout:
        thread_args = (last_progress, timeout, stop)
        threading.Thread(target=watch_progress, args=thread_args, daemon=True, name="watchdog").start()
    return last_progress


def watch_progress(last_progress: list, timeout: float, stop):
    """JAX does not detect a peer that is alive but stuck (e.g. in a collective): abort instead of hanging."""
    while not stop.wait(1.0):
        if time.time() - last_progress[0] > timeout:
            print(
                f"error: no iteration completed in {timeout} s (--stall-timeout); a process or device is stuck. "
                "Stacks:",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)  # the main thread is blocked: no orderly shutdown is possible


class Stopwatch:
    """Sums of perf_counter intervals by name: where an actor's rollout time goes (stats/actor_*_time)."""

    def __init__(self):
        self.sums, self.last = {}, time.perf_counter()

    def lap(self, name: str):
        now = time.perf_counter()
        self.sums[name] = self.sums.get(name, 0.0) + now - self.last
        self.last = now


class GameScores:
    """The raw score and length (in valid agent steps) of each env's game in play, in an actor thread."""

    def __init__(self, num_envs: int):
        self.returns, self.lengths = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)

    def step(self, raw_rewards: np.ndarray, valid: np.ndarray, game_over: np.ndarray) -> tuple:
        """(returns, lengths) of the games that end at this step (NaN for the other envs); those games then restart."""
        self.returns += raw_rewards
        self.lengths += valid
        ended = np.where(game_over, self.returns, np.nan), np.where(game_over, self.lengths, np.nan)
        self.returns[game_over], self.lengths[game_over] = 0.0, 0
        return ended


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def pipeline_stats(iteration: int, rollout_infos: list, queue_wait: float, update_time: float) -> dict:
    """An iteration's stats/ of the pipeline: policy versions, queue waits, where the time went (docs/metrics.md)."""
    stats = {
        "actor_policy_version": min(info.policy_version for info in rollout_infos),
        "learner_policy_version": iteration - 1,  # the version this update trained
        "rollout_queue_wait": queue_wait,
        "param_queue_wait": float(np.mean([info.param_queue_wait for info in rollout_infos])),
        "actor_rollout_queue_wait": float(np.mean([info.rollout_queue_wait for info in rollout_infos])),
        "actor_rollout_time": float(np.mean([info.rollout_time for info in rollout_infos])),
        "learner_update_time": update_time,
    }
    for name in rollout_infos[0].timings:  # where the actors' rollout time went, e.g. stats/actor_env_recv_time
        stats[f"actor_{name}_time"] = float(np.mean([info.timings[name] for info in rollout_infos]))
    return stats


class IterationLogger:
    """The writer's TensorBoard (and, with --track, wandb) logs: stats/ every iteration; charts/, losses/ and the
    console line every log_frequency iterations. On resume, what the stopped run logged after its checkpoint is
    dropped (purge_step), so the curves continue from there, with the window of the last 20 games the checkpoint
    saved (episode_window). compile_time, the seconds the learner update took to compile ahead of time, is logged
    once, as stats/learner_compile_time at the first iteration this process logs."""

    def __init__(self, args, run_dir: Path, purge_step=None, episode_window=None, compile_time=None):
        if args.track:
            import wandb

            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=asdict(args),
                name=run_dir.name,
                id=run_dir.name,
                resume="allow",
                save_code=True,
            )
        self.args, self.writer = args, SummaryWriter(str(run_dir), purge_step=purge_step)
        self.writer.add_text(
            "hyperparameters",
            "|param|value|\n|-|-|\n" + "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items()),
        )
        self.recent_returns, self.recent_lengths = deque(maxlen=20), deque(maxlen=20)
        if episode_window is not None:
            self.recent_returns.extend(episode_window["returns"].tolist())
            self.recent_lengths.extend(episode_window["lengths"].tolist())
        self.window_start, self.window_steps = time.time(), 0
        self.compile_time = compile_time

    def log(
        self, iteration: int, rollout_infos: list, episodes: np.ndarray, queue_wait: float, update_time, state, metrics
    ):
        """rollout_infos: the actors' RolloutInfo. episodes: (2, T, num_envs) returns and lengths of the games of all
        envs that ended (NaN elsewhere). queue_wait and update_time: the learner's wait for the rollouts and the
        seconds its update took."""
        args, writer = self.args, self.writer
        ended = np.isfinite(episodes[0])  # in (step, global env id) order: the same on every layout
        self.recent_returns.extend(episodes[0][ended])
        self.recent_lengths.extend(episodes[1][ended])
        global_step = iteration * args.batch_size
        self.window_steps += args.batch_size
        stats = pipeline_stats(iteration, rollout_infos, queue_wait, update_time)
        stats["params_checksum"] = int(params_checksum(unreplicate(state.params)))
        if self.compile_time is not None:
            stats["learner_compile_time"], self.compile_time = self.compile_time, None
        for key, value in stats.items():
            writer.add_scalar(f"stats/{key}", value, global_step)
        if iteration % args.log_frequency and iteration != args.num_iterations:
            return
        for key, value in jax.device_get(unreplicate(metrics)).items():
            writer.add_scalar(f"losses/{key}", float(value), global_step)
        sps = self.window_steps / (time.time() - self.window_start)
        self.window_start, self.window_steps = time.time(), 0
        # By name, wherever the optimizer chain keeps it (inject_hyperparams's value, not its schedule's state).
        learning_rate = optax.tree_utils.tree_get(
            state.opt_state, "learning_rate", filtering=lambda _, value: isinstance(value, jax.Array)
        )
        learning_rate = jax.device_get(unreplicate(learning_rate))
        writer.add_scalar("charts/SPS", sps, global_step)
        writer.add_scalar("charts/learning_rate", float(learning_rate), global_step)
        recent = "n/a"
        if self.recent_returns:
            recent = f"{np.mean(self.recent_returns):.1f}"
            writer.add_scalar("charts/episodic_return", np.mean(self.recent_returns), global_step)
            writer.add_scalar("charts/episodic_length", np.mean(self.recent_lengths), global_step)
        eta = (args.num_iterations - iteration) * args.batch_size / sps
        print(
            f"step {global_step:,}/{args.num_iterations * args.batch_size:,} "
            f"({100 * iteration / args.num_iterations:.0f}%) | SPS {sps:,.0f} | return {recent} | "
            f"lag {stats['learner_policy_version'] - stats['actor_policy_version']} | "
            f"ETA {format_duration(eta)}",
            flush=True,
        )

    def episode_window(self) -> dict:
        """The returns and lengths of the last 20 games, oldest first: what a checkpoint saves."""
        return {"returns": np.array(self.recent_returns), "lengths": np.array(self.recent_lengths)}

    def close(self):
        self.writer.close()
        if self.args.track:
            import wandb

            wandb.finish()


# ---- Start-up and shut-down of a run (the scripts' start, train and shut_down call these)


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


def check_learner_memory(args, update, compile_update, rollouts: tuple, fields):
    """Refuse a learner that cannot fit in memory, before training (check_memory). update: the compiled learner
    update; compile_update(args): the same for other args, tried with more --gradient-accumulation-steps for the
    advice. rollouts: the update's rollout shapes (one per actor thread); fields: one actor thread's host storage."""
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    mesh_size = args.world_size * len(learner_devices)
    queued = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(rollouts)) // mesh_size
    host_storage = len(rollouts) * sum(np.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in fields)

    def accumulation_needs(steps: int) -> dict:
        other = compile_update(replace(args, gradient_accumulation_steps=steps))
        return learner_memory_needs(other.memory_analysis(), queued)

    needs = learner_memory_needs(update.memory_analysis(), queued)
    check_memory(needs, learner_devices, host_storage, accumulation_needs, args.gradient_accumulation_steps)


def print_start(args, run_dir: Path, blocks: tuple):
    """The start line of a run (process 0): its sizes, devices, logs and versions; with --exact, where its bits hold.
    blocks: (env_sets, block_size) of reductions.learner_env_blocks, how learner devices split an actor's envs."""
    block, num_learner_devices = blocks[1], args.world_size * len(args.learner_device_ids)
    kind = jax.local_devices()[args.learner_device_ids[0]].device_kind  # "cpu", "NVIDIA H100 80GB HBM3"
    shards = split_envs(np.arange(args.local_num_envs), len(args.learner_device_ids), *blocks)
    pads = sum(len(pad_ids) for _, pad_ids in shards)  # masked pad envs per actor thread
    padding = f" (+{pads} masked pad envs per actor thread to split evenly)" if pads else ""
    print(
        f"{run_dir.name}: {args.num_iterations} iterations of batch_size={args.batch_size} "
        f"(num_envs={args.num_envs}, minibatch_size={args.minibatch_size}), learner on "
        f"{num_learner_devices} x {kind}{padding}, logs in {run_dir}; jax {jax.__version__} (jaxlib "
        f"{version('jaxlib')}), XLA_FLAGS: {os.environ.get('XLA_FLAGS') or 'none'}",
        flush=True,
    )
    if args.exact:  # groups are cut from each actor thread's envs, so they only tile the same way in whole blocks
        splits = (
            f"and on any split of the envs over actor threads and processes whose --local-num-envs is a "
            f"multiple of {block}"
            if args.local_num_envs % block == 0
            else f"but not on another split of the envs over actor threads or processes (--local-num-envs is not "
            f"a multiple of {block}, a block of groups)"
        )
        print(
            f"exact: sums over groups of {args.group_envs} envs in a fixed order, the same bits on every learner "
            f"layout {splits}; XLA_FLAGS: {os.environ['XLA_FLAGS']}",
            flush=True,
        )


class StopTraining(Exception):
    """Raised in a thread that waits on a queue after the run was told to stop."""


class Stop(threading.Event):
    """Set when the run must stop: at the end, on a signal (SIGINT, SIGTERM) or on an error in any thread. Every
    queue wait sees it within 0.2 s (StopTraining), the learner at each iteration. It keeps why."""

    def __init__(self):
        super().__init__()
        self.signals, self.errors = [], []


def queue_get(q: queue.Queue, stop: Stop):
    while True:  # short timeouts so a stop (error elsewhere, Ctrl-C, end of run) is seen promptly
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if stop.is_set():
                raise StopTraining from None


def queue_put(q: queue.Queue, item, stop: Stop):
    while True:
        try:
            return q.put(item, timeout=0.2)
        except queue.Full:
            if stop.is_set():
                raise StopTraining from None


def stops_run_on_error(body):
    """A thread's body whose last argument is the run's Stop: an error in it stops the whole run, and the main thread
    reports it (exit_status); StopTraining just ends the thread."""

    def thread(*thread_args):
        try:
            body(*thread_args)
        except StopTraining:
            pass
        except BaseException as error:
            thread_args[-1].errors.append(error)
            thread_args[-1].set()

    return thread


def handle_signals(stop: Stop, distributed: bool):
    """SIGINT and SIGTERM stop the run at the next queue wait or iteration boundary; it then checkpoints and exits."""

    def on_signal(signum, frame):
        stop.signals.append(signum)
        if distributed:  # processes must stop after the same iteration, or one would wait forever in a
            os.kill(os.getpid(), signal.SIGTERM)  # collective: JAX's preemption notifier syncs them (train)
        else:
            stop.set()

    signal.signal(signal.SIGINT, on_signal)
    if not distributed:  # JAX's notifier already holds SIGTERM
        signal.signal(signal.SIGTERM, on_signal)


def make_process_gather(mesh):
    """x (..., envs) of every process, concatenated along the envs in process order, through the learner devices
    (an actor's device may be busy with inference: no collective runs there). For the episodes of all processes'
    envs, on every process; x itself where there is one process."""
    if jax.process_count() == 1:
        return lambda x: x
    replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    local_devices = mesh.local_devices

    def gather(x: np.ndarray) -> np.ndarray:
        parts = [jax.device_put(x[None], device) for device in local_devices]
        stacked = jax.make_array_from_single_device_arrays(
            (mesh.size, *x.shape), NamedSharding(mesh, P("learner")), parts
        )
        return np.concatenate(list(np.asarray(unreplicate(replicate(stacked)))[:: len(local_devices)]), axis=-1)

    return gather


def join_threads(threads: list):
    for thread in threads:
        if thread.ident is not None:  # started
            thread.join(timeout=30)
    if any(thread.is_alive() for thread in threads):
        print("warning: an actor thread did not stop within 30 s", file=sys.stderr)


def exit_status(stop: Stop, iterations_done: int, now: bool = False):
    """The end of a run that stopped early: the first error, of an actor thread or the learner (exit status 1), or the
    signal (128 + it). now: exit on an error at once, skipping Python's shutdown (see shut_down)."""
    if stop.errors:
        print_exception(stop.errors[0])
        print(f"the run stopped on an error ({type(stop.errors[0]).__name__})", file=sys.stderr, flush=True)
        if now:
            sys.stdout.flush()
            os._exit(1)
        sys.exit(1)
    if stop.signals:
        print(f"stopped by signal {stop.signals[0]} after iteration {iterations_done}", file=sys.stderr)
        sys.exit(128 + stop.signals[0])


def shut_down(run, save_checkpoint):
    """After a script's train, however it ended (run: its TrainingRun): every actor thread joined, a checkpoint
    (save_checkpoint(run)) when a signal stopped the run, and the barrier of all processes (before process 0
    evaluates, so that none waits for it)."""
    run.stop.set()
    join_threads(run.threads)
    signalled = run.stop.signals and not run.stop.errors and run.iterations_done >= run.start_iteration
    if signalled and run.logger is not None and run.args.checkpoint_frequency:
        save_checkpoint(run)
        print(f"checkpoint of iteration {run.iterations_done} saved to {run.checkpoint_path}", flush=True)
    if run.logger is not None:
        run.logger.writer.flush()
    if run.args.distributed:
        if run.stop.errors:  # the others may wait for this process in a collective, and a shutdown would wait for
            exit_status(run.stop, run.iterations_done, now=True)  # them: exit now, they abort (--heartbeat-timeout)
        jax.distributed.shutdown()


def close_and_exit(run):
    """The end of a script's run (run: its TrainingRun), after its model's evaluation: the logs closed, and the exit
    status of how the run ended."""
    if run.logger is not None:
        run.logger.close()
    exit_status(run.stop, run.iterations_done)
