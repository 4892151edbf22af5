"""IMPALA and PPO on StarPilot (Procgen, easy, trained on levels 0-199, tested on the whole distribution), from the
event files of docs/runs/starpilot-procgen-cpu, beside OpenAI's PPO on the same protocol (3 runs,
../2026-12-06-procgen-starpilot/openai_ppo_starpilot_easy_200.csv).

    python docs/benchmarks/2026-12-07-starpilot-cpu/figures.py    # the table; docs/images/starpilot_cpu.png

Each cell is the mean over a window of 125k steps of a curve's logged points: charts/episodic_return (the mean of the
run's last 20 training games) and test/episodic_return (100 games on the whole distribution every ~65k steps), and
OpenAI's train and test eprewmean (each worker's last 100 games). The windows end at the last 125k both runs passed.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from cleanba import events

ROOT = Path(__file__).resolve().parents[3]
RUNS = ROOT / "docs" / "runs" / "starpilot-procgen-cpu"
OPENAI = pd.read_csv(ROOT / "docs/benchmarks/2026-12-06-procgen-starpilot/openai_ppo_starpilot_easy_200.csv")
NAMES = {"impala-1": "Cleanba IMPALA", "ppo-1": "Cleanba PPO"}
WINDOW = 125_000


def curves(name: str) -> tuple:
    """(train, test): the run's charts/episodic_return and test/episodic_return, each a DataFrame(step, value)."""
    scalars = events.read_run(RUNS / name).scalars
    return scalars["charts/episodic_return"], scalars["test/episodic_return"]


def windows() -> list:
    last = min(curves(name)[0].step.iloc[-1] for name in NAMES)
    return [(low, low + WINDOW) for low in range(0, int(last) - WINDOW + 1, WINDOW)]


def mean_in(frame: pd.DataFrame, column: str, low: int, high: int) -> float:
    return frame[(frame.step > low) & (frame.step <= high)][column].mean()


def table() -> list:
    """Rows of (low, high, {label: (train, test)}), OpenAI's PPO last."""
    rows = []
    for low, high in windows():
        cells = {}
        for name, label in NAMES.items():
            train, test = curves(name)
            cells[label] = (mean_in(train, "value", low, high), mean_in(test, "value", low, high))
        cells["OpenAI PPO"] = (mean_in(OPENAI, "train", low, high), mean_in(OPENAI, "test", low, high))
        rows.append((low, high, cells))
    return rows


def markdown(rows: list) -> list:
    """The table's lines, as the report gives them."""
    labels = list(rows[0][2])
    lines = ["| steps | " + " | ".join(f"{label} train / test" for label in labels) + " |"]
    lines.append("|---|" + "---|" * len(labels))
    for low, high, cells in rows:
        row = " | ".join(f"{train:.2f} / {test:.2f}" for train, test in cells.values())
        lines.append(f"| {low // 1000}k-{high // 1000}k | {row} |")
    return lines


if __name__ == "__main__":
    rows = table()
    print("\n".join(markdown(rows)))
    last = rows[-1][1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    colors = {"Cleanba IMPALA": "tab:red", "Cleanba PPO": "tab:blue"}
    for name, label in NAMES.items():
        for ax, curve in zip(axes, curves(name)):
            curve = curve[curve.step <= last]
            ax.plot(curve.step, curve.value, color=colors[label], label=label)
    openai = OPENAI[OPENAI.step <= last].groupby("step").mean()
    for ax, column in zip(axes, ["train", "test"]):
        ax.plot(openai.index, openai[column], color="black", linestyle="--", label="OpenAI PPO (3 runs)")
    axes[0].set(title="training levels (0-199)", xlabel="environment steps", ylabel="episodic return")
    axes[1].set(title="the whole distribution (unseen levels)", xlabel="environment steps")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle("StarpilotEasy-v0, 200 training levels: Cleanba on a 2-core AMD EPYC (Zen 3), seed 1", fontsize=10)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "images" / "starpilot_cpu.png", dpi=100)
