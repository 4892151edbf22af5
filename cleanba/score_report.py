"""Score report: human-normalized scores of Cleanba runs over games, seeds and variants, aggregated with rliable.

Reads the TensorBoard event files that the training scripts write to runs/<run_name>/, scores every run by its
final performance, normalizes per game with the Atari-57 random and human scores in cleanba/atari_scores.csv
(games without reference scores, MuJoCo's and dm_control's, are scored raw),
and aggregates over games and seeds with rliable: median, interquartile mean (IQM), mean and optimality gap
with stratified bootstrap confidence intervals (Agarwal et al., "Deep RL at the Edge of the Statistical
Precipice", NeurIPS 2021, arXiv 2108.13264).

    python -m cleanba.score_report runs --out-dir report
    python -m cleanba.score_report runs --variant-key exp_name layout --out-dir report   # compare device layouts
    python -m cleanba.score_report runs --reference-scores cartpole.csv --out-dir report  # env_id,random,human

- A run is a directory holding events.out.tfevents* files; its env_id, exp_name, seed and the rest come from
  the `hyperparameters` text the scripts log. Its variant is the value of --variant-key (exp_name by default;
  several keys are joined with "/"; `layout` is the device layout, e.g. a0-l1,2-d1).
- A resumed run has several event files: each later file replaces the earlier files' points from its first
  logged step on (what tensorboardX's purge_step means), so duplicate steps take the later file's value. Its
  wall-clock axis is the time of training that produced the kept points: a later file continues where the
  kept points of the earlier ones end, leaving out time spent queued or redone after a preemption.
- A run's score is the mean of charts/episodic_return (--tag) over the last 10% of its env steps
  (--final-fraction): final performance. The tag is itself a mean over the last 20 episodes; averaging over
  the last tenth of the run lowers the noise of a single logged point without mixing in early learning.
- Missing data: rliable needs a (seeds x games) matrix per variant. The aggregates use the games that every
  variant has runs of (so that variants are compared on the same games), and for each variant the seeds it
  has on every one of those games; everything else is reported on stderr and still listed in scores.csv
  and plotted in per_game.png.

Writes to --out-dir: scores.csv (variant, game, seed: raw and normalized final score, and whether it entered
the aggregates), aggregates.csv and aggregates.md (per variant: the four metrics with CI bounds), and PNGs at
100 dpi with these sizes in pixels (width x height):
    aggregate_vs_steps.png, aggregate_vs_time.png   800 x 500: --curve-metric with its CI band per variant
    per_game.png    300 x 240 per game, up to 8 games a row, plus a legend band on top: 60 px for its first
                    row of variants, 18 px for each further row (one variant per 200 px of width, up to 6)
    intervals.png   1400 x (130 + 45 per variant): rliable's interval plot of the four metrics
"""

import ast
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, and the same pixels everywhere
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import tyro
from rliable import library, metrics, plot_utils

from cleanba.events import Run, find_run_dirs, read_run
from cleanba.flags import fail

ATARI_SCORES = Path(__file__).with_name("atari_scores.csv")
METRICS = {
    "median": metrics.aggregate_median,
    "iqm": metrics.aggregate_iqm,
    "mean": metrics.aggregate_mean,
    "optimality_gap": metrics.aggregate_optimality_gap,
}
METRIC_TITLES = {"median": "Median", "iqm": "IQM", "mean": "Mean", "optimality_gap": "Optimality Gap"}

# Figure sizes in pixels at DPI, saved without bbox_inches="tight" so that the files have exactly these sizes.
DPI = 100
AGGREGATE_SIZE = (800, 500)
PANEL_SIZE = (300, 240)
PER_GAME_COLUMNS = 8
LEGEND_BAND = 60
LEGEND_ROW = 18  # each further row of per_game.png's legend
LEGEND_ENTRY_WIDTH = 200  # px of figure width per legend column: the longest variant names fit
LEGEND_MAX_COLUMNS = 6
INTERVALS_WIDTH, INTERVALS_BASE_HEIGHT, INTERVALS_ROW_HEIGHT = 1400, 130, 45

# rliable 1.2 hands a RandomState to arch, which warns that this is deprecated; nothing to fix on our side.
warnings.filterwarnings("ignore", message="random_state is deprecated", category=FutureWarning)


