"""One PPO learner iteration of cleanba_ppo.py against a plain reference written from the PPO paper and CleanRL's
update: the values of every observation from one forward pass, GAE by a loop, each epoch cut into minibatches that
hold every sample once, advantages normalised over the valid samples of the minibatch, the clipped loss as one mean
over the minibatch, Adam after global-norm clipping, the learning rate annealed per iteration. The script computes
the same thing in pieces (value pass in chunks, groups of envs, micro-batches, masked sums); the pieces CartPole
cannot exercise are checked here on Atari observations, with episode ends and auto-reset steps in the rollout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from learner_reference import (
    MINIBATCHES,
    OBS_SHAPE,
    TOLERANCE,
    N,
    T,
    assert_params_match,
    gae_loop,
    make_args,
    make_rollout,
    reference_minibatches,
    script_learner,
)

from cleanba import cleanba_ppo

EPOCHS = 2


def reference_loss(agent, args, params, obs, actions, logprobs, advantages, returns):
    logits, values = agent.apply(params, obs)
    logp = jax.nn.log_softmax(logits)
    logratio = jnp.take_along_axis(logp, actions[:, None], axis=1)[:, 0] - logprobs
    ratio = jnp.exp(logratio)
    clipped = jnp.clip(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    policy_loss = jnp.mean(jnp.maximum(-advantages * ratio, -advantages * clipped))
    value_loss = jnp.mean(0.5 * (values - returns) ** 2)
    entropy = jnp.mean(-jnp.sum(jnp.exp(logp) * logp, axis=1))
    approx_kl = jnp.mean((ratio - 1) - logratio)
    clipfrac = jnp.mean(jnp.abs(ratio - 1) > args.clip_coef)
    loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss
    metrics = dict(policy_loss=policy_loss, value_loss=value_loss, entropy=entropy, approx_kl=approx_kl)
    return loss, dict(metrics, loss=loss, clipfrac=clipfrac)


def reference_iteration(agent, args, shuffle_key, params, opt_state, step: int, rollout):
    """One iteration, the plain way. Returns params, optimizer state, step, the metrics of every minibatch and the
    global norm of every minibatch's gradient (before clipping)."""
    values = np.asarray(jax.jit(agent.apply)(params, rollout.obs.reshape(-1, *OBS_SHAPE))[1]).reshape(T + 1, N)
    advantages = gae_loop(
        rollout.rewards, values, rollout.terminations, rollout.truncations, args.gamma, args.gae_lambda
    ).astype(np.float32)
    returns = advantages + values[:-1]
    iteration = step // (EPOCHS * MINIBATCHES)
    learning_rate = args.learning_rate * (1 - iteration / args.num_iterations)
    optimizer = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adam(learning_rate, eps=1e-5))
    grad_fn = jax.jit(jax.grad(lambda p, *batch: reference_loss(agent, args, p, *batch), has_aux=True))

    @jax.jit  # compiled once: run op by op, each op of each parameter's shape compiles on its own
    def apply_optimizer(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    metrics, seen, norms, first_step = [], [], [], step
    for epoch in range(EPOCHS):
        minibatches = reference_minibatches(shuffle_key, first_step, rollout.env_ids[0], epoch)
        seen.append(sorted((int(t), int(j)) for ts, js in minibatches for t, j in zip(ts, js)))
        for t, j in minibatches:
            keep = rollout.valid[t, j]  # the auto-reset steps are not learned from
            t, j = t[keep], j[keep]
            adv = advantages[t, j]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            batch = (rollout.obs[t, j], rollout.actions[t, j], rollout.logprobs[t, j], adv, returns[t, j])
            grads, minibatch_metrics = grad_fn(params, *batch)
            norms.append(float(optax.global_norm(grads)))
            params, opt_state = apply_optimizer(grads, opt_state, params)
            metrics.append(minibatch_metrics)
            step += 1
    every_sample = sorted((t, j) for t in range(T) for j in range(N))
    assert all(s == every_sample for s in seen), "an epoch's minibatches must hold every sample exactly once"
    return params, opt_state, step, metrics, norms


@pytest.mark.parametrize(
    "extra",
    [
        ["--gradient-accumulation-steps", "2"],  # value pass in 4 chunks of 2 steps, 2 micro-batches per step
        ["--exact", "--group-envs", "2"],  # 2 groups of envs, summed one at a time in key order
    ],
    ids=["micro-batches", "exact-groups"],
)
def test_two_iterations_match_the_plain_reference(extra):
    args = make_args(cleanba_ppo, ["--update-epochs", str(EPOCHS), *extra])
    agent, shuffle_key, state, update = script_learner(cleanba_ppo, args)

    params = state.params
    opt_state = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1.0)).init(params)
    step, norms = 0, []
    for seed in (1, 2):  # seeds whose rollouts hold terminations and truncations (episode_data checks)
        before = params
        rollout = make_rollout(cleanba_ppo, agent, params, seed)
        state, logged = update(state, (cleanba_ppo.Rollout(*map(jnp.asarray, rollout)),))
        params, opt_state, step, metrics, iteration_norms = reference_iteration(
            agent, args, shuffle_key, params, opt_state, step, rollout
        )
        norms += iteration_norms
        assert int(state.step) == step
        for name in ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"):
            expected = np.mean([float(m[name]) for m in metrics])
            np.testing.assert_allclose(float(logged[name]), expected, **TOLERANCE, err_msg=name)
        assert 0 < float(logged["clipfrac"]) < 1, "the rollout should put some ratios outside the clip range"
        assert_params_match(state.params, params, before)
    # the clip at work: a looser or missing clip would move the params elsewhere than the reference's
    assert max(norms) > args.max_grad_norm, norms


def test_defaults_and_optimizer_are_the_papers():
    """PPO's defaults (the Cleanba paper's appendix A, CleanRL's Atari PPO) and the optimizer the script builds from
    them, read back from its state: Adam (b1 0.9, b2 0.999, eps 1e-5) at 2.5e-4, annealed linearly to 0; each
    gradient clipped to a global norm of 0.5 (the reference test above sees the clip act)."""
    import tyro

    args = tyro.cli(cleanba_ppo.Args, args=[])
    defaults = dict(learning_rate=2.5e-4, max_grad_norm=0.5, clip_coef=0.1, ent_coef=0.01, vf_coef=0.5, gamma=0.99)
    defaults |= dict(gae_lambda=0.95, num_steps=128, local_num_envs=64, num_actor_threads=2, num_minibatches=4)
    defaults |= dict(update_epochs=4, norm_adv=True, anneal_lr=True, concurrency=False, total_timesteps=50_000_000)
    assert {name: getattr(args, name) for name in defaults} == defaults
    args = make_args(cleanba_ppo, [])
    _, _, state, _ = script_learner(cleanba_ppo, args)
    (hyperparams,) = [part.hyperparams for part in state.opt_state if hasattr(part, "hyperparams")]
    for name, value in dict(b1=0.9, b2=0.999, eps=1e-5, eps_root=0.0, learning_rate=2.5e-4).items():
        assert float(hyperparams[name]) == pytest.approx(value, rel=1e-6), name
