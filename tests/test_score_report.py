"""The score report and the layout comparison on event files written here, in the training scripts' format."""

import re
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from matplotlib.image import imread
from support import ROOT
from tensorboardX import SummaryWriter

from cleanba import compare_layouts, events, score_report

TAG = "charts/episodic_return"
STEPS = range(1000, 11000, 1000)  # 10 logged points; with --final-fraction 0.25 the score is the mean of the last 3

# Final raw scores of the synthetic runs and their human-normalized scores, worked out by hand from the
# reference table (Breakout 1.7 / 30.5, Pong -20.7 / 14.6, Alien 227.8 / 7127.7): e.g. Breakout 16.1 is
# (16.1 - 1.7) / 28.8 = 0.5 and Pong -13.64 is (-13.64 + 20.7) / 35.3 = 0.2. "impala" has no Alien-v5 runs and
# "ppo" no seed 3 on Pong-v5.
RUNS = {  # (variant, env_id, seed): (final score, human-normalized score)
    ("ppo", "Breakout-v5", 1): (8.9, 0.25),
    ("ppo", "Breakout-v5", 2): (16.1, 0.5),
    ("ppo", "Breakout-v5", 3): (23.3, 0.75),
    ("ppo", "Pong-v5", 1): (-3.05, 0.5),
    ("ppo", "Pong-v5", 2): (14.6, 1.0),
    ("ppo", "Alien-v5", 1): (917.79, 0.1),
    ("ppo", "Alien-v5", 2): (3677.75, 0.5),
    ("ppo", "Alien-v5", 3): (7127.7, 1.0),
    ("impala", "Breakout-v5", 1): (30.5, 1.0),
    ("impala", "Breakout-v5", 2): (44.9, 1.5),
    ("impala", "Breakout-v5", 3): (59.3, 2.0),
    ("impala", "Pong-v5", 1): (-20.7, 0.0),
    ("impala", "Pong-v5", 2): (-13.64, 0.2),
    ("impala", "Pong-v5", 3): (7.54, 0.8),
}
# What enters the aggregates: the games of both variants (Breakout, Pong) and each variant's seeds that have
# both games; rows are seeds, columns Breakout-v5 then Pong-v5.
MATRICES = {"ppo": [[0.25, 0.5], [0.5, 1.0]], "impala": [[1.0, 0.0], [1.5, 0.2], [2.0, 0.8]]}
# Their aggregates by hand. Median: of the per-game means (ppo 0.375 and 0.75; impala 1.5 and 1/3). IQM: the mean
# of the middle half of the sorted scores (ppo 0.5, 0.5; impala 0.2, 0.8, 1.0, 1.5). Optimality gap: 1 minus the
# mean of the scores clipped at 1 (impala: 1 - (1 + 0 + 1 + 0.2 + 1 + 0.8) / 6).
EXPECTED = {
    "ppo": dict(median=0.5625, iqm=0.5, mean=0.5625, optimality_gap=0.4375),
    "impala": dict(median=(1.5 + 1 / 3) / 2, iqm=0.875, mean=5.5 / 6, optimality_gap=1 - 4 / 6),
}


def hyperparameters_text(values: dict) -> str:
    """The markdown table the training scripts log."""
    return "|param|value|\n|-|-|\n" + "\n".join(f"|{key}|{value}|" for key, value in values.items())


def hyperparameters(env_id, exp_name, seed, actor="[0]", learner="[0]", world_size=1) -> dict:
    return dict(
        exp_name=exp_name,
        seed=seed,
        env_id=env_id,
        learning_rate=0.00025,
        actor_device_ids=actor,
        learner_device_ids=learner,
        world_size=world_size,
        num_envs=128,
    )


def write_events(directory, params: dict, scalars: dict, purge_step=None, suffix=""):
    """One event file: the hyperparameters text and {tag: [(step, value)]}, 0.36 s per step (1 h per 10k steps)."""
    writer = SummaryWriter(str(directory), purge_step=purge_step, filename_suffix=suffix)
    writer.add_text("hyperparameters", hyperparameters_text(params))
    start = time.time()
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step, walltime=start + 0.36 * step)
    writer.close()


def return_curve(final: float) -> list:
    """A rising curve whose last three points (steps 8000-10000) are final - 0.5, final, final + 0.5."""
    values = [final - 10 + i for i in range(7)] + [final - 0.5, final, final + 0.5]
    return list(zip(STEPS, values))


def write_benchmark(root):
    for (variant, env_id, seed), (final, _) in RUNS.items():
        directory = root / variant / f"{env_id}__{variant}__{seed}"
        write_events(directory, hyperparameters(env_id, variant, seed), {TAG: return_curve(final)})


