#!/usr/bin/env bash
# This session's GPU call, prepared and run once on the CPU first (small sizes):
#   bash docs/benchmarks/2026-11-27-h100/run.sh OUTDIR [SCRIPT FLAGS]
# The policy probe, then both scripts before and after the CUDA-graph policy (before: the same scripts with the
# policy's compiler options removed), actor alone and each script's default training mode, interleaved; last,
# the EnvPool ceiling and the learner alone (the change does not touch them). One JSON per run in OUTDIR.
set -u
out=${1:?OUTDIR}
shift
here=$(dirname "$0")
mkdir -p "$out" /tmp/before
read -ra bench <<<"${BENCH_FLAGS:---warmup-iterations 2 --iterations 4 --repeats 2}"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  date -u
  nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python -c 'import sys, jax, jaxlib, envpool; print(sys.version.split()[0], "jax", jax.__version__, "jaxlib",
    jaxlib.__version__, "envpool", envpool.__version__, jax.devices())'
} 2>&1 | tee "$out/machine.txt"
quiet() { grep -v "cudart_stub\|^WARNING: All log"; }
timeout 120 python "$here/policy_probe.py" -- "$@" 2>&1 | quiet | tee "$out/policy_probe.txt"
for algo in impala ppo; do
  sed 's/compiler_options=one_graph/compiler_options=None/' "cleanba/cleanba_$algo.py" >"/tmp/before/cleanba_$algo.py"
done
grep -c "compiler_options=None" /tmp/before/*.py
run() {
  local name=$1
  shift
  echo "== $name"
  python -m cleanba.benchmark "${bench[@]}" --json "$out/$name.json" "$@" 2>&1 | quiet
}
{
  run impala-before --script /tmp/before/cleanba_impala.py --phases actor concurrent -- --env-id Breakout-v5 "$@"
  run impala-after --script impala --phases actor concurrent -- --env-id Breakout-v5 "$@"
  run ppo-before --script /tmp/before/cleanba_ppo.py --phases actor sync -- --env-id Breakout-v5 "$@"
  run ppo-after --script ppo --phases actor sync -- --env-id Breakout-v5 "$@"
  run impala --script impala --phases ceiling learner -- --env-id Breakout-v5 "$@"
  run ppo --script ppo --phases ceiling learner -- --env-id Breakout-v5 "$@"
} | tee "$out/console.txt"
