"""StarPilot's generalization runs that docs/procgen.md and README.md report, read back from their own event files in
docs/runs/starpilot-procgen-cpu: IMPALA at its defaults and PPO at CleanRL's ppo_procgen.py settings, trained on
StarpilotEasy-v0's levels 0-199 and tested every ~65k steps on 100 games of the whole distribution, in turns on one
2-core CPU; the report's table (docs/benchmarks/2026-12-07-starpilot-cpu) computed from them beside OpenAI's PPO on
the same protocol."""

import importlib.util

import pytest
from support import ROOT

from cleanba import events

REPORT = ROOT / "docs" / "benchmarks" / "2026-12-07-starpilot-cpu"
PAGE = " ".join((ROOT / "docs" / "procgen.md").read_text().split())  # its words, whatever the line breaks
README = " ".join((ROOT / "README.md").read_text().split())
_spec = importlib.util.spec_from_file_location("starpilot_figures", REPORT / "figures.py")
figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(figures)

PROTOCOL = {
    "env_id": "StarpilotEasy-v0",
    "env_kwargs": "('num_levels=200', 'start_level=0')",
    "test_env_kwargs": "('num_levels=0',)",
    "eval_episodes": "100",
    "seed": "1",
}
SETTINGS = {  # PPO's: CleanRL's ppo_procgen.py (64 envs of 256 steps); IMPALA's: its defaults
    "ppo-1": dict(local_num_envs="64", num_steps="256", learning_rate="0.0005", gamma="0.999", num_minibatches="8"),
    "impala-1": dict(local_num_envs="64", num_actor_threads="2", num_steps="20", learning_rate="0.0006"),
}
SETTINGS["ppo-1"] |= dict(update_epochs="3", clip_coef="0.2")


def run(name: str) -> events.Run:
    return events.read_run(figures.RUNS / name)


@pytest.mark.parametrize("name", list(figures.NAMES))
def test_the_runs_follow_the_protocol(name):
    logged = run(name).hyperparameters
    assert {key: logged[key] for key in PROTOCOL} == PROTOCOL
    assert {key: logged[key] for key in SETTINGS[name]} == SETTINGS[name]


# The tests that a SIGTERM ended unlogged, in runs whose checkpoints did not yet keep unplayed tests (they do now:
# tests/test_reliability.py::test_a_stop_loses_no_test_of_the_test_curve).
LOST = {"impala-1": [384_000], "ppo-1": [393_216]}


@pytest.mark.parametrize("name", list(figures.NAMES))
def test_each_run_tested_on_the_whole_distribution_as_it_trained(name):
    """A test every ~65k steps (PPO: 4 iterations of 16,384 steps; IMPALA: 25 of 2,560), none missing after resumes
    but those LOST names."""
    train, test = figures.curves(name)
    every = 65_536 if name == "ppo-1" else 64_000
    scheduled = range(every, test.step.iloc[-1] + 1, every)
    assert test.step.tolist() == [step for step in scheduled if step not in LOST[name]]
    assert train.step.iloc[-1] - test.step.iloc[-1] <= every


def test_the_report_and_the_pages_give_the_event_files_figures():
    rows = figures.table()
    lines = figures.markdown(rows)
    report = (REPORT / "README.md").read_text()
    for line in lines:
        assert line in report, line
    low, high, cells = rows[-1]
    window = f"{low // 1000}k-{high // 1000}k"
    for label, (train, test) in cells.items():
        assert f"{label} {train:.2f} / {test:.2f}" in PAGE, (label, train, test)
    impala, ppo, openai = (f"{cells[label][1]:.2f}" for label in [*figures.NAMES.values(), "OpenAI PPO"])
    assert window in PAGE and window in README
    assert f"{impala} (IMPALA)" in README and f"{ppo} (PPO)" in README and f"OpenAI's PPO {openai}" in README
