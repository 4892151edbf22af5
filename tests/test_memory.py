"""Learner memory at the default Atari sizes, from XLA's own analysis of the update as this machine's XLA:CPU compiles
it for training (shapes only, nothing runs): it must follow the minibatch, not the rollout."""
import importlib

import pytest
import tyro

from cleanba import benchmark

GIB = 2**30


def default_memory(script: str, *flags) -> dict:
    module = importlib.import_module(f"cleanba.cleanba_{script}")
    args = tyro.cli(module.Args, args=["--actor-device-ids", "0", "--learner-device-ids", "0", *flags])
    module.check_args(args)
    module.fill_runtime_sizes(args, 1, 0)
    return benchmark.learner_memory(module, args)


@pytest.mark.parametrize("script", ["ppo", "impala"])
def test_learner_memory_follows_the_minibatch(script):
    whole = default_memory(script)
    accumulated = default_memory(script, "--gradient-accumulation-steps", "4")
    print(script, whole, accumulated)
    # The whole update (PPO: value pass over the rollout, 16 minibatch steps) needs little more than one step.
    assert whole["update_temp_mib"] <= 1.25 * whole["minibatch_step_temp_mib"], whole
    assert accumulated["update_temp_mib"] <= 1.25 * accumulated["minibatch_step_temp_mib"], accumulated
    # Gradient accumulation really saves memory: 4 micro-batches, well under half.
    assert accumulated["update_temp_mib"] < 0.5 * whole["update_temp_mib"], (whole, accumulated)
    # The paper's GPU, a 40 GB A100, with the scripts' default XLA_CLIENT_MEM_FRACTION of 0.6.
    assert (whole["update_temp_mib"] + whole["update_argument_mib"]) / 1024 < 0.6 * 40e9 / GIB, whole
    # --exact computes the groups of --group-envs envs one after the other, so it needs a fraction of the whole
    # minibatch's memory.
    exact = default_memory(script, "--exact")
    print(script, "exact", exact)
    assert exact["update_temp_mib"] < 0.5 * whole["update_temp_mib"], (exact, whole)
