"""An env's observation and action spaces as the training scripts see them, and the checks that a script trains them.

Every script of the family stores an observation as one array. A Box as it is (float64 as float32, the precision JAX
computes in): images stay images. Anything else becomes one float32 vector: a Dict's parts in the sorted order of
their keys (nested Dicts likewise), a Discrete as a one-hot vector, a Box or MultiBinary part flattened, a uint8 Box
part (MiniGrid's mission bytes, say) scaled by 1 / 255 into [0, 1], as the ResNet scales frames, so that bytes of up
to 255 do not saturate an MLP's first layer. MiniGrid's image is the exception: each of its cells holds three codes
(object type, colour, state), one-hot, as minigrid's OneHotPartialObsWrapper has them, since scaled bytes would put a
key (5) and a ball (6) 0.004 apart in one input. The order is fixed by the space alone, so it is the same on every
layout and in the evaluation. Actions are Discrete or a Box of floats, as each script says (cleanba/family.py);
check_env refuses, in one line, an env whose spaces its script does not train, and check_network a network whose
policy and values do not fit the env's spaces.
"""

import math

import numpy as np

from cleanba.family import FAMILY
from cleanba.flags import fail

# The scripts that train each kind of action space, named in the refusal of an env of another kind.
SCRIPTS_FOR_ACTIONS = {
    kind: " or ".join(script.path.name for script in FAMILY.values() if script.action_space == kind)
    for kind in dict.fromkeys(script.action_space for script in FAMILY.values())
}
VECTOR_PARTS = ("Box", "Discrete", "MultiBinary")  # what a flattened observation is made of
# EnvPool's MiniGrid observation: its image's cells hold minigrid's codes of an object type (11), colour (6), state (3).
MINIGRID_KEYS, MINIGRID_CODES = {"direction", "image", "mission"}, (11, 6, 3)


def kind(space) -> str:
    return type(space).__name__


def cell_codes(space, key: str):
    """How many values each code of a cell takes, for the Dict part that holds MiniGrid's image; None for any other."""
    return MINIGRID_CODES if key == "image" and set(space.spaces) == MINIGRID_KEYS else None


def flat_size(space) -> int:
    if kind(space) == "Dict":
        return sum(part_size(space, key) for key in space.spaces)
    return int(space.n) if kind(space) == "Discrete" else math.prod(space.shape)


def part_size(space, key: str) -> int:
    codes = cell_codes(space, key)
    return math.prod(space.spaces[key].shape[:-1]) * sum(codes) if codes else flat_size(space.spaces[key])


def flatten(obs, space) -> np.ndarray:
    """(n, flat_size(space)) float32 of a batch of n observations of space."""
    if kind(space) == "Dict":
        return np.concatenate([flat_part(obs[key], space, key) for key in sorted(space.spaces)], axis=1)
    if kind(space) == "Discrete":
        return np.eye(int(space.n), dtype=np.float32)[np.asarray(obs).astype(np.int64) - int(space.start)]
    flat = np.reshape(obs, (len(obs), -1)).astype(np.float32)
    return flat / np.float32(255) if kind(space) == "Box" and np.dtype(space.dtype) == np.uint8 else flat


def flat_part(obs, space, key: str) -> np.ndarray:
    """A Dict's part flattened; MiniGrid's image each cell's codes one-hot, side by side."""
    codes = cell_codes(space, key)
    if not codes:
        return flatten(obs, space.spaces[key])
    obs = np.asarray(obs).astype(np.int64)
    hot = [np.eye(size, dtype=np.float32)[obs[..., channel]] for channel, size in enumerate(codes)]
    return np.concatenate(hot, axis=-1).reshape(len(obs), -1)


def observation_field(space) -> tuple:
    """(shape, dtype) of one env's observation as the rollout stores it and the network sees it."""
    if kind(space) != "Box":
        return (flat_size(space),), np.dtype(np.float32)
    dtype = np.dtype(space.dtype)
    return tuple(space.shape), np.dtype(np.float32) if dtype == np.float64 else dtype


def flat_observations(obs, space) -> np.ndarray:
    """A batch of observations (n, ...) of space as observation_field says."""
    if kind(space) != "Box":
        return flatten(obs, space)
    return obs.astype(np.float32) if obs.dtype == np.float64 else obs


def action_field(space) -> tuple:
    """(shape, dtype) of one env's action as the rollout stores it: a Discrete action's index, a Box action's values
    as sampled (before the script's env_actions clips them)."""
    if kind(space) == "Discrete":
        return (), np.dtype(np.int32)
    return tuple(space.shape), np.dtype(np.float32)


def odd_parts(space, name: str = "") -> list:
    """The parts of an observation space that flatten cannot take."""
    if kind(space) == "Dict":
        return [odd for key, part in space.spaces.items() for odd in odd_parts(part, f"{name}{key}.")]
    return [] if kind(space) in VECTOR_PARTS else [f"{name.rstrip('.') or 'observation'}: {kind(space)}"]


