"""cleanba_pqn.py's own parts against plain loops: the Q(lambda) targets (Gallici et al. 2024, written out per env
and step, the episode boundaries of EnvPool's auto-reset) and the epsilon-greedy actor (CleanRL's linear schedule over
the global env steps, each env drawing from its own key)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from learner_reference import episode_data

pqn = importlib.import_module("cleanba.cleanba_pqn")


def q_lambda_loop(rewards, values, terminations, truncations, gamma, lam):
    """G_t = r_t + gamma (1 - lambda) max Q(s_t+1) + gamma lambda G_t+1 within an episode, G_T = max Q(s_T); at an
    episode's end the return bootstraps from the final obs (a truncation) or not at all (a termination)."""
    T, n = rewards.shape
    targets = np.zeros((T, n))
    for j in range(n):
        following = values[T, j]
        for t in reversed(range(T)):
            if terminations[t, j]:
                targets[t, j] = rewards[t, j]
            elif truncations[t, j]:
                targets[t, j] = rewards[t, j] + gamma * values[t + 1, j]
            else:
                targets[t, j] = rewards[t, j] + gamma * ((1 - lam) * values[t + 1, j] + lam * following)
            following = targets[t, j]
    return targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_lambda_targets_match_a_plain_loop(seed):
    rewards, values, terminations, truncations, _ = episode_data(seed)
    got = pqn.q_lambda_targets(values, rewards, terminations, truncations, 0.99, 0.65)
    expected = q_lambda_loop(rewards, values, terminations, truncations, 0.99, 0.65)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def epsilon_greedy_args(envs: int):
    args = pqn.Args(env_id="CartPole-v1", local_num_envs=envs, num_actor_threads=1, num_steps=8)
    args.total_timesteps, args.start_e, args.end_e, args.exploration_fraction = 1_000_000, 1.0, 0.05, 0.5
    pqn.fill_runtime_sizes(args, 1, 0)
    return args


def cleanrl_epsilon(args, step: int) -> float:
    """CleanRL's linear_schedule at the global step of a rollout step: every env has stepped once more."""
    duration, global_step = args.exploration_fraction * args.total_timesteps, (step + 1) * args.num_envs
    return max((args.end_e - args.start_e) / duration * global_step + args.start_e, args.end_e)


@pytest.mark.parametrize("step", [0, 30, 60, 200])
def test_epsilon_greedy_follows_the_schedule_with_each_envs_own_key(step):
    """Over 8,192 envs, the share of actions that are not the greedy one is epsilon x (1 - 1/actions) at that step,
    the stored log-probability is that of the action under epsilon-greedy, and an env's action depends only on its
    own key: the envs drawn alone or in one batch draw alike."""
    envs, actions = 8192, 4
    args = epsilon_greedy_args(envs)
    q = jax.random.normal(jax.random.key(3), (envs, actions))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(jnp.arange(envs))
    taken, logprobs = jax.jit(lambda q, keys, step: pqn.sample_actions(args, q, keys, step))(q, keys, step)
    greedy = np.argmax(np.asarray(q), axis=1)
    epsilon = cleanrl_epsilon(args, step)
    share = np.mean(np.asarray(taken) != greedy)
    assert abs(share - epsilon * (1 - 1 / actions)) < 4 * np.sqrt(0.25 / envs) + 1e-9, (share, epsilon)
    expected = np.log(epsilon / actions + (1 - epsilon) * (np.asarray(taken) == greedy))
    np.testing.assert_allclose(np.asarray(logprobs), expected, rtol=1e-5)
    alone = [pqn.sample_actions(args, q[i : i + 1], keys[i : i + 1], step)[0][0] for i in range(8)]
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(taken[:8]))
