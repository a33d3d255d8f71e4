#!/usr/bin/env bash
# The behaviour table of a redesign ("behaviour unchanged", issue 43): trains the quickstart
# (twice: bitwise repeatable), configs/sbc.yaml, sketch_second_round.yaml, cnn.yaml and the
# quickstart with allreduce by ring, gtopk, spardl and exdyna, and prints one line per job: its
# exit code, summary.json's final_test_accuracy and the first 16 hex digits of the SHA-256 of its
# model.safetensors (equal digits: bitwise the same parameters).
#
#   bench/behaviour.sh OUT [SRC [BUILD]]   # SRC: a checkout (default: this one), BUILD: its build
#
# To compare against an older commit: git worktree add /tmp/base REV && /tmp/base/deploy/build.sh
# /tmp/base/build && bench/behaviour.sh /tmp/before /tmp/base /tmp/base/build, then
# bench/behaviour.sh /tmp/after, and diff the two OUT/table.txt (the seconds differ).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=${1:?usage: bench/behaviour.sh OUT [SRC [BUILD]]}
src=${2:-$here}
build=${3:-$src/build}
mkdir -p "$out"
: >"$out/table.txt"
run() {  # name config key=value...
  local name=$1 config=$2
  shift 2
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  rm -rf "${out:?}/$name"
  local t0=$SECONDS rc acc model=""
  "$src/deploy/launch.sh" --build-dir "$build" --config "$src/configs/$config" \
    --run-dir "$out/$name" --quiet "${sets[@]}" >"$out/$name.log" 2>&1
  rc=$?
  acc=$(python3 -c "import json; print(json.load(open('$out/$name/summary.json'))['final_test_accuracy'])" 2>/dev/null)
  [[ -f "$out/$name/model.safetensors" ]] && model=$(sha256sum "$out/$name/model.safetensors" | cut -c1-16)
  echo "$name rc=$rc accuracy=${acc:-none} model=${model:-none} $((SECONDS - t0)) s" | tee -a "$out/table.txt"
}
run quickstart quickstart.yaml
run quickstart_again quickstart.yaml
run sbc sbc.yaml
run sketch_second_round sketch_second_round.yaml
run cnn cnn.yaml
for algorithm in ring gtopk spardl exdyna; do
  run "$algorithm" quickstart.yaml aggregation=allreduce collective.algorithm=$algorithm
done
