#!/bin/bash
# One pair: CleanRL's sac_continuous_action.py and cleanba_sac.py, HalfCheetah-v4, 12k steps each (5k random), in turn,
# the background runs paused meanwhile.
cd /work/sac-bench; tag=$1
pids=$(pgrep -f "cleanba_(sac|pqn).py --env-id (HalfCheetah|MiniGrid)" | tr '\n' ' ')
kill -STOP $pids
trap "kill -CONT $pids" EXIT
rm -rf crl-$tag cleanba-$tag; mkdir crl-$tag cleanba-$tag
(cd crl-$tag && PYTHONPATH=/work/cleanrl-src /usr/bin/time -v /work/cleanrl-venv/bin/python /work/cleanrl-src/sac_continuous_action.py --env-id HalfCheetah-v4 --total-timesteps 12000 --seed 1 > out.log 2> time.log)
(cd cleanba-$tag && /usr/bin/time -v /work/main/.venv/bin/python /work/main/cleanba/cleanba_sac.py --env-id HalfCheetah-v4 --total-timesteps 12000 --seed 1 --log-frequency 10 --run-name hc > out.log 2> time.log)