@dataclass
class Args:
    paths: tyro.conf.Positional[list[Path]]
    """run directories, or directories to search for them (any directory holding events.out.tfevents* files)"""
    out_dir: Path = Path("score_report")
    """where the tables and plots are written"""
    variant_key: list[str] = field(default_factory=lambda: ["exp_name"])
    """hyperparameters whose values name a run's variant; `layout` is the device layout, e.g. a0-l1,2-d1"""
    tag: str = "charts/episodic_return"
    """the scalar that is scored and plotted"""
    final_fraction: float = 0.1
    """a run's score is the mean of --tag over its points in the last this fraction of its env steps"""
    normalization: Literal["auto", "hns", "none"] = "auto"
    """hns: (score - random) / (human - random) with the reference scores; none: raw scores; auto: hns when every
    game has reference scores (the Atari 57 and --reference-scores), raw when none has (MuJoCo, dm_control, ...)"""
    reference_scores: Path | None = None
    """a CSV with columns env_id,random,human that extends or overrides cleanba/atari_scores.csv"""
    reps: int = 50_000
    """bootstrap replications for the final-score confidence intervals (rliable's default)"""
    curve_reps: int = 2_000
    """bootstrap replications for the curves' CI bands (one interval per grid point, so fewer than --reps)"""
    curve_points: int = 50
    """points of the common grid that every run's curve is interpolated on"""
    curve_metric: Literal["median", "iqm", "mean", "optimality_gap"] = "iqm"
    """the aggregate metric plotted against steps and wall-clock time"""
    confidence: float = 0.95
    """coverage of the stratified bootstrap confidence intervals"""
    seed: int = 0
    """seed of the bootstrap, so that the intervals are reproducible"""


def warn(message: str):
    print(f"warning: {message}", file=sys.stderr)


def check_args(args: Args):
    if not args.paths or not args.variant_key:
        fail("give one or more run directories (or directories that hold them) and at least one --variant-key")
    for path in args.paths:
        if not path.exists():
            fail(f"{path} does not exist; give run directories or directories that hold them")
    if not 0 < args.final_fraction <= 1:
        fail(f"--final-fraction={args.final_fraction} must be in (0, 1]")
    if args.reps < 1 or args.curve_reps < 1 or args.curve_points < 2:
        fail("--reps and --curve-reps must be positive and --curve-points at least 2")
    if not 0 < args.confidence < 1:
        fail(f"--confidence={args.confidence} must be in (0, 1), e.g. 0.95")
    if args.reference_scores is not None and args.normalization == "none":
        fail("--reference-scores is only used with --normalization hns or auto")


# Reading runs


def device_ids(value: str) -> str:
    return ",".join(map(str, ast.literal_eval(value)))


def layout_label(hyperparameters: dict) -> str:
    """The device layout as the README writes it: a<actor ids>-l<learner ids>-d<processes>, e.g. a0-l1,2-d1."""
    return (
        f"a{device_ids(hyperparameters['actor_device_ids'])}-l{device_ids(hyperparameters['learner_device_ids'])}"
        f"-d{hyperparameters['world_size']}"
    )


def variant_name(run: Run, keys: list) -> str:
    missing = [key for key in keys if key != "layout" and key not in run.hyperparameters]
    if missing:
        fail(
            f"--variant-key {' '.join(missing)}: not among the hyperparameters of {run.path} "
            f"({', '.join(run.hyperparameters)})"
        )
    return "/".join(layout_label(run.hyperparameters) if key == "layout" else run.hyperparameters[key] for key in keys)


def load_runs(paths: list, tag: str) -> list:
    """The runs under paths that logged hyperparameters and tag; the others are skipped with a warning."""
    directories = find_run_dirs(paths)
    if not directories:
        fail(f"no events.out.tfevents* files under {', '.join(map(str, paths))}")
    runs = []
    for directory in directories:
        run = read_run(directory)
        if not {"env_id", "seed"} <= run.hyperparameters.keys():
            warn(f"{directory}: no hyperparameters text with env_id and seed (not a Cleanba run?); skipped")
        elif tag not in run.scalars or run.scalars[tag].empty:
            warn(f"{directory}: no {tag} points (did any episode finish?); skipped")
        else:
            runs.append(run)
    if not runs:
        fail(f"none of the {len(directories)} run directories has a hyperparameters text and {tag} points")
    return runs


# Reference scores and final scores


