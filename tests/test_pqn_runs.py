"""PQN's classic-control runs that docs/pqn.md reports, read back from their event files in
docs/runs/pqn-classic-control-cpu: cleanba_pqn.py at CleanRL's pqn.py settings, three seeds each of CartPole-v1 and
Acrobot-v1. Each figure of the page's table is computed here from the files, and the mean of the seeds is at
CleanRL's published figure or better (its docs: CartPole-v1 495.13 +- 6.89, Acrobot-v1 -95.63 +- 5.73 at 500k
steps)."""

import numpy as np
import pytest
from support import ROOT

from cleanba import events

RUNS = ROOT / "docs" / "runs" / "pqn-classic-control-cpu"
PAGE = (ROOT / "docs" / "pqn.md").read_text()
SEEDS = [1, 2, 3]
ENVS = {"CartPole-v1": ("cartpole", 495.13 - 6.89), "Acrobot-v1": ("acrobot", -95.63 - 5.73)}
COMMON = {  # CleanRL's pqn.py: 4 envs, 128 steps, epsilon 1 to 0.05 over half of 500k steps, lambda 0.65
    "local_num_envs": "4",
    "num_actor_threads": "1",
    "num_steps": "128",
    "end_e": "0.05",
    "exploration_fraction": "0.5",
    "total_timesteps": "500000",
    "q_lambda": "0.65",
    "learning_rate": "0.00025",
    "max_grad_norm": "10.0",
}


def last_tenth(env_id: str, seed: int) -> float:
    """The mean of the logged 20-game mean returns over the last 10% of the run's steps."""
    run = events.read_run(RUNS / f"{ENVS[env_id][0]}-pqn-{seed}")
    assert run.hyperparameters["env_id"] == env_id and run.hyperparameters["seed"] == str(seed)
    assert {key: run.hyperparameters[key] for key in COMMON} == COMMON
    curve = run.scalars["charts/episodic_return"]
    assert curve.step.iloc[-1] == 499_712  # 976 iterations of 512 steps
    return float(curve.value[curve.step > 0.9 * 499_712].mean())


@pytest.mark.parametrize("env_id", list(ENVS))
def test_each_figure_of_the_table_comes_from_the_event_files_and_meets_cleanrls(env_id):
    scores = np.array([last_tenth(env_id, seed) for seed in SEEDS])
    row = f"| {env_id} | {scores.mean():.2f} | {', '.join(f'{x:.2f}' for x in scores)} |"
    assert row in PAGE, row
    assert scores.mean() >= ENVS[env_id][1], scores


def test_the_runs_directory_holds_the_seeds_of_the_page():
    expected = sorted(f"{name}-pqn-{seed}" for name, _ in ENVS.values() for seed in SEEDS)
    assert sorted(path.name for path in RUNS.iterdir()) == expected
