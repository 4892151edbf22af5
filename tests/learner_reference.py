"""The plain references the learner's tests compare with: GAE and V-trace as loops written from the papers' equations
(test_advantages.py), random rollouts with episode ends to run them on, and what the two learner reference tests
(test_ppo_update.py, test_impala_update.py) share: the script's args at tiny Atari sizes, a rollout of random frames,
the script's own state and compiled update, and the comparison of its params with the reference's."""

from types import SimpleNamespace

import gymnasium
import jax
import numpy as np
import tyro
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

T, N, MINIBATCHES = 8, 4, 2
OBS_SHAPE = (4, 12, 12)  # a small Atari frame stack: the ResNet's convolutions, pools and dense layers all run
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def episode_data(seed, T=40, n=6):
    """Random rollouts with terminations, truncations and EnvPool's auto-reset step after each of them."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, n)).astype(np.float32)
    values = rng.normal(size=(T + 1, n)).astype(np.float32)
    terminations = np.zeros((T, n), bool)
    truncations = np.zeros((T, n), bool)
    valid = np.ones((T, n), bool)
    for j in range(n):
        t = int(rng.integers(0, 2))
        while t < T:
            if rng.random() < 0.15:
                (terminations if rng.random() < 0.5 else truncations)[t, j] = True
                if t + 1 < T:  # the auto-reset step: reward 0, not learned from
                    valid[t + 1, j], rewards[t + 1, j] = False, 0.0
                t += 2
            else:
                t += 1
    valid[0, 0] = False  # a rollout may start on the auto-reset step of the previous one
    assert terminations.any() and truncations.any()
    return rewards, values, terminations, truncations, valid


def gae_loop(rewards, values, terminations, truncations, gamma, lam):
    T, n = rewards.shape
    advantages = np.zeros((T, n))
    for j in range(n):
        next_advantage = 0.0
        for t in reversed(range(T)):
            ended = terminations[t, j] or truncations[t, j]
            bootstrap = 0.0 if terminations[t, j] else gamma * values[t + 1, j]  # truncation: value of final obs
            delta = rewards[t, j] + bootstrap - values[t, j]
            advantages[t, j] = delta + (0.0 if ended else gamma * lam * next_advantage)
            next_advantage = advantages[t, j]
    return advantages


def vtrace_loop(values, rewards, terminations, valid, rhos, gamma):
    """Espeholt et al. 2018, eq. 1 and 4, rho and c clipped at 1, computed backwards episode by episode."""
    T, n = rewards.shape
    targets = np.zeros((T, n))
    advantages = np.zeros((T, n))
    for j in range(n):
        for t in reversed(range(T)):
            if not valid[t, j]:  # the auto-reset step: its target is the value of its obs, the final obs
                targets[t, j] = values[t, j]
                continue
            rho, c = min(1.0, rhos[t, j]), min(1.0, rhos[t, j])
            discount = 0.0 if terminations[t, j] else gamma
            if t + 1 < T:
                next_target, next_value = targets[t + 1, j], values[t + 1, j]
            else:
                next_target = next_value = values[T, j]
            delta = rho * (rewards[t, j] + discount * values[t + 1, j] - values[t, j])
            targets[t, j] = values[t, j] + delta + discount * c * (next_target - next_value)
            advantages[t, j] = rho * (rewards[t, j] + discount * next_target - values[t, j])
    return targets, advantages


def reference_minibatches(shuffle_key, step: int, env_ids, epoch: int) -> list:
    """The documented order: each env's time steps shuffled with a key of (shuffle key, train step at the start of
    the iteration, epoch, env id), cut into MINIBATCHES equal parts; minibatch m takes part m of every env.
    [(time index, env index) arrays]."""
    key = jax.random.fold_in(jax.random.fold_in(shuffle_key, step), epoch)
    perms = [np.asarray(jax.random.permutation(jax.random.fold_in(key, int(i)), T)) for i in env_ids]
    rows = T // MINIBATCHES
    return [
        (np.concatenate([p[m * rows : (m + 1) * rows] for p in perms]), np.repeat(np.arange(N), rows))
        for m in range(MINIBATCHES)
    ]


def make_args(script, extra: list):
    """script: the training script's module. Breakout, a narrow ResNet, N envs of T steps, 3 iterations."""
    args = tyro.cli(
        script.Args,
        args=[
            *["--env-id", "Breakout-v5", "--channels", "4", "8", "--hidden-dim", "16", "--num-actor-threads", "1"],
            *["--local-num-envs", str(N), "--num-steps", str(T), "--num-minibatches", str(MINIBATCHES)],
            *["--total-timesteps", str(3 * T * N)],  # 3 iterations: the learning rate anneals from one to the next
            *extra,
        ],
    )
    script.check_args(args)
    script.fill_runtime_sizes(args, 1, 0)
    assert args.num_iterations == 3
    return args


