"""Every env samples on its own: a real run of each script with its actor's policy step recorded (a wrapper around
make_policy), two actor threads of four envs each. The draws of one step are independent across envs (at the first
rollout's near-uniform policy, pairs of envs agree as often as independent draws do), an env's draw is the one its
(global env index, step) gives whatever else its thread steps (the same env's step recomputed alone), and each thread's
steps count on over the run's rollouts (no rollout reuses another's draws). Seeds 1-5 gave agreement rates of 0.48-0.54
(CartPole) and pairwise differences of 0.91-1.03 of the independent draws' (Hopper): the bounds leave room."""

import subprocess
import sys

import numpy as np
import pytest
from support import SCRIPTS, TINY, script_env

RECORDER = """
import sys
from pathlib import Path

import numpy as np
import tyro
from cleanba.benchmark.common import load_script

module = load_script(Path(sys.argv[1]))
out, calls = sys.argv[2], []
make_policy = module.make_policy


def recording_make_policy(args, agent, action_key):
    policy = make_policy(args, agent, action_key)

    def recorded(params, obs, state, starts, env_ids, step):
        columns, next_state = policy(params, obs, state, starts, env_ids, step)
        # each env's step again, as a thread stepping that env alone would take it
        one = [(obs[i : i + 1], state[i : i + 1], starts[i : i + 1], env_ids[i : i + 1]) for i in range(len(obs))]
        alone = [np.asarray(policy(params, *inputs, step)[0])[0] for inputs in one]
        calls.append((np.asarray(env_ids), int(step), np.asarray(columns), np.stack(alone)))
        return columns, next_state

    return recorded


module.make_policy = recording_make_policy
args = tyro.cli(module.Args, args=sys.argv[3:])
module.check_args(args)
module.main(args)
names = ["env_ids", "step", "columns", "alone"]
np.savez(out, **{name: np.array([c[i] for c in calls]) for i, name in enumerate(names)})
"""

THREADS, ENVS, STEPS, ITERATIONS = 2, 4, 16, 3


def tiny_flags(script: str) -> list:
    """The script's tiny flags at STEPS steps per rollout, THREADS x ENVS envs, ITERATIONS rollouts."""
    flags = list(TINY[script])
    flags[flags.index("--num-steps") + 1] = STEPS
    if script == "pqn":  # epsilon 1 throughout: every action a draw of the env's own key, none the greedy one
        flags += ["--end-e", "1.0"]
    return [*flags, "--num-actor-threads", THREADS, "--local-num-envs", ENVS, "--log-frequency", ITERATIONS]


@pytest.fixture(scope="module", params=list(SCRIPTS))
def recorded(request, tmp_path_factory):
    script = request.param
    tmp_path = tmp_path_factory.mktemp(script)
    flags = [*tiny_flags(script), "--total-timesteps", THREADS * ENVS * STEPS * ITERATIONS]
    command = [sys.executable, "-c", RECORDER, SCRIPTS[script], tmp_path / "calls.npz", *flags]
    process = subprocess.run(
        list(map(str, command)), cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=600
    )
    assert process.returncode == 0, process.stdout + process.stderr
    return script, dict(np.load(tmp_path / "calls.npz"))


def by_thread(calls: dict) -> dict:
    """{first global env id of a thread: (its steps, its columns (calls, envs, actions + logprob), alone)}."""
    threads = {}
    for first in sorted(set(calls["env_ids"][:, 0])):
        rows = calls["env_ids"][:, 0] == first
        threads[first] = calls["step"][rows], calls["columns"][rows], calls["alone"][rows]
    return threads


def test_each_thread_steps_its_own_global_envs_and_counts_on(recorded):
    """Thread k steps envs k x ENVS ... (k + 1) x ENVS - 1; its steps are 0, 1, ... over all rollouts, each once."""
    _, calls = recorded
    assert sorted(map(tuple, np.unique(calls["env_ids"], axis=0))) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for steps, _, _ in by_thread(calls).values():
        assert steps.tolist() == list(range(STEPS * ITERATIONS)), steps


def test_an_envs_draw_is_its_own(recorded):
    """Each env's action and log-probability at a step are those of the same env stepped alone: they depend on its
    global index, the step and its observation, not on its place in the thread's batch or on the other envs."""
    script, calls = recorded
    if script in ("ppo_continuous", "sac"):  # float actions: a one-row batch may round the means differently
        np.testing.assert_allclose(calls["columns"], calls["alone"], rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(calls["columns"][..., :-1], calls["alone"][..., :-1])
        np.testing.assert_allclose(calls["columns"][..., -1], calls["alone"][..., -1], rtol=1e-5)


def test_envs_of_a_step_draw_independently(recorded):
    """The first rollout (the initial policy: heads initialised at gain 0.01, so near-uniform logits and Gaussians of
    mean about 0 and standard deviation 1), all eight envs of each step: CartPole's pairs of envs take the same of
    its 2 actions about half the time (every env drawing the same noise: always); Hopper's pairs of actions differ
    by E|N(0, 2)| = 2 / sqrt(pi) per component (the same noise: about 0)."""
    script, calls = recorded
    first = np.concatenate([columns[:STEPS, :, :-1] for _, columns, _ in by_thread(calls).values()], axis=1)
    i, j = np.triu_indices(first.shape[1], k=1)
    if script == "sac":  # Gaussians of about std 0.22 (log std -5 + 3.5 (tanh(0) + 1)): the same noise, the same
        rate = np.abs(first[:, i] - first[:, j]).mean() / (0.22 * 2 / np.sqrt(np.pi))
        print(script, "mean pairwise difference / (0.22 x 2/sqrt(pi)):", rate)
        assert 0.5 < rate < 2.0, rate
    elif script == "ppo_continuous":
        rate = np.abs(first[:, i] - first[:, j]).mean() / (2 / np.sqrt(np.pi))
        print(script, "mean pairwise difference / 2/sqrt(pi):", rate)
        assert 0.75 < rate < 1.25, rate
    else:
        rate = (first[:, i] == first[:, j]).mean()
        print(script, "pairs of envs taking the same action:", rate)
        assert 0.35 < rate < 0.65, rate
