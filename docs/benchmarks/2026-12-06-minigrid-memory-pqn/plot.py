"""The memory task's figures from the event files of docs/runs: each seed's charts/episodic_return (the mean of the
last 20 games), interpolated on 200 points, thin, and the seeds' mean, bold; --lstm and feed-forward on one plot.

    python docs/benchmarks/2026-12-06-minigrid-memory-pqn/plot.py pqn      # docs/images/minigrid_memory_pqn_cpu.png
    python docs/benchmarks/2026-12-06-minigrid-memory-pqn/plot.py impala   # docs/images/minigrid_memory_lstm_cpu.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from cleanba import events

ROOT = Path(__file__).resolve().parents[3]
SEEDS = [1, 2, 3]
EXPERIMENTS = {  # script: (runs under docs/runs, image under docs/images, machine)
    "impala": ("minigrid-memory-lstm-cpu", "minigrid_memory_lstm_cpu.png", "a 2-core AMD EPYC (Zen 3)"),
    "pqn": ("minigrid-memory-pqn-cpu", "minigrid_memory_pqn_cpu.png", "a 2-core Intel Xeon (family 6, model 207)"),
}

script = sys.argv[1]
runs, image, machine = EXPERIMENTS[script]
fig, ax = plt.subplots(figsize=(7, 3.5))
grid = np.linspace(0, 9_998_336, 200)
for variant, label, color in [("lstm", "--lstm", "tab:orange"), ("ff", "feed-forward", "tab:blue")]:
    curves = []
    for seed in SEEDS:
        curve = events.read_run(ROOT / "docs" / "runs" / runs / f"{variant}-{seed}").scalars["charts/episodic_return"]
        curves.append(np.interp(grid, curve.step, curve.value))
        ax.plot(grid, curves[-1], color=color, alpha=0.3, linewidth=0.8)
    name = f"{script.upper()} {label}" if variant == "lstm" else f"{script.upper()}, {label}"
    ax.plot(grid, np.mean(curves, axis=0), color=color, linewidth=2, label=f"{name} ({len(SEEDS)} seeds, mean bold)")
ax.set(
    title=f"MiniGrid-MemoryS7-v0 on {machine}",
    xlabel="environment steps",
    ylabel="episodic return (20-game mean)",
    ylim=(0, 1),
)
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(ROOT / "docs" / "images" / image, dpi=100)
