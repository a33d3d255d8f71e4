#!/usr/bin/env bash
# Chaos run: a job under `deploy/launch.sh --max-restarts`, a random process (scheduler, a server
# or a worker) killed with SIGKILL every MIN..MAX seconds until the job ends; then the same job
# without faults. The launcher replaces a killed worker (--rejoin: nothing redone) or server
# (--rejoin and a rollback to the newest checkpoint), and restarts the whole job after the
# scheduler. Prints kills, restarts, the iterations redone after each kill (steps done at the
# kill minus the iteration resumed from), the wall-clock times and both final accuracies.
#
#   bench/chaos.sh [--min S] [--max S] [--restarts N] -- LAUNCH_ARGS...
#   bench/chaos.sh --min 10 --max 20 -- --config configs/quickstart.yaml \
#     --set train.epochs=30 --set checkpoint.every_steps=200
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
min=20 max=60 restarts=50
while [[ $# -gt 0 ]]; do
  case "$1" in
    --min) min="$2"; shift 2 ;;
    --max) max="$2"; shift 2 ;;
    --restarts) restarts="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "chaos.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
out="$(mktemp -d /tmp/sparseps-chaos-XXXXXX)"
accuracy() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['final_test_accuracy'])" "$1"; }

start=$(date +%s.%N)
setsid "$here/deploy/launch.sh" --quiet --run-dir "$out/chaos" --max-restarts "$restarts" "$@" \
  >"$out/chaos.out" 2>&1 &
launcher=$!
kills=0
lost=()
while kill -0 "$launcher" 2>/dev/null; do
  # Wait MIN..MAX seconds, or until the job ends (so that its end is timed right).
  wait_s="$(awk -v a="$min" -v b="$max" -v s="$RANDOM" 'BEGIN { srand(s); printf "%d", 5 * (a + rand() * (b - a)) }')"
  for _ in $(seq "$wait_s"); do
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.2
  done
  kill -0 "$launcher" 2>/dev/null || break
  mapfile -t logs < <(cd "$out/chaos" && ls scheduler.log server-*.log worker-*.log 2>/dev/null)
  [[ ${#logs[@]} -gt 0 ]] || continue
  victim="${logs[RANDOM % ${#logs[@]}]}"
  pid="$(grep -o 'starting (pid [0-9]*' "$out/chaos/$victim" | tail -n 1 | grep -o '[0-9]*$')"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || continue
  done_steps=$(($(wc -l <"$out/chaos/metrics-worker-0.csv") - 1))
  resumes_before=$(grep -c "resumed from" "$out/chaos/worker-0.log")
  joins_before=$(grep -c "joined: it pushes" "$out/chaos/scheduler.log")
  kill -9 "$pid" && kills=$((kills + 1))
  echo "kill $kills: ${victim%.log} (pid $pid) at step $done_steps"
  # Wait for the job to go back to a checkpoint (a whole restart, or a rollback after a server's
  # replacement), or for a worker's replacement to join (nothing redone); then count.
  resumed=0
  for _ in $(seq 600); do
    [[ $(grep -c "resumed from" "$out/chaos/worker-0.log") -gt $resumes_before ]] && resumed=1 && break
    [[ $(grep -c "joined: it pushes" "$out/chaos/scheduler.log") -gt $joins_before ]] && break
    grep -q "from the start" "$out/chaos/restarts.log" 2>/dev/null && break
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.1
  done
  if [[ $resumed -eq 1 ]]; then
    at="$(grep -o 'resumed from .* at iteration [0-9]*' "$out/chaos/worker-0.log" | tail -n 1 | grep -o '[0-9]*$')"
    lost+=($((done_steps - at)))
    echo "  resumed at iteration $at: $((done_steps - at)) iterations redone"
  elif [[ $(grep -c "joined: it pushes" "$out/chaos/scheduler.log") -gt $joins_before ]]; then
    lost+=(0)
    echo "  a replacement joined: nothing redone"
  fi
done
wait "$launcher"
rc=$?
chaos_s=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')

start=$(date +%s.%N)
"$here/deploy/launch.sh" --quiet --run-dir "$out/clean" "$@" >"$out/clean.out" 2>&1
clean_s=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')

echo "chaos run: exit $rc, $kills kills, $(wc -l <"$out/chaos/restarts.log" 2>/dev/null || echo 0) restarts, ${chaos_s} s"
echo "iterations redone per kill: ${lost[*]:-none}"
echo "fault-free run: ${clean_s} s"
echo "final test accuracy: chaos $(accuracy "$out/chaos/summary.json"), fault-free $(accuracy "$out/clean/summary.json")"
cmp -s "$out/chaos/model.safetensors" "$out/clean/model.safetensors" &&
  echo "model.safetensors: identical" || echo "model.safetensors: differ"
echo "run directories: $out"
