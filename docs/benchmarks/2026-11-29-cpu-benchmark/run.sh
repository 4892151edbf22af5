#!/usr/bin/env bash
# performance.md's table: 4 runs, one after the other.
set -u
cd "$(dirname "$0")/../../.."
small="--num-minibatches 2 --channels 4 4 4 --hidden-dim 32"
for algo in ppo impala; do
  for net in default small; do
    extra=""; [[ $net == small ]] && extra=$small
    echo "=== $algo $net $(date -u)"
    python -m cleanba.benchmark --script $algo --iterations 3 --repeats 2 --warmup-iterations 1 \
      -- --env-id Breakout-v5 --num-actor-threads 1 --local-num-envs 8 --num-steps 32 $extra
  done
done
echo "=== done $(date -u)"
