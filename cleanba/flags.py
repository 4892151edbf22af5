"""A training script's flags: declared (flag: a field of Args with its meaningful range and whether a resumed run may
change it), parsed (parse_flags: tyro, with each range in --help) and checked before anything starts (check_flags:
ranges, device ids, the flags that only act together), with what they derive: the actor threads of a process and the
run's default name. Each script adds its algorithm's own checks. fail is every refusal of bad input, the scripts' and
the commands': one line, exit status 2.
"""

import ast
import inspect
import itertools
import os
import sys
import textwrap
import time
from dataclasses import field, fields
from functools import cache, partial
from pathlib import Path
from types import MappingProxyType

import tyro

from cleanba.startup import known_env


def fail(message: str, program: str | None = None):
    """Refuse bad input before any env, thread or device work: exit status 2, no traceback, one line that starts with
    the program's name (default: the file run, as in `cleanba_ppo.py: error: ...`)."""
    print(f"{program or Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def in_range(value: float, interval: str) -> bool:
    """Whether value lies in an interval written "[low, high)": "[" and "]" include the bound, "(" and ")" not."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    below = value <= high if interval[-1] == "]" else value < high
    return above and below


def flag(default, interval: str | None = None, *, may_change_on_resume: bool = False):
    """A field of a script's Args with what the engine needs to know of it: the interval of meaningful values of a
    numeric flag ("[low, high)": "[" and "]" include the bound), refused outside it before anything starts; and
    whether a resumed run may change it (it changes where or how a run computes or reports, not what it learns)."""
    metadata = dict(range=interval, may_change_on_resume=may_change_on_resume)
    if isinstance(default, list):
        return field(default_factory=partial(list, default), metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_ranges(args) -> dict:
    """{name: interval} of every flag of an Args class or instance that has a range."""
    return {f.name: f.metadata["range"] for f in fields(args) if f.metadata.get("range")}


def flags_that_may_change_on_resume(args) -> set:
    """The names of the flags a resumed run may change (flag(..., may_change_on_resume=True))."""
    return {f.name for f in fields(args) if f.metadata.get("may_change_on_resume")}


def field_docstring(args_class, name: str) -> str:
    """The docstring under a field of args_class or of the class it inherits it from (as tyro reads it)."""
    for klass in args_class.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return class_field_docstrings(klass).get(name, "")
    return ""


@cache
def class_field_docstrings(klass) -> dict:
    """{field: its docstring} of the fields a class body declares, its source parsed once per process, not once per
    flag: every start of a script parses its flags (docs/performance.md#a-scripts-start)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
    return {
        node.target.id: " ".join(str(after.value.value).split())
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    }


def parse_flags(args_class, doc: str):
    """A script's command line parsed by tyro. Its --help opens with the script's docstring (what it trains, an example
    command), and each flag with a range (flag(default, interval)) says the values it accepts."""
    for f in fields(args_class):
        if f.metadata.get("range") and "help" not in f.metadata:
            help_text = f"{field_docstring(args_class, f.name)}; in {f.metadata['range']}"
            f.metadata = MappingProxyType({**f.metadata, "help": help_text})
    examples = [line.strip() for line in doc.splitlines() if line.startswith("    python ")]
    description = "\n\n".join([doc.split("\n\n")[0], *(f"e.g. {line}" for line in examples), "docs: README.md, docs/"])
    return tyro.cli(args_class, description=description)


def check_flags(args):
    """The checks every script shares: every numeric flag in its range (NaN is in none), device ids, and the flags
    that only act together with another."""
    for name, interval in flag_ranges(args).items():
        if not in_range(getattr(args, name), interval):
            fail(
                f"--{name.replace('_', '-')}={getattr(args, name)} is outside its meaningful range {interval}; "
                f"give a value in {interval}"
            )
    if (args.capture_video or args.upload_model) and not (args.save_model and args.eval_episodes):
        fail(
            "--capture-video and --upload-model act on the evaluation of the saved model: add --save-model "
            "(and keep --eval-episodes above 0)"
        )
    if args.test_env_kwargs and not args.test_frequency:
        fail("--test-env-kwargs sets the test envs of the test curve: add --test-frequency (iterations between tests)")
    if args.test_frequency and not args.eval_episodes:
        fail("--test-frequency plays --eval-episodes games at each test: keep --eval-episodes above 0")
    if args.upload_model:  # a missing Hub token must not surface only at the end of a long run
        check_hub_login()
    if args.resume and args.run_name is None and "SLURM_JOB_ID" not in os.environ:
        fail("--resume needs --run-name (the run directory under runs/ that holds the checkpoint)")
    if hasattr(args, "channels") and (not args.channels or min(args.channels) <= 0):  # the ResNet's, if it has one
        fail(f"--channels {' '.join(map(str, args.channels))}: give one or more positive channel counts")
    for flag, ids in [("--actor-device-ids", args.actor_device_ids), ("--learner-device-ids", args.learner_device_ids)]:
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            fail(f"{flag} {' '.join(map(str, ids))}: give one or more distinct, non-negative local device ids")
    explicit = {
        "--coordinator-address": args.coordinator_address,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    given = [flag for flag, value in explicit.items() if value is not None]
    if given and not args.distributed:
        fail(f"{' '.join(given)} only apply to multi-process runs; add --distributed")
    if (args.num_processes is None) != (args.process_id is None):
        fail("give --num-processes and --process-id together (or neither, under SLURM)")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        fail(
            f"--process-id={args.process_id} must be in 0..{args.num_processes - 1} for --num-processes="
            f"{args.num_processes}"
        )
    if not known_env(args.env_id):
        fail(
            f"--env-id={args.env_id} is not an EnvPool env; see envpool.list_all_envs() (e.g. Breakout-v5, CartPole-v1)"
        )


def check_hub_login():
    """Called before a long run starts, so that a missing Hugging Face token is not discovered at its end."""
    from huggingface_hub import get_token

    if get_token() is None:
        fail(
            "--upload-model needs a Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write "
            "access), or leave out --upload-model"
        )


def actor_threads(args) -> int:
    """The actor threads of one process: --num-actor-threads on each of its --actor-device-ids."""
    return len(args.actor_device_ids) * args.num_actor_threads


def default_run_name(args) -> str:
    """Deterministic under SLURM, so that a requeued job finds its checkpoint; the start time otherwise."""
    name = f"{args.env_id}__{args.exp_name}__{args.seed}"
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{name}__{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_JOB_ID" in os.environ:
        return f"{name}__{os.environ['SLURM_JOB_ID']}"
    return f"{name}__{int(time.time())}"