def read_reference_file(path: Path) -> pd.DataFrame:
    """env_id -> random, human; lines starting with # are comments (the sources)."""
    table = pd.read_csv(path, comment="#", skipinitialspace=True)
    if not {"env_id", "random", "human"} <= set(table.columns):
        fail(f"{path}: needs the columns env_id,random,human (it has {','.join(table.columns)})")
    duplicated = table.env_id[table.env_id.duplicated()].tolist()
    bad = table.env_id[~(table.human > table.random)].tolist()
    if duplicated or bad:
        fail(f"{path}: every env_id needs one row with human > random (duplicated: {duplicated}, not: {bad})")
    return table.set_index("env_id")[["random", "human"]]


def load_references(extra: Path | None) -> pd.DataFrame:
    """The Atari-57 table, with the rows of `extra` added or replacing the Atari ones."""
    references = read_reference_file(ATARI_SCORES)
    if extra is None:
        return references
    extra_references = read_reference_file(extra)
    return pd.concat([references.drop(extra_references.index, errors="ignore"), extra_references])


def check_references(env_ids: set, references: pd.DataFrame):
    missing = sorted(env_ids - set(references.index))
    if missing:
        fail(
            f"no random and human reference scores for {', '.join(missing)}; add them with --reference-scores "
            f"FILE.csv (columns env_id,random,human, e.g. CartPole-v1,22,500) or report raw scores with "
            f"--normalization none"
        )


def normalize(values, env_id: str, references: pd.DataFrame | None):
    """Human-normalized score (score - random) / (human - random): 0 is random play, 1 is the human tester."""
    if references is None:
        return values
    random, human = references.loc[env_id, "random"], references.loc[env_id, "human"]
    return (values - random) / (human - random)


def final_score(curve: pd.DataFrame, fraction: float) -> float:
    """Mean of the points in the last `fraction` of the run's env steps (by steps: log_frequency may change
    on resume, so a count of points would cover different spans)."""
    last_step = curve.step.iloc[-1]
    return float(curve.value[curve.step >= last_step - fraction * last_step].mean())


def score_table(runs: list, variants: list, args: Args, references: pd.DataFrame | None) -> pd.DataFrame:
    rows = []
    for run, variant in zip(runs, variants):
        curve, env_id = run.scalars[args.tag], run.hyperparameters["env_id"]
        score = final_score(curve, args.final_fraction)
        rows.append(
            dict(
                variant=variant,
                env_id=env_id,
                seed=int(run.hyperparameters["seed"]),
                final_step=int(curve.step.iloc[-1]),
                score=score,
                normalized_score=normalize(score, env_id, references),
                run_dir=str(run.path),
            )
        )
    return pd.DataFrame(rows).sort_values(["variant", "env_id", "seed"], ignore_index=True)


# Missing games and seeds


def check_duplicates(table: pd.DataFrame):
    duplicated = table[table.duplicated(["variant", "env_id", "seed"], keep=False)]
    if len(duplicated):
        first = duplicated.iloc[0]
        directories = duplicated[
            (duplicated.variant == first.variant)
            & (duplicated.env_id == first.env_id)
            & (duplicated.seed == first.seed)
        ].run_dir
        fail(
            f"several runs of variant '{first.variant}', {first.env_id}, seed {first.seed}: "
            f"{', '.join(directories)}; pass only one of them, or tell them apart with --variant-key"
        )


def seed_list(seeds) -> str:
    return ", ".join(map(str, sorted(seeds)))


def common_games(table: pd.DataFrame) -> list:
    """The games every variant has runs of; warns about each game a variant lacks."""
    all_seeds = set(table.seed)
    games_of = {variant: set(group.env_id) for variant, group in table.groupby("variant")}
    games = set.intersection(*games_of.values())
    for variant, variant_games in games_of.items():
        for game in sorted(set(table.env_id) - variant_games):
            warn(
                f"variant '{variant}' has no run of {game} (expected seeds {seed_list(all_seeds)}); {game} is "
                f"left out of the aggregates of every variant, which compare variants on the same games"
            )
    if not games:
        fail("no game has runs of every variant, so there is nothing to compare; see the warnings above")
    return sorted(games)


