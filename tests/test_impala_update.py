"""One IMPALA learner iteration of cleanba_impala.py against a plain reference written from the IMPALA paper and
TorchBeast's learner: minibatch k of an iteration holds the whole sequences of the envs whose id is k modulo
--num-minibatches, the minibatches in a shuffled order; V-trace by a loop (learner_reference.vtrace_loop) on the
values and importance weights of the params before the minibatch; the loss summed over the minibatch's valid
samples; global-norm clipping, then PyTorch's RMSProp (epsilon outside the square root) with the learning rate
annealed per iteration, both written out in numpy. The script computes the same thing in pieces (groups of envs,
micro-batches, masked dot products, rlax's V-trace, optax); Atari observations with episode ends and auto-reset
steps exercise the ResNet and the masks. With --lstm, the network is written out by hand too (its MLP, an LSTM cell,
its heads) and stepped one env and one obs at a time from the rollout's stored state, restarting after each auto-reset
step: the script's batched unroll (nn.scan over time, envs in a batch) and its gradient through the whole rollout
must agree with that loop."""

import gymnasium
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
    vtrace_loop,
)

from cleanba import cleanba_impala

# --lstm on vector observations of VECTOR numbers (the env id only sets the flags' checks)
LSTM, VECTOR = ["--env-id", "CartPole-v1", "--lstm", "--lstm-size", "8"], 6


def feed_forward_outputs(agent):
    """(params, obs, state, valid) -> (logits (T + 1, n, actions), values (T + 1, n)) of the script's network."""

    def outputs(params, obs, state, valid):
        logits, values = agent.apply(params, obs.reshape(-1, *obs.shape[2:]))
        return logits.reshape(*obs.shape[:2], -1), values.reshape(obs.shape[:2])

    return outputs


def lstm_loop_outputs(size: int):
    """The same for --lstm, by hand: each env's rollout one obs at a time, the MLP torso, an LSTM cell (gates i, f,
    g, o; cell, then hidden, as the script stores them) from the env's stored state, restarted from zeros on the row
    after an invalid (EnvPool auto-reset) step, and the heads."""

    def outputs(params, obs, state, valid):
        p = params["params"]
        cell = p["LSTMCore_0"]["OptimizedLSTMCell_0"]

        def dense(name, x):
            return x @ p[name]["kernel"] + p[name]["bias"]

        logits, values = [[None] * obs.shape[1] for _ in range(T + 1)], [[None] * obs.shape[1] for _ in range(T + 1)]
        for i in range(obs.shape[1]):
            c, h = state[i, :size], state[i, size:]
            for t in range(T + 1):
                if t > 0:
                    c, h = jnp.where(valid[t - 1, i], c, 0.0), jnp.where(valid[t - 1, i], h, 0.0)
                x = jnp.tanh(dense("Dense_1", jnp.tanh(dense("Dense_0", obs[t, i]))))

                def gate(g, x=x, h=h):
                    return x @ cell[f"i{g}"]["kernel"] + h @ cell[f"h{g}"]["kernel"] + cell[f"h{g}"]["bias"]

                c = jax.nn.sigmoid(gate("f")) * c + jax.nn.sigmoid(gate("i")) * jnp.tanh(gate("g"))
                h = jax.nn.sigmoid(gate("o")) * jnp.tanh(c)
                logits[t][i], values[t][i] = dense("Dense_2", h), dense("Dense_3", h)[0]
        return jnp.stack([jnp.stack(row) for row in logits]), jnp.stack([jnp.stack(row) for row in values])

    return outputs


def reference_loss(outputs, args, params, obs, state, actions, logprobs, targets, advantages, valid):
    """Sum over the valid samples of the per-sample IMPALA loss, and the per-sample means of the logged terms."""
    logits, values = outputs(params, obs, state, valid)
    logp = jax.nn.log_softmax(logits[:-1])
    values = values[:-1]
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


def reference_iteration(outputs, args, shuffle_key, params, nu, step: int, rollout):
    """One iteration, the plain way. Returns params, RMSProp's mean squares, the step, the metrics of every
    minibatch and the global gradient norm of every minibatch (before clipping)."""
    grad_fn = jax.jit(jax.grad(lambda p, *batch: reference_loss(outputs, args, p, *batch), has_aux=True))
    apply = jax.jit(outputs)  # one compile, not one per op
    order = np.asarray(jax.random.permutation(jax.random.fold_in(shuffle_key, step), MINIBATCHES))
    metrics, norms = [], []
    for k in order:
        envs = np.flatnonzero(rollout.env_ids[0] % MINIBATCHES == k)
        obs, actions, logprobs = rollout.obs[:, envs], rollout.actions[:, envs], rollout.logprobs[:, envs]
        valid, state = rollout.valid[:, envs], rollout.recurrent_state[0, envs]
        logits, values = apply(params, obs, state, valid)
        logp = np.asarray(jax.nn.log_softmax(logits))[:-1]
        rhos = np.exp(np.take_along_axis(logp, actions[..., None], axis=-1)[..., 0] - logprobs)
        values = np.asarray(values, np.float64).reshape(T + 1, len(envs))
        terminations, rewards = rollout.terminations[:, envs], rollout.rewards[:, envs]
        targets, advantages = vtrace_loop(values, rewards, terminations, valid, rhos, args.gamma)
        batch = (obs, state, actions, logprobs, targets.astype(np.float32), advantages.astype(np.float32), valid)
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
        # the LSTM unrolled in groups of 2 envs, each cut into micro-batches of 1 env
        [*LSTM, "--exact", "--group-envs", "2", "--gradient-accumulation-steps", "2"],
    ],
    ids=["micro-batches-clipped", "exact-groups", "lstm"],
)
def test_two_iterations_match_the_plain_reference(extra):
    args = make_args(cleanba_impala, extra)
    if args.lstm:  # vector observations: the hand-written loop covers the whole network
        space = gymnasium.spaces.Box(-np.inf, np.inf, (VECTOR,), np.float32)
        agent, shuffle_key, state, update = script_learner(cleanba_impala, args, space)
        outputs, shape = lstm_loop_outputs(args.lstm_size), (VECTOR,)
    else:
        agent, shuffle_key, state, update = script_learner(cleanba_impala, args)
        outputs, shape = feed_forward_outputs(agent), OBS_SHAPE
    state_size = cleanba_impala.recurrent_state_size(args)

    params = jax.tree.map(np.asarray, state.params)
    nu = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
    step, norms = 0, []
    for seed in (1, 2):  # seeds whose rollouts hold terminations and truncations (episode_data checks)
        before = params
        rollout = make_rollout(cleanba_impala, agent, params, seed, shape, state_size)
        state, logged = update(state, (cleanba_impala.Rollout(*map(jnp.asarray, rollout)),))
        params, nu, step, metrics, iteration_norms = reference_iteration(
            outputs, args, shuffle_key, params, nu, step, rollout
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
