#!/usr/bin/env bash
# Soak: a job trains for DURATION seconds (deploy/launch.sh, stopped with SIGTERM at the end) while
# each daemon's resident set (VmRSS) and open file descriptors are sampled every INTERVAL seconds
# from /proc, by the pid each logged at its start; the servers write what they hold and turned
# away every 10 s themselves (run dir's queues-server-S.csv: waiting pulls and candidate requests,
# stored pushes, rejected messages). Writes OUT/soak.csv (time_s, process, rss_bytes, fds), plots
# OUT/soak.png (bench/soak_plot.py) and prints per process the RSS growth after warm-up (the first
# WARMUP seconds) and the largest queue depths.
#
#   bench/soak.sh [--duration S] [--interval S] [--warmup S] [--out DIR] -- LAUNCH_ARGS...
#   bench/soak.sh --duration 1800 -- --config configs/quickstart.yaml --set train.epochs=100000
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
duration=1800 interval=10 warmup=300 out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --duration) duration="$2"; shift 2 ;;
    --interval) interval="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || out="$(mktemp -d /tmp/sparseps-soak-XXXXXX)"
mkdir -p "$out"
run="$out/run"
"$here/deploy/launch.sh" --quiet --run-dir "$run" "$@" >"$out/launch.out" 2>&1 &
launcher=$!
echo "soak.sh: job in $run for ${duration} s, samples every ${interval} s into $out/soak.csv"
echo "time_s,process,rss_bytes,fds" >"$out/soak.csv"
start=$(date +%s)
declare -A pid_of=()
while (( $(date +%s) - start < duration )); do
  kill -0 "$launcher" 2>/dev/null || { echo "soak.sh: the job ended early:"; tail -20 "$out/launch.out"; break; }
  for log in "$run"/scheduler.log "$run"/server-*.log "$run"/worker-*.log; do
    [[ -f "$log" ]] || continue
    name="$(basename "$log" .log)"
    if [[ -z "${pid_of[$name]:-}" ]]; then
      p="$(grep -m1 -o 'starting (pid [0-9]*)' "$log" | grep -o '[0-9]*')"
      [[ -n "$p" ]] && pid_of[$name]="$p"
    fi
    p="${pid_of[$name]:-}"
    [[ -n "$p" && -r "/proc/$p/status" ]] || continue
    rss="$(awk '/^VmRSS:/ { print $2 * 1024 }' "/proc/$p/status")"
    fds="$(ls "/proc/$p/fd" 2>/dev/null | wc -l)"
    echo "$(( $(date +%s) - start )),$name,$rss,$fds" >>"$out/soak.csv"
  done
  sleep "$interval"
done
kill -TERM "$launcher" 2>/dev/null
wait "$launcher" 2>/dev/null
/usr/bin/python3 "$here/bench/soak_plot.py" "$out/soak.csv" "$run" "$warmup" "$out/soak.png"
