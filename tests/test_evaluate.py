"""Evaluation of saved models: the end-of-training evaluation, the CLI, videos, and the Hub folder and card."""

import json
import subprocess
import sys

import imageio
import pytest
import yaml
from support import ROOT, TINY, check_ok, run_dir, run_script, scalars, script_env

EVALUATE = [sys.executable, "-m", "cleanba.evaluate"]
NO_HUB_TOKEN = {"HF_TOKEN": "", "HF_HUB_OFFLINE": "1"}  # and HF_HOME in tmp_path: no token anywhere


def video_frames(path) -> int:
    with imageio.get_reader(path) as reader:
        return reader.count_frames()


def train_and_save(script, tmp_path, extra=()):
    process = run_script(
        script,
        [
            *TINY[script],
            "--local-num-envs",
            4,
            "--num-actor-threads",
            1,
            "--total-timesteps",
            256,
            "--save-model",
            *extra,
        ],
        tmp_path,
    )
    check_ok(process)
    (model,) = run_dir(tmp_path).glob("*.cleanba_model")
    return process, model


@pytest.mark.slow
def test_training_evaluates_and_records_the_saved_model(script, tmp_path):
    process, _ = train_and_save(script, tmp_path, ["--eval-episodes", 3, "--capture-video"])
    assert "evaluation: 3 episodes" in process.stdout
    logged = scalars(run_dir(tmp_path))
    assert [step for step, _ in logged["eval/episodic_return"]] == [0, 1, 2]
    # CartPole pays 1 per step: every return is a whole episode of at least 8 steps (the shortest possible).
    assert all(value >= 8 for _, value in logged["eval/episodic_return"])
    videos = sorted((run_dir(tmp_path) / "videos").glob("*.mp4"))
    assert [video.name for video in videos] == ["CartPole-v1-episode-0.mp4"]  # env 0's share of 3 over 3 envs
    assert video_frames(videos[0]) >= 9  # the reset frame and one per step


@pytest.mark.slow
def test_cli_plays_the_asked_episodes_with_video(tmp_path):
    _, model = train_and_save("impala", tmp_path, ["--eval-episodes", 0])
    assert not (run_dir(tmp_path) / "videos").exists()
    command = [
        *EVALUATE,
        model,
        "--episodes",
        5,
        "--num-envs",
        2,
        "--greedy",
        "--capture-video",
        "--video-dir",
        tmp_path / "videos",
        "--log-dir",
        tmp_path / "eval-log",
    ]
    process = subprocess.run(
        list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
    )
    check_ok(process)
    lengths = [int(line.rsplit(" ", 1)[1]) for line in process.stdout.splitlines() if line.startswith("episode ")]
    assert len(lengths) == 5 and "CartPole-v1: 5 episodes" in process.stdout
    assert len(scalars(tmp_path / "eval-log")["eval/episodic_return"]) == 5
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 3  # env 0 plays 3 of the 5 episodes
    # Each video holds one of the printed episodes: its first frame, then one per step.
    assert all(video_frames(video) - 1 in lengths for video in videos)