def run_module(module: str, args: list, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=180
    )


def check_ok(process):
    assert process.returncode == 0, f"exit {process.returncode}\n{process.stdout}\n{process.stderr}"


def png_size(path) -> tuple:
    """(width, height) in pixels of a PNG."""
    image = imread(path)
    return image.shape[1], image.shape[0]


def reference_table() -> pd.DataFrame:
    return score_report.load_references(None)


def test_human_normalized_scores_by_hand():
    references = reference_table()
    cases = [
        ("Breakout-v5", 1.7, 0.0),
        ("Breakout-v5", 16.1, 0.5),
        ("Breakout-v5", 59.3, 2.0),
        ("Pong-v5", -20.7, 0.0),
        ("Pong-v5", -3.05, 0.5),
        ("Pong-v5", 14.6, 1.0),
        ("Alien-v5", 227.8, 0.0),
        ("Alien-v5", 3677.75, 0.5),
        ("Alien-v5", 14027.6, 2.0),
    ]
    for env_id, score, expected in cases:
        assert score_report.normalize(score, env_id, references) == pytest.approx(expected, abs=1e-12), env_id


def test_one_run_of_each_game_gives_rliables_intervals_without_its_draws():
    """With one run of each game every stratified resample is the data: the shortcut's intervals and points are
    rliable's bootstrap's (here 200 draws), for the final scores' metrics and for a curve's points; with more runs
    the bootstrap draws."""
    args = score_report.Args(paths=[], reps=200)
    rng = np.random.default_rng(0)
    finals = {"ppo": rng.uniform(0, 2, (1, 3)), "impala": rng.uniform(0, 2, (1, 3))}
    curves = {"ppo": rng.uniform(0, 2, (1, 3, 5))}
    per_point = lambda x: np.array([score_report.METRICS["iqm"](x[..., k]) for k in range(x.shape[-1])])  # noqa: E731
    for scores, func in [(finals, score_report.all_metrics), (curves, per_point)]:
        points, intervals = score_report.interval_estimates(scores, func, args.reps, args)
        rliable = score_report.library.get_interval_estimates(
            scores, func, reps=args.reps, confidence_interval_size=args.confidence
        )
        for variant in scores:
            np.testing.assert_allclose(points[variant], rliable[0][variant])
            np.testing.assert_allclose(intervals[variant], rliable[1][variant])
    # with three runs of a game the draws differ: the intervals are the bootstrap's, wider than a point
    _, intervals = score_report.interval_estimates(
        {"ppo": rng.uniform(0, 2, (3, 3))}, score_report.all_metrics, 200, args
    )
    assert np.all(intervals["ppo"][0] < intervals["ppo"][1]), intervals


def test_reference_table_has_the_57_games_of_benchmark_sh():
    atari57 = re.search(r"ATARI57=\(([^)]*)\)", (ROOT / "benchmark.sh").read_text()).group(1).split()
    references = reference_table()
    assert len(atari57) == 57 and sorted(references.index) == sorted(atari57)
    assert (references.human > references.random).all()
    assert references.loc["Breakout-v5"].tolist() == [1.7, 30.5]
    assert references.loc["Pong-v5"].tolist() == [-20.7, 14.6]
    assert references.loc["Alien-v5"].tolist() == [227.8, 7127.7]


def test_resumed_run_merges_event_files(tmp_path):
    params = hyperparameters("Breakout-v5", "ppo", 1)
    write_events(tmp_path, params, {TAG: [(step, -1.0) for step in STEPS[:6]]})  # stopped after step 6000
    # resumed from the checkpoint at step 4000: steps 5000 and 6000 are logged again, and replace the old ones;
    # the run ends with --save-model's evaluation, whose x axis is the episode index (0, 1, 2)
    evaluation = [(episode, 10.0 + episode) for episode in range(3)]
    resumed = {TAG: [(step, float(step)) for step in STEPS[4:]], "eval/episodic_return": evaluation}
    write_events(tmp_path, params, resumed, purge_step=4001, suffix=".resumed")
    run = events.read_run(tmp_path)
    curve = run.scalars[TAG]
    assert curve.step.tolist() == list(STEPS)
    assert curve.value.tolist() == [-1.0] * 4 + [float(step) for step in STEPS[4:]]
    assert np.all(np.diff(curve.hours) >= 0)
    evaluated = run.scalars["eval/episodic_return"]
    assert list(zip(evaluated.step, evaluated.value)) == evaluation


