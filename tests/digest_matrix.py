"""Final params sha256 of a fixed matrix of short runs: the check that a refactor of the scripts changes no bit.

    python tests/digest_matrix.py record before.json   # on the code before the change
    python tests/digest_matrix.py check before.json    # after it: every digest must be the same
    python tests/digest_matrix.py check before.json "ppo CartPole"   # only the cases whose name holds this

The matrix: every script (IMPALA with and without --lstm); CartPole and a tiny Breakout (gradient accumulation 2),
Hopper for the continuous PPO; layouts a0-l0 and a0-l1,2; concurrency on and off; with and without --exact; and a
run resumed from a checkpoint written mid-run, per script and env. Digests are of one machine and jaxlib: compare
runs made on the same ones, not across machines.
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from support import script_command, script_env

ITERATIONS = 6
SIZES = {  # (script, env): flags, steps per env per iteration
    ("ppo", "CartPole-v1"): (
        ["--hidden-dim", "16", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
        16,
    ),
    ("impala", "CartPole-v1"): (["--hidden-dim", "16", "--num-steps", "8", "--num-minibatches", "2"], 8),
    ("ppo", "Breakout-v5"): (
        [
            "--channels",
            "4",
            "--hidden-dim",
            "16",
            "--num-steps",
            "8",
            "--num-minibatches",
            "2",
            "--update-epochs",
            "1",
            "--gradient-accumulation-steps",
            "2",
        ],
        8,
    ),
    ("impala", "Breakout-v5"): (
        [
            "--channels",
            "4",
            "--hidden-dim",
            "16",
            "--num-steps",
            "8",
            "--num-minibatches",
            "2",
            "--gradient-accumulation-steps",
            "2",
        ],
        8,
    ),
}
SIZES["impala+lstm", "CartPole-v1"] = (["--lstm", "--lstm-size", "8", *SIZES["impala", "CartPole-v1"][0]], 8)
SIZES["ppo_continuous", "Hopper-v4"] = (SIZES["ppo", "CartPole-v1"][0], 16)
CASES = [(s, e) for s in ("ppo", "impala") for e in ("CartPole-v1", "Breakout-v5")]
CASES += [("impala+lstm", "CartPole-v1"), ("ppo_continuous", "Hopper-v4")]
LAYOUTS = {"a0-l0": [], "a0-l1,2": ["--actor-device-ids", "0", "--learner-device-ids", "1", "2"]}
ENVS, THREADS = 4, 2


def flags(script: str, env_id: str, iterations: int = ITERATIONS) -> list:
    sizes, steps = SIZES[script, env_id]
    return [
        *sizes,
        "--env-id",
        env_id,
        "--seed",
        "5",
        "--local-num-envs",
        ENVS,
        "--num-actor-threads",
        THREADS,
        "--total-timesteps",
        iterations * ENVS * THREADS * steps,
        "--log-frequency",
        "1",
    ]


def final_digest(output: str) -> str:
    found = re.findall(r"rank 0: final params sha256 (\w+)", output)
    if len(found) != 1:
        raise RuntimeError(f"no final digest in the output:\n{output[-3000:]}")
    return found[0]


def command(script: str, args: list) -> list:
    return script_command(script.split("+")[0], args)


def run(script: str, args: list, directory: Path) -> str:
    process = subprocess.run(
        command(script, args), cwd=directory, env=script_env(3), capture_output=True, text=True, timeout=600
    )
    if process.returncode:
        raise RuntimeError(f"{script} {args}: exit {process.returncode}\n{process.stdout}\n{process.stderr}")
    return final_digest(process.stdout)


def case(name: str) -> str:
    script, env_id, layout, concurrency, exact = name.split(" ")
    args = [*flags(script, env_id), *LAYOUTS[layout], "--concurrency" if concurrency == "conc" else "--no-concurrency"]
    if exact == "exact":
        args += ["--exact", "--group-envs", "2"]
    with tempfile.TemporaryDirectory() as directory:
        return run(script, args, Path(directory))


def resume_case(name: str) -> str:
    """Run 8 iterations with a checkpoint every 4; keep the checkpoint of iteration 4 as it appears, put it back
    after the run and resume from it: the digest of iterations 5-8 trained after a resume."""
    script, env_id, _ = name.split(" ")
    args = [*flags(script, env_id, 8), "--checkpoint-frequency", "4", "--run-name", "resume"]
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        checkpoint = directory / "runs" / "resume" / "checkpoint.msgpack"
        process = subprocess.Popen(
            command(script, args),
            cwd=directory,
            env=script_env(3),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        kept = None
        while process.poll() is None and kept is None:
            if checkpoint.exists():
                kept = checkpoint.read_bytes()
            time.sleep(0.005)
        output = process.communicate(timeout=600)[0]
        if process.returncode or kept is None:
            raise RuntimeError(f"{name}: exit {process.returncode}, checkpoint seen: {kept is not None}\n{output}")
        checkpoint.write_bytes(kept)
        resumed = subprocess.run(
            command(script, [*args, "--resume"]),
            cwd=directory,
            env=script_env(3),
            capture_output=True,
            text=True,
            timeout=600,
        )
        line = re.search(r"resumed .* at iteration (\d+)", resumed.stdout)
        if resumed.returncode or not line:
            raise RuntimeError(f"{name} resume: exit {resumed.returncode}\n{resumed.stdout}\n{resumed.stderr}")
        if line.group(1) != "4":
            raise RuntimeError(f"{name}: the kept checkpoint is of iteration {line.group(1)}, not 4; run again")
        shutil.rmtree(directory / "runs")
        return final_digest(resumed.stdout)


def matrix(only: str = "") -> dict:
    names = [" ".join((*c, *o)) for c in CASES for o in product(LAYOUTS, ["conc", "sync"], ["exact", "plain"])]
    names = [name for name in names if only in name]
    resumes = [f"{script} {env_id} resume" for script, env_id in CASES if only in f"{script} {env_id} resume"]
    with ThreadPoolExecutor(2) as pool:
        digests = dict(zip(names, pool.map(case, names)))
        digests.update(zip(resumes, pool.map(resume_case, resumes)))
    return digests


def main():
    command, path = sys.argv[1], Path(sys.argv[2])
    only = sys.argv[3] if len(sys.argv) > 3 else ""  # check: only the cases whose name holds this text
    digests = matrix(only)
    if command == "record":
        path.write_text(json.dumps(digests, indent=1) + "\n")
        print(f"{len(digests)} digests recorded in {path}")
        return
    recorded = json.loads(path.read_text())
    recorded = {name: digest for name, digest in recorded.items() if only in name}
    changed = [name for name in recorded if recorded[name] != digests.get(name)]
    for name in recorded:
        print(f"{'same   ' if name not in changed else 'CHANGED'} {name}: {recorded[name]} -> {digests.get(name)}")
    print(f"{len(recorded) - len(changed)} of {len(recorded)} digests the same")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
