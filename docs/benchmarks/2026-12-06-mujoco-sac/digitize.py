"""CleanRL's published SAC curves as numbers: reads the mean line of the plots in its docs
(vwxyzjn/cleanrl, docs/rl-algorithms/sac/{HalfCheetah,Hopper,Walker2d}-v2.png: sac_continuous_action.py, 3 seeds,
1M steps, wandb's mean in red over a min-max band) pixel by pixel, and writes cleanrl_sac_v2.csv, the mean return at
every 2,500 steps. Usage: python digitize.py DIR_WITH_THE_PNGS."""

import sys
from pathlib import Path

import numpy as np
from PIL import Image

GRID_STEP = {"HalfCheetah": 2000, "Hopper": 500, "Walker2d": 1000}  # the y axis' gridline spacing (return)
LINE, GRID, BAND_GRID = (218, 76, 76), (230, 230, 233), (228, 215, 217)  # RGB: the mean, gridlines, under the band
STEPS = np.arange(15_000, 1_000_001, 2_500)


def runs(indices: np.ndarray) -> list:
    """Consecutive index runs (gaps of up to 2 pixels joined) as their centres."""
    groups = []
    for i in indices:
        if groups and i - groups[-1][1] <= 2:
            groups[-1][1] = i
        else:
            groups.append([i, i])
    return groups


def mean_curve(path: Path, grid_step: int) -> np.ndarray:
    pixels = np.asarray(Image.open(path).convert("RGB")).astype(int)
    near = lambda colour, tolerance: np.abs(pixels - colour).sum(-1) <= tolerance  # noqa: E731
    # y: the horizontal gridlines, top to bottom, are grid_step apart; the lowest is 0 (the x axis).
    rows = runs(np.where((near(GRID, 3) | near(BAND_GRID, 3)).sum(1) > 800)[0])
    centres = [(a + b) / 2 for a, b in rows]
    y_fit = np.polyfit(centres, [grid_step * (len(rows) - 1 - i) for i in range(len(rows))], 1)
    # x: the tick marks under the axis at 200k, 400k, ...
    axis = rows[-1][1]
    ticks = np.where((pixels[axis + 8 : axis + 30].mean(-1) < 245).all(0))[0]
    tick_centres = [(a + b) / 2 for a, b in runs(ticks) if b - a < 15 and a > 500]
    x_fit = np.polyfit(tick_centres, [200_000 * (i + 1) for i in range(len(tick_centres))], 1)
    line = near(LINE, 25)
    line[:460] = False  # the legend's text above the plot is the same red
    columns = [x for x in range(pixels.shape[1]) if line[: axis + 1, x].any()]
    steps = np.polyval(x_fit, columns)
    returns = [np.polyval(y_fit, np.median(np.where(line[: axis + 1, x])[0])) for x in columns]
    return np.interp(STEPS, steps, returns)


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    curves = {env: mean_curve(directory / f"{env}-v2.png", step) for env, step in GRID_STEP.items()}
    with open(Path(__file__).parent / "cleanrl_sac_v2.csv", "w") as f:
        f.write("step," + ",".join(curves) + "\n")
        for i, step in enumerate(STEPS):
            f.write(f"{step}," + ",".join(f"{curve[i]:.1f}" for curve in curves.values()) + "\n")
    for env, curve in curves.items():  # the check: the line's end, against CleanRL's table for this run
        print(env, "at 100k, 1M:", round(curve[STEPS == 100_000][0], 1), round(curve[-1], 1))
