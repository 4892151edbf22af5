"""Running statistics of observations and returns, kept by the learner for every env of a run: gym's
NormalizeObservation and NormalizeReward (which CleanRL's continuous PPO wraps its envs in), computed
over the rollouts of every learner device in the order of the reduction groups, so that --exact
gives the same statistics on every layout. cleanba_ppo_continuous.py keeps them in its network's
"normalizer" collection."""

import jax
import jax.numpy as jnp

from cleanba.reductions import Groups


def merge_statistics(mean, var, count, batch_mean, batch_var, batch_count):
    """Running mean and variance merged with a batch's (Chan et al. 1979), as gym's RunningMeanStd."""
    delta = batch_mean - mean
    total = count + batch_count
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return mean + delta * batch_count / total, m2 / total, total


def batch_statistics(groups: Groups, x, mask):
    """Mean, variance and count of x's (rows, n, ...) valid samples over every group of every device."""
    data = groups.take(dict(x=x, mask=mask))
    count = groups.total(jnp.sum, data["mask"])
    safe = jnp.maximum(count, 1.0)
    mean = groups.total(lambda v, m: jnp.tensordot(m, v, axes=2), data["x"], data["mask"]) / safe
    var = groups.total(lambda v, m: jnp.tensordot(m, (v - mean) ** 2, axes=2), data["x"], data["mask"]) / safe
    return mean, var, count


def scale_rewards(args, normalizer: dict, rollout, groups: Groups):
    """(rewards divided by the standard deviation of the discounted return and clipped, normalizer with the return
    statistics and each env's return updated): gym's NormalizeReward over every env of the run, updated from this
    rollout before it is scaled. Each env's discounted return carries over from its last rollout and restarts at the
    auto-reset step (invalid), where a new episode begins. args: gamma, reward_clip, num_envs."""
    env_ids = rollout.env_ids[0]

    def discount(carry, step):
        reward, valid = step
        carry = jnp.where(valid, reward + args.gamma * carry, 0.0)
        return carry, carry

    start = normalizer["env_returns"][jnp.maximum(env_ids, 0)]  # pad envs (negative ids): every step invalid
    last, returns = jax.lax.scan(discount, start, (rollout.rewards, rollout.valid))
    batch = batch_statistics(groups, returns, rollout.valid.astype(jnp.float32))
    mean, var, count = normalizer["return_mean"], normalizer["return_var"], normalizer["return_count"]
    mean, var, count = merge_statistics(mean, var, count, *batch)
    # Every device gets every env's return at the rollout's end (a copy, no arithmetic: the same on every layout).
    ids, last = jax.lax.all_gather((env_ids, last), "learner", tiled=True)
    env_returns = normalizer["env_returns"].at[jnp.where(ids >= 0, ids, args.num_envs)].set(last, mode="drop")
    rewards = jnp.clip(rollout.rewards / jnp.sqrt(var + 1e-8), -args.reward_clip, args.reward_clip)
    return rewards, dict(normalizer, return_mean=mean, return_var=var, return_count=count, env_returns=env_returns)


def update_obs_statistics(normalizer: dict, rollout, groups: Groups) -> dict:
    """The observation statistics merged with the rollout's valid observations (each once: the last row is the next
    rollout's first), after the update, so that the update saw the observations normalised as the actor did."""
    obs = rollout.obs[:-1].reshape(*rollout.valid.shape, -1).astype(jnp.float32)  # as the network flattens it
    batch = batch_statistics(groups, obs, rollout.valid.astype(jnp.float32))
    mean, var, count = merge_statistics(normalizer["obs_mean"], normalizer["obs_var"], normalizer["obs_count"], *batch)
    return dict(normalizer, obs_mean=mean, obs_var=var, obs_count=count)
