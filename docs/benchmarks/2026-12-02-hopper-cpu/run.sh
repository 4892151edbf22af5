#!/usr/bin/env bash
# The continuous script's throughput on Hopper-v4, a0-l0: at its defaults (2 actor threads x 4 envs), then with 32
# envs per actor thread; one run after the other, nothing else running.
set -u
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/bench
python -m cleanba.benchmark --script ppo_continuous --json /tmp/bench/hopper-a0-l0.json \
  -- --env-id Hopper-v4 --actor-device-ids 0 --learner-device-ids 0
python -m cleanba.benchmark --script ppo_continuous --json /tmp/bench/hopper-a0-l0-32envs.json \
  -- --env-id Hopper-v4 --actor-device-ids 0 --learner-device-ids 0 --local-num-envs 32
