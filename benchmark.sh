#!/usr/bin/env bash
# Four modes. Run from the checkout, inside the project's environment so that `python` is the project's.
#
# bash benchmark.sh throughput [BENCHMARK FLAGS --] [SCRIPT FLAGS]
#   Throughput of PPO, IMPALA and PQN on Breakout-v5 on this machine (python -m cleanba.benchmark; what each
#   figure means is in cleanba/benchmark/__init__.py): the EnvPool ceiling, actor alone, learner alone, training with
#   concurrency off and on. SCRIPT FLAGS go to every training script (e.g. the layout: --actor-device-ids 0
#   --learner-device-ids 1 2 3); flags before a `--` go to the benchmark (e.g. --repeats 5). Writes
#   benchmark-cleanba_{ppo,impala,pqn}-Breakout-v5.json here.
#     poetry run bash benchmark.sh throughput --repeats 5 -- --actor-device-ids 0 --learner-device-ids 0
#
# bash benchmark.sh machine OUTDIR [SCRIPT FLAGS]
#   One report of this machine, for docs/gpu.md (made to run once on a lent GPU, in a few minutes): `throughput`
#   for both scripts, then the actor with more threads over the same envs (THREADS, default "4 8"; local envs =
#   NUM_ENVS / threads, NUM_ENVS default 128): ceiling, actor and training (IMPALA concurrent, its default; PPO
#   its actor only). One JSON per run and the console log in OUTDIR. BENCH_FLAGS sets the benchmark's flags.
#     bash benchmark.sh machine report                        # a GPU machine, default sizes
#
# bash benchmark.sh learning OUTDIR [SCRIPT FLAGS]
#   Time to score on this machine: one run of SCRIPT (impala by default, or ppo) on ENV_ID (Breakout-v5) at its
#   defaults for STEPS env steps (5,000,000; the learning rate anneals over them), seed 1, the model saved and
#   evaluated. SIGTERMed after LIMIT seconds (540) if still running: it then checkpoints, flushes its logs and
#   exits, so a time-boxed machine (a lent GPU) still returns its curve. OUTDIR gets machine.txt, train.log, the
#   run directory (runs/learning: event files, checkpoint, model) and score_report's table (report/).
#     bash benchmark.sh learning run-f32                             # IMPALA at defaults
#     bash benchmark.sh learning run-bf16 --conv-dtype bfloat16      # the same run with bfloat16 convolutions
#     SCRIPT=ppo STEPS=3000000 bash benchmark.sh learning run-ppo --concurrency
#
# bash benchmark.sh [LAUNCHER FLAGS]
#   The Cleanba paper's Atari-57 experiments (arXiv 2310.00036, section 5): PPO and IMPALA, 3 seeds, on
#   - 1 GPU + 10 CPU cores, actor and learner sharing the GPU (a0-l0-d1), and
#   - 8 GPUs as 2 processes of 4 GPUs, actor on the first, learner on the other three (a0-l1,2,3-d2),
#   submitted as SLURM job arrays (one task per game and seed) through `python -m cleanba.launch_slurm`, from a
#   login node:   poetry run bash benchmark.sh --partition gpu --account my-account
#   The arguments go to every launcher call; --dry-run prints the scripts instead of submitting them.
set -euo pipefail
cd "$(dirname "$0")"

if [[ "${1:-}" == throughput ]]; then
  shift
  bench_flags=() script_flags=("$@")
  for i in "${!script_flags[@]}"; do  # split at the first --, if any
    if [[ "${script_flags[i]}" == -- ]]; then
      bench_flags=("${script_flags[@]:0:i}") script_flags=("${script_flags[@]:i+1}")
      break
    fi
  done
  for algo in ppo impala pqn; do
    python -m cleanba.benchmark --script "$algo" "${bench_flags[@]}" -- --env-id Breakout-v5 "${script_flags[@]}"
  done
  exit 0
fi

