"""Two learner iterations of cleanba_ppo_continuous.py against a plain reference written from the PPO paper, CleanRL's
ppo_continuous_action.py and gym's NormalizeObservation and NormalizeReward wrappers: rewards scaled by the running
standard deviation of each env's discounted return (carried from one rollout to the next, restarted at the auto-reset
step) and clipped, GAE by a loop, each epoch's minibatches of every env's shuffled time steps, advantages normalised
over the minibatch, the Gaussian log-density summed over the action's components, the clipped surrogate, the value
loss with and without clipping, the entropy, Adam after global-norm clipping at the annealed rate, and then the
observation statistics merged with the rollout's valid observations. Real Hopper-v4 observations, episode ends and
auto-reset steps in the rollout; micro-batches, --exact groups and every toggle once."""

import envpool
import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tyro
from learner_reference import (
    MINIBATCHES,
    TOLERANCE,
    N,
    T,
    assert_params_match,
    episode_data,
    gae_loop,
    reference_minibatches,
    script_learner,
)

from cleanba import cleanba_ppo_continuous as module

EPOCHS, OBS, ACTIONS = 2, 11, 3  # Hopper-v4: 11 observation components, 3 action components


def make_args(extra: list):
    args = tyro.cli(
        module.Args,
        args=[
            *["--env-id", "Hopper-v4", "--hidden-dim", "16", "--num-actor-threads", "1", "--local-num-envs", str(N)],
            *["--num-steps", str(T), "--num-minibatches", str(MINIBATCHES), "--update-epochs", str(EPOCHS)],
            # a clip of 0.002: the values leave their clip range within an iteration (with 0.2 they would not move
            # that far, and the value loss clipped the wrong way round would pass), the ratios theirs
            *["--total-timesteps", str(3 * T * N), "--ent-coef", "0.01", "--clip-coef", "0.002"],
            *extra,
        ],
    )
    module.check_args(args)  # registers EnvPool's MuJoCo family
    module.fill_runtime_sizes(args, 1, 0)
    return args


def hopper_rollout(agent, params, seed: int):
    """Observations of Hopper-v4 played with random actions (scaled up, so that their statistics move), the episode
    structure of episode_data, Gaussian actions near the policy's, behaviour log-densities within about the clip."""
    rng = np.random.default_rng(seed)
    envs = envpool.make("Hopper-v4", "gymnasium", num_envs=N, batch_size=N, seed=seed)
    obs = [envs.reset()[0]]
    for _ in range(T):
        obs.append(envs.step(rng.uniform(-1, 1, (N, ACTIONS)).astype(np.float32))[0])
    envs.close()
    obs = (3 * np.stack(obs) + 1).astype(np.float32)
    rewards, _, terminations, truncations, valid = episode_data(seed, T, N)
    rewards = 5 * rewards
    rewards[~valid] = 0.0
    policy = np.asarray(jax.jit(agent.apply)(params, obs[:-1].reshape(T * N, OBS))[0]).reshape(T, N, -1)
    actions = (policy[..., :ACTIONS] + rng.normal(0, 1, (T, N, ACTIONS))).astype(np.float32)
    logprobs = reference_logprob(policy, actions)[0] + rng.normal(0, 0.002, (T, N))  # ratios about the clip
    return module.Rollout(
        obs=obs,
        actions=actions,
        logprobs=logprobs.astype(np.float32),
        rewards=rewards,
        terminations=terminations,
        truncations=truncations,
        valid=valid,
        env_ids=np.arange(N, dtype=np.int32)[None],
        recurrent_state=np.zeros((1, N, 0), np.float32),
    )


def reference_logprob(policy, actions):
    """A diagonal Gaussian's log-density of actions, summed over components, and its entropy."""
    mean, log_std = policy[..., :ACTIONS], policy[..., ACTIONS:]
    logprob = -0.5 * ((actions - mean) / jnp.exp(log_std)) ** 2 - log_std - 0.5 * jnp.log(2 * jnp.pi)
    return logprob.sum(-1), (log_std + 0.5 + 0.5 * jnp.log(2 * jnp.pi)).sum(-1)


def running(mean, var, count, x):
    """gym's RunningMeanStd.update with the batch x (samples first)."""
    batch_mean, batch_var, batch_count = x.mean(0), x.var(0), len(x)
    delta, total = batch_mean - mean, count + batch_count
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return mean + delta * batch_count / total, m2 / total, total


def scaled_rewards(args, normalizer: dict, rollout):
    """NormalizeReward: each env's discounted return, restarted at the auto-reset step, updates the return statistics
    (valid steps), then every reward is divided by their standard deviation and clipped."""
    returns, carried = np.zeros((T, N)), np.asarray(normalizer["env_returns"], np.float64).copy()
    for t in range(T):
        carried = np.where(rollout.valid[t], rollout.rewards[t] + args.gamma * carried, 0.0)
        returns[t] = carried
    stats = (float(normalizer[k]) for k in ("return_mean", "return_var", "return_count"))
    mean, var, count = running(*stats, returns[rollout.valid])
    rewards = np.clip(rollout.rewards / np.sqrt(var + 1e-8), -args.reward_clip, args.reward_clip)
    statistics = dict(return_mean=mean, return_var=var, return_count=count, env_returns=carried)
    return rewards, dict(normalizer, **{k: np.asarray(v, np.float32) for k, v in statistics.items()})


