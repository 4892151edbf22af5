"""The continuous-control learning that docs/continuous.md and README.md report, read back from the runs' own event
files in docs/runs/mujoco-ppo-continuous-cpu (scored as score_report scores them: the mean of the last 10% of the
steps): each figure is computed here and found in the text, and each MuJoCo task's mean over seeds is at least
CleanRL's published 1M-step return (ppo_continuous_action, tag pr-424)."""

import numpy as np
import pytest
from support import ROOT

from cleanba import events, score_report

RUNS = ROOT / "docs" / "runs" / "mujoco-ppo-continuous-cpu"
PAGE = (ROOT / "docs" / "continuous.md").read_text()
README = (ROOT / "README.md").read_text()
CLEANRL = {"HalfCheetah-v4": 1442.64, "Hopper-v4": 2382.86, "Walker2d-v4": 2287.95}
SEEDS = {"HalfCheetah-v4": 3, "Hopper-v4": 3, "Walker2d-v4": 3, "CheetahRun-v1": 1, "WalkerWalk-v1": 1}


def final_scores(env_id: str) -> tuple:
    """(final scores, minutes) of the env's runs, seed by seed."""
    scores, minutes = [], []
    for directory in sorted(RUNS.glob(f"{env_id}__cleanba_ppo_continuous__*")):
        run = events.read_run(directory)
        assert run.hyperparameters["env_id"] == env_id and run.hyperparameters["total_timesteps"] == "1000000"
        curve = run.scalars["charts/episodic_return"]
        assert curve.step.iloc[-1] == 999_424  # 488 iterations of 2,048 steps
        scores.append(score_report.final_score(curve, 0.1))
        minutes.append(curve.hours.iloc[-1] * 60)
    return np.array(scores), np.array(minutes)


@pytest.mark.parametrize("env_id", list(SEEDS))
def test_each_figure_of_the_table_comes_from_the_event_files(env_id):
    scores, minutes = final_scores(env_id)
    assert len(scores) == SEEDS[env_id]
    mean = f"{scores.mean():,.1f} +- {scores.std():,.1f}" if len(scores) > 1 else f"{scores.mean():,.1f}"
    row = f"| {env_id} | {len(scores)} | {mean} | {', '.join(f'{x:,.1f}' for x in scores)} |"
    assert row in PAGE, row
    assert f"| {minutes.min():.1f}-{minutes.max():.1f} |" in PAGE
    if env_id in CLEANRL:
        assert scores.mean() >= CLEANRL[env_id], (env_id, scores)
        assert f"{scores.mean():,.1f}" in README, f"README: {env_id}'s {scores.mean():,.1f}"
    else:  # dm_control learns: the last 10% of the run well above its first logged points
        curve = events.read_run(next(RUNS.glob(f"{env_id}__*"))).scalars["charts/episodic_return"]
        assert scores.mean() > 3 * curve.value.iloc[:3].mean(), (env_id, scores, curve.value.iloc[:3])
