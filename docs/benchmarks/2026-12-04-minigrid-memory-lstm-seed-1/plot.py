"""docs/images/minigrid_memory_lstm_cpu.png from the event files in docs/runs/minigrid-memory-lstm-cpu: each seed's
charts/episodic_return (the mean of the last 20 games), interpolated on 200 points, thin, and the seeds' mean, bold.

    python docs/benchmarks/2026-12-04-minigrid-memory-lstm-seed-1/plot.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from cleanba import events

ROOT = Path(__file__).resolve().parents[3]
RUNS = ROOT / "docs" / "runs" / "minigrid-memory-lstm-cpu"
SEEDS = [1, 2, 3]
VARIANTS = {"lstm": ("IMPALA --lstm", "tab:orange"), "ff": ("IMPALA, feed-forward", "tab:blue")}

fig, ax = plt.subplots(figsize=(7, 3.5))
grid = np.linspace(0, 9_998_336, 200)
for variant, (label, color) in VARIANTS.items():
    curves = []
    for seed in SEEDS:
        curve = events.read_run(RUNS / f"{variant}-{seed}").scalars["charts/episodic_return"]
        curves.append(np.interp(grid, curve.step, curve.value))
        ax.plot(grid, curves[-1], color=color, alpha=0.3, linewidth=0.8)
    ax.plot(grid, np.mean(curves, axis=0), color=color, linewidth=2, label=f"{label} ({len(SEEDS)} seeds, mean bold)")
ax.set(
    title="MiniGrid-MemoryS7-v0 on a 2-core AMD EPYC (Zen 3)",
    xlabel="environment steps",
    ylabel="episodic return (20-game mean)",
    ylim=(0, 1),
)
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(ROOT / "docs" / "images" / "minigrid_memory_lstm_cpu.png", dpi=100)
