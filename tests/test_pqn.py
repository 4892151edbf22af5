"""cleanba_pqn.py's own parts against plain loops: the Q(lambda) targets (Gallici et al. 2024, written out per env
and step, the episode boundaries of EnvPool's auto-reset) and the epsilon-greedy actor (CleanRL's linear schedule over
the global env steps, each env drawing from its own key)."""

import importlib

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from learner_reference import (
    MINIBATCHES,
    N,
    T,
    assert_params_match,
    episode_data,
    make_args,
    make_rollout,
    reference_minibatches,
    script_learner,
)

pqn = importlib.import_module("cleanba.cleanba_pqn")


def q_lambda_loop(rewards, values, terminations, truncations, gamma, lam):
    """G_t = r_t + gamma (1 - lambda) max Q(s_t+1) + gamma lambda G_t+1 within an episode, G_T = max Q(s_T); at an
    episode's end the return bootstraps from the final obs (a truncation) or not at all (a termination)."""
    T, n = rewards.shape
    targets = np.zeros((T, n))
    for j in range(n):
        following = values[T, j]
        for t in reversed(range(T)):
            if terminations[t, j]:
                targets[t, j] = rewards[t, j]
            elif truncations[t, j]:
                targets[t, j] = rewards[t, j] + gamma * values[t + 1, j]
            else:
                targets[t, j] = rewards[t, j] + gamma * ((1 - lam) * values[t + 1, j] + lam * following)
            following = targets[t, j]
    return targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_lambda_targets_match_a_plain_loop(seed):
    rewards, values, terminations, truncations, _ = episode_data(seed)
    got = pqn.q_lambda_targets(values, rewards, terminations, truncations, 0.99, 0.65)
    expected = q_lambda_loop(rewards, values, terminations, truncations, 0.99, 0.65)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def epsilon_greedy_args(envs: int):
    args = pqn.Args(env_id="CartPole-v1", local_num_envs=envs, num_actor_threads=1, num_steps=8)
    args.total_timesteps, args.start_e, args.end_e, args.exploration_fraction = 1_000_000, 1.0, 0.05, 0.5
    pqn.fill_runtime_sizes(args, 1, 0)
    return args


def cleanrl_epsilon(args, step: int) -> float:
    """CleanRL's linear_schedule at the global step of a rollout step: every env has stepped once more."""
    duration, global_step = args.exploration_fraction * args.total_timesteps, (step + 1) * args.num_envs
    return max((args.end_e - args.start_e) / duration * global_step + args.start_e, args.end_e)


@pytest.mark.parametrize("step", [0, 30, 60, 200])
def test_epsilon_greedy_follows_the_schedule_with_each_envs_own_key(step):
    """Over 8,192 envs, the share of actions that are not the greedy one is epsilon x (1 - 1/actions) at that step,
    the stored log-probability is that of the action under epsilon-greedy, and an env's action depends only on its
    own key: the envs drawn alone or in one batch draw alike."""
    envs, actions = 8192, 4
    args = epsilon_greedy_args(envs)
    q = jax.random.normal(jax.random.key(3), (envs, actions))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(jnp.arange(envs))
    taken, logprobs = jax.jit(lambda q, keys, step: pqn.sample_actions(args, q, keys, step))(q, keys, step)
    greedy = np.argmax(np.asarray(q), axis=1)
    epsilon = cleanrl_epsilon(args, step)
    share = np.mean(np.asarray(taken) != greedy)
    assert abs(share - epsilon * (1 - 1 / actions)) < 4 * np.sqrt(0.25 / envs) + 1e-9, (share, epsilon)
    expected = np.log(epsilon / actions + (1 - epsilon) * (np.asarray(taken) == greedy))
    np.testing.assert_allclose(np.asarray(logprobs), expected, rtol=1e-5)
    alone = [pqn.sample_actions(args, q[i : i + 1], keys[i : i + 1], step)[0][0] for i in range(8)]
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(taken[:8]))


# ---- Two learner iterations against a plain reference: the update as CleanRL's PQN and purejaxql write it


FRAMES = (4, 36, 36)  # the smallest frame stack the Nature CNN's strided convolutions take
EPOCHS = 2


def reference_optimizer(args):
    """Global-norm clipping, then RAdam at a rate annealed linearly to 0 from one iteration to the next. RAdam's
    hyperparameters are float32 arrays, as inject_hyperparams keeps them (the script logs the rate from it): its
    rectification term, a difference of numbers near 2,000 in early steps, differs from one of Python floats."""

    def rate(count):
        return args.learning_rate * (1 - (count // (EPOCHS * MINIBATCHES)) / args.num_iterations)

    radam = optax.inject_hyperparams(optax.radam)(learning_rate=rate)
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), radam)


