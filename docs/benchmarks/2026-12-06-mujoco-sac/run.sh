#!/bin/bash
# usage: run.sh STEPS: the nine runs at the defaults (3 tasks x seeds 1-3), from the repository's root with its
# environment active, until each has logged STEPS env steps; then SIGTERM, which checkpoints them. They take turns:
# every 20 s the run with the fewest steps continues and the others wait (SIGSTOP). On a 2-core CPU one run alone
# trains faster than two or nine at once together (on the Zen 3 of the report: 178 steps/s against about 140 in all).
# Run again with a larger STEPS, the runs resume from their checkpoints.
target=$1
mkdir -p logs
declare -A pid
for seed in 1 2 3; do
  for env_id in HalfCheetah-v4 Hopper-v4 Walker2d-v4; do
    name=${env_id}__cleanba_sac__$seed
    resume=""; [ -f runs/$name/checkpoint.msgpack ] && resume="--resume"
    python cleanba/cleanba_sac.py --env-id $env_id --seed $seed --run-name $name --checkpoint-frequency 1000 \
      $resume >> logs/$name.log 2>&1 &
    pid[$name]=$!
  done
done
steps() { grep -o "^step [0-9,]*" logs/$1.log | tail -1 | tr -dc '0-9'; }
while true; do
  fewest=""
  for name in "${!pid[@]}"; do
    s=$(steps $name); s=${s:-0}
    if [ -z "$fewest" ] || [ "$s" -lt "$(steps $fewest || echo 0)" ]; then fewest=$name; fi
  done
  [ "$(steps $fewest)" -ge "$target" ] 2>/dev/null && break
  for name in "${!pid[@]}"; do [ $name != $fewest ] && kill -STOP ${pid[$name]}; done
  kill -CONT ${pid[$fewest]}
  echo "$(date +%T) $fewest $(steps $fewest)"
  sleep 20
done
kill -TERM "${pid[@]}"; kill -CONT "${pid[@]}"
wait