def reference_iteration(agent, args, shuffle_key, params, opt_state, step: int, rollout):
    """One iteration, the plain way. Returns params (the normalizer's statistics included), optimizer state, step
    and the loss of each minibatch."""
    normalizer = dict(params["normalizer"])
    rewards = rollout.rewards
    if args.norm_reward:
        rewards, normalizer = scaled_rewards(args, normalizer, rollout)
    values = np.asarray(jax.jit(agent.apply)(params, rollout.obs.reshape(-1, OBS))[1]).reshape(T + 1, N)
    advantages = gae_loop(rewards, values, rollout.terminations, rollout.truncations, args.gamma, args.gae_lambda)
    returns = advantages + values[:-1]
    rate = args.learning_rate * (1 - step // (EPOCHS * MINIBATCHES) / args.num_iterations)
    adam = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adam(rate, eps=1e-5))

    def loss(network, obs, actions, logprobs, adv, ret, old_values):
        policy, new_values = agent.apply(dict(params, **network), obs)
        logprob, entropy = reference_logprob(policy, actions)
        ratio = jnp.exp(logprob - logprobs)
        clipped = jnp.clip(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        policy_loss = jnp.maximum(-adv * ratio, -adv * clipped)
        value_loss = 0.5 * (new_values - ret) ** 2
        if args.clip_vloss:
            clipped_values = old_values + jnp.clip(new_values - old_values, -args.clip_coef, args.clip_coef)
            value_loss = jnp.maximum(value_loss, 0.5 * (clipped_values - ret) ** 2)
        return jnp.mean(policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss)

    network = {k: v for k, v in params.items() if k != "normalizer"}
    losses, first_step = [], step
    for epoch in range(EPOCHS):
        for t, j in reference_minibatches(shuffle_key, first_step, rollout.env_ids[0], epoch):
            keep = rollout.valid[t, j]
            t, j = t[keep], j[keep]
            adv = advantages[t, j]
            if args.norm_adv:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            batch = (rollout.obs[t, j], rollout.actions[t, j], rollout.logprobs[t, j], adv, returns[t, j])
            value, grads = jax.value_and_grad(loss)(network, *batch, values[t, j])
            updates, opt_state = adam.update(grads, opt_state, network)
            network, step = optax.apply_updates(network, updates), step + 1
            losses.append(float(value))
    if args.norm_obs:  # after the update: it saw the observations normalised as the actor did
        obs = rollout.obs[:-1][rollout.valid].astype(np.float64)
        stats = (np.asarray(normalizer[k], np.float64) for k in ("obs_mean", "obs_var", "obs_count"))
        mean, var, count = running(*stats, obs)
        normalizer |= dict(obs_mean=mean, obs_var=var, obs_count=count)
    normalizer = {k: np.asarray(v, np.float32) for k, v in normalizer.items()}
    return dict(network, normalizer=normalizer), opt_state, step, losses


@pytest.mark.parametrize(
    "extra",
    [
        ["--gradient-accumulation-steps", "2"],  # values in chunks, 2 micro-batches per step
        ["--exact", "--group-envs", "2"],  # 2 groups of envs, summed one at a time in key order
        ["--no-norm-adv", "--no-clip-vloss", "--no-norm-obs", "--no-norm-reward"],  # every toggle once
    ],
    ids=["micro-batches", "exact-groups", "toggles"],
)
def test_two_iterations_match_the_plain_reference(extra):
    args = make_args(extra)
    spaces = gymnasium.spaces.Box(-np.inf, np.inf, (OBS,), np.float32), gymnasium.spaces.Box(-1, 1, (ACTIONS,))
    agent, shuffle_key, state, update = script_learner(module, args, *spaces)
    params = state.params
    opt_state = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1.0)).init(
        {k: v for k, v in params.items() if k != "normalizer"}
    )
    step = 0
    for seed in (1, 2):  # seeds whose rollouts hold terminations and truncations (episode_data checks)
        before = params
        rollout = hopper_rollout(agent, params, seed)
        state, logged = update(state, (module.Rollout(*map(jnp.asarray, rollout)),))
        params, opt_state, step, losses = reference_iteration(
            agent, args, shuffle_key, params, opt_state, step, rollout
        )
        assert int(state.step) == step
        np.testing.assert_allclose(float(logged["loss"]), np.mean(losses), **TOLERANCE)
        assert 0 < float(logged["clipfrac"]) < 1, "some ratios should leave the clip range"
        assert_params_match(state.params, params, before)
    if args.norm_obs:  # the statistics moved, and the second iteration normalised with them
        assert float(np.max(np.abs(params["normalizer"]["obs_mean"]))) > 0.1
