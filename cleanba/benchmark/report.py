"""The benchmark's figures as the parent reads them (the training runs' stats/, CPU samples), the ratios between
phases, and the table it prints."""

import sys
from pathlib import Path

import numpy as np

from cleanba.benchmark.common import BenchmarkArgs, median, window_boundaries, window_sps
from cleanba.benchmark.layers import layers_table


def read_stats(run_dir: Path, batch_size: int) -> dict:
    """{name: (wall times, values)} of the stats/ scalars, ordered by iteration."""
    from cleanba.events import scalar_events

    stats = {}
    for tag, logged in scalar_events(run_dir).items():
        if tag.startswith("stats/"):
            events = sorted(logged, key=lambda e: e.step)
            assert [e.step for e in events] == [batch_size * (i + 1) for i in range(len(events))], tag
            stats[tag[len("stats/") :]] = ([e.wall_time for e in events], np.array([e.value for e in events]))
    return stats


def training_figures(run_dir: Path, sizes: dict, bench: BenchmarkArgs) -> dict:
    stats = read_stats(run_dir, sizes["batch_size"])
    ends = stats["learner_update_time"][0]
    if len(ends) != sizes["num_iterations"]:
        sys.exit(f"benchmark: {run_dir} holds {len(ends)} iterations, expected {sizes['num_iterations']}")
    bounds = window_boundaries(ends, bench)
    windows = window_sps(bounds, sizes["batch_size"] * bench.iterations)
    measured = slice(bench.warmup_iterations, None)

    def measured_median(*names):
        return median(sum(stats[name][1][measured] for name in names))

    update_time = measured_median("learner_update_time")
    rollout_time = measured_median("actor_rollout_time")
    parts = [n for n in stats if n.startswith("actor_") and n.endswith("_time") and n != "actor_rollout_time"]
    return dict(
        sps=median(windows),
        window_sps=windows,
        window_bounds=bounds,
        compile_s=float(stats["learner_compile_time"][1][0]),
        actor_compile_s=float(stats["actor_rollout_time"][1][0]) - rollout_time,
        learner_update_time_s=update_time,
        actor_rollout_time_s=rollout_time,
        learner_wait_s=measured_median("rollout_queue_wait"),
        actor_wait_s=measured_median("param_queue_wait", "actor_rollout_queue_wait"),
        actor_param_wait_s=measured_median("param_queue_wait"),
        actor_rollout_queue_wait_s=measured_median("actor_rollout_queue_wait"),
        # where the actors' rollout time goes while the learner runs beside them (on a shared GPU, say)
        actor_timings_s={name[len("actor_") : -len("_time")]: measured_median(name) for name in parts},
    )


def busy_cores(figures: dict) -> dict:
    """CPU seconds per wall second of the phase's process in each window (all its threads), from the samples."""
    times, cpu = np.array(figures.pop("cpu_samples")).T
    used = np.diff(np.interp(figures["window_bounds"], times, cpu)) / np.diff(figures["window_bounds"])
    return dict(cores=median(used), window_cores=used.tolist())


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def derived_ratios(phases: dict) -> dict:
    sps = {name: figures["sps"] for name, figures in phases.items() if "sps" in figures}
    get = sps.get
    ratios = {f"{name}_over_ceiling": ratio(value, get("ceiling")) for name, value in sps.items() if name != "ceiling"}
    ratios["concurrent_over_sync"] = ratio(get("concurrent"), get("sync"))
    both_sides = get("actor") is not None and get("learner") is not None
    ratios["overlap_efficiency"] = ratio(get("concurrent"), min(get("actor"), get("learner"))) if both_sides else None
    serial = 1 / (1 / get("actor") + 1 / get("learner")) if both_sides else None
    ratios["sync_efficiency"] = ratio(get("sync"), serial)
    ratios["concurrent_over_serial"] = ratio(get("concurrent"), serial)
    ours = get("concurrent") or get("sync")
    ratios["ours_over_reference"] = ratio(ours, get("reference"))
    return {name: value for name, value in ratios.items() if value is not None}


def cell(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if digits == 0 else f"{value:.{digits}f}"


def device_cell(peaks) -> str:
    return "n/a" if not peaks else f"{max(peaks.values()):,.0f}"


def table(phases: dict, ratios: dict) -> str:
    header = (
        f"{'phase':<11}{'SPS':>10}{'/ ceiling':>11}{'compile s':>11}{'learner wait s':>16}{'actor wait s':>14}"
        f"{'cores':>7}{'host MiB':>10}{'device MiB':>12}"
    )
    lines = [header, "-" * len(header)]
    for name, figures in phases.items():
        if name == "layers":
            continue
        lines.append(
            f"{name:<11}{cell(figures['sps'], 0):>10}{cell(ratios.get(f'{name}_over_ceiling')):>11}"
            f"{cell(figures.get('compile_s')):>11}{cell(figures.get('learner_wait_s'), 4):>16}"
            f"{cell(figures.get('actor_wait_s'), 4):>14}{cell(figures.get('cores'), 1):>7}"
            f"{cell(figures['peak_rss_mib'], 0):>10}"
            f"{device_cell(figures.get('device_peak_mib')):>12}"
        )
    labels = {
        "concurrent_over_sync": "concurrent / sync",
        "overlap_efficiency": "overlap efficiency (concurrent / min(actor, learner))",
        "sync_efficiency": "sync efficiency (sync / (1 / (1/actor + 1/learner)))",
        "concurrent_over_serial": "concurrent / serial bound (concurrent / (1 / (1/actor + 1/learner)))",
        "ours_over_reference": "ours / reference",
    }
    lines += [f"{label}: {ratios[key]:.2f}" for key, label in labels.items() if key in ratios]
    for name in ["actor", "sync", "concurrent"]:  # the script's stats/actor_*_time: median s per rollout of a thread
        if name in phases and phases[name].get("actor_timings_s"):
            figures = phases[name]
            rollout = figures.get("rollout_time_s", figures.get("actor_rollout_time_s"))
            lines.append(
                f"actor time per rollout, {name} (s): "
                + ", ".join(f"{part} {value:.3f}" for part, value in figures["actor_timings_s"].items())
                + f" (rollout {rollout:.3f})"
            )
    if "learner" in phases:
        memory = phases["learner"]["learner_memory"]
        step = (
            f"one minibatch step temp {mebibytes(memory['minibatch_step_temp_mib'])} MiB "
            f"(x{memory['update_over_minibatch_step']:.2f}), "
            if "minibatch_step_temp_mib" in memory
            else ""
        )
        lines.append(
            f"learner device memory (XLA's analysis): update temp {mebibytes(memory['update_temp_mib'])} MiB, {step}"
            f"update arguments {mebibytes(memory['update_argument_mib'])} MiB"
        )
    if "layers" in phases:
        lines.append(layers_table(phases["layers"]))
    return "\n".join(lines)


def mebibytes(value: float) -> str:
    """A MiB figure: whole MiB, or three decimals under 10 (an MLP's learner needs less than one)."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.3f}"
