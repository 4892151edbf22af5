"""GAE and V-trace of the scripts against plain loops written from the papers' equations (learner_reference.py)."""

import numpy as np
import pytest
from learner_reference import episode_data, gae_loop, vtrace_loop

from cleanba.cleanba_impala import vtrace_targets
from cleanba.cleanba_ppo import compute_gae


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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vtrace_matches_loop(seed):
    rewards, values, terminations, _, valid = episode_data(seed)
    rhos = np.exp(np.random.default_rng(seed + 10).normal(scale=0.5, size=rewards.shape)).astype(np.float32)
    output = vtrace_targets(values, rewards, terminations, valid, rhos, 0.99)
    targets, advantages = vtrace_loop(values, rewards, terminations, valid, rhos, 0.99)
    np.testing.assert_allclose(np.asarray(output.errors) + values[:-1], targets, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(output.pg_advantage)[valid], advantages[valid], rtol=1e-5, atol=1e-5)
