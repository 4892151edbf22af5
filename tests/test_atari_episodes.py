"""The Atari path's bookkeeping against a plain replay: the script's own actor thread (rollout_actor) plays Breakout,
then the same actions are replayed through a fresh EnvPool with the same seed, and what the actor stored and
reported is checked against what EnvPool says step by step."""

import importlib
import queue
import threading

import envpool
import jax
import numpy as np
import pytest
import tyro
from jax.sharding import Mesh

ENVS, STEPS = 4, 64


def actor_rollouts(script: str, protocol: str, iterations: int):
    """(args, [(rollout as numpy, RolloutInfo)]) of `iterations` rollouts of the script's actor, a tiny network."""
    module = importlib.import_module(f"cleanba.cleanba_{script}")
    flags = [
        "--env-id",
        "Breakout-v5",
        "--atari-protocol",
        protocol,
        "--channels",
        "4",
        "--hidden-dim",
        "16",
        "--local-num-envs",
        ENVS,
        "--num-actor-threads",
        1,
        "--num-steps",
        STEPS,
        "--num-minibatches",
        2,
        "--total-timesteps",
        iterations * ENVS * STEPS,
        "--seed",
        3,
    ]
    args = tyro.cli(module.Args, args=list(map(str, flags)))
    module.check_args(args)
    module.fill_runtime_sizes(args, 1, 0)
    device = jax.local_devices()[0]
    mesh = Mesh(np.array([device]), ("learner",))
    spec = envpool.make_spec(args.env_id, **module.env_kwargs(args))
    agent, state, action_key, _ = module.make_agent(args, spec, mesh)
    params = module.unreplicate(state.params)
    param_queue, rollout_queue = queue.Queue(maxsize=1), queue.Queue(maxsize=1)
    stop = module.Stop()
    policy = module.make_policy(args, agent, action_key)
    thread = threading.Thread(
        target=module.rollout_actor,
        daemon=True,
        args=(args, 1, 0, device, mesh, policy, param_queue, rollout_queue, stop),
    )
    thread.start()
    rollouts = []
    try:
        for version in range(iterations):  # as a sync learner would: params before every rollout
            module.queue_put(param_queue, (version, params), stop)
            rollout, info = module.queue_get(rollout_queue, stop)
            rollouts.append((jax.device_get(rollout), info))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not stop.errors, stop.errors
    return module, args, rollouts


def replay(module, args, actions: np.ndarray):
    """EnvPool's own account of playing `actions` (T, n) from a reset with the actor's seed: per step, the
    elapsed_step, raw reward, lives, real game over and truncation of every env, and the first observation."""
    envs = module.make_env(args, ENVS, seed=args.seed)  # the first actor thread's pool: seed + first env index 0
    envs.async_reset()
    first_obs, _, _, _, info = envs.recv()
    record = {key: [] for key in ["elapsed_step", "reward", "lives", "terminated", "truncated"]}
    for step_actions in actions:
        envs.send(step_actions, info["env_id"])
        _, _, _, truncated, info = envs.recv()
        for key in ["elapsed_step", "reward", "lives", "terminated"]:
            record[key].append(np.array(info[key]))
        record["truncated"].append(truncated)
    envs.close()
    return first_obs, {key: np.array(values) for key, values in record.items()}


@pytest.mark.parametrize("script", ["impala", "ppo"])
def test_steps_after_a_life_loss_are_invalid(script):
    """--atari-protocol impala (episodic_life): after a life loss EnvPool's next step is a reset step that ignores
    the action and repeats elapsed_step. Exactly the steps whose elapsed_step did not advance are invalid."""
    module, args, rollouts = actor_rollouts(script, "impala", iterations=3)
    actions = np.concatenate([rollout.actions for rollout, _ in rollouts])
    valid = np.concatenate([rollout.valid for rollout, _ in rollouts])
    first_obs, env = replay(module, args, actions)
    assert np.array_equal(rollouts[0][0].obs[0], first_obs)  # the replay starts where the actor did
    elapsed = np.concatenate([np.zeros((1, ENVS), int), env["elapsed_step"]])
    advanced = elapsed[1:] == elapsed[:-1] + 1
    lives = np.concatenate([env["lives"][:1], env["lives"]])
    life_lost = lives[1:] < lives[:-1]
    assert life_lost.sum() >= 4, "too few life losses to check anything"
    # The step after every life loss (and after every game over) is invalid, and no other step is.
    assert np.array_equal(valid, advanced), np.argwhere(valid != advanced)

    def next_step(mask):
        return np.concatenate([np.zeros((1, ENVS), bool), mask[:-1]])

    assert not valid[next_step(life_lost)].any()
    # After a life lost mid-game, EnvPool repeats elapsed_step (so elapsed_step > 0 would call that step valid).
    midgame = next_step(life_lost & (env["terminated"] == 0))
    assert midgame.any() and (elapsed[1:][midgame] == elapsed[:-1][midgame]).all()


@pytest.mark.parametrize("script", ["ppo", "impala"])
def test_episode_returns_and_lengths_match_a_replay(script):
    """Machado protocol (the default): the finished games the actor reports (logged as charts/episodic_return and
    charts/episodic_length) are EnvPool's raw game scores and lengths in agent steps, with lost lives not counted as
    game ends."""
    module, args, rollouts = actor_rollouts(script, "machado", iterations=6)
    actions = np.concatenate([rollout.actions for rollout, _ in rollouts])
    _, env = replay(module, args, actions)
    expected_returns, expected_lengths = [], []
    score, length = np.zeros(ENVS), np.zeros(ENVS, int)
    for t in range(len(actions)):  # a plain loop over EnvPool's raw info, in the actor's reporting order
        score += env["reward"][t]
        length = np.where(env["terminated"][t] | env["truncated"][t], env["elapsed_step"][t], length)
        for i in np.flatnonzero(env["terminated"][t] | env["truncated"][t]):
            expected_returns.append(score[i])
            expected_lengths.append(length[i])
            score[i] = 0
    # The actor reports (steps, envs) arrays, NaN where no game ended: read in (step, env) order, as the loop above.
    returns = [r for _, info in rollouts for r in info.episode_returns[np.isfinite(info.episode_returns)]]
    lengths = [n for _, info in rollouts for n in info.episode_lengths[np.isfinite(info.episode_lengths)]]
    assert len(expected_returns) >= 2, "no game finished: lengthen the run"
    assert returns == expected_returns and lengths == expected_lengths
    assert np.diff(env["lives"], axis=0).min() < 0  # lives were lost within games that went on
    assert max(expected_returns) > 1  # raw points, not one clipped reward per game
