#!/bin/bash
# Sourced by a report's run.sh. `take_turns STEPS NAME FLAGS [NAME FLAGS ...]`, from the repository's root with its
# environment active, starts `python FLAGS --run-name NAME` for each pair (FLAGS: a script and its flags), resumed
# from runs/NAME/checkpoint.msgpack where there is one, its output appended to logs/NAME.log. On a 2-core CPU one run
# alone trains faster than several at once, so they take turns: every 20 s the run that has logged the fewest steps
# goes on and the others wait (SIGSTOP). Once each has logged STEPS env steps they all get SIGTERM, which checkpoints
# them; run again with a larger STEPS and they go on from there. A file `pause` in the working directory stops them
# all until it is removed; a file `stop` ends them as STEPS does; a run that exits ends the others (status 1).
take_turns() {
  local target=$1 name flags resume fewest status=0
  local -A pid
  shift
  mkdir -p logs
  while (($# >= 2)); do
    name=$1 flags=$2
    shift 2
    resume=""
    [ -f "runs/$name/checkpoint.msgpack" ] && resume="--resume"
    python $flags --run-name "$name" $resume >>"logs/$name.log" 2>&1 &
    pid[$name]=$!
  done
  steps() { local s; s=$(grep -o "^step [0-9,]*" "logs/$1.log" | tail -1 | tr -dc '0-9'); echo "${s:-0}"; }
  while [ ! -e stop ]; do
    for name in "${!pid[@]}"; do
      kill -0 "${pid[$name]}" 2>/dev/null || { echo "$name exited: logs/$name.log" >&2; status=1; break 2; }
    done
    if [ -e pause ]; then
      kill -STOP "${pid[@]}" 2>/dev/null
      sleep 5
      continue
    fi
    fewest=""
    for name in "${!pid[@]}"; do
      if [ -z "$fewest" ] || [ "$(steps "$name")" -lt "$(steps "$fewest")" ]; then fewest=$name; fi
    done
    [ "$(steps "$fewest")" -ge "$target" ] && break
    for name in "${!pid[@]}"; do [ "$name" != "$fewest" ] && kill -STOP "${pid[$name]}" 2>/dev/null; done
    kill -CONT "${pid[$fewest]}" 2>/dev/null
    echo "$(date +%T) $fewest $(steps "$fewest")"
    sleep 20
  done
  kill -TERM "${pid[@]}" 2>/dev/null
  kill -CONT "${pid[@]}" 2>/dev/null
  wait
  return $status
}
