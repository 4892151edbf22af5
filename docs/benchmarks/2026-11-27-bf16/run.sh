#!/usr/bin/env bash
# This session's GPU call, prepared and run once on the CPU first (small sizes):
#   bash docs/benchmarks/2026-11-27-bf16/run.sh OUTDIR [SCRIPT FLAGS]
# Most wanted first, as the machine's time may end the call: the learner alone with float32 and with bfloat16
# convolutions (--conv-dtype), for PPO then IMPALA; PPO's default training (sync) both ways; the actor alone before
# and after the one-array policy step (before: the same scripts with actions and log-probs returned and copied as
# two arrays); IMPALA's actor alone with 4 and 8 threads of the same 128 envs. One JSON per run in OUTDIR.
set -u
out=${1:?OUTDIR}
shift
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
for algo in impala ppo; do
  python - "cleanba/cleanba_$algo.py" "/tmp/before/cleanba_$algo.py" <<'PY'
import sys
s = open(sys.argv[1]).read()
for old, new in [
    ("return jnp.stack([actions.astype(jnp.float32), logprobs], axis=1)", "return actions, logprobs"),
    ("sampled = np.asarray(sampled)\n                actions, logprobs = sampled[:, 0].astype(np.int32), sampled[:, 1]",
     "actions, logprobs = jax.device_get(sampled)"),
]:
    assert s.count(old) == 1, old
    s = s.replace(old, new)
open(sys.argv[2], "w").write(s)
PY
done
run() {
  local name=$1
  shift
  echo "== $name $(date -u +%T)"
  python -m cleanba.benchmark "${bench[@]}" --json "$out/$name.json" "$@" 2>&1 | quiet
}
{
  run ppo-learner-f32 --script ppo --phases learner -- --env-id Breakout-v5 "$@"
  run ppo-learner-bf16 --script ppo --phases learner -- --env-id Breakout-v5 --conv-dtype bfloat16 "$@"
  run impala-learner-f32 --script impala --phases learner -- --env-id Breakout-v5 "$@"
  run impala-learner-bf16 --script impala --phases learner -- --env-id Breakout-v5 --conv-dtype bfloat16 "$@"
  run ppo-sync-bf16 --script ppo --phases sync -- --env-id Breakout-v5 --conv-dtype bfloat16 "$@"
  run ppo-sync-f32 --script ppo --phases sync -- --env-id Breakout-v5 "$@"
  run impala-actor-before --script /tmp/before/cleanba_impala.py --phases actor -- --env-id Breakout-v5 "$@"
  run impala-actor-after --script impala --phases actor -- --env-id Breakout-v5 "$@"
  read -r envs4 envs8 <<<"${THREAD_ENVS:-32 16}"  # per thread: 128 envs in all at the defaults
  run impala-actor-4threads --script impala --phases actor -- --env-id Breakout-v5 "$@" --num-actor-threads 4 \
    --local-num-envs "$envs4"
  run impala-actor-8threads --script impala --phases actor -- --env-id Breakout-v5 "$@" --num-actor-threads 8 \
    --local-num-envs "$envs8"
  run ppo-actor-before --script /tmp/before/cleanba_ppo.py --phases actor -- --env-id Breakout-v5 "$@"
  run ppo-actor-after --script ppo --phases actor -- --env-id Breakout-v5 "$@"
  echo "== end $(date -u +%T)"
} | tee "$out/console.txt"
