"""The one-step lag on the params themselves, per actor thread: rollout k of every actor thread (k = 0, 1, ...) is
played with the params of update k - lag (update 0: the initial params; lag 1 with --concurrency, 0 without), every
one of its steps. Read from the params each policy call receives and the learner's state after each update, in a
run of the script's own start/train in this process, not from the version labels the run logs."""

import importlib
import signal
import threading
from collections import defaultdict

import pytest
import tyro
from support import TINY

from cleanba.lifetime import shut_down
from cleanba.replicas import digest, unreplicate

ITERATIONS, THREADS, ENVS = 4, 2, 4


@pytest.mark.parametrize("concurrency", [False, True], ids=["sync", "concurrent"])
@pytest.mark.parametrize(  # the lag is the engine's (the same in every script): PPO's, and the actor's LSTM state
    ("script", "extra"), [("ppo", []), ("impala", ["--lstm", "--lstm-size", "8"])], ids=["ppo", "impala-lstm"]
)
def test_every_actor_thread_plays_the_params_of_its_lag(script, extra, concurrency, tmp_path, monkeypatch):
    """With --lstm too: the recurrent state changes nothing of which params each step is played with."""
    module = importlib.import_module(f"cleanba.cleanba_{script}")
    monkeypatch.chdir(tmp_path)  # the run's runs/ folder
    flags = [*TINY[script], "--num-actor-threads", str(THREADS), "--local-num-envs", str(ENVS), *extra]
    args = tyro.cli(module.Args, args=[*flags, "--concurrency" if concurrency else "--no-concurrency"])
    steps = args.num_steps
    args.total_timesteps = ITERATIONS * THREADS * ENVS * steps
    module.check_args(args)

    played = defaultdict(list)  # actor thread -> the digest of the params of each policy call, in order
    make_policy = module.make_policy

    def recording_make_policy(*policy_args):
        policy = make_policy(*policy_args)

        def recorded(params, *rest):
            played[threading.current_thread().name].append(digest(params))
            return policy(params, *rest)

        return recorded

    monkeypatch.setattr(module, "make_policy", recording_make_policy)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run = module.start(args)
        updates = [digest(unreplicate(run.state.params))]  # updates[j]: the params after update j
        update = run.update

        def recording_update(state, replay, rollouts):
            state, replay, metrics = update(state, replay, rollouts)
            updates.append(digest(unreplicate(state.params)))
            return state, replay, metrics

        run.update = recording_update
        try:
            module.train(run)
        finally:
            shut_down(run, module.checkpoint.save_run_checkpoint)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)

    assert not run.stop.errors and len(updates) == ITERATIONS + 1 and len(set(updates)) == ITERATIONS + 1
    assert sorted(played) == [f"actor-{i}" for i in range(THREADS)]
    lag = int(concurrency)
    for thread, digests in played.items():
        assert len(digests) == ITERATIONS * steps, thread
        for k in range(ITERATIONS):
            rollout = digests[k * steps : (k + 1) * steps]
            assert set(rollout) == {updates[max(0, k - lag)]}, (thread, k, [updates.index(d) for d in set(rollout)])
