"""Submit Cleanba runs to SLURM: one job array task per (env id, seed), from `cleanba.slurm_template`.

    python -m cleanba.launch_slurm --env-ids Breakout-v5 Pong-v5 --seeds 1 2 3 --ntasks-per-node 2 \\
        --gpus-per-task 4 --cpus-per-task 10 --command "python cleanba/cleanba_impala.py --distributed" --dry-run

Every task of an array job runs the command through srun with `--env-id` and `--seed` appended; with
`--distributed` the script reads its rank and the number of tasks from srun's variables.
"""

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

TEMPLATE = Path(__file__).resolve().parents[1] / "cleanba.slurm_template"


@dataclass
class Args:
    command: str
    """the training command every task runs, e.g. "python cleanba/cleanba_ppo.py --distributed --track\""""
    env_ids: list[str] = field(default_factory=lambda: ["Breakout-v5"])
    """env ids, one array task per env id and seed"""
    seeds: list[int] = field(default_factory=lambda: [1])
    """seeds, one array task per env id and seed"""
    job_name: str = "cleanba"
    """the SLURM job name"""
    partition: str = ""
    """the partition (empty: the cluster's default)"""
    account: str = ""
    """the account to charge (empty: your default)"""
    nodes: int = 1
    """nodes per array task"""
    ntasks_per_node: int = 1
    """processes per node (jax.distributed world size = nodes x ntasks_per_node)"""
    gpus_per_task: int = 0
    """GPUs per process (0: do not ask for GPUs)"""
    cpus_per_task: int = 0
    """CPU cores per process, for EnvPool (0: the cluster's default)"""
    mem: str = ""
    """memory per node, e.g. 64G (empty: the cluster's default)"""
    time: str = ""
    """time limit, e.g. 2-00:00:00 (empty: the partition's default)"""
    srun_options: str = ""
    """extra srun options, e.g. --overcommit to share cores between tasks"""
    output: str = "slurm/%x-%A_%a.out"
    """where each array task writes its output (%x job name, %A job id, %a array index)"""
    workdir: Path = field(default_factory=Path.cwd)
    """the directory the jobs run in (the Cleanba checkout)"""
    template: Path = TEMPLATE
    """the sbatch template to render"""
    dry_run: bool = False
    """print the rendered script instead of submitting it"""


def check(args: Args):
    for name in ["nodes", "ntasks_per_node"]:
        if getattr(args, name) < 1:
            sys.exit(f"launch_slurm: error: --{name.replace('_', '-')} must be at least 1")
    if not args.env_ids or not args.seeds:
        sys.exit("launch_slurm: error: give at least one --env-ids and one --seeds")
    if not args.template.is_file():
        sys.exit(f"launch_slurm: error: --template {args.template} does not exist")


def render(args: Args) -> str:
    values = {
        "job_name": args.job_name,
        "partition": args.partition,
        "account": args.account,
        "nodes": args.nodes,
        "ntasks_per_node": args.ntasks_per_node,
        "gpus_per_task": args.gpus_per_task or "",
        "cpus_per_task": args.cpus_per_task or "",
        "mem": args.mem,
        "time": args.time,
        "last_array_index": len(args.env_ids) * len(args.seeds) - 1,
        "output": args.output,
        "workdir": shlex.quote(str(args.workdir.resolve())),
        "env_ids": " ".join(map(shlex.quote, args.env_ids)),
        "seeds": " ".join(map(str, args.seeds)),
        "srun_options": args.srun_options,
        "command": args.command,
    }
    lines = []
    for line in args.template.read_text().splitlines():
        placeholders = re.findall(r"\{\{(\w+)\}\}", line)
        if line.startswith("#SBATCH") and any(values[name] == "" for name in placeholders):
            continue  # an unset option: leave it to the cluster's defaults
        lines.append(re.sub(r"\{\{(\w+)\}\}", lambda match: str(values[match.group(1)]), line))
    return "\n".join(lines) + "\n"


def main(args: Args):
    check(args)
    script = render(args)
    if args.dry_run:
        print(script, end="")
        return
    Path(args.workdir, Path(args.output).parent).mkdir(parents=True, exist_ok=True)  # sbatch does not create it
    path = Path(args.workdir, "slurm", f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    result = subprocess.run(["sbatch", "--parsable", str(path)], cwd=args.workdir, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"launch_slurm: sbatch failed: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: {len(args.env_ids) * len(args.seeds)} array task(s), script {path}")


if __name__ == "__main__":
    main(tyro.cli(Args, prog="python -m cleanba.launch_slurm", description=__doc__))
