#!/usr/bin/env bash
# This session's GPU call: the lock's JAX for Python 3.12 (jax 0.12.0.1, its CUDA 13 plugin of the same version,
# flax 0.12.12, optax 0.2.8, chex 0.1.92) against the machine's own (jax 0.11.2), side by side in one call:
#   NEWEST=DIR bash docs/benchmarks/2026-11-28-jax012/run.sh OUTDIR [SCRIPT FLAGS]
# DIR holds those wheels unpacked (it comes first on PYTHONPATH); the machine has no network, so they travel with the
# call. Most wanted first, as the machine's time may end the call: each script's learner alone at its defaults on
# a0-l0 (Breakout) on the newest stack, then on the machine's; then each script's own training on the newest stack,
# and two --exact runs of IMPALA compared bit for bit. One JSON or log per run in OUTDIR.
set -u
out=${1:?OUTDIR}
shift
newest=${NEWEST:?the folder of the unpacked jax 0.12.0.1 wheels}
py=${PYTHON:-python3}
kit=$PWD/.gpukit/site
read -ra bench <<<"${BENCH_FLAGS:---warmup-iterations 1 --iterations 2 --repeats 2}"
read -ra ppo_run <<<"${PPO_RUN:---total-timesteps 49152}"         # 3 iterations of 16,384 steps
read -ra impala_run <<<"${IMPALA_RUN:---total-timesteps 25600}"   # 10 iterations of 2,560 steps
read -ra exact_run <<<"${EXACT_RUN:---exact --total-timesteps 12800}"
mkdir -p "$out"
machine() { PYTHONPATH=$kit:$PWD "$py" "$@"; }
newest() { PYTHONPATH=$newest:$kit:$PWD "$py" "$@"; }
quiet() { grep -v "cudart_stub\|^WARNING: All log\|^$"; }
versions='import sys, jax, jaxlib, flax, optax, envpool; import jax_plugins.xla_cuda13 as p
print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "envpool", envpool.__version__, "plugin", p.__file__, jax.devices())'
{
  date -u
  nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  echo "machine: $(machine -c "$versions" 2>&1 | tail -1)"
  echo "newest:  $(newest -c "$versions" 2>&1 | tail -1)"
} 2>&1 | tee "$out/machine.txt"
learner() {  # learner STACK SCRIPT [SCRIPT FLAGS]
  local stack=$1 script=$2
  shift 2
  echo "== $script learner, $stack stack $(date -u +%T)"
  "$stack" -m cleanba.benchmark "${bench[@]}" --json "$out/$script-learner-$stack.json" --script "$script" \
    --phases learner -- --env-id Breakout-v5 "$@" 2>&1 | quiet
}
{
  learner newest ppo "$@"
  learner machine ppo "$@"
  learner newest impala "$@"
  learner machine impala "$@"
  echo "== ppo training, newest stack $(date -u +%T)"
  newest cleanba/cleanba_ppo.py --env-id Breakout-v5 "${ppo_run[@]}" "$@" 2>&1 | quiet
  echo "== impala training, newest stack $(date -u +%T)"
  newest cleanba/cleanba_impala.py --env-id Breakout-v5 "${impala_run[@]}" "$@" 2>&1 | quiet
  for run in 1 2; do
    echo "== impala --exact, newest stack, run $run $(date -u +%T)"
    newest cleanba/cleanba_impala.py --env-id Breakout-v5 "${exact_run[@]}" "$@" 2>&1 | quiet | grep -v "^step "
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$out/console.txt"
