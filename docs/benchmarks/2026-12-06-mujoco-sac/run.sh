#!/bin/bash
# usage: run.sh STEPS: the nine runs at the defaults (3 tasks x seeds 1-3), in turns (../take-turns.sh), until each
# has logged STEPS env steps. On a 2-core CPU one run alone trains faster than two or nine at once together (on the
# Zen 3 of the report: 178 steps/s against about 140 in all).
source "$(dirname "$0")/../take-turns.sh"
runs=()
for seed in 1 2 3; do
  for env_id in HalfCheetah-v4 Hopper-v4 Walker2d-v4; do
    runs+=("${env_id}__cleanba_sac__$seed" "cleanba/cleanba_sac.py --env-id $env_id --seed $seed --checkpoint-frequency 1000")
  done
done
take_turns "$1" "${runs[@]}"
