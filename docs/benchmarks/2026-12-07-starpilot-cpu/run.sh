#!/bin/bash
# usage: run.sh STEPS: IMPALA and PPO on StarpilotEasy-v0's first 200 levels, each tested every ~65k steps on 100 games
# of the whole distribution, in turns (../take-turns.sh), until each has logged STEPS env steps.
source "$(dirname "$0")/../take-turns.sh"
protocol="--env-id StarpilotEasy-v0 --env-kwargs num_levels=200 start_level=0 --test-env-kwargs num_levels=0
  --eval-episodes 100 --total-timesteps 25000000 --seed 1"
# IMPALA at its defaults (128 envs of 20 steps): a test every 25 iterations, 64,000 steps. PPO at CleanRL's
# ppo_procgen.py settings (64 envs of 256 steps, lr 5e-4, gamma 0.999, 8 minibatches, 3 epochs, clip 0.2): a test
# every 4 iterations, 65,536 steps, and a step line each iteration (16,384 steps) for the turns.
take_turns "$1" \
  impala-1 "cleanba/cleanba_impala.py --test-frequency 25 --checkpoint-frequency 25 $protocol" \
  ppo-1 "cleanba/cleanba_ppo.py --local-num-envs 64 --num-actor-threads 1 --num-steps 256 --learning-rate 5e-4
    --gamma 0.999 --num-minibatches 8 --update-epochs 3 --clip-coef 0.2 --test-frequency 4 --checkpoint-frequency 4
    --log-frequency 1
    $protocol"
