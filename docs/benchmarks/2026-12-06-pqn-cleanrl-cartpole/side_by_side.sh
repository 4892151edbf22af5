#!/bin/bash
# One seed each, alone on the machine: CleanRL's pqn.py (its own venv, its defaults) and cleanba_pqn.py at the same
# settings; the launch time is recorded so that the time to a 20-game mean of 450 counts imports and compiles.
set -e
seed=$1; out=/work/cleanrl/out; mkdir -p $out; cd $out
start=$(date +%s.%N)
/work/cleanrl-venv/bin/python /work/cleanrl/pqn.py --seed $seed --no-cuda > cleanrl-$seed.log 2>&1
end=$(date +%s.%N)
echo "cleanrl $seed start $start end $end" >> times.txt
start=$(date +%s.%N)
/work/main/.venv/bin/python /work/main/cleanba/cleanba_pqn.py --env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 \
  --end-e 0.05 --exploration-fraction 0.5 --total-timesteps 500000 --seed $seed --run-name cleanba-$seed --log-frequency 1 > cleanba-$seed.log 2>&1
end=$(date +%s.%N)
echo "cleanba $seed start $start end $end" >> times.txt
