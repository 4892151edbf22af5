"""SAC on MuJoCo at the defaults, from the event files of docs/runs/mujoco-sac-cpu, beside CleanRL's SAC (the mean of
its 3 seeds, read off its docs' plots: cleanrl_sac_v2.csv) and the continuous PPO's runs at the defaults
(docs/runs/mujoco-ppo-continuous-cpu): each script's charts/episodic_return (the mean of the last 20 games), the mean
over seeds, the min-max shaded. Two figures: over the steps the SAC runs reached (docs/sac.md), and over 1M steps
(README.md).

    python docs/benchmarks/2026-12-06-mujoco-sac/plot.py      # docs/images/mujoco_sac_cpu.png and mujoco_cpu.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from cleanba import events

ROOT = Path(__file__).resolve().parents[3]
RUNS = ROOT / "docs" / "runs"
ENVS = ["HalfCheetah", "Hopper", "Walker2d"]
CLEANRL = pd.read_csv(Path(__file__).parent / "cleanrl_sac_v2.csv")
SCRIPTS = [  # runs under docs/runs, script, label, colour
    ("mujoco-sac-cpu", "cleanba_sac", "Cleanba SAC", "tab:red"),
    ("mujoco-ppo-continuous-cpu", "cleanba_ppo_continuous", "Cleanba PPO", "tab:blue"),
]
MACHINE = "SAC on a 2-core AMD EPYC (Zen 3), nine runs in turns; PPO on a 2-core Intel Xeon, two at a time"


def returns(directory: str, script: str, env: str) -> list:
    runs = sorted((RUNS / directory).glob(f"{env}-v4__{script}__*"))
    return [events.read_run(run).scalars["charts/episodic_return"] for run in runs]


def on_grid(curves: list, grid: np.ndarray) -> np.ndarray:
    """Each seed's curve on the grid, NaN past the last step all the seeds reached."""
    last = min(curve.step.iloc[-1] for curve in curves)
    return np.array([np.where(grid <= last, np.interp(grid, curve.step, curve.value), np.nan) for curve in curves])


def plot(grid: np.ndarray, image: str):
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, env in zip(axes, ENVS):
        for directory, script, label, color in SCRIPTS:
            curves = on_grid(returns(directory, script, env), grid)
            ax.fill_between(grid, curves.min(0), curves.max(0), color=color, alpha=0.2, linewidth=0)
            ax.plot(grid, curves.mean(0), color=color, linewidth=2, label=f"{label} ({len(curves)} seeds)")
        cleanrl = CLEANRL[CLEANRL.step <= grid[-1]]
        ax.plot(cleanrl.step, cleanrl[env], color="black", linestyle="--", label="CleanRL SAC (3 seeds, -v2)")
        ax.set(title=f"{env}-v4", xlabel="environment steps")
    axes[0].set_ylabel("episodic return (20-game mean)")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"At the defaults: {MACHINE}", fontsize=10)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "images" / image, dpi=100)


sac_steps = min(curve.step.iloc[-1] for env in ENVS for curve in returns(*SCRIPTS[0][:2], env))
plot(np.linspace(0, sac_steps, 200), "mujoco_sac_cpu.png")
plot(np.linspace(0, 1_000_000, 400), "mujoco_cpu.png")
