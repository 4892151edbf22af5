"""The report's table from the event files of docs/runs/minigrid-memory-pqn-cpu: for each run, the mean of
charts/episodic_return and episodic_length over each tenth of the logged points, the saved model's 100-game
evaluation, the first step from which charts/episodic_return stays above 0.8, and the hours of training.

    python docs/benchmarks/2026-12-06-minigrid-memory-pqn/figures.py
"""

from pathlib import Path

import numpy as np

from cleanba import events

RUNS = Path(__file__).resolve().parents[3] / "docs" / "runs" / "minigrid-memory-pqn-cpu"

print("| run | tenths of the run: return / length | evaluation, 100 episodes | above 0.8 from | hours |")
print("|---|---|---|---|---|")
for name in ["lstm-1", "lstm-2", "lstm-3", "ff-1", "ff-2", "ff-3"]:
    scalars = events.read_run(RUNS / name).scalars
    returns, lengths = scalars["charts/episodic_return"], scalars["charts/episodic_length"]
    tenths = " ".join(
        f"{ret.mean():.2f}/{length.mean():.0f}"
        for ret, length in zip(np.array_split(returns.value, 10), np.array_split(lengths.value, 10))
    )
    games = scalars["eval/episodic_return"].value
    below = np.flatnonzero(returns.value <= 0.8)
    if len(below) == 0:
        above = f"{returns.step.iloc[0] / 1e6:.2f}M"
    elif below[-1] + 1 < len(returns):
        above = f"{returns.step.iloc[below[-1] + 1] / 1e6:.2f}M"
    else:
        above = "never"
    hours = returns.hours.iloc[-1]
    print(f"| {name} | {tenths} | {games.mean():.2f} +- {games.std():.2f} | {above} | {hours:.2f} |")