def test_score_report(tmp_path):
    write_benchmark(tmp_path / "runs")
    out = tmp_path / "report"
    process = run_module(
        "cleanba.score_report",
        [
            tmp_path / "runs",
            "--out-dir",
            out,
            "--final-fraction",
            0.25,
            "--reps",
            200,
            "--curve-reps",
            20,
            "--curve-points",
            10,
        ],
    )
    check_ok(process)
    assert "variant 'impala' has no run of Alien-v5 (expected seeds 1, 2, 3)" in process.stderr
    assert "variant 'ppo', Pong-v5: missing seed(s) 3 (has 1, 2)" in process.stderr
    assert "variant 'ppo': seed(s) 3 left out of its aggregates" in process.stderr

    scores = pd.read_csv(out / "scores.csv")
    assert len(scores) == len(RUNS)
    for row in scores.itertuples():
        final, normalized = RUNS[(row.variant, row.env_id, row.seed)]
        assert row.score == pytest.approx(final, rel=1e-6)
        assert row.normalized_score == pytest.approx(normalized, abs=1e-6)
        assert row.used == (row.env_id != "Alien-v5" and not (row.variant == "ppo" and row.seed == 3))

    aggregates = pd.read_csv(out / "aggregates.csv").set_index("variant")
    for variant, matrix in MATRICES.items():
        used = scores[scores.used & (scores.variant == variant)]
        from_csv = used.pivot(index="seed", columns="env_id", values="normalized_score").to_numpy()
        np.testing.assert_allclose(from_csv, matrix, atol=1e-6)
        row = aggregates.loc[variant]
        assert (row.games, row.seeds) == (2, len(matrix))
        assert row["mean"] == pytest.approx(np.mean(from_csv))
        assert row["iqm"] == pytest.approx(scipy.stats.trim_mean(from_csv.flatten(), 0.25))
        for name, value in EXPECTED[variant].items():
            assert row[name] == pytest.approx(value, abs=1e-5), (variant, name)
            assert row[f"{name}_ci_low"] <= row[f"{name}_ci_high"]

    markdown = (out / "aggregates.md").read_text()
    assert "| variant | games | seeds | Median | IQM | Mean | Optimality Gap |" in markdown
    for variant in MATRICES:
        (line,) = [line for line in markdown.splitlines() if line.startswith(f"| {variant} |")]
        assert len(re.findall(r"-?\d+\.\d+ \[-?\d+\.\d+, -?\d+\.\d+\]", line)) == 4
        assert line in process.stdout

    # Sizes documented in score_report: 800 x 500; 300 x 240 per game (3 games in a row) + 60; 1400 x (130 + 45 x 2)
    sizes = {
        "aggregate_vs_steps.png": (800, 500),
        "aggregate_vs_time.png": (800, 500),
        "per_game.png": (900, 300),
        "intervals.png": (1400, 220),
    }
    for name, size in sizes.items():
        assert (out / name).stat().st_size > 10_000, name
        assert png_size(out / name) == size, name


def test_reference_scores_file(tmp_path):
    for seed, final in [(1, 261.0), (2, 500.0)]:
        write_events(
            tmp_path / "runs" / f"cartpole{seed}",
            hyperparameters("CartPole-v1", "ppo", seed),
            {TAG: return_curve(final)},
        )
    references = tmp_path / "cartpole.csv"
    references.write_text("# random policy and the maximum return\nenv_id,random,human\nCartPole-v1,22,500\n")
    out = tmp_path / "report"
    process = run_module(
        "cleanba.score_report",
        [
            tmp_path / "runs",
            "--out-dir",
            out,
            "--final-fraction",
            0.25,
            "--reference-scores",
            references,
            "--reps",
            100,
            "--curve-reps",
            10,
            "--curve-points",
            5,
        ],
    )
    check_ok(process)
    scores = pd.read_csv(out / "scores.csv").set_index("seed")
    assert scores.normalized_score.tolist() == pytest.approx([0.5, 1.0])  # (261 - 22) / 478, (500 - 22) / 478


def test_per_game_legend_of_long_variant_names_fits(tmp_path):
    """One game, four variants with long names (as several --variant-key values make them): a 300 px figure has
    room for one 200 px legend column, so the band grows a row per variant beyond the first and no name runs off
    the figure."""
    for seed, name in enumerate(["breakout-impala-cpu", "breakout-ppo-cpu", "breakout-ppo-cpu-1024", "breakout-50m"]):
        write_events(
            tmp_path / "runs" / name,
            hyperparameters("Breakout-v5", f"cleanba_variant_{seed}", 1),
            {TAG: return_curve(10.0 + seed)},
        )
    out = tmp_path / "report"
    check_ok(run_module("cleanba.score_report", [tmp_path / "runs", "--out-dir", out, "--reps", 50, "--curve-reps", 5]))
    assert png_size(out / "per_game.png") == (300, 240 + 60 + 3 * 18)
    # The legend band is drawn on: its rows hold non-white pixels (the names), down to the last variant's row.
    image = imread(out / "per_game.png")[: 60 + 3 * 18, :, :3]
    inked_rows = np.flatnonzero((image < 0.5).any(axis=(1, 2)))
    assert inked_rows.max() > 60 + 18, inked_rows.max()
    inked_columns = np.flatnonzero((image < 0.5).any(axis=(0, 2)))  # a name cut by the edge would reach it
    assert 0 < inked_columns.min() and inked_columns.max() < 299, (inked_columns.min(), inked_columns.max())