@pytest.mark.slow
def test_cli_plays_a_checkpoint_as_the_model_of_its_iteration(tmp_path):
    """A run stopped before its end has no .cleanba_model: its checkpoint is evaluated instead. The last
    iteration's checkpoint holds the params the model file holds, so both play the same games."""
    _, model = train_and_save("ppo", tmp_path, ["--eval-episodes", 0, "--checkpoint-frequency", 1])
    checkpoint = run_dir(tmp_path) / "checkpoint.msgpack"

    def play(path):
        command = [*EVALUATE, path, "--episodes", 4, "--num-envs", 2, "--seed", 7]
        process = subprocess.run(
            list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
        )
        check_ok(process)
        return [line for line in process.stdout.splitlines() if line.startswith("episode ")]

    games = play(checkpoint)
    assert len(games) == 4 and games == play(model)
    refused = subprocess.run(
        list(map(str, [*EVALUATE, checkpoint, "--upload-model"])),
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "--upload-model uploads a .cleanba_model" in refused.stderr


def cartpole_games(choose, episodes: int, num_envs: int, seed: int) -> list:
    """A plain EnvPool loop playing CartPole with choose(obs, starts) -> actions (starts: the obs begins a game):
    each game's length, in the order games end, each env playing its share of the episodes (the step after a game
    over is EnvPool's reset: not counted, and the next obs begins a game)."""
    import envpool
    import numpy as np

    envs = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seed)
    obs, _ = envs.reset()
    starts = np.ones(num_envs, bool)
    quotas = [episodes // num_envs + (i < episodes % num_envs) for i in range(num_envs)]
    played, steps, resetting, games = [0] * num_envs, [0] * num_envs, [False] * num_envs, []
    while played != quotas:
        obs, _, terminated, truncated, _ = envs.step(choose(obs, starts))
        starts = np.array(resetting)
        for i in range(num_envs):
            steps[i] += not resetting[i]
            resetting[i] = bool(terminated[i] or truncated[i])
            if resetting[i]:
                if played[i] < quotas[i]:
                    games.append(steps[i])
                    played[i] += 1
                steps[i] = 0
    envs.close()
    return games


def constant_action_games(action: int, episodes: int, num_envs: int, seed: int) -> list:
    """cartpole_games with one action always."""
    import numpy as np

    return cartpole_games(lambda obs, starts: np.full(num_envs, action), episodes, num_envs, seed)


@pytest.mark.slow
def test_cli_plays_the_params_of_the_model(tmp_path):
    """Two models whose policy heads always pick action 0, and always action 1 (zero weights, a bias of +-10):
    the CLI's greedy games are, length for length, those of a plain loop playing that action, so the evaluation
    plays the params it loads (the two loops' games differ, so ignoring the params cannot match both)."""
    import jax
    import numpy as np

    from cleanba.checkpoint import load_model, save_model

    _, model = train_and_save("ppo", tmp_path, ["--eval-episodes", 0])
    args, params, script = load_model(model)
    games = {}
    for action in (0, 1):
        forced = jax.tree.map(np.array, params)  # a copy
        (head,) = [layer for layer in forced["params"].values() if np.shape(layer.get("bias")) == (2,)]
        head["kernel"] = np.zeros_like(head["kernel"])
        head["bias"] = np.array([10.0, -10.0] if action == 0 else [-10.0, 10.0], np.float32)
        path = tmp_path / f"action{action}.cleanba_model"
        save_model(path, script, args, forced)
        command = [*EVALUATE, path, "--episodes", 6, "--num-envs", 2, "--seed", 7, "--greedy"]
        process = subprocess.run(
            list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
        )
        check_ok(process)
        games[action] = [
            int(line.rsplit(" ", 1)[1]) for line in process.stdout.splitlines() if line.startswith("episode ")
        ]
        assert games[action] == constant_action_games(action, 6, 2, seed=7), process.stdout
    assert games[0] != games[1], games


@pytest.mark.slow
def test_pqn_cli_plays_the_largest_q_or_epsilon_greedy(tmp_path):
    """A PQN model whose Q head prefers action 0 (zero weights, biases +-10): greedy, and epsilon-greedy at a final
    epsilon of 0, the CLI plays the games of a plain loop always pushing left; at a final epsilon of 1 (every action
    a draw) it plays others. Its Hub card names PQN and evaluates with PQN's script."""
    import jax
    import numpy as np

    from cleanba.checkpoint import load_model, save_model
    from cleanba.evaluate import build_hub_folder

    _, model = train_and_save("pqn", tmp_path, ["--eval-episodes", 0])
    args, params, script = load_model(model)

    def play(end_e: float, greedy: bool) -> list:
        forced = jax.tree.map(np.array, params)  # a copy
        (head,) = [layer for layer in forced["params"].values() if np.shape(layer.get("bias")) == (2,)]
        head["kernel"], head["bias"] = np.zeros_like(head["kernel"]), np.array([10.0, -10.0], np.float32)
        path = tmp_path / f"forced{end_e}.cleanba_model"
        save_model(path, script, {**args, "end_e": end_e}, forced)
        command = [*EVALUATE, path, "--episodes", 6, "--num-envs", 2, "--seed", 7, *["--greedy"] * greedy]
        process = subprocess.run(
            list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
        )
        check_ok(process)
        return [int(line.rsplit(" ", 1)[1]) for line in process.stdout.splitlines() if line.startswith("episode ")]

    left = constant_action_games(0, 6, 2, seed=7)
    assert play(0.0, greedy=True) == left and play(0.0, greedy=False) == left
    assert play(1.0, greedy=True) == left and play(1.0, greedy=False) != left
    folder = build_hub_folder(tmp_path / "hub", model, ROOT / "cleanba" / script, args, [9.0], [9], [], "me/cartpole")
    card = (folder / "README.md").read_text()
    assert "- name: PQN" in card and "# PQN agent playing CartPole-v1" in card, card
    assert f"--script model/{script}" in card, card


def lstm_greedy_games(params, train_args: dict, episodes: int, num_envs: int, seed: int, carry: bool) -> list:
    """A plain loop playing CartPole greedily with an --lstm model through cleanba_impala.policy_step: each env's
    recurrent state carried from step to step and restarted from zeros at each game's first obs (carry=False: from
    zeros at every step); each game's length, in the order games end, each env playing its share."""
    import gymnasium
    import jax
    import numpy as np

    from cleanba import cleanba_impala as module
    from cleanba.evaluate import args_of_model

    args = args_of_model(module, train_args)
    agent = module.make_network(args, gymnasium.spaces.Discrete(2))
    step = jax.jit(lambda p, o, s, r: module.policy_step(agent, p, o, s, r))
    state = [np.zeros((num_envs, module.recurrent_state_size(args)), np.float32)]

    def choose(obs, starts):
        logits, state[0] = step(params, obs.astype(np.float32), state[0], starts if carry else np.ones_like(starts))
        return np.asarray(np.argmax(logits, axis=1))

    return cartpole_games(choose, episodes, num_envs, seed)


@pytest.mark.slow
def test_cli_carries_the_recurrent_state_of_an_lstm_model(tmp_path):
    """An --lstm model whose policy head reads only the LSTM's hidden state (weights scaled up, zero bias): the
    CLI's greedy games are, length for length, those of a plain loop carrying each env's state from step to step
    and restarting it at each game, and not those of the same loop restarting it at every step."""
    import jax
    import numpy as np

    from cleanba.checkpoint import load_model, save_model

    _, model = train_and_save("impala", tmp_path, ["--lstm", "--lstm-size", 8, "--eval-episodes", 0])
    args, params, script = load_model(model)
    forced = jax.tree.map(np.array, params)  # a copy
    (head,) = [layer for layer in forced["params"].values() if np.shape(layer.get("bias")) == (2,)]
    head["kernel"], head["bias"] = 100 * head["kernel"], np.zeros_like(head["bias"])
    path = tmp_path / "forced.cleanba_model"
    save_model(path, script, args, forced)
    command = [*EVALUATE, path, "--episodes", 6, "--num-envs", 2, "--seed", 7, "--greedy"]
    process = subprocess.run(
        list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
    )
    check_ok(process)
    games = [int(line.rsplit(" ", 1)[1]) for line in process.stdout.splitlines() if line.startswith("episode ")]
    assert games == lstm_greedy_games(forced, args, 6, 2, seed=7, carry=True), process.stdout
    assert games != lstm_greedy_games(forced, args, 6, 2, seed=7, carry=False), games


def cli_games(path, greedy: bool) -> list:
    """(length, return) of the 4 games the CLI plays with the model at path on 2 envs, seed 7."""
    command = [*EVALUATE, path, "--episodes", 4, "--num-envs", 2, "--seed", 7, *["--greedy"] * greedy]
    process = subprocess.run(
        list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
    )
    check_ok(process)
    lines = [line.split() for line in process.stdout.splitlines() if line.startswith("episode ")]
    return [(int(line[-1]), float(line[3].rstrip(","))) for line in lines]


def constant_box_games(env_id: str, action, episodes: int, num_envs: int, seed: int, kwargs: dict) -> list:
    """A plain EnvPool loop sending one continuous action always: (length, return) of each game, in the order games
    end, each env playing its share (the step after a game over is EnvPool's reset: not counted)."""
    import envpool
    import numpy as np

    envs = envpool.make(env_id, "gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seed, **kwargs)
    envs.reset()
    quotas = [episodes // num_envs + (i < episodes % num_envs) for i in range(num_envs)]
    played, steps, returns = [0] * num_envs, [0] * num_envs, [0.0] * num_envs
    resetting, games = [False] * num_envs, []
    while played != quotas:
        _, reward, terminated, truncated, _ = envs.step(np.tile(np.asarray(action, np.float32), (num_envs, 1)))
        for i in range(num_envs):
            if not resetting[i]:
                steps[i], returns[i] = steps[i] + 1, returns[i] + float(reward[i])
            resetting[i] = bool(terminated[i] or truncated[i])
            if resetting[i]:
                if played[i] < quotas[i]:
                    games.append((steps[i], returns[i]))
                    played[i] += 1
                steps[i], returns[i] = 0, 0.0
    envs.close()
    return games


@pytest.mark.slow
def test_continuous_cli_plays_the_clipped_means_or_samples(tmp_path):
    """The continuous script's saved model (Hopper-v4, evaluated at the end of training too), with its policy's means
    forced to (2, -2, 0.5) (zero weights, that bias): greedy, and sampled at a standard deviation of e^-20, the CLI
    plays the games of a plain loop sending the clipped action (1, -1, 0.5) (unclipped, MuJoCo's control cost would
    differ); at a standard deviation of 1, sampled games differ from greedy ones."""
    import jax
    import numpy as np
    import tyro

    from cleanba import cleanba_ppo_continuous as module
    from cleanba.checkpoint import load_model, save_model

    process, model = train_and_save("ppo_continuous", tmp_path, ["--eval-episodes", 2])
    assert "evaluation: 2 episodes" in process.stdout
    args, params, script = load_model(model)

    def play(log_std: float, greedy: bool) -> list:
        forced = jax.tree.map(np.array, params)  # a copy
        layers = [layer for layer in forced["params"].values() if isinstance(layer, dict)]
        (head,) = [layer for layer in layers if np.shape(layer["bias"]) == (3,)]
        head["kernel"] = np.zeros_like(head["kernel"])
        head["bias"] = np.array([2.0, -2.0, 0.5], np.float32)
        forced["params"]["log_std"] = np.full(3, log_std, np.float32)
        path = tmp_path / f"forced{log_std}.cleanba_model"
        save_model(path, script, args, forced)
        return cli_games(path, greedy)

    train_args = tyro.cli(module.Args, args=["--env-id", "Hopper-v4"])
    module.check_args(train_args)  # registers EnvPool's MuJoCo family, as a run does
    reference = constant_box_games("Hopper-v4", [1.0, -1.0, 0.5], 4, 2, 7, module.env_kwargs(train_args))
    for greedy in (True, False):
        games = play(-20.0, greedy)
        assert [length for length, _ in games] == [length for length, _ in reference], (games, reference)
        np.testing.assert_allclose([r for _, r in games], [r for _, r in reference], atol=0.01)
    assert play(0.0, greedy=False) != play(0.0, greedy=True)
    # Its Hub folder: the continuous script beside the model, and a card that evaluates it with that script.
    from cleanba.evaluate import build_hub_folder

    script_path = ROOT / "cleanba" / "cleanba_ppo_continuous.py"
    folder = build_hub_folder(tmp_path / "hub", model, script_path, args, [1.0, 3.0], [9, 11], [], "me/hopper")
    assert (folder / "cleanba_ppo_continuous.py").read_bytes() == script_path.read_bytes()
    card = (folder / "README.md").read_text()
    assert "name: Hopper-v4" in card and "value: 2.00 +/- 1.00" in card, card
    command = (
        "python -m cleanba.evaluate model/cleanba_ppo_continuous.cleanba_model --script model/cleanba_ppo_continuous.py"
    )
    assert command in card, card


@pytest.mark.slow
def test_cli_on_atari_scores_whole_games(tmp_path):
    """Machado protocol: no life-loss signal, so an episode is a whole game of Breakout (5 lives)."""
    process = run_script(
        "ppo",
        [
            "--env-id",
            "Breakout-v5",
            "--channels",
            4,
            "--hidden-dim",
            16,
            "--local-num-envs",
            2,
            "--num-actor-threads",
            1,
            "--num-steps",
            8,
            "--num-minibatches",
            1,
            "--update-epochs",
            1,
            "--total-timesteps",
            16,
            "--save-model",
            "--eval-episodes",
            0,
        ],
        tmp_path,
    )
    check_ok(process)
    (model,) = run_dir(tmp_path).glob("*.cleanba_model")
    command = [*EVALUATE, model, "--episodes", 1, "--capture-video", "--video-dir", tmp_path / "videos"]
    process = subprocess.run(
        list(map(str, command)), cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=240
    )
    check_ok(process)
    (line,) = [line for line in process.stdout.splitlines() if line.startswith("episode 0:")]
    length = int(line.rsplit(" ", 1)[1])
    assert length > 100  # five lives of a near-random agent; one life is far shorter
    (video,) = (tmp_path / "videos").glob("Breakout-v5-episode-0.mp4")
    with imageio.get_reader(video) as reader:
        assert reader.get_meta_data()["size"] == (160, 210)  # the game's screen, not the 84x84 observation
        assert reader.count_frames() == length + 1


@pytest.mark.slow
def test_hub_folder_and_model_card(tmp_path):
    from cleanba.evaluate import build_hub_folder

    _, model = train_and_save("ppo", tmp_path, ["--eval-episodes", 2, "--capture-video", "--exp-name", "cp"])
    videos = sorted((run_dir(tmp_path) / "videos").glob("*.mp4"))
    train_args = json.loads(__import__("flax").serialization.msgpack_restore(model.read_bytes())["args"])
    folder = build_hub_folder(
        tmp_path / "hub",
        model,
        ROOT / "cleanba" / "cleanba_ppo.py",
        train_args,
        [12.0, 20.0],
        [12, 20],
        videos,
        "someone/CartPole-v1-cp-seed1",
    )
    names = sorted(path.name for path in folder.iterdir())
    assert names == sorted(
        [
            "README.md",
            "args.json",
            "cleanba_ppo.py",
            "cp.cleanba_model",
            "eval_returns.json",
            *[video.name for video in videos],
        ]
    )
    assert (folder / "cp.cleanba_model").read_bytes() == model.read_bytes()
    assert json.loads((folder / "eval_returns.json").read_text()) == {
        "episodic_return": [12.0, 20.0],
        "episodic_length": [12, 20],
    }
    assert json.loads((folder / "args.json").read_text())["env_id"] == "CartPole-v1"
    card = (folder / "README.md").read_text()
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["library_name"] == "cleanba"
    result = front_matter["model-index"][0]["results"][0]
    assert result["dataset"]["name"] == "CartPole-v1"
    assert result["metrics"][0]["value"] == "16.00 +/- 4.00"
    assert "huggingface-cli download someone/CartPole-v1-cp-seed1" in card
    assert "python -m cleanba.evaluate model/cp.cleanba_model --script model/cleanba_ppo.py" in card


def test_upload_without_a_token_is_refused_before_training(tmp_path):
    env = dict(NO_HUB_TOKEN, HF_HOME=str(tmp_path / "hf"))
    process = run_script("ppo", [*TINY["ppo"], "--save-model", "--upload-model"], tmp_path, env=env)
    assert process.returncode == 2 and "--upload-model needs a Hugging Face token" in process.stderr
    assert not (tmp_path / "runs").exists()
    process = run_script("impala", [*TINY["impala"], "--capture-video"], tmp_path)
    assert process.returncode == 2 and "add --save-model" in process.stderr


@pytest.mark.slow
def test_cli_plays_a_model_saved_by_an_older_version(tmp_path):
    """Models saved before the run-time size local_rank became process_index still load: args that are no longer
    flags are left out."""
    from cleanba.checkpoint import load_model, save_model

    _, model = train_and_save("ppo", tmp_path, ["--eval-episodes", 0])
    args, params, script = load_model(model)
    args["local_rank"] = args.pop("process_index")
    save_model(model, script, args, params)
    process = subprocess.run(
        list(map(str, [*EVALUATE, model, "--episodes", 2])),
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    check_ok(process)
    assert "CartPole-v1: 2 episodes" in process.stdout


def test_sac_cli_plays_the_tanh_of_the_means_or_samples(tmp_path):
    """SAC's saved model (Hopper-v4), its policy's pre-tanh means forced to atanh(0.5, -0.25, 0.9) (zero weights,
    that bias) and its log stds to CleanRL's floor (-5): greedy, the CLI plays the games of a plain loop sending
    tanh of the means, (0.5, -0.25, 0.9); sampled games differ from those."""
    import jax
    import numpy as np
    import tyro

    from cleanba import cleanba_sac as module
    from cleanba.checkpoint import load_model, save_model

    process, model = train_and_save("sac", tmp_path, ["--eval-episodes", 2])
    assert "evaluation: 2 episodes" in process.stdout
    args, params, script = load_model(model)
    forced = jax.tree.map(np.array, params)
    head = forced["params"]["actor"]["Dense_2"]
    head["kernel"] = np.zeros_like(head["kernel"])
    head["bias"] = np.concatenate([np.arctanh([0.5, -0.25, 0.9]), np.full(3, -20.0)]).astype(np.float32)
    path = tmp_path / "forced.cleanba_model"
    save_model(path, script, args, forced)

    train_args = tyro.cli(module.Args, args=["--env-id", "Hopper-v4"])
    module.check_args(train_args)
    reference = constant_box_games("Hopper-v4", [0.5, -0.25, 0.9], 4, 2, 7, module.env_kwargs(train_args))
    games = cli_games(path, greedy=True)
    assert [length for length, _ in games] == [length for length, _ in reference], (games, reference)
    np.testing.assert_allclose([r for _, r in games], [r for _, r in reference], atol=0.01)
    assert cli_games(path, greedy=False) != games
