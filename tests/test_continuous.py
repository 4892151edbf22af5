"""cleanba_ppo_continuous.py: its normalisation against a plain loop, what its actor stores and sends, and its refusals.

The learner keeps the observation and return statistics (cleanba/normalize.py) for every env of the run, in the
network's "normalizer" collection: here they are computed over two rollouts and compared with gym's
NormalizeObservation / NormalizeReward arithmetic written as plain float64 loops. A real run with every envs.recv()
and envs.send() recorded then shows the rollout keeps the sampled action (its log-probability that of a Gaussian),
EnvPool gets it clipped, and a Dict observation is stored flattened in sorted key order."""

import importlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from support import SCRIPTS, script_env

from cleanba.normalize import scale_rewards, update_obs_statistics
from cleanba.reductions import make_groups

T, N, OBS = 8, 4, 3


def running(mean, var, count, batch: np.ndarray):
    """gym's RunningMeanStd.update, in float64."""
    batch_mean, batch_var, batch_count = batch.mean(0), batch.var(0), len(batch)
    delta, total = batch_mean - mean, count + batch_count
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return mean + delta * batch_count / total, m2 / total, total


def test_normalizer_is_gyms_arithmetic_over_every_env(tmp_path):
    module = importlib.import_module("cleanba.cleanba_ppo_continuous")
    args = module.Args(env_id="Hopper-v4", local_num_envs=N, num_actor_threads=1, num_steps=T, gamma=0.9)
    module.fill_runtime_sizes(args, 1, 0)
    mesh = Mesh(np.array(jax.devices()[:1]), ("learner",))
    agent = module.Agent(2, 8, args.num_envs, True, 10.0)
    normalizer = agent.init(jax.random.key(0), jnp.zeros((1, OBS)))["normalizer"]

    def normalize(normalizer, rollout):
        groups = make_groups(args, rollout.env_ids[0], 1, "time").of_env_set(0)
        rewards, normalizer = scale_rewards(args, normalizer, rollout, groups)
        return rewards, update_obs_statistics(normalizer, rollout, groups)

    step = jax.jit(
        jax.shard_map(
            normalize,
            mesh=mesh,
            in_specs=(P(), P(None, "learner")),
            out_specs=(P(None, "learner"), P()),
            check_vma=False,
        )
    )
    rng = np.random.default_rng(0)
    obs_stats = (np.zeros(OBS), np.ones(OBS), 1e-4)
    return_stats, env_returns = (0.0, 1.0, 1e-4), np.zeros(N)
    for _ in range(2):  # the second rollout starts from the first's statistics and each env's return
        obs = rng.normal(3.0, 2.0, (T + 1, N, OBS)).astype(np.float32)
        rewards = rng.normal(1.0, 1.0, (T, N)).astype(np.float32)
        valid = rng.random((T, N)) > 0.2
        zeros = np.zeros((T, N), bool)
        rollout = module.Rollout(
            obs,
            np.zeros((T, N, 2), np.float32),
            zeros,
            rewards,
            zeros,
            zeros,
            valid,
            np.arange(N, dtype=np.int32)[None],
            np.zeros((1, N, 0), np.float32),  # no recurrent state
        )
        scaled, normalizer = step(normalizer, rollout)
        # The plain loop: each env's discounted return, restarted at an invalid (auto-reset) step.
        returns = np.zeros((T, N))
        for t in range(T):
            for e in range(N):
                env_returns[e] = rewards[t, e] + args.gamma * env_returns[e] if valid[t, e] else 0.0
                returns[t, e] = env_returns[e]
        return_stats = running(*return_stats, returns[valid])
        expected = np.clip(rewards / np.sqrt(return_stats[1] + 1e-8), -10, 10)
        obs_stats = running(*obs_stats, obs[:-1][valid])
        np.testing.assert_allclose(np.asarray(scaled), expected, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(normalizer["env_returns"], env_returns, rtol=1e-5, atol=1e-6)
        for name, value in zip(["return_mean", "return_var", "return_count"], return_stats):
            np.testing.assert_allclose(normalizer[name], value, rtol=1e-4)
        for name, value in zip(["obs_mean", "obs_var", "obs_count"], obs_stats):
            np.testing.assert_allclose(normalizer[name], value, rtol=1e-4)
    # The network normalises with them: the obs statistics are what it subtracts and divides by, clipped at 10.
    params = {"params": agent.init(jax.random.key(0), jnp.zeros((1, OBS)))["params"], "normalizer": normalizer}
    mean, std = np.asarray(normalizer["obs_mean"]), np.sqrt(np.asarray(normalizer["obs_var"]) + 1e-8)
    far = (mean + 20 * std)[None]  # clipped: the same outputs as at exactly 10 standard deviations
    np.testing.assert_allclose(agent.apply(params, far)[1], agent.apply(params, (mean + 10 * std)[None])[1], rtol=1e-6)


RECORDER = """
import sys
from pathlib import Path

import numpy as np
from cleanba.benchmark.common import load_script

script, out = sys.argv[1], sys.argv[2]
module = load_script(Path(script))
import envpool, tyro

recvs, sends, stored = [], [], []


class Recording:
    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def send(self, actions, env_ids):
        sends.append(np.array(actions))
        return self.env.send(actions, env_ids)

    def recv(self):
        obs, reward, terminated, truncated, info = self.env.recv()
        recvs.append({key: np.array(value) for key, value in obs.items()} if isinstance(obs, dict) else {"": obs})
        return obs, reward, terminated, truncated, info


make, put_on_learners = envpool.make, module.put_on_learners
envpool.make = lambda *args, **kwargs: Recording(make(*args, **kwargs))


def storing(rollout, mesh, blocks):
    stored.append([np.array(x) for x in rollout])
    return put_on_learners(rollout, mesh, blocks)


module.put_on_learners = storing
args = tyro.cli(module.Args, args=sys.argv[3:])
module.check_args(args)
try:
    module.main(args)
finally:
    columns = {f"recv_{key}": np.array([r[key] for r in recvs]) for key in recvs[0]}
    columns["sent"] = np.array(sends)
    columns.update({f"stored_{f}": np.array([s[i] for s in stored]) for i, f in enumerate(module.Rollout._fields)})
    np.savez(out, **columns)
"""


@pytest.mark.parametrize("env_id", ["Hopper-v4", "CheetahRun-v1"])
def test_actor_stores_the_sample_and_sends_it_clipped(env_id, tmp_path):
    """One actor thread, 4 envs, 3 rollouts of 16 steps: the stored observations are EnvPool's (a Dict's parts
    flattened in sorted key order, as float32), the stored actions the Gaussian's samples (about a third outside the
    bounds at the initial standard deviation of 1), EnvPool is sent them clipped to [-1, 1], and each stored
    log-probability is the initial Gaussian's density of the stored, unclipped action (its mean is near 0 at the
    policy head's 0.01 init)."""
    envs, steps, iterations = 4, 16, 3
    flags = ["--env-id", env_id, "--num-actor-threads", 1, "--local-num-envs", envs, "--num-steps", steps]
    flags += ["--num-minibatches", 2, "--update-epochs", 1, "--total-timesteps", envs * steps * iterations]
    command = [sys.executable, "-c", RECORDER, SCRIPTS["ppo_continuous"], tmp_path / "recorded.npz", *flags]
    process = subprocess.run(
        list(map(str, command)), cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=600
    )
    assert process.returncode == 0, process.stdout + process.stderr
    r = dict(np.load(tmp_path / "recorded.npz"))
    keys = sorted(k for k in r if k.startswith("recv_"))
    flat = np.concatenate([r[k].reshape(*r[k].shape[:2], -1) for k in keys], axis=2).astype(np.float32)
    stored_obs = r["stored_obs"]  # (iterations, T + 1, n, dims)
    assert stored_obs.dtype == np.float32 and stored_obs.shape == (iterations, steps + 1, envs, flat.shape[2])
    for i in range(iterations):  # row t of rollout i is the (i * steps + t)-th recv; its last row the next's first
        np.testing.assert_array_equal(stored_obs[i], flat[i * steps : (i + 1) * steps + 1])
    actions = r["stored_actions"].reshape(-1, envs, r["stored_actions"].shape[-1])
    np.testing.assert_array_equal(r["sent"], np.clip(actions, -1.0, 1.0))
    outside = np.mean(np.abs(actions) > 1)
    assert 0.2 < outside < 0.45, outside  # a standard normal: 0.317
    first = r["stored_actions"][0]  # played with the initial params: log std 0, means about 0
    density = np.sum(-0.5 * first**2 - 0.5 * np.log(2 * np.pi), axis=-1)
    np.testing.assert_allclose(r["stored_logprobs"][0], density, atol=0.15)
    # The envs of a step sample on their own: no two envs of a step take the same action.
    assert all(len({tuple(a) for a in step}) == envs for step in actions)