def make_rollout(script, agent, params, seed: int, obs_shape: tuple = OBS_SHAPE, state_size: int = 0):
    """Random frames with the episode structure of episode_data (terminations, truncations, invalid auto-reset
    steps), rewards in {-1, 0, 1}, and behaviour log-probabilities near the current policy's, so that some ratios
    (PPO) leave the clip range and some importance weights (IMPALA) are clipped at 1. obs_shape (T, N, ...) float
    observations where it is not a frame stack; state_size: each env's stored recurrent state, random."""
    rng = np.random.default_rng(seed)
    _, _, terminations, truncations, valid = episode_data(seed, T, N)
    if len(obs_shape) == 3:  # frames
        obs = rng.integers(0, 256, size=(T + 1, N, *obs_shape), dtype=np.uint8)
    else:
        obs = rng.normal(0, 1, size=(T + 1, N, *obs_shape)).astype(np.float32)
    rewards = rng.choice(np.array([-1.0, 0.0, 1.0], np.float32), size=(T, N), p=[0.2, 0.5, 0.3])
    rewards[~valid] = 0.0
    logits = jax.jit(agent.apply)(params, obs[:-1].reshape(T * N, *obs_shape))[0]  # one compile, not one per op
    actions = rng.integers(0, logits.shape[-1], size=(T, N)).astype(np.int32)
    logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), actions.reshape(-1, 1), axis=1).reshape(T, N)
    return script.Rollout(
        obs=obs,
        actions=actions,
        logprobs=(logp + rng.normal(0, 0.3, (T, N))).astype(np.float32),
        rewards=rewards,
        terminations=terminations,
        truncations=truncations,
        valid=valid,
        env_ids=np.arange(N, dtype=np.int32)[None],
        recurrent_state=rng.normal(0, 0.5, (1, N, state_size)).astype(np.float32),
    )


def script_learner(script, args, observation_space=None, action_space=None):
    """The script's network, shuffle key, initial state and learner update (state, rollouts) (one learner device), for
    observations of observation_space (default: the frame stack) and actions of action_space (default: Atari's 18)."""
    observation_space = observation_space or gymnasium.spaces.Box(0, 255, OBS_SHAPE, np.uint8)
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("learner",))
    agent = script.make_network(args, action_space or gymnasium.spaces.Discrete(18))
    init_key, shuffle_key = jax.random.split(jax.random.key(7))
    spec = SimpleNamespace(observation_space=observation_space)  # as make_spec gives
    # replicated over the mesh as the scripts place it: the update's outputs come back so, and the second iteration
    # then finds the first one's program instead of compiling another for other input shardings
    state = jax.device_put(script.initial_state(agent, args, spec, init_key), NamedSharding(mesh, P()))
    update = script.make_learner_update(agent, args, shuffle_key, mesh, 1)

    def on_policy_update(state, rollouts):  # the on-policy scripts' replay memory: none
        state, _, metrics = update(state, {}, rollouts)
        return state, metrics

    return agent, shuffle_key, state, on_policy_update


def assert_params_match(got, want, before):
    """The script's params equal the reference's leaf by leaf, and moved from `before` by far more than the tolerance
    (an update that did nothing would fail)."""
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, **TOLERANCE, err_msg=jax.tree_util.keystr(path[0]))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(got))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(before)))
    assert moved > 100 * TOLERANCE["atol"]