def reference_iteration(agent, args, shuffle_key, params, opt_state, step: int, rollout):
    """One iteration, the plain way: max Q of every row with the iteration's params, Q(lambda) by the loop above,
    each epoch's minibatches (time slices of every env, or with --lstm the env sets in a shuffled order, each env's
    sequence unrolled alone from its stored state), half the mean squared TD error over the valid samples, RAdam
    after global-norm clipping at the annealed rate. Returns params, optimizer state, step, each step's loss and
    gradient norm (before clipping)."""
    rows = [(rollout.obs[:, j : j + 1], rollout.recurrent_state[0, j : j + 1], rollout.valid[:, j]) for j in range(N)]

    def env_q(params, obs, state, valid):  # each env alone: (T + 1, actions)
        if not args.lstm:
            return agent.apply(params, obs[:, 0])[0]
        starts = jnp.concatenate([jnp.zeros(1, bool), ~valid])[:, None]
        return agent.apply(params, obs, state, starts)[0][:, 0]

    values = np.stack([np.asarray(jax.jit(env_q)(params, *row)).max(axis=1) for row in rows], axis=1)
    terminal = rollout.terminations, rollout.truncations
    targets = q_lambda_loop(rollout.rewards, values, *terminal, args.gamma, args.q_lambda).astype(np.float32)
    optimizer = reference_optimizer(args)

    @jax.jit  # compiled once: run op by op, each op of each parameter's shape compiles on its own
    def apply_optimizer(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # One env's squared TD errors summed over its chosen time steps, compiled once: every env's arrays have the
    # same shapes whatever it samples. Run op by op, each op and its gradient compiled for each count of samples,
    # the three cases took 116 s of CPU against 76 (2-core AMD EPYC Zen 3).
    @jax.jit
    def env_errors(params, obs, state, valid, chosen, actions, targets):
        q = jnp.take_along_axis(env_q(params, obs, state, valid)[:T], actions[:, None], axis=1)[:, 0]
        return jnp.sum(jnp.where(chosen & valid, 0.5 * (q - targets) ** 2, 0.0))

    def loss(params, samples):  # samples: (env, time indices) pairs
        errors = []
        for j, ts in samples:
            chosen = np.isin(np.arange(T), ts)
            errors.append(env_errors(params, *rows[j], chosen, rollout.actions[:, j], targets[:, j]))
        return sum(errors) / max(sum(int(rollout.valid[ts, j].sum()) for j, ts in samples), 1)

    losses, norms, first_step = [], [], step
    for epoch in range(EPOCHS):
        key = jax.random.fold_in(jax.random.fold_in(shuffle_key, first_step), epoch)
        if args.lstm:  # env set k: the envs whose id is k mod the number of minibatches, every time step
            order = np.asarray(jax.random.permutation(key, MINIBATCHES))
            minibatches = [[(j, np.arange(T)) for j in range(N) if j % MINIBATCHES == k] for k in order]
        else:
            minibatches = [
                [(j, t[js == j]) for j in range(N)]
                for t, js in reference_minibatches(shuffle_key, first_step, rollout.env_ids[0], epoch)
            ]
        for samples in minibatches:
            value, grads = jax.value_and_grad(loss)(params, samples)
            norms.append(float(jax.jit(optax.global_norm)(grads)))
            params, opt_state = apply_optimizer(grads, opt_state, params)
            step += 1
            losses.append(float(value))
    return params, opt_state, step, losses, norms


@pytest.mark.parametrize(
    "extra",
    [
        ["--gradient-accumulation-steps", "2"],  # values in chunks, 2 micro-batches per step
        ["--exact", "--group-envs", "2"],  # 2 groups of envs, summed one at a time in key order
        ["--lstm", "--lstm-size", "8", "--exact", "--group-envs", "1"],  # whole sequences from the stored state
    ],
    ids=["micro-batches", "exact-groups", "lstm"],
)
def test_two_iterations_match_the_plain_reference(extra):
    """The learner on Atari frames (the Nature CNN with its LayerNorms) with terminations, truncations and
    auto-reset steps: params, step count and the logged loss as the plain reference's, two iterations running."""
    args = make_args(pqn, ["--update-epochs", str(EPOCHS), "--max-grad-norm", "1.0", "--learning-rate", "0.01", *extra])
    space = gymnasium.spaces.Box(0, 255, FRAMES, np.uint8)
    agent, shuffle_key, state, update = script_learner(pqn, args, space)
    params = state.params
    opt_state = reference_optimizer(args).init(params)
    step, size, norms = 0, pqn.recurrent_state_size(args), []
    for seed in (1, 2):  # seeds whose rollouts hold terminations and truncations (episode_data checks)
        before = params
        rollout = make_rollout(pqn, agent, params, seed, FRAMES, size)
        state, logged = update(state, (pqn.Rollout(*map(jnp.asarray, rollout)),))
        params, opt_state, step, losses, iteration_norms = reference_iteration(
            agent, args, shuffle_key, params, opt_state, step, rollout
        )
        norms += iteration_norms
        assert int(state.step) == step
        np.testing.assert_allclose(float(logged["loss"]), np.mean(losses), rtol=1e-5)
        assert_params_match(state.params, params, before)
    assert max(norms) > args.max_grad_norm, norms  # the clip at work


def test_defaults_and_optimizer_are_cleanrls():
    """CleanRL's pqn_atari_envpool.py defaults, and the optimizer read back from the script's state: RAdam (b1 0.9,
    b2 0.999, eps 1e-8) at 2.5e-4 annealed, gradients clipped at a global norm of 10."""
    args = pqn.Args()
    defaults = dict(learning_rate=2.5e-4, num_steps=128, num_minibatches=4, update_epochs=4, gamma=0.99, q_lambda=0.65)
    defaults |= dict(max_grad_norm=10.0, start_e=1.0, end_e=0.01, exploration_fraction=0.1, anneal_lr=True)
    defaults |= dict(total_timesteps=10_000_000, local_num_envs=4, num_actor_threads=2)  # CleanRL's 8 envs
    assert {name: getattr(args, name) for name in defaults} == defaults
    state = script_learner(pqn, make_args(pqn, []), gymnasium.spaces.Box(0, 255, FRAMES, np.uint8))[2]
    (hyperparams,) = [part.hyperparams for part in state.opt_state if hasattr(part, "hyperparams")]
    for name, value in dict(b1=0.9, b2=0.999, eps=1e-8, threshold=5.0, learning_rate=2.5e-4).items():
        assert float(hyperparams[name]) == pytest.approx(value, rel=1e-6), name
    assert float(make_args(pqn, []).max_grad_norm) == 10.0