def complete_seeds(table: pd.DataFrame, variant: str, games: list) -> list:
    """The seeds of a variant that have a run of every game; warns about each game that misses seeds."""
    all_seeds = set(table.seed)
    rows = table[table.variant == variant]
    seeds_of = {game: set(rows.seed[rows.env_id == game]) for game in games}
    for game, seeds in seeds_of.items():
        if seeds != all_seeds:
            warn(
                f"variant '{variant}', {game}: missing seed(s) {seed_list(all_seeds - seeds)} (has {seed_list(seeds)})"
            )
    seeds = set.intersection(*seeds_of.values())
    dropped = set(rows.seed) - seeds
    if not seeds:
        fail(f"variant '{variant}' has no seed with a run of every one of {', '.join(games)}")
    if dropped:
        warn(
            f"variant '{variant}': seed(s) {seed_list(dropped)} left out of its aggregates (an aggregate needs "
            f"each seed on every game); they use seed(s) {seed_list(seeds)}"
        )
    return sorted(seeds)


def mark_used(table: pd.DataFrame) -> pd.DataFrame:
    """Adds the column `used`: the run enters its variant's aggregates (see the module docstring)."""
    check_duplicates(table)
    games = common_games(table)
    used = pd.Series(False, index=table.index)
    for variant in sorted(table.variant.unique()):
        seeds = complete_seeds(table, variant, games)
        used |= (table.variant == variant) & table.env_id.isin(games) & table.seed.isin(seeds)
    return table.assign(used=used)


# Aggregates


def score_matrices(table: pd.DataFrame) -> dict:
    """variant -> (seeds x games) matrix of normalized final scores, games in name order, as rliable takes it."""
    used = table[table.used]
    return {
        variant: group.pivot(index="seed", columns="env_id", values="normalized_score").to_numpy()
        for variant, group in used.groupby("variant")
    }


def interval_estimates(score_dict: dict, func, reps: int, args: Args):
    """rliable's stratified bootstrap (runs resampled within each game), seeded so reruns give the same CIs. With one
    run of each game every resample is the data itself: the intervals are the point estimates, without the reps."""
    if all(len(scores) == 1 for scores in score_dict.values()):
        points = {variant: func(scores) for variant, scores in score_dict.items()}
        return points, {variant: np.stack([point, point]) for variant, point in points.items()}
    return library.get_interval_estimates(
        score_dict,
        func,
        reps=reps,
        confidence_interval_size=args.confidence,
        random_state=np.random.RandomState(args.seed),
    )


def all_metrics(scores: np.ndarray) -> np.ndarray:
    return np.array([metric(scores) for metric in METRICS.values()])


