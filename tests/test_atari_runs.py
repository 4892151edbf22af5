"""The Breakout learning that README.md and docs/atari-cpu.md report, read back from the runs' own event files in
docs/runs (merged as the score report merges a resumed run, scored as it scores them): each figure the docs give
is computed here from the curve it comes from and found in the text, so neither can change alone. The first runs,
on the code of their dates, are a dated report with their own event files (docs/benchmarks/2026-11-27-breakout-cpu)."""

import numpy as np
import pytest
from support import ROOT

from cleanba import events, score_report

README = (ROOT / "README.md").read_text()
ATARI_CPU = (ROOT / "docs" / "atari-cpu.md").read_text()
REPORT = ROOT / "docs" / "benchmarks" / "2026-11-27-breakout-cpu"
REFERENCES = score_report.load_references(None)


def scalars(directory):
    return events.read_run(directory).scalars


def value_at(points, step: int) -> float:
    """The logged 20-game mean at the logged step nearest `step`."""
    return float(points.value[(points.step - step).abs().idxmin()])


def human_normalized_end(points) -> tuple:
    """(raw mean, human-normalized) over the last 10% of the steps, as score_report computes them."""
    raw = score_report.final_score(points, 0.1)
    return raw, float(score_report.normalize(raw, "Breakout-v5", REFERENCES))


IMPALA = scalars(ROOT / "docs" / "runs" / "breakout-impala-cpu")


def test_impala_at_the_defaults_learns_breakout_in_1_5m_steps():
    """README and docs/atari-cpu.md: the end of the run, its human-normalized score over the last 10% of its steps, and
    its saved model's evaluation (10 whole games), from the run's own event files."""
    points = IMPALA["charts/episodic_return"]
    assert points.step.iloc[-1] == 1_497_600  # 585 iterations of 2,560 steps
    end = f"{points.value.iloc[-1]:.1f} at 1.5M steps"
    raw, normalized = human_normalized_end(points)
    evaluation = IMPALA["eval/episodic_return"].value.to_numpy()
    assert len(evaluation) == 10
    figures = [end, f"human-normalized {normalized:.3f} (raw {raw:.1f})", f"{evaluation.mean():.1f} over 10 games"]
    for figure in figures:
        assert figure in README and figure in ATARI_CPU, figure
    assert f"std {evaluation.std():.1f}: {', '.join(str(int(v)) for v in evaluation)}" in ATARI_CPU


@pytest.mark.parametrize("step", [51_200, 307_200, 768_000, 1_024_000, 1_280_000])
def test_impala_curve_as_stored(step):
    """docs/atari-cpu.md's points of the IMPALA curve."""
    points = IMPALA["charts/episodic_return"]
    assert f"{value_at(points, step):.1f} at {step / 1e6:.2f}M" in ATARI_CPU


def test_ppo_with_the_default_schedule_passes_10():
    """README: PPO with its default 50M-step schedule passes 10 at 1.15M steps (11.7 at 1.34M)."""
    assert "PPO on its default 50M-step schedule passes 10 at 1.15M steps" in README
    points = scalars(ROOT / "docs" / "runs" / "breakout-ppo-cpu-50m")["charts/episodic_return"]
    first = points[points.value >= 10].iloc[0]
    assert round(first.step / 1e6, 2) == 1.15 and round(first.value, 1) == 10.2
    assert round(points.step.iloc[-1] / 1e6, 2) == 1.34 and round(points.value.iloc[-1], 1) == 11.7
    assert "10.2 at 1.15M" in ATARI_CPU and "11.7 at 1.34M" in ATARI_CPU
    raw, normalized = human_normalized_end(points)
    assert (round(normalized, 3), round(raw, 2)) == (0.297, 10.24)
    assert "0.297 (raw 10.24, over 1.21M-1.34M)" in ATARI_CPU


def test_the_first_runs_report_reads_its_own_event_files():
    """The dated report of the first runs: its IMPALA curve up to 691k (where its event files end) and the annealed
    PPO run's 9.55, from the event files beside it."""
    text = (REPORT / "README.md").read_text()
    impala = scalars(REPORT / "runs" / "breakout-impala-cpu-lecun")["charts/episodic_return"]
    assert round(impala.step.iloc[-1] / 1000) == 691
    for step, value in [(51_000, 1.5), (307_000, 3.4), (691_000, 8.6)]:
        assert round(value_at(impala, step), 1) == value and f"{value} at {step // 1000}k" in text
    ppo = scalars(REPORT / "runs" / "breakout-ppo-cpu")["charts/episodic_return"]
    assert round(ppo.value.max(), 2) == 9.55 and ppo.value.max() < 10 and "9.55 at 1.49M" in text
    assert np.isclose(human_normalized_end(ppo)[1], 0.212, atol=5e-4) and "0.212 (raw 7.8)" in text


PQN = scalars(ROOT / "docs" / "runs" / "breakout-pqn-cpu")


def test_pqn_at_cleanrls_settings_in_1_5m_steps():
    """docs/atari-cpu.md: PQN's curve, the end of its run scored as score_report scores it, and its saved model's 10
    games played by the evaluation CLI (their event file beside the run's)."""
    points = PQN["charts/episodic_return"]
    assert points.step.iloc[-1] == 1_499_136  # 1,464 iterations of 1,024 steps
    curve = [f"{value_at(points, step):.1f} at {step / 1e6:.2f}M" for step in (51_200, 307_200, 768_000, 1_024_000)]
    curve += [f"{value_at(points, 1_280_000):.1f} at 1.28M", f"{points.value.iloc[-1]:.1f} at 1.5M steps"]
    first = points[points.value >= 5].step.iloc[0]
    raw, normalized = human_normalized_end(points)
    games = events.scalar_events(ROOT / "docs" / "runs" / "breakout-pqn-cpu-evaluation")["eval/episodic_return"]
    evaluation = np.array([game.value for game in sorted(games, key=lambda game: game.step)])
    assert len(evaluation) == 10
    listed = ", ".join(str(int(v)) for v in evaluation)
    games = f"{evaluation.mean():.1f} over 10 games (std {evaluation.std():.1f}: {listed})"
    figures = [
        *curve,
        f"first past 5 at {first / 1000:.0f}k",
        f"human-normalized {normalized:.3f} (raw {raw:.1f})",
        games,
    ]
    for figure in figures:
        assert figure in ATARI_CPU, figure