def action_kind(space) -> str:
    """Discrete, Box (of floats) or what else the space is, as the refusals name it."""
    if kind(space) == "Box" and not np.issubdtype(space.dtype, np.floating):
        return f"integer Box ({np.dtype(space.dtype).name})"
    return kind(space)


def check_video(env_id: str, flag: str = "--capture-video"):
    """EnvPool renders its MuJoCo-based envs through an OpenGL context that it does not create: MuJoCo then ends the
    process at the first frame (exit 1). Refused where the run starts, not after training."""
    import envpool

    family = envpool.registration.registry.specs[env_id][0]
    if family.startswith("envpool.mujoco"):
        fail(
            f"{flag}: EnvPool's {family} envs ({env_id}) render through an OpenGL context EnvPool does not create, "
            "and MuJoCo ends the process at the first frame; leave out --capture-video (Atari, classic control and "
            "box2d envs record videos)"
        )


# EnvPool's config keys that no --env-kwargs sets: the engine's (env count, batching, seeds, threads, players, the
# reset's info), the assets' path, and the channels-first frames every script's network reads.
ENGINE_OPTIONS = {
    "num_envs", "batch_size", "num_threads", "thread_affinity_offset", "max_num_players", "seed", "env_seed",
    "gym_reset_return_info", "base_path", "channel_first",
}  # fmt: skip


def env_options(args, protocol: dict, test: bool = False) -> dict:
    """EnvPool's options of a run: the protocol's (a script's Atari settings), then --env-kwargs over them, and with
    test --test-env-kwargs over those (the test curve's envs); the KEY=VALUE pairs of both flags checked at each call,
    each value typed as the env's default config types it. Refused in one line: a pair without "=", a key given
    twice in one flag, a key the env's config does not have (the refusal names those it has), a value of another
    type, and a key the engine, the env id or the protocol sets."""
    flags = {"--env-kwargs": args.env_kwargs, "--test-env-kwargs": getattr(args, "test_env_kwargs", ())}
    options, env_id = dict(protocol), args.env_id
    if not any(flags.values()):
        return options
    import envpool

    registered = envpool.registration.registry.specs[env_id][2]
    defaults = make_spec(env_id, {}).config._asdict()
    fixed = dict.fromkeys(ENGINE_OPTIONS, "the engine sets it")
    fixed |= dict.fromkeys(set(registered) - {"max_episode_steps"}, f"--env-id={env_id} sets it; choose another id")
    fixed |= dict.fromkeys(protocol, "the Atari protocol sets it (--atari-protocol)")
    lists = {key for key, value in defaults.items() if isinstance(value, list)}
    settable = ", ".join(sorted(set(defaults) - set(fixed) - lists)) or "none"
    for flag, pairs in flags.items():
        given = {}
        for pair in pairs:
            key, equals, text = pair.partition("=")
            if not equals or key in given:
                fail(f"{flag}: {pair!r} is not KEY=VALUE with a key of its own (e.g. {flag} num_levels=200)")
            if key not in defaults or key in fixed or key in lists:
                why = fixed.get(key, "a list" if key in lists else f"not {env_id}'s")
                fail(f"{flag}: {key} cannot be set ({why}); {env_id} takes {settable}")
            given[key] = typed(flag, key, text, defaults[key])
        if flag == "--env-kwargs" or test:
            options |= given
    return options


def typed(flag: str, key: str, text: str, default):
    """text as a value of default's type: a bool from true/false/1/0, an int, a float, or a str as it is."""
    booleans = {"true": True, "false": False, "1": True, "0": False}
    try:
        if isinstance(default, bool):
            return booleans[text.lower()]
        return type(default)(text)
    except (KeyError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}[type(default)]
        fail(f"{flag}: {key}={text} is not {kind} (its default: {key}={default})")


# EnvPool's VizDoom envs do not start inside a training run here: envpool.make hangs in the actor thread (Basic-v1,
# holding the GIL, so that not even SIGTERM is handled), and on the multiplayer maps (Cig-v1, MultiDuel-v1) it ends
# the process with a segmentation fault, though a plain loop makes the single-player ones. Refused where the run
# starts (envpool 1.2.x, Linux x86_64).
REFUSED_FAMILIES = {
    "envpool.vizdoom": "its envs do not start inside a Cleanba run (envpool.make hangs in the actor thread, or "
    "ends the process with a segmentation fault on the multiplayer maps)"
}


def make_spec(env_id: str, env_kwargs: dict):
    """EnvPool's spec of the env, or a one-line refusal saying why EnvPool cannot make it here."""
    import envpool

    try:
        return envpool.make_spec(env_id, **env_kwargs)
    except Exception as error:  # e.g. Procgen without the system's Qt 5
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        family = envpool.registration.registry.specs[env_id][0]
        fail(f"--env-id={env_id}: EnvPool's {family} cannot make it here: {message}")


