"""What a run logs (docs/metrics.md): its start line (print_start); where an actor's rollout time goes (Stopwatch)
and the scores of its games (GameScores); and, on process 0, the learner's stats/, charts/ and losses/ in TensorBoard
(and wandb with --track) with the console line (IterationLogger).
"""

import os
import time
from collections import deque
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import jax
import numpy as np
import optax
from tensorboardX import SummaryWriter

from cleanba.reductions import split_envs
from cleanba.replicas import params_checksum, unreplicate


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
    saved and the tests it had not logged (episode_window). compile_time, the seconds the learner update took to
    compile ahead of time, is logged once, as stats/learner_compile_time at the first iteration this process logs.
    The test curve's Tester (cleanba/evaluate.py, with --test-frequency) is handed each iteration's params."""

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
        self.unplayed_tests = {}  # iteration -> params, for the Tester
        if episode_window is not None:
            self.recent_returns.extend(episode_window["returns"].tolist())
            self.recent_lengths.extend(episode_window["lengths"].tolist())
            self.unplayed_tests = episode_window.get("tests", {})
        self.window_start, self.window_steps = time.time(), 0
        self.compile_time, self.tester = compile_time, None

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
        if iteration % args.log_frequency == 0 or iteration == args.num_iterations:
            self.log_curves(iteration, stats, state, metrics)
        if self.tester:  # last: a stop while the learner waits to hand over a test loses none of these points
            self.tester.test(iteration, state.params)

    def log_curves(self, iteration: int, stats: dict, state, metrics):
        """charts/, losses/ and the console line, every log_frequency iterations."""
        args, writer, global_step = self.args, self.writer, iteration * self.args.batch_size
        for key, value in jax.device_get(unreplicate(metrics)).items():
            writer.add_scalar(key if "/" in key else f"losses/{key}", float(value), global_step)
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
        """What a checkpoint saves of the logs: the returns and lengths of the last 20 games, oldest first, and the
        test curve's unplayed tests, {"iteration": params} (cleanba/evaluate.py's Tester)."""
        tests = self.tester.unplayed_tests() if self.tester else {}
        window = {"returns": np.array(self.recent_returns), "lengths": np.array(self.recent_lengths)}
        return window | {"tests": {str(iteration): params for iteration, params in tests.items()}}

    def close(self):
        self.writer.close()
        if self.args.track:
            import wandb

            wandb.finish()
