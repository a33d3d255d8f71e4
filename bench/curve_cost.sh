#!/usr/bin/env bash
# What CURVE costs: the same job with security.curve off and on (one keypair made with
# sparseps-keygen for every process, authorized for all), REPEATS times each, alternating so that
# the machine's noise hits both. Prints each run's training time (summary.json train_s) and
# accuracy, and the ratio of the medians (on / off).
#
#   bench/curve_cost.sh [--repeats N] -- LAUNCH_ARGS...
#   bench/curve_cost.sh --repeats 3 -- --config configs/quickstart.yaml
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
repeats=3 build="$here/build"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repeats) repeats="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "curve_cost.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
out="$(mktemp -d /tmp/sparseps-curve-XXXXXX)"
"$build/security/sparseps-keygen" "$out/keys" >/dev/null 2>&1 || exit 1
mkdir -p "$out/authorized" && cp "$out/keys/public.key" "$out/authorized/node.key"
curve=(--set security.curve=true --set "security.key_dir=$out/keys"
       --set "security.authorized_keys_dir=$out/authorized"
       --set "security.scheduler_public_key=$out/authorized/node.key")
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
declare -A times=()
for r in $(seq "$repeats"); do
  for mode in off on; do
    dir="$out/$mode-$r"
    extra=()
    [[ $mode == on ]] && extra=("${curve[@]}")
    "$here/deploy/launch.sh" --quiet --run-dir "$dir" "$@" "${extra[@]}" >"$dir.out" 2>&1 ||
      { cat "$dir.out"; exit 1; }
    t="$(field "$dir/summary.json" train_s)"
    times[$mode]+="$t "
    printf 'curve %-3s run %d: train_s %.2f, accuracy %.4f\n' "$mode" "$r" "$t" \
      "$(field "$dir/summary.json" final_test_accuracy)"
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
off="$(echo "${times[off]}" | median)" on="$(echo "${times[on]}" | median)"
python3 -c "import sys; print(f'median train_s: off {float(sys.argv[1]):.2f} s, on {float(sys.argv[2]):.2f} s, on/off {float(sys.argv[2]) / float(sys.argv[1]):.3f}')" "$off" "$on"
echo "runs in $out"
