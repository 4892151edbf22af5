"""The actor against the learner: the learner, computing a rollout's log-probabilities from the stored observations
and recurrent state with the params that played it, gets the actor's stored ones. A real run of each script with
concurrency off (lag 0) and a learning rate of 1e-12 (so every update keeps the params that played the rollout, up to
1e-12): in every iteration the learner's ratios to the behaviour policy are 1 up to float32 rounding, which the logged
approx_kl (the mean of (ratio - 1) - log ratio) shows; episodes end inside and across rollouts (CartPole's first
random games last 10-40 steps, the rollouts 16). A slip between the two sides (observations normalised differently, a
recurrent state carried across an episode's end on one side only, a stored state that is not the one the actor
started the rollout from, another distribution) moves the ratios off 1. PQN's learner does not read the stored
log-probabilities (Q-learning is off-policy)."""

import numpy as np
import pytest
from support import TINY, check_ok, run_dir, run_script, scalars

CASES = {
    "ppo": ("ppo", []),
    "impala": ("impala", []),
    "impala-lstm": ("impala", ["--lstm", "--lstm-size", "8"]),
    "ppo_continuous": ("ppo_continuous", []),
}
ITERATIONS = 6


@pytest.mark.parametrize("case", list(CASES))
def test_the_learner_reproduces_the_actors_log_probabilities(case, tmp_path):
    script, extra = CASES[case]
    flags = [*TINY[script], "--num-actor-threads", 1, "--local-num-envs", 4, "--no-concurrency", *extra]
    flags += ["--learning-rate", 1e-12, "--total-timesteps", ITERATIONS * 4 * 16, "--num-steps", 16]
    process = run_script(script, flags, tmp_path)
    check_ok(process)
    logged = scalars(run_dir(tmp_path))
    kl = [value for _, value in logged["losses/approx_kl"]]
    assert len(kl) == ITERATIONS and np.isfinite(kl).all(), kl
    # without a slip they are the same bits here; the slips above gave 4e-8 to 1e-7
    assert max(np.abs(kl)) < 1e-9, kl