@pytest.mark.parametrize("normalization", ["hns", "auto"])
def test_env_without_reference_is_refused(tmp_path, capsys, normalization):
    """A game without reference scores: refused with --normalization hns, and by default (auto) beside a game that
    has them (one report would mix normalized and raw scores)."""
    write_events(tmp_path / "run", hyperparameters("CartPole-v1", "ppo", 1), {TAG: return_curve(100.0)})
    if normalization == "auto":
        write_events(tmp_path / "atari", hyperparameters("Breakout-v5", "ppo", 1), {TAG: return_curve(10.0)})
    with pytest.raises(SystemExit) as exit_info:
        score_report.main(score_report.Args(paths=[tmp_path], out_dir=tmp_path / "report", normalization=normalization))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "no random and human reference scores for CartPole-v1" in error
    assert "--reference-scores" in error and "--normalization none" in error
    assert not (tmp_path / "report").exists()


def test_games_without_references_are_scored_raw_by_default(tmp_path, capsys):
    """MuJoCo runs (no Atari reference scores) at the default --normalization auto: the raw mean return of the
    final 25%, labelled raw."""
    for seed, final in [(1, 1200.0), (2, 2000.0)]:
        write_events(
            tmp_path / "runs" / f"hopper{seed}", hyperparameters("Hopper-v4", "ppo", seed), {TAG: return_curve(final)}
        )
    out = tmp_path / "report"
    score_report.main(
        score_report.Args(
            paths=[tmp_path / "runs"], out_dir=out, final_fraction=0.25, reps=100, curve_reps=10, curve_points=5
        )
    )
    scores = pd.read_csv(out / "scores.csv").set_index("seed")
    assert scores.normalized_score.tolist() == scores.score.tolist() == pytest.approx([1200.0, 2000.0])
    assert "no reference scores for Hopper-v4: raw scores" in capsys.readouterr().err
    assert f"raw scores of {TAG}" in (out / "aggregates.md").read_text()


def test_compare_layouts(tmp_path):
    base = {TAG: [(step, step / 100) for step in STEPS], "losses/value_loss": [(step, 1 / step) for step in STEPS]}
    changed = {
        TAG: [(step, value + 0.25 if step == 3000 else value) for step, value in base[TAG]],
        "losses/value_loss": base["losses/value_loss"],
    }
    write_events(tmp_path / "a", hyperparameters("Breakout-v5", "ppo", 1), base)
    write_events(tmp_path / "b", hyperparameters("Breakout-v5", "ppo", 1, learner="[1, 2]"), changed)
    out = tmp_path / "layouts.png"
    process = run_module(
        "cleanba.compare_layouts", [tmp_path / "a", tmp_path / "b", "--tags", TAG, "losses/value_loss", "--out", out]
    )
    check_ok(process)
    assert (
        f"{TAG}: max |a - b| = 0.25 (step 3000), max relative difference = 0.00826 over 10 common steps"
        in process.stdout
    )  # 0.25 / (30 + 0.25)
    assert "losses/value_loss: max |a - b| = 0, max relative difference = 0 over 10 common steps" in process.stdout
    assert "warning" not in process.stderr
    assert png_size(out) == (900, 600) and out.stat().st_size > 10_000


def test_layout_labels_and_mismatch_warning(tmp_path, capsys):
    logged = [
        hyperparameters("Breakout-v5", "ppo", 1),
        hyperparameters("Pong-v5", "ppo", 2, learner="[1, 2]", world_size=2),
    ]
    runs = [events.Run(tmp_path, {key: str(value) for key, value in params.items()}, {}) for params in logged]
    assert compare_layouts.run_labels(runs) == ["a0-l0-d1", "a0-l1,2-d2"]
    compare_layouts.check_same_experiment(runs)
    error = capsys.readouterr().err
    assert "differ in env_id (Breakout-v5 vs Pong-v5)" in error and "differ in seed (1 vs 2)" in error
