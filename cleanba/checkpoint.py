"""Checkpoints and saved models of the training scripts: one msgpack file each, never left half-written.

The training scripts resume from a checkpoint (resume), write one (save_run_checkpoint) and save their trained model
(save_trained_model) with these; the file functions take everything on the host (jax.device_get).

    args, params, script = load_model("runs/<run_name>/cleanba_ppo.cleanba_model")
"""

import json
import os
from dataclasses import asdict
from pathlib import Path

import flax.serialization
import jax
import numpy as np

from cleanba import replay
from cleanba.flags import fail, flags_that_may_change_on_resume
from cleanba.replicas import digest, host_copy


def write_atomically(path: Path, payload: dict):
    """msgpack to a temporary file, fsync, rename: the file at `path` is always a complete one (old or new)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(flax.serialization.msgpack_serialize(payload))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


class Unreadable(ValueError):
    """A file that is not a whole model or checkpoint of the scripts: empty, cut short, or of another format."""


def read_payload(path: Path, keys: tuple) -> dict:
    """The msgpack payload of a file written by write_atomically that holds its args and one of keys; Unreadable,
    naming the file, otherwise."""
    try:
        payload = flax.serialization.msgpack_restore(Path(path).read_bytes())
        if not isinstance(payload, dict) or not isinstance(json.loads(payload["args"]), dict):
            raise TypeError("no args")
        if not any(key in payload for key in keys):
            raise KeyError(" or ".join(keys))
    except Exception as error:  # msgpack, json and the checks above raise errors of several kinds
        what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise Unreadable(f"{path} is not a Cleanba model or checkpoint ({what})") from None
    return payload


def save_model(path: Path, script: str, args: dict, params):
    """Args and params in one file, and the name of the script that defines the network and envs."""
    write_atomically(
        path, {"args": json.dumps(args), "script": script, "params": flax.serialization.to_state_dict(params)}
    )


def load_model(path: Path):
    """Returns (args dict, params, file name of the training script) of a file written by save_model, or of a
    checkpoint (its train state's params; its script is the one its exp_name names, the script's stem by
    default), so that a run stopped before its end can be evaluated too."""
    payload = read_payload(path, ("params", "train_state"))
    args = json.loads(payload["args"])
    if "train_state" in payload:
        return args, payload["train_state"]["params"], f"{args.get('exp_name')}.py"
    return args, payload["params"], payload.get("script")


def save_checkpoint(path: Path, args: dict, train_state, iteration: int, episode_window: dict, memory=None):
    """Params, optimizer state and its step count, the iteration (which fixes the global step, the policy
    versions and the actors' RNG counters), the args (which fix the seeds), the logger's window of the last
    games' returns and lengths (so the first curve point after a resume averages as many games as before) with the
    params of the test curve's tests not yet logged (the resumed run plays them), and the
    replay memory in global env order (replay.to_host), if the script keeps one."""
    payload = {
        "args": json.dumps(args),
        "iteration": iteration,
        "train_state": flax.serialization.to_state_dict(train_state),
        "episode_window": flax.serialization.to_state_dict(episode_window),
    }
    write_atomically(path, dict(payload, replay=memory) if memory else payload)


def load_checkpoint(path: Path, args: dict, template, may_change: set, defaults: dict | None = None):
    """Returns (iteration, train state like template, episode window, replay memory or {}) of a checkpoint; the
    window is empty in a checkpoint written before it was saved. ValueError, naming the flags, where its
    flags differ from args in one that is not in may_change (those change where or how a run computes or reports,
    not what it learns: the scripts' flag(..., may_change_on_resume=True)). A flag newer than the checkpoint was
    trained at its default (defaults: the flags' defaults)."""
    payload = read_payload(path, ("train_state",))
    saved, current = json.loads(payload["args"]), json.loads(json.dumps(args))
    saved = json.loads(json.dumps(defaults or {})) | saved
    conflicts = [
        f"{key}={saved.get(key)} (now {current[key]})"
        for key in current
        if key not in may_change and saved.get(key) != current[key]
    ]
    if conflicts:
        raise ValueError(f"the checkpoint {path} was trained with {', '.join(conflicts)}")
    empty = {"returns": np.zeros(0), "lengths": np.zeros(0)}
    window = payload.get("episode_window", empty)
    window = {key: np.asarray(window[key]) for key in empty} | {
        "tests": {int(iteration): params for iteration, params in window.get("tests", {}).items()}
    }
    state = flax.serialization.from_state_dict(template, payload["train_state"])
    return payload["iteration"], state, window, payload.get("replay", {})


def resume_checkpoint(path: Path, args, state):
    """(iterations done, train state, the last games' returns, replay memory) of the run that saved the checkpoint
    at path, on the host; a checkpoint of other hyperparameters or global sizes is refused with the fix."""
    try:
        may_change = flags_that_may_change_on_resume(args)
        return load_checkpoint(path, asdict(args), host_copy(state), may_change, asdict(type(args)()))
    except Unreadable as error:
        fail(f"--resume: {error}; move it away to start the run over, or give another --run-name")
    except ValueError as error:
        fail(
            f"--resume: {error}; resume with the same hyperparameters and global sizes, or start a new run "
            "with another --run-name"
        )


def checkpoint_path(run_dir: Path) -> Path:
    """Where a training run saves its checkpoint and resumes from."""
    return run_dir / "checkpoint.msgpack"


def resume_requested(args, checkpoint_path: Path) -> bool:
    """Whether this run resumes from its checkpoint: --resume, or a requeued SLURM job (SLURM_RESTART_COUNT counts
    the requeues) whose run saved one."""
    resume = args.resume or (int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0 and checkpoint_path.exists())
    if resume and not checkpoint_path.exists():
        fail(
            f"--resume: no checkpoint at {checkpoint_path}; give the --run-name of a run that saved one "
            f"(--checkpoint-frequency)"
        )
    return resume


def resume(args, path: Path, state):
    """(iterations done, train state, the last games' returns, replay memory on the host) a training run starts
    from: where it resumes (resume_requested), its checkpoint's, the train state on the devices of `state`; else
    (0, state, None, None)."""
    if not resume_requested(args, path):
        return 0, state, None, None
    iterations_done, restored, episode_window, memory = resume_checkpoint(path, args, state)
    placed = jax.device_put(restored, jax.tree.map(lambda x: x.sharding, state))
    # The line tells what training continues from: the state as placed on the learner devices, read back, not
    # the file's (a state lost between the two would show).
    on_devices = host_copy(placed)
    replayed = f", replay memory sha256 {digest(memory)}" if memory else ""
    print(
        f"rank {args.process_index}: resumed {path} at iteration {iterations_done} (global step "
        f"{iterations_done * args.batch_size}): params sha256 {digest(on_devices.params)}, opt_state sha256 "
        f"{digest(on_devices.opt_state)}, optimizer step {int(on_devices.step)}{replayed}; its last games' returns "
        f"{episode_window['returns'].tolist()}",
        flush=True,
    )
    if iterations_done >= args.num_iterations:  # e.g. a requeued job, or a run stopped in its last iteration
        print(
            f"rank {args.process_index}: nothing to train, the checkpoint is of the last iteration "
            f"({args.num_iterations})",
            flush=True,
        )
    return iterations_done, placed, episode_window, memory or None


def save_run_checkpoint(run) -> bool:
    """A checkpoint of a script's TrainingRun: its args, train state, last iteration, its logger's last games and
    its replay memory. Every process calls it (the memory is gathered from all); process 0 writes it (True)."""
    memory = replay.to_host(run.replay)
    if run.logger is None:
        return False
    window = run.logger.episode_window()
    save_checkpoint(
        checkpoint_path(run.run_dir), asdict(run.args), host_copy(run.state), run.iterations_done, window, memory
    )
    if memory:
        size = checkpoint_path(run.run_dir).stat().st_size / 2**20
        print(f"checkpoint of iteration {run.iterations_done}: {size:.1f} MiB on disk", flush=True)
    return True


def save_trained_model(run, script: str) -> Path:
    """The end of a --save-model run (a training script's TrainingRun): runs/<run_name>/<exp_name>.cleanba_model."""
    path = run.run_dir / f"{run.args.exp_name}.cleanba_model"
    save_model(path, script, asdict(run.args), host_copy(run.state.params))
    print(f"model saved to {path}", flush=True)
    return path
