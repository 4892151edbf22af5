"""The edits of docs/forking.md, kept as patches under tests/forks/: each is applied to a copy of
cleanba_ppo.py, which then trains a few iterations on two layouts. The new metric is logged and the layouts
learn the same thing, so the guide cannot go stale and its edits keep layout invariance."""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from support import LOSS_TAGS, ROOT, SCRIPTS, TINY, check_ok, first_losses, run_dir, scalars, script_env

ATARI = [
    "--env-id",
    "Breakout-v5",
    "--hidden-dim",
    "16",
    "--num-steps",
    "8",
    "--num-minibatches",
    "2",
    "--update-epochs",
    "1",
    "--log-frequency",
    "1",
]
FORKS = {  # patch: (the script it edits, flags, the tag the edit adds)
    "kl_penalty": ("ppo", TINY["ppo"], "losses/kl_penalty"),
    "new_metric": ("ppo", TINY["ppo"], "losses/value_abs_error"),
    "nature_cnn": ("ppo", ATARI, None),
    "impala_kl_schedule": ("impala", TINY["impala"], "losses/kl_penalty"),
}
LAYOUTS = {"a0-l0": ([], 1), "a0-l1,2": (["--actor-device-ids", "0", "--learner-device-ids", "1", "2"], 3)}


def forked_script(patch: str, directory) -> str:
    """A copy of the stock script with tests/forks/<patch>.patch applied (git apply works outside a repository)."""
    name = SCRIPTS[FORKS[patch][0]].name
    (directory / "cleanba").mkdir(parents=True)
    shutil.copy(SCRIPTS[FORKS[patch][0]], directory / "cleanba" / name)
    result = subprocess.run(
        ["git", "apply", str(ROOT / "tests" / "forks" / f"{patch}.patch")],
        cwd=directory,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"docs/forking.md's {patch} edit no longer applies: {result.stderr}"
    return str(directory / "cleanba" / name)


# The Nature CNN's run is mostly its convolutions (XLA's own, not the scripts' kernels), which LLVM's optimizations
# (support.py) make more than twice as fast: it runs with XLA's defaults.
@pytest.mark.slow
@pytest.mark.parametrize(
    "patch", [pytest.param(p, marks=[pytest.mark.xla_default] * (p == "nature_cnn")) for p in FORKS]
)
def test_fork_edit_trains_on_two_layouts(patch, tmp_path):
    _, flags, new_tag = FORKS[patch]
    script = forked_script(patch, tmp_path / "fork")
    steps = 16 if flags is TINY["ppo"] else 8
    losses = {}
    for name, (layout, devices) in LAYOUTS.items():
        directory = tmp_path / name
        directory.mkdir()
        extra = ["--save-model", "--eval-episodes", "1"] if patch == "nature_cnn" and devices == 1 else []
        command = [
            sys.executable,
            script,
            *flags,
            *layout,
            *extra,
            "--local-num-envs",
            "4",
            "--num-actor-threads",
            "1",
            "--total-timesteps",
            3 * 4 * steps,
        ]
        process = subprocess.run(
            list(map(str, command)), cwd=directory, env=script_env(devices), capture_output=True, text=True, timeout=300
        )
        check_ok(process)
        logged = scalars(run_dir(directory))
        tags = LOSS_TAGS + ([new_tag] if new_tag else [])
        losses[name] = first_losses(logged, tags, 3)
        assert np.all(np.isfinite(losses[name]))
        if new_tag:
            assert np.all(losses[name][-1] > 0), (new_tag, losses[name][-1])
    np.testing.assert_allclose(losses["a0-l1,2"], losses["a0-l0"], rtol=1e-4, atol=1e-6)
    if patch == "nature_cnn":  # the saved model is the Nature CNN, and its evaluation ran
        from cleanba.checkpoint import load_model

        (model,) = run_dir(tmp_path / "a0-l0").glob("*.cleanba_model")
        _, params, _ = load_model(model)
        kernels = {k: v.shape for k, v in flatten_dict(params).items() if k[-1] == "kernel"}
        assert kernels[("params", "Conv_0", "kernel")] == (8, 8, 4, 32), kernels
        assert "eval/episodic_return" in scalars(run_dir(tmp_path / "a0-l0"))


@pytest.mark.slow
def test_impala_kl_penalty_has_a_gradient_and_the_entropy_coefficient_follows_state_step(tmp_path):
    """docs/forking.md's IMPALA recipe: the KL term built from newlogprobs with their gradient changes what is
    learned (from IMPALA's stop-gradient logratio it would add a constant: the same params as without it), and the
    entropy coefficient computed from state.step anneals over the run's minibatch updates."""
    script = forked_script("impala_kl_schedule", tmp_path / "fork")
    iterations, steps = 3, 8
    digests, logged = {}, {}
    for kl_coef in ["0", "1"]:
        directory = tmp_path / f"kl{kl_coef}"
        directory.mkdir()
        command = [sys.executable, script, *TINY["impala"], "--kl-coef", kl_coef, "--local-num-envs", "4"]
        command += ["--num-actor-threads", "1", "--total-timesteps", iterations * 4 * steps]
        process = subprocess.run(
            list(map(str, command)), cwd=directory, env=script_env(1), capture_output=True, text=True, timeout=300
        )
        check_ok(process)
        (digests[kl_coef],) = re.findall(r"final params sha256 (\w+)", process.stdout)
        logged[kl_coef] = scalars(run_dir(directory))
    assert digests["0"] != digests["1"], digests
    assert all(value == 0 for _, value in logged["0"]["losses/kl_penalty"])
    # Iteration i's 2 minibatch updates have state.step 2(i - 1) and 2(i - 1) + 1 of 2 x 3: their mean coefficient.
    coefficients = [value for _, value in logged["1"]["losses/ent_coef"]]
    expected = [0.01 * (1 - (2 * i + 0.5) / (2 * iterations)) for i in range(iterations)]
    np.testing.assert_allclose(coefficients, expected, rtol=1e-5)


CONTRACT_BREAKS = {  # a fork's network that breaks the contract: (edit of cleanba_ppo.py, what the refusal names)
    "three outputs": (
        ("        return logits, value[:, 0]\n", "        return logits, value, logits\n"),
        "make_network",
    ),
    # the silent trainer: 16 logits (the hidden width) for CartPole's 2 actions, which EnvPool accepted
    "a head of the wrong width": (
        ("nn.Dense(self.num_actions, kernel_init", "nn.Dense(self.hidden_dim, kernel_init"),
        "shapes (2, 16) and (2,) for a batch of 2 observations; the scripts need ((2, 2), (2,))",
    ),
}


@pytest.mark.parametrize("case", list(CONTRACT_BREAKS))
def test_network_contract_checked_at_start(case, tmp_path):
    """A fork whose network breaks the contract fails at start, exit 2 in one line, on every run (without
    --save-model too), before any env steps."""
    (old, new), named = CONTRACT_BREAKS[case]
    directory = tmp_path / "fork" / "cleanba"
    directory.mkdir(parents=True)
    source = (ROOT / "cleanba" / "cleanba_ppo.py").read_text()
    broken = source.replace(old, new)
    assert broken != source
    (directory / "cleanba_ppo.py").write_text(broken)
    command = [
        sys.executable,
        str(directory / "cleanba_ppo.py"),
        *TINY["ppo"],
        "--local-num-envs",
        "4",
        "--num-actor-threads",
        "1",
        "--total-timesteps",
        10_000_000,
    ]
    process = subprocess.run(
        list(map(str, command)), cwd=tmp_path, env=script_env(1), capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 2, process.stderr
    assert named in process.stderr and "step " not in process.stdout, process.stderr
    assert len(process.stderr.strip().splitlines()) == 1 and "Traceback" not in process.stderr, process.stderr


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_field_the_loss_reads_but_learn_does_not_pass_is_named(script, tmp_path):
    """The loss reading a field that learn's data dict lacks stops the run at its start, exit 2 in one line that
    says where the field goes (not a traceback through cleanba/reductions.py)."""
    source = SCRIPTS[script].read_text()
    signature = re.search(
        r'^def \w+_loss\(agent: Agent, args: "?Args"?, params, (\w+, )?batch: dict, count', source, re.M
    )
    signature = re.compile(r"\):\n").search(source, signature.end())
    docstring_or_body = source[signature.end() :]
    broken = source[: signature.end()] + '    unused = batch["old_values"]  # noqa: F841\n' + docstring_or_body
    fork = tmp_path / "fork" / f"my_{script}.py"
    fork.parent.mkdir()
    fork.write_text(broken)
    command = [sys.executable, str(fork), *TINY[script], "--local-num-envs", "4", "--num-actor-threads", "1"]
    process = subprocess.run(
        list(map(str, command)), cwd=tmp_path, env=script_env(1), capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 2, process.stderr
    assert "step " not in process.stdout and "Traceback" not in process.stderr, process.stderr
    (line,) = process.stderr.strip().splitlines()
    assert "the loss reads batch['old_values'], which the minibatches do not have (they have " in line, line
    assert "put old_values=... in the data dict that learn builds from the rollout" in line, line
