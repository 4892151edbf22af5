"""Evaluate a saved Cleanba model: play N episodes with the training wrappers, record videos, upload to the Hub.

    python -m cleanba.evaluate runs/<run_name>/cleanba_ppo.cleanba_model --episodes 10 --capture-video
    python -m cleanba.evaluate MODEL --greedy --upload-model --hf-repo-id my-name/breakout-cleanba-ppo
    python -m cleanba.evaluate runs/<run_name>/checkpoint.msgpack --episodes 10   # a run not finished yet

The model file (written by a training script's --save-model) holds the args and params; the network and
the env wrappers come from the training script that wrote it (its file name is in the model file; --script
points at a fork elsewhere), so evaluation sees exactly what training saw: the same Atari protocol, frame
stack, sticky actions and episode cap. Returns are raw game scores of whole games (unclipped; a lost life does
not end a game), as the training scripts' charts/episodic_return.

Each training script runs `evaluate_after_training` at the end of a --save-model run : it
logs eval/episodic_return (one point per episode, x = episode index) next to the run's other curves, writes
videos to runs/<run_name>/videos/ with --capture-video, and uploads with --upload-model.
"""

import importlib.util
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from cleanba.startup import hide_cuda_plugin, known_env

if __name__ == "__main__":  # the program, not a module imported by a test or a tool
    hide_cuda_plugin()  # before anything imports JAX: no CUDA plugin noise where the machine has no GPU

import numpy as np
import tyro

from cleanba import spaces
from cleanba.checkpoint import Unreadable, load_model
from cleanba.family import FAMILY
from cleanba.flags import check_hub_login, fail
from cleanba.lifetime import queue_get, queue_put, stops_run_on_error
from cleanba.logs import GameScores
from cleanba.replicas import unreplicate

VIDEO_FPS = 30  # agent steps per second of video; an Atari agent step is 4 frames of the 60 Hz game


@dataclass
class Args:
    model: tyro.conf.Positional[Path]
    """a .cleanba_model file written by --save-model, or a run's checkpoint.msgpack (its params at that iteration)"""
    episodes: int = 10
    """the number of episodes to play"""
    num_envs: int = 8
    """envs played in parallel (at most --episodes); each plays its share of the episodes"""
    greedy: bool = False
    """take the most likely action (PQN: the largest Q; SAC: the tanh of the means) instead of sampling as the actors
    do (PQN: epsilon-greedy at the run's final epsilon)"""
    seed: int | None = None
    """seed of the evaluation envs and action sampling (default: the run's seed, on envs that training never used)"""
    env_kwargs: tuple[str, ...] = ()
    """EnvPool options as KEY=VALUE over the run's --env-kwargs: e.g. Procgen's unseen levels, num_levels=0"""
    capture_video: bool = False
    """record the episodes of the first env to MP4 files in --video-dir"""
    video_dir: Path | None = None
    """where videos go (default: a videos/ folder next to the model)"""
    script: Path | None = None
    """the training script that defines the network and env wrappers (default: the one named in the model file)"""
    log_dir: Path | None = None
    """also write eval/episodic_return to TensorBoard event files in this directory"""
    upload_model: bool = False
    """upload the model, its evaluation returns, videos and a model card to the Hugging Face Hub"""
    hf_repo_id: str | None = None
    """the Hub repository, e.g. my-name/breakout-cleanba-ppo (default: <your user>/<env_id>-<exp_name>-seed<seed>)"""


def load_script(path: Path):
    """Import a training script by file path, so that a forked script anywhere can be evaluated."""
    name = f"cleanba_script_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and tyro resolve the Args annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def script_of(model_path: Path, name: str | None, script: Path | None) -> Path:
    """--script, or the training script of this checkout named in the model file."""
    if script is not None:
        return script
    candidate = Path(__file__).with_name(name) if name else None
    if candidate is None or not candidate.exists():
        fail(
            f"{model_path} does not name a training script of this checkout ({name}); pass --script PATH of the "
            "script that trained it"
        )
    return candidate