if [[ "${1:-}" == machine ]]; then
  out=${2:?bash benchmark.sh machine OUTDIR [SCRIPT FLAGS]}
  shift 2
  mkdir -p "$out"
  read -ra bench <<<"${BENCH_FLAGS:---warmup-iterations 2 --iterations 4 --repeats 2}"
  num_envs=${NUM_ENVS:-128}
  {
    date -u
    nproc
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python -c 'import sys, jax, jaxlib, envpool; print(sys.version.split()[0], "jax", jax.__version__, "jaxlib",
      jaxlib.__version__, "envpool", envpool.__version__, jax.devices())'
  } | tee "$out/machine.txt"
  for algo in impala ppo; do
    python -m cleanba.benchmark --script "$algo" "${bench[@]}" --json "$out/$algo.json" -- --env-id Breakout-v5 "$@"
  done
  for threads in ${THREADS:-4 8}; do
    sweep=(--env-id Breakout-v5 "$@" --num-actor-threads "$threads" --local-num-envs $((num_envs / threads)))
    python -m cleanba.benchmark --script impala "${bench[@]}" --phases ceiling actor concurrent \
      --json "$out/impala-t$threads.json" -- "${sweep[@]}"
    python -m cleanba.benchmark --script ppo "${bench[@]}" --phases actor --json "$out/ppo-t$threads.json" \
      -- "${sweep[@]}"
  done
  exit 0
fi

if [[ "${1:-}" == learning ]]; then
  out=${2:?bash benchmark.sh learning OUTDIR [SCRIPT FLAGS]}
  shift 2
  mkdir -p "$out"
  out=$(cd "$out" && pwd) script=$PWD/cleanba/cleanba_${SCRIPT:-impala}.py
  {
    date -u
    nproc
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  } | tee "$out/machine.txt"
  status=0
  (cd "$out" && timeout --signal=TERM --kill-after=60 "${LIMIT:-540}" python "$script" --env-id "${ENV_ID:-Breakout-v5}" \
    --seed 1 --total-timesteps "${STEPS:-5000000}" --run-name learning --checkpoint-frequency 100 --save-model "$@") \
    2>&1 | tee "$out/train.log" || status=$?
  echo "training exit status $status" | tee -a "$out/train.log"
  # Where score_report's libraries are missing (pandas, rliable on a bare GPU machine), score the run elsewhere.
  python -m cleanba.score_report "$out/runs" --out-dir "$out/report" 2>&1 | tee "$out/report.log" ||
    echo "score_report failed: score $out/runs on another machine (python -m cleanba.score_report)"
  exit 0
fi

ATARI57=(Alien-v5 Amidar-v5 Assault-v5 Asterix-v5 Asteroids-v5 Atlantis-v5 BankHeist-v5 BattleZone-v5
  BeamRider-v5 Berzerk-v5 Bowling-v5 Boxing-v5 Breakout-v5 Centipede-v5 ChopperCommand-v5 CrazyClimber-v5
  Defender-v5 DemonAttack-v5 DoubleDunk-v5 Enduro-v5 FishingDerby-v5 Freeway-v5 Frostbite-v5 Gopher-v5
  Gravitar-v5 Hero-v5 IceHockey-v5 Jamesbond-v5 Kangaroo-v5 Krull-v5 KungFuMaster-v5 MontezumaRevenge-v5
  MsPacman-v5 NameThisGame-v5 Phoenix-v5 Pitfall-v5 Pong-v5 PrivateEye-v5 Qbert-v5 Riverraid-v5
  RoadRunner-v5 Robotank-v5 Seaquest-v5 Skiing-v5 Solaris-v5 SpaceInvaders-v5 StarGunner-v5 Surround-v5
  Tennis-v5 TimePilot-v5 Tutankham-v5 UpNDown-v5 Venture-v5 VideoPinball-v5 WizardOfWor-v5 YarsRevenge-v5
  Zaxxon-v5)
SEEDS=(1 2 3)

for algo in ppo impala; do
  python -m cleanba.launch_slurm --job-name "$algo-a0-l0-d1" --env-ids "${ATARI57[@]}" --seeds "${SEEDS[@]}" \
    --nodes 1 --ntasks-per-node 1 --gpus-per-task 1 --cpus-per-task 10 "$@" \
    --command "python cleanba/cleanba_$algo.py --distributed --exp-name $algo-a0-l0-d1 --actor-device-ids 0 --learner-device-ids 0 --track --save-model"
  python -m cleanba.launch_slurm --job-name "$algo-a0-l123-d2" --env-ids "${ATARI57[@]}" --seeds "${SEEDS[@]}" \
    --nodes 1 --ntasks-per-node 2 --gpus-per-task 4 --cpus-per-task 10 "$@" \
    --command "python cleanba/cleanba_$algo.py --distributed --exp-name $algo-a0-l123-d2 --actor-device-ids 0 --learner-device-ids 1 2 3 --track --save-model"
done
