#!/bin/bash
seed=$1; out=/work/cleanrl/out; cd $out
start=$(date +%s.%N)
/work/main/.venv/bin/python /work/main/cleanba/cleanba_pqn.py --env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 \
  --end-e 0.05 --exploration-fraction 0.5 --total-timesteps 500000 --seed $seed --run-name cleanba_concurrency-$seed --log-frequency 1 --concurrency > cleanba_concurrency-$seed.log 2>&1
end=$(date +%s.%N)
echo "cleanba_concurrency $seed start $start end $end" >> times.txt
