"""What an actor thread stores is what EnvPool said: a real run of a script, with every envs.recv() recorded beside it
(a wrapper around envpool.make) and every rollout the actor hands to the learner copied as it leaves (a wrapper around
put_on_learners), compared field by field. Time limits are forced short (max_episode_steps) so that truncations
happen, on an Atari game under each protocol: Breakout under the IMPALA paper's (a lost life ends a learning episode,
not a game; games end), and Asteroids under Machado et al.'s (lost lives end nothing; raw scores above 1)."""

import subprocess
import sys

import numpy as np
import pytest
from support import SCRIPTS, script_env

RECORDER = """
import sys
from pathlib import Path

import numpy as np
from cleanba.benchmark.common import load_script

script, limit, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
module = load_script(Path(script))
import envpool, tyro

recvs, stored, games = [], [], []


class Recording:
    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def recv(self):
        obs, reward, terminated, truncated, info = self.env.recv()
        recvs.append([reward, terminated, truncated, info["reward"], info["terminated"], info["lives"]])
        return obs, reward, terminated, truncated, info


make, env_kwargs, put_on_learners, queue_put = envpool.make, module.env_kwargs, module.put_on_learners, module.queue_put
envpool.make = lambda *args, **kwargs: Recording(make(*args, **kwargs))
module.env_kwargs = lambda args: dict(env_kwargs(args), max_episode_steps=limit)


def storing(rollout, mesh, blocks):
    stored.append([np.array(x) for x in rollout])
    return put_on_learners(rollout, mesh, blocks)


def queueing(q, item, stop):
    if isinstance(item[1], module.RolloutInfo):
        games.append([item[1].episode_returns, item[1].episode_lengths])
    return queue_put(q, item, stop)


module.put_on_learners, module.queue_put = storing, queueing
args = tyro.cli(module.Args, args=sys.argv[4:])
module.check_args(args)
try:
    module.main(args)
finally:
    columns = {name: np.array([r[i] for r in recvs]) for i, name in enumerate(["reward", "terminated", "truncated",
        "raw", "game_over", "lives"])}
    columns.update({f"stored_{f}": np.array([s[i] for s in stored]) for i, f in enumerate(module.Rollout._fields)})
    columns.update(returns=np.array([g[0] for g in games]), lengths=np.array([g[1] for g in games]))
    np.savez(out, **columns)
"""

ENVS, STEPS, ITERATIONS = 4, 32, 20
CASES = {  # script, game, protocol, time limit in agent steps
    "breakout-impala-protocol": ("ppo", "Breakout-v5", "impala", 200),
    "asteroids-machado": ("impala", "Asteroids-v5", "machado", 100),
}


@pytest.fixture(scope="module", params=list(CASES))
def recorded(request, tmp_path_factory):
    script, game, protocol, limit = CASES[request.param]
    tmp_path = tmp_path_factory.mktemp(request.param)
    flags = ["--env-id", game, "--atari-protocol", protocol, "--num-actor-threads", "1", "--local-num-envs", ENVS]
    flags += ["--num-steps", STEPS, "--total-timesteps", ENVS * STEPS * ITERATIONS, "--num-minibatches", "2"]
    flags += ["--channels", "4", "4", "4", "--hidden-dim", "16", "--log-frequency", "5"]
    command = [sys.executable, "-c", RECORDER, SCRIPTS[script], limit, tmp_path / "recorded.npz", *flags]
    process = subprocess.run(
        list(map(str, command)), cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=600
    )
    assert process.returncode == 0, process.stdout + process.stderr
    recorded = dict(np.load(tmp_path / "recorded.npz"))
    return protocol, limit, recorded


def steps(recorded: dict, name: str) -> np.ndarray:
    """A stored field as (iterations x steps, envs): row k is the step whose envs.recv() was the (k + 1)-th."""
    stored = recorded[f"stored_{name}"]
    return stored.reshape(-1, *stored.shape[2:])


@pytest.mark.slow
def test_stored_steps_are_what_envpool_returned(recorded):
    """Rewards (EnvPool's, clipped to their sign), terminations and truncations as each recv() returned them; valid
    False exactly on the step after an episode ended (EnvPool's reset step, whose action is ignored)."""
    _, _, r = recorded
    assert r["stored_rewards"].shape == (ITERATIONS, STEPS, ENVS) and len(r["reward"]) == ITERATIONS * STEPS + 1
    np.testing.assert_array_equal(steps(r, "rewards"), r["reward"][1:])
    np.testing.assert_array_equal(steps(r, "rewards"), np.sign(r["raw"][1:]))  # clipped, as Atari's protocol asks
    np.testing.assert_array_equal(steps(r, "terminations"), r["terminated"][1:])
    np.testing.assert_array_equal(steps(r, "truncations"), r["truncated"][1:])
    ended = r["terminated"] | r["truncated"]
    np.testing.assert_array_equal(steps(r, "valid"), ~ended[:-1])
    assert r["truncated"].any(), "the short time limit truncated no episode"
    assert not (r["terminated"] & r["truncated"]).any()


