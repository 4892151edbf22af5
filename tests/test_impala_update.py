"""One IMPALA learner iteration of cleanba_impala.py against a plain reference written from the IMPALA paper and
TorchBeast's learner: minibatch k of an iteration holds the whole sequences of the envs whose id is k modulo
--num-minibatches, the minibatches in a shuffled order; V-trace by a loop (test_advantages.vtrace_loop) on the
values and importance weights of the params before the minibatch; the loss summed over the minibatch's valid
samples; global-norm clipping, then PyTorch's RMSProp (epsilon outside the square root) with the learning rate
annealed per iteration, both written out in numpy. The script computes the same thing in pieces (groups of envs,
micro-batches, masked dot products, rlax's V-trace, optax); Atari observations with episode ends and auto-reset
steps exercise the ResNet and the masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from learner_reference import (
    MINIBATCHES,
    OBS_SHAPE,
    TOLERANCE,
    T,
    assert_params_match,
    make_args,
    make_rollout,
    script_learner,
)
from test_advantages import vtrace_loop

from cleanba import cleanba_impala


def reference_loss(agent, args, params, obs, actions, logprobs, targets, advantages, valid):
    """Sum over the valid samples of the per-sample IMPALA loss, and the per-sample means of the logged terms."""
    n = obs.shape[1]
    logits, values = agent.apply(params, obs.reshape(-1, *OBS_SHAPE))
    logp = jax.nn.log_softmax(logits.reshape(T + 1, n, -1)[:-1])
    values = values.reshape(T + 1, n)[:-1]
    newlogp = jnp.take_along_axis(logp, actions[..., None], axis=-1)[..., 0]
    logratio = jax.lax.stop_gradient(newlogp) - logprobs
    rho = jnp.exp(logratio)
    policy_loss = -newlogp * advantages
    value_loss = 0.5 * (targets - values) ** 2
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss
    terms = dict(
        loss=loss,
        policy_loss=policy_loss,
        value_loss=value_loss,
        entropy=entropy,
        approx_kl=(rho - 1) - logratio,
        clipped_rho_fraction=(rho > 1).astype(jnp.float32),
    )
    return jnp.sum(jnp.where(valid, loss, 0.0)), {
        k: jnp.sum(jnp.where(valid, v, 0.0)) / valid.sum() for k, v in terms.items()
    }


def clipped_rmsprop(args, params, grads, nu, learning_rate: float):
    """Global-norm clipping, then PyTorch's RMSProp (mean squares from 0, epsilon outside the square root), in
    float64. Returns the params, the mean squares and the norm before clipping."""
    grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    norm = np.sqrt(sum(np.sum(g**2) for g in grads))
    grads = [g * min(1.0, args.max_grad_norm / norm) for g in grads]
    nu = [args.rmsprop_decay * v + (1 - args.rmsprop_decay) * g**2 for v, g in zip(jax.tree.leaves(nu), grads)]
    leaves = [
        (p - learning_rate * g / (np.sqrt(v) + args.rmsprop_eps)).astype(np.float32)
        for p, g, v in zip(jax.tree.leaves(params), grads, nu)
    ]
    treedef = jax.tree.structure(params)
    return jax.tree.unflatten(treedef, leaves), jax.tree.unflatten(treedef, nu), norm


def reference_iteration(agent, args, shuffle_key, params, nu, step: int, rollout):
    """One iteration, the plain way. Returns params, RMSProp's mean squares, the step, the metrics of every
    minibatch and the global gradient norm of every minibatch (before clipping)."""
    grad_fn = jax.jit(jax.grad(lambda p, *batch: reference_loss(agent, args, p, *batch), has_aux=True))
    apply = jax.jit(agent.apply)  # one compile, not one per op
    order = np.asarray(jax.random.permutation(jax.random.fold_in(shuffle_key, step), MINIBATCHES))
    metrics, norms = [], []
    for k in order:
        envs = np.flatnonzero(rollout.env_ids[0] % MINIBATCHES == k)
        obs, actions, logprobs = rollout.obs[:, envs], rollout.actions[:, envs], rollout.logprobs[:, envs]
        valid = rollout.valid[:, envs]
        logits, values = apply(params, obs.reshape(-1, *OBS_SHAPE))
        logp = np.asarray(jax.nn.log_softmax(logits)).reshape(T + 1, len(envs), -1)[:-1]
        rhos = np.exp(np.take_along_axis(logp, actions[..., None], axis=-1)[..., 0] - logprobs)
        values = np.asarray(values, np.float64).reshape(T + 1, len(envs))
        terminations, rewards = rollout.terminations[:, envs], rollout.rewards[:, envs]
        targets, advantages = vtrace_loop(values, rewards, terminations, valid, rhos, args.gamma)
        batch = (obs, actions, logprobs, targets.astype(np.float32), advantages.astype(np.float32), valid)
        grads, minibatch_metrics = grad_fn(params, *batch)
        learning_rate = args.learning_rate * (1 - (step // MINIBATCHES) / args.num_iterations)
        params, nu, norm = clipped_rmsprop(args, params, grads, nu, learning_rate)
        metrics.append(minibatch_metrics)
        norms.append(norm)
        step += 1
    return params, nu, step, metrics, norms


@pytest.mark.parametrize(
    "extra",
    [
        ["--gradient-accumulation-steps", "2", "--max-grad-norm", "0.5"],  # micro-batches of envs; clipping at work
        ["--exact", "--group-envs", "1"],  # envs summed one group at a time in key order
    ],
    ids=["micro-batches-clipped", "exact-groups"],
)
def test_two_iterations_match_the_plain_reference(extra):
    args = make_args(cleanba_impala, extra)
    agent, shuffle_key, state, update = script_learner(cleanba_impala, args)

    params = jax.tree.map(np.asarray, state.params)
    nu = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
    step, norms = 0, []
    for seed in (1, 2):  # seeds whose rollouts hold terminations and truncations (episode_data checks)
        before = params
        rollout = make_rollout(cleanba_impala, agent, params, seed)
        state, logged = update(state, (cleanba_impala.Rollout(*map(jnp.asarray, rollout)),))
        params, nu, step, metrics, iteration_norms = reference_iteration(
            agent, args, shuffle_key, params, nu, step, rollout
        )
        norms += iteration_norms
        assert int(state.step) == step
        for name in ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipped_rho_fraction"):
            expected = np.mean([float(m[name]) for m in metrics])
            np.testing.assert_allclose(float(logged[name]), expected, **TOLERANCE, err_msg=name)
        assert 0 < float(logged["clipped_rho_fraction"]) < 1, "some importance weights should be clipped, some not"
        assert_params_match(state.params, params, before)
    if args.max_grad_norm < 1:
        assert max(norms) > args.max_grad_norm, "the clipped case should clip"


def test_defaults_and_optimizer_are_the_papers():
    """IMPALA's defaults (the Cleanba paper's appendix A, TorchBeast) and the optimizer the script builds from them,
    read back from its state: RMSProp with decay 0.99 and eps 0.01 at 6e-4, annealed linearly to 0 (eps outside the
    square root: the reference test above writes PyTorch's update out); gradients clipped to a global norm of 40."""
    import tyro

    args = tyro.cli(cleanba_impala.Args, args=[])
    defaults = dict(learning_rate=6e-4, rmsprop_decay=0.99, rmsprop_eps=0.01, max_grad_norm=40.0, ent_coef=0.01)
    defaults |= dict(vf_coef=0.5, gamma=0.99, num_steps=20, local_num_envs=64, num_actor_threads=2, num_minibatches=4)
    defaults |= dict(anneal_lr=True, concurrency=True, total_timesteps=50_000_000)
    assert {name: getattr(args, name) for name in defaults} == defaults
    args = make_args(cleanba_impala, [])
    _, _, state, _ = script_learner(cleanba_impala, args)
    (hyperparams,) = [part.hyperparams for part in state.opt_state if hasattr(part, "hyperparams")]
    for name, value in dict(decay=0.99, eps=0.01, initial_scale=0.0, learning_rate=6e-4).items():
        assert float(hyperparams[name]) == pytest.approx(value, rel=1e-6), name
