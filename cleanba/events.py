"""A run's TensorBoard event files read back (score_report, compare_layouts, check_fork, the benchmark and the tests
read runs here): its hyperparameters, the "|param|value|" table the training scripts log as text, and its scalars,
the event files of a resumed run merged, each later file replacing the points from its first step on (what
tensorboardX's purge_step means)."""

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

HYPERPARAMETERS_TAG = "hyperparameters/text_summary"  # where SummaryWriter.add_text("hyperparameters") lands


@dataclass
class Run:
    path: Path
    hyperparameters: dict
    """name -> value, as logged (text)"""
    scalars: dict
    """tag -> DataFrame with columns step, value, hours (of training since the run's first event), by step"""


def find_run_dirs(paths: list) -> list:
    return sorted({event_file.parent for path in paths for event_file in Path(path).rglob("events.out.tfevents*")})


def parse_hyperparameters(text: str) -> dict:
    """The "|param|value|" markdown table that the training scripts log, as {param: value}."""
    rows = [line.strip().split("|") for line in text.splitlines() if line.strip().startswith("|")]
    return {row[1]: "|".join(row[2:-1]) for row in rows if len(row) >= 4 and row[1] not in ("param", "-")}


def read_event_file(path: Path):
    """(hyperparameters or {}, wall time of the first event, {tag: DataFrame(step, value, wall_time)}), or None
    for a file without events (a run stopped before its writer flushed)."""
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    accumulator.Reload()
    try:
        first_time = accumulator.FirstEventTimestamp()
    except ValueError:
        return None
    tags = accumulator.Tags()
    hyperparameters = {}
    if HYPERPARAMETERS_TAG in tags["tensors"]:
        text = accumulator.Tensors(HYPERPARAMETERS_TAG)[0].tensor_proto.string_val[0].decode()
        hyperparameters = parse_hyperparameters(text)
    scalars = {
        tag: pd.DataFrame(
            [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)], columns=["step", "value", "wall_time"]
        )
        for tag in tags["scalars"]
    }
    return hyperparameters, first_time, scalars


def merge_event_files(files: list) -> dict:
    """Scalars of a run's event files in the order written. A later file (a resume) replaces the earlier points
    from its first step on; its hours continue from the last kept point, so time lost to the stop is not counted."""
    merged = {}
    for first_time, scalars in files:
        # eval/ curves are indexed by episode, not env step (cleanba/evaluate.py), and a resumed run first logs the
        # test/ points its checkpoint had not: neither says where a resume starts, and either would drop earlier
        # points.
        out_of_step = ("eval/", "test/")
        starts = [frame.step.min() for tag, frame in scalars.items() if len(frame) and not tag.startswith(out_of_step)]
        if starts:
            merged = {tag: frame[frame.step < min(starts)] for tag, frame in merged.items()}
        offset = max((frame.hours.max() for frame in merged.values() if len(frame)), default=0.0)
        for tag, frame in scalars.items():
            frame = frame.assign(hours=offset + (frame.wall_time - first_time) / 3600).drop(columns="wall_time")
            merged[tag] = pd.concat([merged[tag], frame]) if tag in merged else frame
    return {
        tag: frame.drop_duplicates("step", keep="last").sort_values("step", ignore_index=True)
        for tag, frame in merged.items()
    }


def read_run(directory: Path) -> Run:
    """A run from all its event files. Its hyperparameters are those it started with, the first file's (a resume
    may change exp_name and the device layout)."""
    files = [read_event_file(path) for path in Path(directory).glob("events.out.tfevents*")]
    files = sorted((file for file in files if file is not None), key=lambda file: file[1])
    hyperparameters = next((file[0] for file in files if file[0]), {})
    return Run(Path(directory), hyperparameters, merge_event_files([file[1:] for file in files]))


def scalar_events(directory: Path) -> dict:
    """{tag: [ScalarEvent(wall_time, step, value), ...]} of every scalar in a directory's event files, as
    TensorBoard's EventAccumulator reads them."""
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}