@pytest.mark.slow
def test_episode_ends_follow_the_protocol(recorded):
    """Machado et al.: a lost life ends nothing, only a game over terminates; the IMPALA paper's protocol: a lost life
    terminates the learning episode (EnvPool's episodic_life), the game goes on."""
    protocol, _, r = recorded
    game_over = r["game_over"].astype(bool)
    lives_lost = r["lives"][1:] < r["lives"][:-1]
    assert lives_lost.any(), "no life was lost: the protocol's life handling is untested"
    if protocol == "machado":
        np.testing.assert_array_equal(r["terminated"], game_over)
    else:
        assert (r["terminated"] & ~game_over).any() and game_over.any()
        # a life lost at the time limit is a truncation, as EnvPool reports it
        life_ends = lives_lost & ~game_over[1:] & ~r["truncated"][1:]
        np.testing.assert_array_equal(r["terminated"][1:] & ~game_over[1:], life_ends)


@pytest.mark.slow
def test_scores_are_raw_and_per_game(recorded):
    """The returns and lengths the actor reports: raw game rewards (info["reward"], not clipped) summed over a whole
    game (every life) up to its game over or time limit, lengths in valid steps; nothing at other steps."""
    protocol, limit, r = recorded
    raw, valid, terminated = r["raw"][1:], steps(r, "valid"), r["terminated"][1:]
    over = r["game_over"][1:].astype(bool) | r["truncated"][1:]
    returns, clipped, lengths = (np.full(raw.shape, np.nan) for _ in range(3))
    lives_per_game = []  # learning episodes (terminations) in each game that ended
    for env in range(ENVS):
        total, total_clipped, length, lives = 0.0, 0.0, 0, 0
        for k in range(len(raw)):
            total, total_clipped = total + raw[k, env], total_clipped + np.sign(raw[k, env])
            length, lives = length + int(valid[k, env]), lives + int(terminated[k, env])
            if over[k, env]:
                returns[k, env], clipped[k, env], lengths[k, env] = total, total_clipped, length
                lives_per_game.append(lives)
                total, total_clipped, length, lives = 0.0, 0.0, 0, 0
    np.testing.assert_array_equal(r["returns"].reshape(raw.shape), returns)
    np.testing.assert_array_equal(r["lengths"].reshape(raw.shape), lengths)
    np.testing.assert_array_equal(lengths[r["truncated"][1:]], limit)  # a game cut at its limit: `limit` agent steps
    if protocol == "machado":  # raw scores: some game's differs from its clipped sum
        assert (returns[over] != clipped[over]).any(), (returns[over], clipped[over])
    else:  # one score per game, over several learning episodes (lives)
        assert max(lives_per_game) > 1, lives_per_game


# The papers' Atari settings (../shared/NOTES.md): Machado et al. 2018, section 5 ("Revisiting the ALE"; the Cleanba
# paper's appendix A): sticky actions with probability 0.25, the full action set of 18, no life-loss signal, no
# no-op starts beyond one, 108,000 frames (27,000 agent steps) per episode at most. Espeholt et al. 2018 (IMPALA): a
# lost life ends the learning episode, up to 30 no-ops at the start, the game's minimal action set, no sticky
# actions. Both: 84x84 grey frames, 4 stacked, an action repeated over 4 frames, rewards clipped to their sign.
PROTOCOLS = {
    "machado": dict(repeat_action_probability=0.25, episodic_life=False, noop_max=1, actions=18),
    "impala": dict(repeat_action_probability=0.0, episodic_life=True, noop_max=30, actions=4),  # Breakout's minimal set
}
COMMON = dict(img_height=84, img_width=84, stack_num=4, frame_skip=4, gray_scale=True, reward_clip=True)


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("script", ["ppo", "impala"])
def test_each_protocol_builds_the_papers_envs(script, protocol):
    """The envs an actor thread makes (the script's make_env) under each --atari-protocol, read back from EnvPool."""
    import importlib

    import tyro

    module = importlib.import_module(f"cleanba.cleanba_{script}")
    args = tyro.cli(module.Args, args=["--env-id", "Breakout-v5", "--atari-protocol", protocol])
    envs = module.make_env(args, 2, seed=1)
    try:
        config, expected = envs.config, dict(PROTOCOLS[protocol])
        assert envs.action_space.n == expected.pop("actions")
        assert config["max_episode_steps"] == 108_000 // 4
        for key, value in {**expected, **COMMON}.items():
            assert config[key] == value, (key, config[key], value)
        assert envs.observation_space.shape == (4, 84, 84)
    finally:
        envs.close()
