"""GAE and V-trace of the scripts against plain loops written from the papers' equations."""

import numpy as np
import pytest

from cleanba.cleanba_impala import vtrace_targets
from cleanba.cleanba_ppo import compute_gae


def episode_data(seed, T=40, n=6):
    """Random rollouts with terminations, truncations and EnvPool's auto-reset step after each of them."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, n)).astype(np.float32)
    values = rng.normal(size=(T + 1, n)).astype(np.float32)
    terminations = np.zeros((T, n), bool)
    truncations = np.zeros((T, n), bool)
    valid = np.ones((T, n), bool)
    for j in range(n):
        t = int(rng.integers(0, 2))
        while t < T:
            if rng.random() < 0.15:
                (terminations if rng.random() < 0.5 else truncations)[t, j] = True
                if t + 1 < T:  # the auto-reset step: reward 0, not learned from
                    valid[t + 1, j], rewards[t + 1, j] = False, 0.0
                t += 2
            else:
                t += 1
    valid[0, 0] = False  # a rollout may start on the auto-reset step of the previous one
    assert terminations.any() and truncations.any()
    return rewards, values, terminations, truncations, valid


def gae_loop(rewards, values, terminations, truncations, gamma, lam):
    T, n = rewards.shape
    advantages = np.zeros((T, n))
    for j in range(n):
        next_advantage = 0.0
        for t in reversed(range(T)):
            ended = terminations[t, j] or truncations[t, j]
            bootstrap = 0.0 if terminations[t, j] else gamma * values[t + 1, j]  # truncation: value of final obs
            delta = rewards[t, j] + bootstrap - values[t, j]
            advantages[t, j] = delta + (0.0 if ended else gamma * lam * next_advantage)
            next_advantage = advantages[t, j]
    return advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop(seed):
    rewards, values, terminations, truncations, valid = episode_data(seed)
    advantages, returns = compute_gae(values, rewards, terminations, truncations, 0.99, 0.95)
    expected = gae_loop(rewards, values, terminations, truncations, 0.99, 0.95)
    # Only valid steps are learned from; the auto-reset step's own advantage is masked out of the loss.
    np.testing.assert_allclose(np.asarray(advantages)[valid], expected[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(returns), np.asarray(advantages) + values[:-1], rtol=1e-6)


def test_gae_ignores_what_follows_an_episode_end():
    """Changing anything after a termination or truncation (the reset step, the next episode) leaves the
    advantages before it unchanged, up to the bootstrap value of the final obs on truncation."""
    rewards, values, terminations, truncations, _ = episode_data(3)
    base = np.asarray(compute_gae(values, rewards, terminations, truncations, 0.99, 0.95)[0])
    j = 1
    ends = np.flatnonzero(terminations[:, j] | truncations[:, j])
    t = ends[0]
    rewards2, values2 = rewards.copy(), values.copy()
    rewards2[t + 1 :, j] += 10.0
    values2[t + 2 :, j] -= 7.0
    if terminations[t, j]:
        values2[t + 1, j] += 3.0  # a terminated episode does not even look at the final obs
    changed = np.asarray(compute_gae(values2, rewards2, terminations, truncations, 0.99, 0.95)[0])
    np.testing.assert_allclose(changed[: t + 1, j], base[: t + 1, j], rtol=1e-6)


def vtrace_loop(values, rewards, terminations, valid, rhos, gamma):
    """Espeholt et al. 2018, eq. 1 and 4, rho and c clipped at 1, computed backwards episode by episode."""
    T, n = rewards.shape
    targets = np.zeros((T, n))
    advantages = np.zeros((T, n))
    for j in range(n):
        for t in reversed(range(T)):
            if not valid[t, j]:  # the auto-reset step: its target is the value of its obs, the final obs
                targets[t, j] = values[t, j]
                continue
            rho, c = min(1.0, rhos[t, j]), min(1.0, rhos[t, j])
            discount = 0.0 if terminations[t, j] else gamma
            if t + 1 < T:
                next_target, next_value = targets[t + 1, j], values[t + 1, j]
            else:
                next_target = next_value = values[T, j]
            delta = rho * (rewards[t, j] + discount * values[t + 1, j] - values[t, j])
            targets[t, j] = values[t, j] + delta + discount * c * (next_target - next_value)
            advantages[t, j] = rho * (rewards[t, j] + discount * next_target - values[t, j])
    return targets, advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vtrace_matches_loop(seed):
    rewards, values, terminations, _, valid = episode_data(seed)
    rhos = np.exp(np.random.default_rng(seed + 10).normal(scale=0.5, size=rewards.shape)).astype(np.float32)
    output = vtrace_targets(values, rewards, terminations, valid, rhos, 0.99)
    targets, advantages = vtrace_loop(values, rewards, terminations, valid, rhos, 0.99)
    np.testing.assert_allclose(np.asarray(output.errors) + values[:-1], targets, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(output.pg_advantage)[valid], advantages[valid], rtol=1e-5, atol=1e-5)