def check_env(env_id: str, env_kwargs: dict, action_space: str, script: str, capture_video: bool = False):
    """Refuse, before anything starts, an env this script cannot train: its EnvPool module cannot load here, it has
    several players, its observations hold a part no script stores, or its actions are not the script's kind; and
    videos of an env EnvPool cannot render."""
    import envpool

    if capture_video:
        check_video(env_id)

    family = envpool.registration.registry.specs[env_id][0]
    if family in REFUSED_FAMILIES:
        fail(f"--env-id={env_id}: EnvPool's {family}: {REFUSED_FAMILIES[family]}; no Cleanba script trains it")
    spec = make_spec(env_id, env_kwargs)
    players = getattr(spec.config, "max_num_players", 1)
    if players > 1:
        fail(f"--env-id={env_id} is a game of {players} players ({family}); every Cleanba script trains one agent")
    odd = odd_parts(spec.observation_space)
    if odd:
        fail(f"--env-id={env_id}: its observations hold {', '.join(odd)}, which no Cleanba script stores")
    actions = action_kind(spec.action_space)
    if actions not in SCRIPTS_FOR_ACTIONS:
        fail(
            f"--env-id={env_id}: its {actions} actions are not Discrete or a Box of floats, so no Cleanba script "
            "trains them"
        )
    if actions != action_space:
        fail(
            f"--env-id={env_id} has {actions} actions, which {script} does not train: use "
            f"{SCRIPTS_FOR_ACTIONS[actions]}"
        )


# ---- The network's contract: what the actors, the learner and the evaluation need of its outputs


def make_eval_policy(module, agent, greedy: bool, train_args):
    """(params, obs, recurrent state, starts, key) -> (actions, the next recurrent state), through the script's
    policy_step, as its actors step (the state restarts where starts, an episode's first obs): actions sampled by the
    script's own sample_actions (each env with its own key, as its actors sample, at the training run's last step:
    PQN's final epsilon), or with greedy its most likely action: discrete scripts' networks give logits or Q-values
    (greedy: their argmax), Box scripts' a Gaussian's means then log standard deviations (greedy: the means). EnvPool
    is sent them through the script's env_actions (clipped to a Box)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def act(params, obs, state, starts, key):
        policy, state = module.policy_step(agent, params, obs, state, starts)
        if not greedy:
            keys, last_step = jax.random.split(key, obs.shape[0]), train_args.num_iterations * train_args.num_steps
            return module.sample_actions(train_args, policy, keys, last_step)[0], state
        if module.ACTION_SPACE == "Box":
            return jnp.split(policy, 2, axis=1)[0], state
        return jnp.argmax(policy, axis=1), state

    return act


def policy_width(module, action_space) -> int:
    """The width of the network's policy output for the env's action space: the logits of each action, or a
    Gaussian's mean and log standard deviation of each action component."""
    return action_space.n if module.ACTION_SPACE == "Discrete" else 2 * action_space.shape[0]


def check_network(module, train_args, params):
    """At the start of every run, from shapes alone (jax.eval_shape: nothing compiles or runs): the network gives a
    policy and values of the shapes the actors, the learner and the evaluation use (make_network, apply(params, obs)
    -> (policy, values), make_eval_policy). A fork whose network breaks that contract, a head of the wrong width
    say, fails here, before anything starts, instead of training on out-of-range actions."""
    import envpool
    import jax

    spec = envpool.make_spec(train_args.env_id, **module.env_kwargs(train_args))
    obs_shape, obs_dtype = observation_field(spec.observation_space)
    obs = jax.ShapeDtypeStruct((2, *obs_shape), obs_dtype)
    width, action_shape = int(policy_width(module, spec.action_space)), action_field(spec.action_space)[0]
    try:
        agent = module.make_network(train_args, spec.action_space)
        state = jax.ShapeDtypeStruct((2, module.recurrent_state_size(train_args)), np.float32)
        starts = jax.ShapeDtypeStruct((2,), bool)
        act = make_eval_policy(module, agent, greedy=False, train_args=train_args)
        actions, _ = jax.eval_shape(act, params, obs, state, starts, jax.random.key(0))
        policy, values = jax.eval_shape(agent.apply, params, obs)
    except Exception as error:
        fail(
            f"the network breaks the scripts' contract ({type(error).__name__}: {error}): they build it with "
            f"make_network(args, action_space) and need apply(params, obs) -> (policy, values)"
        )
    shapes = (getattr(policy, "shape", None), getattr(values, "shape", None), actions.shape)
    if shapes != ((2, width), (2,), (2, *action_shape)):
        per_action = (
            f"one logit for each of {train_args.env_id}'s {width} actions"
            if module.ACTION_SPACE == "Discrete"
            else f"the means, then the log standard deviations, of {train_args.env_id}'s {width // 2} action components"
        )
        fail(
            f"the network returns policy and values of shapes {shapes[0]} and {shapes[1]} for a batch of 2 "
            f"observations; the scripts need ({(2, width)}, (2,)): apply(params, obs) -> (policy, values), the policy "
            f"{per_action} (make_network builds it)"
        )
