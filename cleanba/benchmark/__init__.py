"""Throughput benchmark of a Cleanba training script: how fast each side runs alone, and how well they overlap.

    python -m cleanba.benchmark --script ppo -- --env-id Breakout-v5 --num-actor-threads 1 --local-num-envs 8 \\
        --num-steps 32 --actor-device-ids 0 --learner-device-ids 0
    python -m cleanba.benchmark --script impala --reference-command "python other/impala.py --env-id Breakout-v5" \\
        -- --env-id Breakout-v5 --actor-device-ids 0 --learner-device-ids 1 2 3     # a GPU machine with 4 GPUs
    bash benchmark.sh throughput --actor-device-ids 0 --learner-device-ids 0      # PPO and IMPALA on Breakout-v5

Everything after `--` goes to the training script's own flags (its tyro Args), so every phase sizes envs, actor
threads, batches and devices exactly like a real single-process run of that command: `local_num_envs` envs per
actor thread, `num_actor_threads` threads per id of `--actor-device-ids`, the learner data-parallel over
`--learner-device-ids`. `--script` is ppo, impala, ppo_continuous, pqn, or the path of a fork that keeps the scripts'
functions. On a GPU pass the device ids as for training (a0-l0: actor and learner share GPU 0; a0-l1,2,3: actor on
GPU 0); on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices. The environment (XLA_FLAGS,
JAX_PLATFORMS, ...) is passed on to every phase unchanged.

Phases, each in a child process of its own, so that XLA state does not carry over from one to the next and
the peak host memory of each is measured alone (ru_maxrss of the child, from os.wait4):
    ceiling     EnvPool alone: one Python thread per actor thread, each stepping its own pool (same env
                config, envs and seeds as the actors) with random valid actions, no policy, no JAX
                computation. The fastest the actors could ever go on this machine.
    actor       the script's own actor threads (rollout_actor: policy inference, rollout storage, transfer to
                the learner devices), fed the initial params without waiting and drained at once: no learning.
                Also where an actor's time goes, from the script's own stats/actor_*_time (perf_counter sums per
                rollout): inference (dispatch), device_to_host (waits for the inference result), env_send,
                env_recv, storage (rollout and episode bookkeeping), host_to_device (put_on_learners).
    learner     the script's jitted update on synthetic rollouts of the real global size (random observations
                and actions, env ids as a real run assigns them), no envs.
                Before running it, XLA's own memory analysis of the compiled update and of one minibatch gradient
                step (the gradients of the batch the update hands it, and the optimizer's step): what the learner
                allocates on its device besides params and rollouts. The update should need little more than one
                minibatch step, and --gradient-accumulation-steps should lower both.
    sync        the training script itself with --no-concurrency: actor and learner alternate.
    concurrent  the training script itself with --concurrency: they overlap, the actor one policy behind.
    reference   optional (--reference-command): any command, run in a shell in the current directory; its
                figure is the last "SPS <number>" it printed, its wall time and peak memory are reported too.
    layers      only when asked for (--phases layers): where the learner's compute goes. Every convolution of
                the script's network (each nn.Conv call, found while tracing its forward pass) timed alone on the
                first learner device at the learner's micro-batch (minibatch / gradient accumulation steps /
                learner devices, or --layer-batch): forward, input gradient (dx) and weight gradient (dk), each
                in ms and GFLOP/s; then the whole network's forward and gradient at that batch, the share of the
                gradient the convolutions account for, and a large float32 matmul's GFLOP/s on the same device as
                the practical peak to read them against. The first convolution's dx is left out of the sums: its
                input is the observation, and the learner never computes it. Last, one learner update (as in
                the learner phase) under JAX's profiler: the share of its time in each kind of XLA operation that
                the trace names (layout transposes, pooling, ...; XLA:CPU's Eigen convolutions mostly go unnamed).

An iteration is one rollout of num_steps steps of every env: batch_size env steps. Every phase runs
--warmup-iterations iterations first, which are not measured (compilation, first env resets), then --repeats
windows of --iterations iterations; each figure is the median over the windows (these machines are noisy, so
compare ratios measured in one run rather than absolute figures across runs). sync and concurrent train for
exactly warmup + repeats x iterations iterations (the benchmark sets --total-timesteps and --run-name, and runs
them in a temporary directory), and their figures come from the TensorBoard stats/ the script logs every
iteration, timed by the events' wall times.

Figures (one table row per phase; all of them, per window too, in the JSON file):
    SPS            env steps per second. ceiling, actor: steps of all actor threads together per second of a
                   window. learner: batch_size / median update time. sync, concurrent: batch_size x iterations of
                   a window / the wall time between the end of the window's first and last iterations.
    / ceiling      SPS over the ceiling's: the share of raw EnvPool speed that the phase keeps.
    compile s      actor: the first rollout's time minus the median rollout time (the policy's compilation).
                   learner: from the start of the ahead-of-time compile to the end of the first update, less
                   the median update time. sync, concurrent: the script's own stats/learner_compile_time (it
                   compiles the update ahead of time, so its first update waits for no compile).
    learner wait   sync, concurrent: median seconds per iteration the learner waited for rollouts
                   (stats/rollout_queue_wait; large: the actor is the bottleneck).
    actor wait     sync, concurrent: median seconds per iteration an actor waited for params plus to hand over
                   its rollout (stats/param_queue_wait + stats/actor_rollout_queue_wait; large: the learner is).
    cores          CPU seconds per wall second of the phase's process in a window: all its threads (actors,
                   learner, EnvPool's workers, XLA's pools), sampled every 50 ms. Next to the cores the machine
                   has (cpu_cores_available in the JSON) it says whether a phase is compute-bound: a ceiling
                   that keeps every core busy leaves no room for a policy on the same cores.
    host MiB       peak resident memory of the phase's process (with its JAX, EnvPool and, for sync and
                   concurrent, the whole training run).
    device MiB     the largest peak_bytes_in_use of the local devices (memory_stats(); GPUs). n/a on CPU.
Ratio lines:
    concurrent / sync      what overlapping buys.
    overlap efficiency     concurrent SPS / min(actor SPS, learner SPS): 1 means the overlap is perfect and
                           the run goes as fast as its slower side alone allows.
    sync efficiency        sync SPS / (1 / (1 / actor SPS + 1 / learner SPS)): the same for alternating sides.
    concurrent / serial bound
                           concurrent SPS over that same serial bound. Where the actor and the learner share
                           the same compute (one CPU, one GPU for both), the slower side alone is out of reach:
                           the other side's work takes cores from it. Then this ratio says what the overlap
                           gains over taking turns: at most 1 + (faster side's time per iteration / slower side's).
    ours / reference       concurrent SPS (sync SPS without a concurrent phase) over the reference's.
"""