def episode_quotas(episodes: int, num_envs: int) -> np.ndarray:
    """Each env plays a fixed share, so the set of episodes does not favour short ones (first-finished bias)."""
    return np.full(num_envs, episodes // num_envs) + (np.arange(num_envs) < episodes % num_envs)


def args_of_model(module, saved: dict):
    """The script's Args from a saved model's args. Entries that are no longer fields (the run-time sizes of older
    versions, such as local_rank, now process_index) are left out: they do not change the network or the envs."""
    names = {f.name for f in fields(module.Args)}
    return module.Args(**{name: value for name, value in saved.items() if name in names})


def check_params(model: Path, script_path: Path, module, train_args, params):
    """Refuse, in one line, params that the script's network does not take (another script's model, say)."""
    import envpool
    import jax

    known_env(train_args.env_id)
    spec = envpool.make_spec(train_args.env_id, **module.env_kwargs(train_args))
    shape, dtype = spaces.observation_field(spec.observation_space)
    obs = jax.ShapeDtypeStruct((1, *shape), dtype)
    agent = module.make_network(train_args, spec.action_space)
    expected = jax.eval_shape(agent.init, jax.random.key(0), obs)

    def shapes(tree):
        return {jax.tree_util.keystr(path): np.shape(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}

    want, got = shapes(expected), shapes(params)
    if want != got:
        (first, *_) = sorted(set(want.items()) ^ set(got.items()), key=str)
        fail(
            f"{model}'s params do not fit {script_path.name}'s network (first difference: {first[0]} {first[1]}); "
            "give --script the training script that wrote it"
        )


def write_video(path: Path, frames: list):
    import imageio

    # imageio starts ffmpeg with subprocess (fork then exec at once), which JAX's fork warning does not concern.
    warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
    path.parent.mkdir(parents=True, exist_ok=True)
    # macro_block_size 2: keep the game's own size (yuv420p needs even sides; 210x160 and 400x600 are even).
    with imageio.get_writer(path, fps=VIDEO_FPS, codec="libx264", macro_block_size=2) as writer:
        for frame in frames:
            writer.append_data(frame)


def evaluate(
    module,
    train_args,
    params,
    episodes: int,
    num_envs: int = 8,
    greedy: bool = False,
    seed: int | None = None,
    video_dir: Path | None = None,
    interrupted=lambda: False,
    act=None,
    env_kwargs: dict | None = None,
) -> tuple:
    """Play `episodes` whole games with the training script's network and wrappers (act: the policy of
    spaces.make_eval_policy, and env_kwargs: EnvPool's options, by default the script's for train_args). Returns
    (returns, lengths, video paths); episode i of the result is the i-th to finish. Stops early when interrupted()
    is true."""
    import envpool
    import jax

    known_env(train_args.env_id)  # its family registered: the scripts' start registers only their own
    num_envs = max(1, min(num_envs, episodes))
    # Training envs are seeded seed + 0 .. num_envs - 1; start after them so evaluation plays unseen envs.
    seed = train_args.seed + train_args.num_envs if seed is None else seed
    recording = video_dir is not None
    kwargs = module.env_kwargs(train_args) if env_kwargs is None else env_kwargs
    kwargs = dict(kwargs, **({"render_mode": "rgb_array"} if recording else {}))
    envs = envpool.make(train_args.env_id, "gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seed, **kwargs)
    spec = envs.spec
    if act is None:
        act = spaces.make_eval_policy(module, module.make_network(train_args, spec.action_space), greedy, train_args)
    key = jax.random.key(seed)
    quotas, played = episode_quotas(episodes, num_envs), np.zeros(num_envs, np.int64)
    scores, resetting = GameScores(num_envs), np.zeros(num_envs, bool)
    # A recurrent network's state, per env, restarted at each episode's first obs (starts), as in training.
    state, starts = np.zeros((num_envs, module.recurrent_state_size(train_args)), np.float32), np.ones(num_envs, bool)
    returns, lengths, videos, frames = [], [], [], []
    try:
        obs, info = envs.reset()
        if recording:
            frames.append(envs.render(env_ids=[0])[0])
        while np.any(played < quotas) and not interrupted():
            key, step_key = jax.random.split(key)
            actions, state = act(params, spaces.flat_observations(obs, spec.observation_space), state, starts, step_key)
            actions = module.env_actions(np.asarray(actions), spec.action_space)
            obs, reward, terminated, truncated, info = envs.step(actions)
            if recording and played[0] < quotas[0]:
                # After a game over, the next step is EnvPool's auto-reset: its frame starts the next episode.
                frames.append(envs.render(env_ids=[0])[0])
            # Raw scores, not the clipped training reward; EnvPool's reset steps (after a game over or a lost life)
            # ignore the action and do not count; a lost life is not a game over.
            game_over = info.get("terminated", terminated).astype(bool) | truncated
            ended_returns, ended_lengths = scores.step(info.get("reward", reward), ~resetting, game_over)
            starts, resetting = resetting, terminated | truncated
            for i in np.flatnonzero(game_over):
                if played[i] < quotas[i]:
                    returns.append(float(ended_returns[i]))
                    lengths.append(int(ended_lengths[i]))
                    if i == 0 and recording:
                        videos.append(video_dir / f"{train_args.env_id}-episode-{played[0]}.mp4")
                        write_video(videos[-1], frames)
                        frames = []
                    played[i] += 1
    finally:
        envs.close()
    return returns, lengths, videos


def with_options(args, pairs) -> object:
    """args whose --env-kwargs are theirs with the KEY=VALUE pairs over them (a key given again takes the new value)."""
    merged = {pair.partition("=")[0]: pair for pair in [*args.env_kwargs, *pairs]}
    return replace(args, env_kwargs=tuple(merged.values()))


def start_tests(module, logger, stop):
    """With --test-frequency, the run's test curve: process 0's Tester, handed each iteration's params by logger,
    first playing the tests that the run it resumes had not logged (its checkpoint's)."""
    if logger.args.test_frequency:
        logger.tester = Tester(module, logger.args, stop, logger.writer, logger.unplayed_tests)


class Tester:
    """The test curve (--test-frequency): a thread that plays --eval-episodes games with the params of every
    --test-frequency-th iteration and of the last, on the test envs (--test-env-kwargs over --env-kwargs: Procgen's
    unseen levels, say), sampling as the actors do, and logs their mean as test/episodic_return (and
    test/episodic_length) at that iteration's step. The games are those of `evaluate`, on the same env seeds at every
    test: with --exact, the same curve on every layout. The learner hands it params through a queue of one: it waits
    only while a test is still queued, and at the last iteration until the tests end. A test handed over and not yet
    logged is unplayed: a checkpoint keeps those (a stop ends a test unlogged, and the learner may be iterations
    ahead), and the resumed run plays them first, so no point of the curve is lost to a stop."""

    def __init__(self, module, args, stop, writer, unplayed=None):
        import envpool

        self.module, self.args, self.stop, self.writer = module, args, stop, writer
        self.env_kwargs = module.env_kwargs(args, test=True)
        spec = envpool.make_spec(args.env_id, **self.env_kwargs)
        self.act = spaces.make_eval_policy(module, module.make_network(args, spec.action_space), False, args)
        self.queue, self.done = queue.Queue(maxsize=1), threading.Event()
        self.unplayed, self.lock = dict(sorted((unplayed or {}).items())), threading.Lock()  # iteration -> params
        self.thread = threading.Thread(target=stops_run_on_error(self.work), args=(stop,), name="tester", daemon=True)
        self.thread.start()

    def test(self, iteration: int, params):
        """Queue a test of the learner's params (a host copy) if iteration is one to test; at the last, wait for the
        tests."""
        import jax

        last = iteration == self.args.num_iterations
        if iteration % self.args.test_frequency == 0 or last:
            params = jax.device_get(unreplicate(params))
            with self.lock:
                self.unplayed[iteration] = params
            queue_put(self.queue, iteration, self.stop)
        if last:
            queue_put(self.queue, None, self.stop)
            while not self.done.wait(0.2) and not self.stop.is_set():
                pass

    def unplayed_tests(self) -> dict:
        """{iteration: params} of the tests handed over and not yet logged: what a checkpoint keeps."""
        with self.lock:
            return dict(self.unplayed)

    def work(self, stop):
        resumed = list(self.unplayed)  # the checkpoint's, before any of this run's
        while (iteration := resumed.pop(0) if resumed else queue_get(self.queue, stop)) is not None:
            games = evaluate(
                self.module,
                self.args,
                self.unplayed[iteration],
                self.args.eval_episodes,
                interrupted=stop.is_set,
                act=self.act,
                env_kwargs=self.env_kwargs,
            )
            if stop.is_set():
                return
            step = iteration * self.args.batch_size
            self.writer.add_scalar("test/episodic_return", np.mean(games[0]), step)
            self.writer.add_scalar("test/episodic_length", np.mean(games[1]), step)
            with self.lock:
                del self.unplayed[iteration]
            print(f"test at step {step:,}: {summary(games[0])}", flush=True)
        self.done.set()


def log_returns(writer, returns: list):
    for episode, value in enumerate(returns):
        writer.add_scalar("eval/episodic_return", value, episode)


def summary(returns: list) -> str:
    return f"{len(returns)} episodes, return {np.mean(returns):.2f} +- {np.std(returns):.2f}"


def model_card(train_args: dict, returns: list, script_name: str, repo_id: str, videos: list) -> str:
    """A Hub model card: metadata the Hub indexes (model-index results), then how to reproduce and evaluate."""
    env_id, exp_name = train_args["env_id"], train_args["exp_name"]
    known = {script.path.name: script.algorithm for script in FAMILY.values()}
    algorithm = known.get(script_name, script_name)  # a fork: its file's name
    mean, std = float(np.mean(returns)), float(np.std(returns))
    flags = " ".join(
        f"--{key.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        for key, value in (
            ("env_id", env_id),
            ("seed", train_args["seed"]),
            ("total_timesteps", train_args["total_timesteps"]),
        )
    )
    video_line = f"\nVideo of an evaluation episode: `{videos[0].name}`.\n" if videos else ""
    return f"""---
library_name: cleanba
tags:
- {env_id}
- deep-reinforcement-learning
- reinforcement-learning
- cleanba
model-index:
- name: {algorithm}
  results:
  - task:
      type: reinforcement-learning
      name: reinforcement-learning
    dataset:
      name: {env_id}
      type: {env_id}
    metrics:
    - type: mean_reward
      value: {mean:.2f} +/- {std:.2f}
      name: mean_reward
      verified: false
---

# {algorithm} agent playing {env_id}

Trained with Cleanba's `{script_name}` (experiment `{exp_name}`): {len(returns)} evaluation episodes scored
{mean:.2f} +/- {std:.2f} (raw game score; `eval_returns.json` has each episode).
{video_line}
## Reproduce

```bash
python cleanba/{script_name} {flags} --save-model
```

`args.json` holds every hyperparameter of the run, including the device layout (the learning curve does not
depend on it).

## Evaluate

```bash
huggingface-cli download {repo_id} --local-dir model
python -m cleanba.evaluate model/{exp_name}.cleanba_model --script model/{script_name} --episodes 10
```
"""


def build_hub_folder(
    folder: Path,
    model_path: Path,
    script_path: Path,
    train_args: dict,
    returns: list,
    lengths: list,
    videos: list,
    repo_id: str,
) -> Path:
    """Everything the Hub repository holds, in a local folder: model, script, args, returns, videos, card."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(model_path, folder / model_path.name)
    shutil.copy2(script_path, folder / script_path.name)
    (folder / "args.json").write_text(json.dumps(train_args, indent=2))
    (folder / "eval_returns.json").write_text(json.dumps({"episodic_return": returns, "episodic_length": lengths}))
    for video in videos:
        shutil.copy2(video, folder / video.name)
    (folder / "README.md").write_text(model_card(train_args, returns, script_path.name, repo_id, videos))
    return folder


def default_repo_id(train_args: dict) -> str:
    from huggingface_hub import HfApi

    user = HfApi().whoami()["name"]
    return f"{user}/{train_args['env_id']}-{train_args['exp_name']}-seed{train_args['seed']}"


def upload(
    model_path: Path,
    script_path: Path,
    train_args: dict,
    returns: list,
    lengths: list,
    videos: list,
    repo_id: str | None,
) -> str:
    from huggingface_hub import HfApi

    repo_id = repo_id or default_repo_id(train_args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_hub_folder(Path(tmp), model_path, script_path, train_args, returns, lengths, videos, repo_id)
        api = HfApi()
        api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=f"{summary(returns)}")
    print(f"uploaded to https://huggingface.co/{repo_id}", flush=True)
    return repo_id


def evaluate_after_training(module, run):
    """The end of a --save-model run (run: the training script's TrainingRun): evaluate the saved params, log
    eval/episodic_return, record, upload. A signal (run.stop) interrupts it."""
    start, args = time.time(), run.args
    params = load_model(run.model_path)[1]  # what the file holds: the round trip is part of what is evaluated
    video_dir = run.run_dir / "videos" if args.capture_video else None

    def interrupted() -> bool:
        return bool(run.stop.signals)

    returns, lengths, videos = evaluate(
        module, args, params, args.eval_episodes, video_dir=video_dir, interrupted=interrupted
    )
    if interrupted():
        return
    log_returns(run.logger.writer, returns)
    print(
        f"evaluation: {summary(returns)} ({time.time() - start:.0f} s)"
        + (f", videos in {video_dir}" if videos else ""),
        flush=True,
    )
    if args.upload_model:
        upload(run.model_path, Path(module.__file__), asdict(args), returns, lengths, videos, args.hf_repo_id)


def main(args: Args):
    if args.episodes < 1 or args.num_envs < 1:
        fail(f"--episodes={args.episodes} and --num-envs={args.num_envs} must be at least 1")
    if not args.model.is_file():
        fail(
            f"{args.model} is not a file; give the .cleanba_model written by a training run's --save-model, or its "
            "checkpoint.msgpack"
        )
    if args.upload_model and args.model.suffix != ".cleanba_model":
        fail(f"--upload-model uploads a .cleanba_model (params and args only), not {args.model.name}")
    if args.upload_model:
        check_hub_login()
    try:
        train_args_dict, params, script_name = load_model(args.model)
    except Unreadable as error:
        fail(f"{error}; give the .cleanba_model written by a training run's --save-model, or its checkpoint.msgpack")
    script_path = script_of(args.model, script_name, args.script)
    module = load_script(script_path)
    train_args = with_options(args_of_model(module, train_args_dict), args.env_kwargs)
    check_params(args.model, script_path, module, train_args, params)
    if args.capture_video:
        spaces.check_video(train_args.env_id)
    video_dir = (args.video_dir or args.model.parent / "videos") if args.capture_video else None
    returns, lengths, videos = evaluate(
        module, train_args, params, args.episodes, args.num_envs, args.greedy, args.seed, video_dir
    )
    for episode, (value, length) in enumerate(zip(returns, lengths)):
        print(f"episode {episode}: return {value:.2f}, length {length}")
    print(f"{train_args.env_id}: {summary(returns)}" + (f"; videos: {', '.join(map(str, videos))}" if videos else ""))
    if args.log_dir is not None:
        from tensorboardX import SummaryWriter

        with SummaryWriter(str(args.log_dir)) as writer:
            log_returns(writer, returns)
    if args.upload_model:
        upload(args.model, script_path, train_args_dict, returns, lengths, videos, args.hf_repo_id)


if __name__ == "__main__":
    main(tyro.cli(Args, prog="python -m cleanba.evaluate", description=__doc__))
