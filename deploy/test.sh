#!/usr/bin/env bash
# Installs what the tests need, builds with tests and runs them with ctest, then runs the suite
# again under AddressSanitizer + UndefinedBehaviorSanitizer in a second build directory, then
# builds the libFuzzer targets (decoders, state machines) with clang in a third and runs each for a
# bounded time.
# The first build compiles the CUDA code when nvcc is there (/usr/local/cuda); the sanitizer and
# fuzz builds are configured with -DSPARSEPS_CUDA=OFF, so CI also builds and tests the project as
# a machine without nvcc gets it.
#
#   deploy/test.sh                 # both builds (what CI runs)
#   SPARSEPS_TEST_SANITIZE=0 deploy/test.sh   # skip the sanitizer build
#   SPARSEPS_TEST_FUZZ=0 deploy/test.sh       # skip the libFuzzer targets (SPARSEPS_FUZZ_SECONDS=15 each)
#   deploy/test.sh -R Codec        # extra arguments go to ctest
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit 0
fi
"$here/deploy/install-deps.sh"
jobs="$(nproc)"
# Each phase's heading says how long the run has taken so far (CI keeps the whole under 30 min).
phase() { echo "== $1 (at $((SECONDS / 60)) min $((SECONDS % 60)) s) =="; }

if git -C "$here" rev-parse --git-dir >/dev/null 2>&1; then
  phase "format (clang-format --dry-run, .clang-format)"
  (cd "$here" && git ls-files -z '*.h' '*.cc' '*.cu' '*.cuh' | xargs -0 -r clang-format --dry-run -Werror)
fi

phase "build (build/)"
"$here/deploy/build.sh" "$here/build" -DSPARSEPS_BUILD_TESTS=ON
phase "ctest (build/)"
(cd "$here/build" && ctest --output-on-failure --timeout 300 -j "$jobs" "$@")

if [[ "${SPARSEPS_TEST_SANITIZE:-1}" != 0 ]]; then
  phase "build (build-asan/, -fsanitize=address,undefined)"
  "$here/deploy/build.sh" "$here/build-asan" -DSPARSEPS_BUILD_TESTS=ON -DSPARSEPS_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=Debug -DSPARSEPS_SANITIZE=address,undefined -DSPARSEPS_CUDA=OFF
  phase "ctest (build-asan/)"
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:${ASAN_OPTIONS:-}"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
  (cd "$here/build-asan" && ctest --output-on-failure --timeout 600 -j "$jobs" "$@")
fi
if [[ "${SPARSEPS_TEST_FUZZ:-1}" != 0 ]]; then
  # One libFuzzer target per decoder and per state machine (shard server, scheduler, peer group), built with
  # clang (+ ASan/UBSan), each run for a bounded time.
  fuzz_s="${SPARSEPS_FUZZ_SECONDS:-15}"
  phase "build (build-fuzz/, clang, libFuzzer)"
  CC=clang CXX=clang++ cmake -S "$here" -B "$here/build-fuzz" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSPARSEPS_BUILD_FUZZ=ON -DSPARSEPS_BUILD_TESTS=OFF -DSPARSEPS_BUILD_BENCH=OFF \
    -DSPARSEPS_SANITIZE=address,undefined -DSPARSEPS_CUDA=OFF >/dev/null
  targets=(dense topk sbc sketch golomb varint shard_server scheduler peer_group)
  cmake --build "$here/build-fuzz" -j "$jobs" --target "${targets[@]/#/fuzz_}"
  phase "fuzz (${fuzz_s} s per target)"
  for t in "${targets[@]}"; do
    corpus="$here/build-fuzz/corpus/$t"
    mkdir -p "$corpus"
    if ! "$here/build-fuzz/tests/fuzz/fuzz_$t" -max_total_time="$fuzz_s" -print_final_stats=1 \
        "$corpus" >"$here/build-fuzz/fuzz_$t.log" 2>&1; then
      tail -n 40 "$here/build-fuzz/fuzz_$t.log"
      echo "test.sh: fuzz_$t found a crash (input saved by libFuzzer in the working directory)" >&2
      exit 1
    fi
    echo "fuzz_$t: $(grep -o 'Done [0-9]* runs' "$here/build-fuzz/fuzz_$t.log"), no crash"
  done
fi
echo "test.sh: all tests passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
