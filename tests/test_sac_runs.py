"""SAC's MuJoCo learning that docs/sac.md and README.md report, read back from the runs' own event files in
docs/runs/mujoco-sac-cpu: 3 seeds of each task at the defaults, nine at a time on one CPU and stopped together, each
scored over the last 10% of the steps all nine reached (score_report's final score), beside CleanRL's SAC over the
same steps (the mean of its seeds, read off its docs' plots into docs/benchmarks/2026-12-06-mujoco-sac)."""

import functools

import numpy as np
import pandas as pd
import pytest
from support import ROOT

from cleanba import events, score_report

RUNS = ROOT / "docs" / "runs" / "mujoco-sac-cpu"
REPORT = ROOT / "docs" / "benchmarks" / "2026-12-06-mujoco-sac"
PAGE = (ROOT / "docs" / "sac.md").read_text()
README = (ROOT / "README.md").read_text()
ENVS = ["HalfCheetah-v4", "Hopper-v4", "Walker2d-v4"]
SEEDS = [1, 2, 3]
# CleanRL's values (docs/sac.md), as the runs logged them; the runs differ only in the task, the seed and the name.
DEFAULTS = {
    "total_timesteps": "1000000",
    "buffer_size": "1000000",
    "replay_batch_size": "256",
    "updates_per_step": "1.0",
    "learning_starts": "5000",
    "policy_frequency": "2",
    "local_num_envs": "4",
    "num_actor_threads": "2",
    "num_steps": "8",
    "concurrency": "False",
}
VARYING = {"env_id", "seed", "run_name"}


@functools.cache
def run(env_id: str, seed: int) -> events.Run:
    return events.read_run(RUNS / f"{env_id}__cleanba_sac__{seed}")


def curves() -> dict:
    return {(env_id, seed): run(env_id, seed).scalars["charts/episodic_return"] for env_id in ENVS for seed in SEEDS}


def common_step(all_curves: dict) -> int:
    """The last step all nine runs logged: the runs were stopped together, a few iterations apart."""
    return min(curve.step.iloc[-1] for curve in all_curves.values())


def scores(env_id: str) -> tuple:
    """(each seed's final score up to the common step, CleanRL's mean over the same steps)."""
    all_curves = curves()
    last = common_step(all_curves)
    finals = [
        score_report.final_score(curve[curve.step <= last], 0.1) for curve in (all_curves[env_id, s] for s in SEEDS)
    ]
    cleanrl = pd.read_csv(REPORT / "cleanrl_sac_v2.csv")
    window = cleanrl[(cleanrl.step >= 0.9 * last) & (cleanrl.step <= last)]
    return np.array(finals), float(window[env_id.removesuffix("-v4")].mean())


def test_the_runs_are_at_the_defaults_and_differ_only_in_the_task_and_the_seed():
    reference = run(ENVS[0], SEEDS[0]).hyperparameters
    assert {key: reference[key] for key in DEFAULTS} == DEFAULTS
    for env_id in ENVS:
        for seed in SEEDS:
            logged = run(env_id, seed).hyperparameters
            assert logged["env_id"] == env_id and logged["seed"] == str(seed)
            differing = {key for key in reference.keys() | logged.keys() if reference.get(key) != logged.get(key)}
            assert differing <= VARYING, (env_id, seed, differing)


def test_the_runs_were_stopped_together_and_the_page_says_where():
    all_curves = curves()
    last = common_step(all_curves)
    assert max(curve.step.iloc[-1] for curve in all_curves.values()) - last < 0.05 * last
    assert f"{last:,} steps" in PAGE and f"{last / 1e6:.2f}M steps" in README


@pytest.mark.parametrize("env_id", ENVS)
def test_each_figure_of_the_table_comes_from_the_event_files(env_id):
    finals, cleanrl = scores(env_id)
    seeds = ", ".join(f"{x:,.1f}" for x in finals)
    row = f"| {env_id} | {finals.mean():,.1f} +- {finals.std():,.1f} | {seeds} | {cleanrl:,.1f} |"
    assert row in PAGE, row
    # At least CleanRL's SAC over the same steps, the mean of its seeds (HalfCheetah's margin, 28, is within the
    # reading of its plot: about 30).
    assert finals.mean() >= cleanrl, (env_id, finals, cleanrl)
    assert f"{env_id} {finals.mean():,.1f}" in README, f"README: {env_id} {finals.mean():,.1f}"


def test_the_runs_directory_holds_the_seeds_of_the_page_and_its_figures():
    names = sorted(path.name for path in RUNS.iterdir())
    assert names == sorted(f"{env_id}__cleanba_sac__{seed}" for env_id in ENVS for seed in SEEDS)
    assert "](images/mujoco_sac_cpu.png)" in PAGE and "](docs/images/mujoco_cpu.png)" in README
    for image in ["mujoco_sac_cpu.png", "mujoco_cpu.png"]:
        assert (ROOT / "docs" / "images" / image).stat().st_size > 10_000
