"""OpenAI's PPO learning curves on StarPilot (Procgen, easy, 200 training levels, tested on all levels), as one CSV
to set beside Cleanba's IMPALA and PPO, and a table of its means over windows of steps.

Source: https://github.com/openai/train-procgen (MIT licence), commit 1a2ae2194a61f76a733a39339530401c024c3ad8, the
files train_procgen/results/easy-200-run{0,1,2}/progress-starpilot-{train,test}.csv.

    python docs/benchmarks/2026-12-06-procgen-starpilot/reference.py PATH_TO_TRAIN_PROCGEN_CHECKOUT

writes openai_ppo_starpilot_easy_200.csv next to this script: one row per run and PPO update (3 x 3051), with columns
run, step, train and test; then prints the mean over the runs of each curve's points in windows of 0.25M steps up to
1.5M and around 5M, 25M and 50M. Each run is two MPI workers sharing one policy: the train worker plays the 200 training
levels and its data alone updates the policy; the test worker plays all levels with a gradient weight of 0. Each writes
its own progress CSV. step is misc/total_timesteps, the environment steps of one worker (64 envs x 256 steps per
update), so the steps the policy trained on; train and test are each worker's eprewmean, the mean return of its last 100
finished episodes, unsmoothed (the repo's plots add an EMA of 0.9 and drop the first 10 points)."""

import sys
from pathlib import Path

import pandas as pd

results = Path(sys.argv[1]) / "train_procgen" / "results"


def returns(run, split):
    csv = results / f"easy-200-run{run}" / f"progress-starpilot-{split}.csv"
    # The logged means are float32 casts of means of 100 integer returns: 2 decimals give them back exactly.
    return pd.read_csv(csv, index_col="misc/total_timesteps")["eprewmean"].round(2)


frames = []
for run in range(3):
    train, test = returns(run, "train"), returns(run, "test")
    assert train.index.equals(test.index), f"run {run}: the workers' logs cover different updates"
    frames.append(pd.DataFrame({"run": run, "step": train.index.astype(int), "train": train, "test": test}))
curves = pd.concat(frames)
curves.to_csv(Path(__file__).with_name("openai_ppo_starpilot_easy_200.csv"), index=False)

windows = [(a * 250_000, (a + 1) * 250_000) for a in range(6)] + [(m - 250_000, m + 250_000) for m in (5e6, 25e6, 50e6)]
print("| steps | train | test |\n|---|---|---|")
for low, high in windows:
    window = curves[(curves.step > low) & (curves.step <= high)]
    print(f"| {low / 1e6:.2f}M-{high / 1e6:.2f}M | {window.train.mean():.2f} | {window.test.mean():.2f} |")