def aggregates_frame(points: dict, intervals: dict, matrices: dict) -> pd.DataFrame:
    rows = []
    for variant, matrix in matrices.items():
        row = dict(variant=variant, games=matrix.shape[1], seeds=matrix.shape[0])
        for index, name in enumerate(METRICS):
            row.update(
                {
                    name: points[variant][index],
                    f"{name}_ci_low": intervals[variant][0, index],
                    f"{name}_ci_high": intervals[variant][1, index],
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


def markdown_table(aggregates: pd.DataFrame, args: Args) -> str:
    header = ["variant", "games", "seeds", *METRIC_TITLES.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in aggregates.itertuples():
        cells = [
            f"{getattr(row, name):.3f} [{getattr(row, name + '_ci_low'):.3f}, {getattr(row, name + '_ci_high'):.3f}]"
            for name in METRICS
        ]
        lines.append(f"| {row.variant} | {row.games} | {row.seeds} | " + " | ".join(cells) + " |")
    scores = "human-normalized scores" if args.normalization == "hns" else f"raw scores of {args.tag}"
    note = (
        f"\nOver {scores}: point estimate [{100 * args.confidence:g}% stratified bootstrap CI]. Optimality gap: "
        "the mean shortfall below a score of 1, human level (lower is better).\n"
    )
    return "\n".join(lines) + "\n" + note


# Curves


def overlap_grid(curves: list, points: int) -> np.ndarray | None:
    """A grid over the x range that every (x, y) curve covers, so nothing is extrapolated; None if none."""
    low, high = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    return np.linspace(low, high, points) if low <= high else None


def run_curve(run: Run, tag: str, axis: str, references: pd.DataFrame | None):
    """(x, y): the run's normalized tag against env steps (axis "step") or hours of training (axis "hours")."""
    frame = run.scalars[tag]
    return frame[axis].to_numpy(float), normalize(
        frame.value.to_numpy(float), run.hyperparameters["env_id"], references
    )


def curve_tensors(table: pd.DataFrame, runs_by_dir: dict, axis: str, args: Args, references) -> dict:
    """variant -> (grid, (seeds x games x points) tensor) of the runs in the aggregates, on the variant's grid."""
    tensors = {}
    for variant, rows in table[table.used].groupby("variant"):
        rows = rows.sort_values(["seed", "env_id"])
        curves = [run_curve(runs_by_dir[directory], args.tag, axis, references) for directory in rows.run_dir]
        grid = overlap_grid(curves, args.curve_points)
        if grid is None:
            warn(f"variant '{variant}': its runs share no {axis} range; left out of the {axis} plot")
            continue
        values = np.array([np.interp(grid, x, y) for x, y in curves])
        tensors[variant] = grid, values.reshape(rows.seed.nunique(), rows.env_id.nunique(), len(grid))
    return tensors


def aggregate_curves(tensors: dict, args: Args) -> dict:
    """variant -> (grid, point estimates, CI low, CI high) of --curve-metric at each grid point."""
    metric = METRICS[args.curve_metric]

    def per_point(scores: np.ndarray) -> np.ndarray:  # (seeds x games x points) -> the metric at each point
        return np.array([metric(scores[..., k]) for k in range(scores.shape[-1])])

    points, intervals = interval_estimates(
        {variant: values for variant, (_, values) in tensors.items()}, per_point, args.curve_reps, args
    )
    return {variant: (grid, points[variant], *intervals[variant]) for variant, (grid, _) in tensors.items()}


# Plots


def new_figure(width: int, height: int, rows: int = 1, columns: int = 1):
    """A figure of width x height pixels at DPI."""
    return plt.subplots(rows, columns, figsize=(width / DPI, height / DPI), dpi=DPI, squeeze=False)


def save_figure(figure, path: Path):
    figure.savefig(path, dpi=DPI)  # no bbox_inches="tight": it would change the pixel size
    plt.close(figure)


def variant_colors(variants: list) -> dict:
    palette = plt.get_cmap("tab10").colors
    return {variant: palette[index % len(palette)] for index, variant in enumerate(sorted(variants))}


def score_label(args: Args) -> str:
    return "human-normalized score" if args.normalization == "hns" else f"{args.tag} (raw)"


def plot_aggregate_curves(curves: dict, xlabel: str, path: Path, colors: dict, args: Args, games: int):
    figure, axes = new_figure(*AGGREGATE_SIZE)
    axis = axes[0, 0]
    for variant, (grid, estimate, low, high) in curves.items():
        axis.plot(grid, estimate, color=colors[variant], label=variant)
        axis.fill_between(grid, low, high, color=colors[variant], alpha=0.2)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(f"{METRIC_TITLES[args.curve_metric]} {score_label(args)}")
    axis.set_title(
        f"{METRIC_TITLES[args.curve_metric]} over {games} game(s), {100 * args.confidence:g}% stratified bootstrap CI"
    )
    axis.grid(alpha=0.25)
    if curves:
        axis.legend(loc="best")
    figure.tight_layout()
    save_figure(figure, path)


def per_game_lines(runs: list, variants: list, tag: str):
    """{game: {variant: (grid, mean, min, max) over seeds}} of the raw tag, every run included."""
    curves = {}
    for run, variant in zip(runs, variants):
        frame = run.scalars[tag]
        curves.setdefault(run.hyperparameters["env_id"], {}).setdefault(variant, []).append(
            (frame.step.to_numpy(float), frame.value.to_numpy(float))
        )
    lines = {}
    for game, by_variant in sorted(curves.items()):
        for variant, seed_curves in sorted(by_variant.items()):
            grid = overlap_grid(seed_curves, 100)
            if grid is None:
                warn(f"variant '{variant}', {game}: its seeds share no step range; left out of per_game.png")
                continue
            values = np.array([np.interp(grid, x, y) for x, y in seed_curves])
            lines.setdefault(game, {})[variant] = grid, values.mean(0), values.min(0), values.max(0)
    return lines


def plot_per_game(lines: dict, path: Path, colors: dict, tag: str):
    columns = min(len(lines), PER_GAME_COLUMNS)
    rows = math.ceil(len(lines) / columns)
    width = PANEL_SIZE[0] * columns
    legend_columns = max(1, min(len(colors), LEGEND_MAX_COLUMNS, width // LEGEND_ENTRY_WIDTH))
    band = LEGEND_BAND + LEGEND_ROW * (math.ceil(len(colors) / legend_columns) - 1)
    height = PANEL_SIZE[1] * rows + band
    figure, axes = new_figure(width, height, rows, columns)
    for axis, (game, by_variant) in zip(axes.flat, lines.items()):
        for variant, (grid, mean, low, high) in by_variant.items():
            axis.plot(grid, mean, color=colors[variant], label=variant)
            axis.fill_between(grid, low, high, color=colors[variant], alpha=0.2)
        axis.set_title(game, fontsize="medium")
        axis.tick_params(labelsize="small")
        axis.xaxis.get_offset_text().set_fontsize("small")
    for axis in axes.flat[len(lines) :]:
        axis.axis("off")
    figure.legend(
        handles=[plt.Line2D([], [], color=color, label=variant) for variant, color in colors.items()],
        loc="upper center",
        ncol=legend_columns,
        frameon=False,
        fontsize="small",
        title="mean over seeds, min-max shaded",
        title_fontsize="small",
    )
    figure.supxlabel("environment steps", fontsize="small")
    figure.supylabel(tag, fontsize="small")
    figure.tight_layout(rect=(0, 0, 1, 1 - band / height))
    save_figure(figure, path)


def plot_intervals(points: dict, intervals: dict, path: Path, colors: dict, args: Args):
    variants = list(points)
    height = INTERVALS_BASE_HEIGHT + INTERVALS_ROW_HEIGHT * len(variants)
    figure, _ = plot_utils.plot_interval_estimates(
        points,
        intervals,
        list(METRIC_TITLES.values()),
        variants,
        colors=colors,
        xlabel=score_label(args),
        xlabel_y_coordinate=8 / height,
    )
    figure.set_size_inches(INTERVALS_WIDTH / DPI, height / DPI)
    figure.set_dpi(DPI)
    # rliable lays the figure out for bbox_inches="tight"; fit it to the fixed canvas instead, above the x label.
    figure.tight_layout(rect=(0, 40 / height, 1, 1))
    save_figure(figure, path)


# Main


def write_tables(table: pd.DataFrame, aggregates: pd.DataFrame, markdown: str, out_dir: Path):
    table[["variant", "env_id", "seed", "final_step", "score", "normalized_score", "used", "run_dir"]].to_csv(
        out_dir / "scores.csv", index=False
    )
    aggregates.to_csv(out_dir / "aggregates.csv", index=False)
    (out_dir / "aggregates.md").write_text(markdown)


def main(args: Args):
    check_args(args)
    runs = load_runs(args.paths, args.tag)
    variants = [variant_name(run, args.variant_key) for run in runs]
    references, env_ids = None, {run.hyperparameters["env_id"] for run in runs}
    if args.normalization != "none":
        references = load_references(args.reference_scores)
        if args.normalization == "auto":  # a mix of games with and without reference scores is refused below
            args.normalization = "hns" if env_ids & set(references.index) else "none"
        if args.normalization == "hns":
            check_references(env_ids, references)
        else:
            print(f"no reference scores for {', '.join(sorted(env_ids))}: raw scores", file=sys.stderr)
            references = None
    table = mark_used(score_table(runs, variants, args, references))
    matrices = score_matrices(table)
    points, intervals = interval_estimates(matrices, all_metrics, args.reps, args)
    aggregates = aggregates_frame(points, intervals, matrices)
    markdown = markdown_table(aggregates, args)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_tables(table, aggregates, markdown, args.out_dir)
    colors = variant_colors(set(variants))
    runs_by_dir = {str(run.path): run for run in runs}
    games = table[table.used].env_id.nunique()
    for axis, xlabel, name in [
        ("step", "environment steps", "aggregate_vs_steps.png"),
        ("hours", "wall-clock hours of training", "aggregate_vs_time.png"),
    ]:
        curves = aggregate_curves(curve_tensors(table, runs_by_dir, axis, args, references), args)
        plot_aggregate_curves(curves, xlabel, args.out_dir / name, colors, args, games)
    plot_per_game(per_game_lines(runs, variants, args.tag), args.out_dir / "per_game.png", colors, args.tag)
    plot_intervals(points, intervals, args.out_dir / "intervals.png", colors, args)
    print(f"wrote scores.csv, aggregates.csv, aggregates.md and 4 PNGs to {args.out_dir}", file=sys.stderr)
    print(markdown, end="")


if __name__ == "__main__":
    main(tyro.cli(Args, prog="python -m cleanba.score_report", description=__doc__))
