"""Compare two runs of the same seed on different device layouts: the Cleanba paper's reproducibility figure
(arXiv 2310.00036): with the same seed and global sizes, the learning curves should match up to float rounding.

    python -m cleanba.compare_layouts runs/Breakout-v5__ppo-a0-l0-d1__1__7 runs/Breakout-v5__ppo-a0-l123-d2__1__8 \\
        --tags charts/episodic_return losses/value_loss --out layouts.png

Writes one PNG, one panel per tag (900 x 300 pixels each at 100 dpi): both runs against global_step, labelled
by their layout (a<actor ids>-l<learner ids>-d<processes>). For each tag it prints, and puts in the panel's
title, the largest absolute difference |a - b| and the largest relative difference |a - b| / max(|a|, |b|)
over the steps both runs logged, then whether the runs are bitwise identical: every tag equal at every common
step, stats/params_checksum included (runs with --exact, docs/reproducibility.md).
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import tyro

from cleanba.events import read_run
from cleanba.flags import fail
from cleanba.score_report import layout_label, new_figure, save_figure, warn

PANEL_SIZE = (900, 300)


@dataclass
class Args:
    run_dirs: tyro.conf.Positional[tuple[Path, Path]]
    """the two run directories (runs/<run_name>) to compare"""
    tags: list[str] = field(
        default_factory=lambda: [
            "charts/episodic_return",
            "losses/value_loss",
            "losses/policy_loss",
            "losses/entropy",
            "stats/params_checksum",
        ]
    )
    """the scalars to compare, one panel each"""
    out: Path = Path("layouts.png")
    """the PNG to write"""


def check_same_experiment(runs: list):
    """A layout comparison only means something for the same game and seed: warn otherwise."""
    for key in ["env_id", "seed"]:
        values = [run.hyperparameters[key] for run in runs]
        if values[0] != values[1]:
            warn(
                f"the runs differ in {key} ({values[0]} vs {values[1]}): this is not a reproducibility "
                f"comparison, which needs the same env_id and seed on both layouts"
            )


def run_labels(runs: list) -> list:
    """The layouts; with the directory name when both runs have the same layout."""
    layouts = [layout_label(run.hyperparameters) for run in runs]
    if layouts[0] == layouts[1]:
        return [f"{layout} ({run.path.name})" for layout, run in zip(layouts, runs)]
    return layouts


def curve_difference(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """Largest |a - b| (and its step) and largest |a - b| / max(|a|, |b|) over the steps both logged."""
    common = a.merge(b, on="step", suffixes=("_a", "_b"))
    if common.empty:
        return dict(steps=0)
    absolute = (common.value_a - common.value_b).abs().to_numpy()
    scale = np.maximum(common.value_a.abs(), common.value_b.abs()).to_numpy()
    relative = np.divide(absolute, scale, out=np.zeros_like(absolute), where=scale > 0)  # 0 where both are 0
    return dict(
        steps=len(common), absolute=absolute.max(), step=int(common.step[absolute.argmax()]), relative=relative.max()
    )


def describe(tag: str, difference: dict) -> str:
    if not difference["steps"]:
        return f"{tag}: no common steps"
    where = f" (step {difference['step']})" if difference["absolute"] > 0 else ""
    return (
        f"{tag}: max |a - b| = {difference['absolute']:.6g}{where}, max relative difference = "
        f"{difference['relative']:.3g} over {difference['steps']} common steps"
    )


def scalar(run, tag: str) -> pd.DataFrame:
    if tag not in run.scalars:
        fail(f"{run.path} has no scalar {tag}; it has {', '.join(sorted(run.scalars))}")
    return run.scalars[tag]


def main(args: Args):
    for directory in args.run_dirs:
        if not any(Path(directory).glob("events.out.tfevents*")):
            fail(f"{directory} holds no events.out.tfevents* files; give two run directories (runs/<run_name>)")
    runs = [read_run(directory) for directory in args.run_dirs]
    for run in runs:
        if not {"env_id", "seed", "actor_device_ids", "learner_device_ids", "world_size"} <= run.hyperparameters.keys():
            fail(f"{run.path}: no hyperparameters text with env_id, seed and the device layout (not a Cleanba run?)")
    check_same_experiment(runs)
    labels = run_labels(runs)
    figure, axes = new_figure(PANEL_SIZE[0], PANEL_SIZE[1] * len(args.tags), rows=len(args.tags))
    identical = True
    for axis, tag in zip(axes[:, 0], args.tags):
        curves = [scalar(run, tag) for run in runs]
        difference = curve_difference(*curves)
        identical = identical and difference["steps"] > 0 and difference["absolute"] == 0
        summary = describe(tag, difference)
        print(summary)
        for curve, label, style in zip(curves, labels, ["-", "--"]):  # dashed on top: equal curves stay visible
            axis.plot(curve.step, curve.value, style, label=label)
        axis.set_title(summary.replace(": ", "\n", 1), fontsize="small")
        axis.set_xlabel("global_step", fontsize="small")
        axis.legend(fontsize="small")
        axis.grid(alpha=0.25)
    print(
        f"bitwise identical: all {len(args.tags)} tags equal at every common step"
        if identical
        else "not bitwise identical (runs without --exact differ by float rounding, which RL amplifies)"
    )
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(figure, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args, prog="python -m cleanba.compare_layouts", description=__doc__))
