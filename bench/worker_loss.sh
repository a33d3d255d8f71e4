#!/usr/bin/env bash
# Losing a worker (cluster.on_worker_failure: continue): what the commit round trip costs, and what
# a job that goes on without a killed worker ends with. Runs the same job REPEATS times each with
# on_worker_failure abort (push and pull pipelined) and continue (pulls once every push is
# acknowledged), alternating so that the machine's noise hits both, then once more with continue
# and worker W-1 killed with SIGKILL after KILL_AT steps, and once with it killed and replaced
# (deploy/launch.sh --max-restarts 1 starts a replacement with --rejoin). Prints each run's training
# time (summary.json train_s), steps and final accuracy, and the continue/abort ratio of the
# medians.
#
#   bench/worker_loss.sh [--repeats N] [--kill-at STEPS] -- LAUNCH_ARGS...
#   bench/worker_loss.sh --repeats 3 --kill-at 800 -- --config configs/quickstart.yaml
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
repeats=3 kill_at=800
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repeats) repeats="$2"; shift 2 ;;
    --kill-at) kill_at="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "worker_loss.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
out="$(mktemp -d /tmp/sparseps-worker-loss-XXXXXX)"
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

declare -A times=()
for r in $(seq "$repeats"); do
  for mode in abort continue; do
    dir="$out/$mode-$r"
    "$here/deploy/launch.sh" --quiet --run-dir "$dir" "$@" \
      --set "cluster.on_worker_failure=$mode" >"$dir.out" 2>&1 || { cat "$dir.out"; exit 1; }
    t="$(field "$dir/summary.json" train_s)"
    times[$mode]+="$t "
    printf '%-8s run %d: train_s %.2f, %s steps, accuracy %.4f\n' "$mode" "$r" "$t" \
      "$(field "$dir/summary.json" steps)" "$(field "$dir/summary.json" final_test_accuracy)"
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
ma="$(echo "${times[abort]}" | median)" mc="$(echo "${times[continue]}" | median)"
printf 'median train_s: abort %.2f, continue %.2f, continue / abort = %.3f\n' "$ma" "$mc" \
  "$(awk -v a="$ma" -v c="$mc" 'BEGIN { print c / a }')"

# The killed run, then the killed-and-replaced one.
workers="$("$here/build/scheduler/sparseps-scheduler" "${@:1}" --get cluster.num_workers 2>/dev/null |
  tail -n 1)"
victim=$((${workers:-2} - 1))
for run in killed replaced; do
  dir="$out/$run"
  extra=()
  [[ $run == replaced ]] && extra=(--max-restarts 1)
  "$here/deploy/launch.sh" --quiet --run-dir "$dir" "${extra[@]}" "$@" \
    --set cluster.on_worker_failure=continue >"$dir.out" 2>&1 &
  launcher=$!
  csv="$dir/metrics-worker-$victim.csv"
  while kill -0 "$launcher" 2>/dev/null; do
    [[ -f "$csv" && $(wc -l <"$csv") -gt $kill_at ]] && break
    sleep 0.05
  done
  pid="$(grep -o 'starting (pid [0-9]*' "$dir/worker-$victim.log" | head -n 1 | grep -o '[0-9]*$')"
  kill -9 "$pid"
  killed_at=$(($(wc -l <"$csv") - 1))
  wait "$launcher"
  echo "$run run: killed worker $victim at its step $killed_at: launcher exit $?"
  grep -h "removed; its push\|joined: it pushes" "$dir/scheduler.log" | sed 's/^.*\] //'
  printf '%s run: train_s %.2f, %s steps of worker 0, accuracy %.4f\n' "$run" \
    "$(field "$dir/summary.json" train_s)" "$(field "$dir/summary.json" steps)" \
    "$(field "$dir/summary.json" final_test_accuracy)"
done
echo "runs in $out"
