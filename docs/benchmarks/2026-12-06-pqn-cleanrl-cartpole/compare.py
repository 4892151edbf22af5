"""Time to a 20-game mean return of 450 on CartPole-v1, from each run's event file and its launch time:
python compare.py OUT_DIR (side_by_side.sh's folder: times.txt, runs/)."""

import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def returns(run_dir: Path):
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator.Scalars("charts/episodic_return")


def first_mean_of_450(events, rolling: bool):
    """(wall time, env step) of the first 20-game mean of 450: CleanRL logs each game, Cleanba the mean already."""
    values = np.array([e.value for e in events])
    means = np.convolve(values, np.ones(20) / 20, "valid") if rolling else values
    offset = 19 if rolling else 0
    index = int(np.argmax(means >= 450)) if (means >= 450).any() else None
    return (None, None) if index is None else (events[index + offset].wall_time, events[index + offset].step)


out = Path(sys.argv[1])
for line in (out / "times.txt").read_text().splitlines():
    name, seed, _, start, _, end = line.split()
    pattern = f"CartPole-v1__pqn__{seed}__*" if name == "cleanrl" else f"{name}-{seed}"
    (run_dir,) = sorted((out / "runs").glob(pattern))
    wall, step = first_mean_of_450(returns(run_dir), rolling=name == "cleanrl")
    to_450 = "never" if wall is None else f"{wall - float(start):.1f} s at step {step:,}"
    print(f"{name} seed {seed}: 500k steps in {float(end) - float(start):.1f} s; a 20-game mean of 450 after {to_450}")
