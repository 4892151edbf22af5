"""The memory task's runs that docs/recurrent.md and README.md report, read back from their own event files in
docs/runs/minigrid-memory-lstm-cpu: cleanba_impala.py on MiniGrid-MemoryS7-v0 with and without --lstm, the same seeds
each, every other flag the same. Each figure is computed here and found in the text, and every LSTM seed beats every
feed-forward seed by a clear margin."""

import numpy as np
import pytest
from support import ROOT

from cleanba import events

RUNS = ROOT / "docs" / "runs" / "minigrid-memory-lstm-cpu"
PAGE = (ROOT / "docs" / "recurrent.md").read_text()
README = (ROOT / "README.md").read_text()
SEEDS = [1, 2, 3]
VARIANTS = {"lstm": "`--lstm --lstm-size 128`", "ff": "feed-forward"}
COMMON = {  # the flags of the page's command, as the runs logged them
    "env_id": "MiniGrid-MemoryS7-v0",
    "total_timesteps": "10000000",
    "hidden_dim": "128",
    "ent_coef": "0.03",
    "num_steps": "64",
    "num_minibatches": "8",
    "local_num_envs": "32",
    "num_actor_threads": "2",
    "eval_episodes": "100",
}
# Flags that may differ between the six runs: the core, and what names a run.
VARYING = {"lstm", "lstm_size", "seed", "run_name"}


def run(variant: str, seed: int):
    return events.read_run(RUNS / f"{variant}-{seed}")


def evaluations(variant: str) -> np.ndarray:
    """Each seed's evaluation: the mean return of the saved model's 100 games at the end of the run."""
    means = []
    for seed in SEEDS:
        scalars = run(variant, seed).scalars
        assert scalars["charts/episodic_return"].step.iloc[-1] == 9_998_336  # 2,441 iterations of 4,096 steps
        games = scalars["eval/episodic_return"].value
        assert len(games) == 100, (variant, seed, len(games))
        means.append(games.mean())
    return np.array(means)


def test_the_runs_differ_only_in_the_core_and_the_seed():
    reference = run("lstm", SEEDS[0]).hyperparameters
    assert {key: reference[key] for key in COMMON} == COMMON
    for variant in VARIANTS:
        for seed in SEEDS:
            logged = run(variant, seed).hyperparameters
            assert logged["lstm"] == str(variant == "lstm") and logged["seed"] == str(seed)
            differing = {key for key in reference.keys() | logged.keys() if reference.get(key) != logged.get(key)}
            assert differing <= VARYING, (variant, seed, differing)
    assert reference["lstm_size"] == "128"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_figure_of_the_table_comes_from_the_event_files(variant):
    scores = evaluations(variant)
    row = f"| {VARIANTS[variant]} | {scores.mean():.2f} | {', '.join(f'{x:.2f}' for x in scores)} |"
    assert row in PAGE, row


def test_the_lstm_is_ahead_of_the_feed_forward_policy():
    lstm, ff = evaluations("lstm"), evaluations("ff")
    # The LSTM solves the task (a success is worth about 0.93 after the walk's step penalty); the feed-forward policy,
    # which can only look back from the corridor's end (docs/recurrent.md), stays clearly below every LSTM seed.
    assert lstm.min() > 0.9 and lstm.min() > ff.max() + 0.1, (lstm, ff)
    sentence = f"{lstm.mean():.2f} against {ff.mean():.2f}"
    assert sentence in PAGE and sentence in README, sentence


def test_the_runs_directory_holds_the_seeds_of_the_page_and_its_figure():
    assert sorted(path.name for path in RUNS.iterdir()) == sorted(f"{v}-{s}" for v in VARIANTS for s in SEEDS)
    assert "](images/minigrid_memory_lstm_cpu.png)" in PAGE
    assert (ROOT / "docs" / "images" / "minigrid_memory_lstm_cpu.png").stat().st_size > 10_000
