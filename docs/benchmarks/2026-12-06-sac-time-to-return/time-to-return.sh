#!/bin/bash
# usage: time-to-return.sh NAME [FLAGS...]: cleanba_sac.py on HalfCheetah-v4, seed 1, alone; stops once the 20-game
# mean return reaches CleanRL's 1M-step 9,634.89 and prints the seconds from launch. Run from the repository's root
# with its environment active (poetry shell), or prefix python with poetry run.
name=$1; shift
start=$(date +%s.%N)
python cleanba/cleanba_sac.py --env-id HalfCheetah-v4 --seed 1 --total-timesteps 1000000 \
  --log-frequency 10 --run-name $name "$@" > $name.log 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
  line=$(grep "return" $name.log | tail -1)
  ret=$(echo "$line" | sed -n 's/.*| return \([-0-9.]*\) |.*/\1/p')
  if [ -n "$ret" ] && awk -v r="$ret" 'BEGIN { exit !(r >= 9634.89) }'; then
    now=$(date +%s.%N)
    echo "crossed: $line"
    echo "seconds from launch: $(echo "$now - $start" | bc)"
    kill -TERM $pid; wait $pid
    break
  fi
  sleep 2
done
