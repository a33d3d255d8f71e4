#!/usr/bin/env bash
# Installs what the tests need, builds with tests and runs them with ctest, then builds the suite
# again with clang under AddressSanitizer + UndefinedBehaviorSanitizer in a second build directory
# (with the libFuzzer targets: decoders and state machines) and runs it there, then runs each fuzz
# target for a bounded time, as many at once as there are cores.
# The first build compiles the CUDA code when nvcc is there (/usr/local/cuda); the sanitizer build
# is configured with -DSPARSEPS_CUDA=OFF, so CI also builds and tests the project as a machine
# without nvcc gets it. Both builds carry line tables only (-DSPARSEPS_DEBUG_INFO=lines: file:line
# in backtraces and sanitizer reports), which GCC compiles a third faster than full -g; clang
# compiles the sanitizer build in half GCC's time, so it also builds the fuzz targets instead of a
# third build. Whole jobs too long for -O0 under the sanitizers run in the plain build only (their
# GTEST_SKIP messages, or tests/CMakeLists.txt, say so). The test code compiles at -Og in the
# plain build (tests/CMakeLists.txt). CI's budget for the whole is 30 min on 2 cores. CI's machine
# took 32 min 34 s for the whole before the cuts of af2ee89 to 46c4488 (2026-12-05, b17c901), and
# 22 min 9 s for the plain build and its ctest with them (0421965, where a failed test, the Slurm
# script's race that e691838 mends, ended the run there): scaled by this VM's runs, about 30 to 33
# min for the whole, at the budget's edge. Fresh clones on the project's 2-core AMD EPYC VM: 29
# min 35 s (2026-12-05, 6635b3c; its speed varies by hours). Both builds are unity builds
# (CMakeLists.txt); docs/log/benchmarks-2026-11.md has the history and where the time goes.
# Every phase keeps the cores busy, so the phases stay in sequence: the sanitizer build beside
# the plain suite at nice 19 slowed the suite by more than it saved. ctest gets two slots of a
# resource "cpu" per core (build/ctest-resources.json) and twice as many tests as cores: every
# test asks for two slots, the suites that mostly wait (test_worker, test_ssh, test_slurm) for one
# (tests/CMakeLists.txt), so one of those runs beside two busy tests and never two busy ones beside
# a third (`ctest -j 3` doubled the long suites' times).
#
#   deploy/test.sh                 # both builds and the fuzz targets (what CI runs)
#   SPARSEPS_TEST_SANITIZE=0 deploy/test.sh   # skip the sanitizer build (and the fuzz targets)
#   SPARSEPS_TEST_FUZZ=0 deploy/test.sh       # skip running the fuzz targets (SPARSEPS_FUZZ_SECONDS=10 each)
#   deploy/test.sh -R Codec        # extra arguments go to ctest
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit 0
fi
"$here/deploy/install-deps.sh"
jobs="$(nproc)"
# ctest in build directory $1 with two slots of the resource "cpu" per core, the other arguments
# passed on.
run_ctest() {
  local dir="$1"
  shift
  printf '{"version": {"major": 1, "minor": 0}, "local": [{"cpu": [{"id": "0", "slots": %d}]}]}\n' \
    $((2 * jobs)) >"$dir/ctest-resources.json"
  (cd "$dir" && ctest --output-on-failure --resource-spec-file "$dir/ctest-resources.json" \
    -j $((2 * jobs)) "$@")
}
# Each phase's heading says how long the run has taken so far (CI's budget: 30 min) and how much
# CPU time the machine spent meanwhile (/proc/stat: user, nice, system, irq and softirq of every
# core, daemons and containers included), so that how busy its cores were in a phase shows
# between two headings.
busy_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }
busy0="$(busy_ticks)"
phase() {
  local cpu
  cpu="$(awk -v a="$busy0" -v b="$(busy_ticks)" -v hz="$(getconf CLK_TCK)" \
    'BEGIN { printf "%.1f", (b - a) / hz / 60 }')"
  echo "== $1 (at $((SECONDS / 60)) min $((SECONDS % 60)) s; machine CPU time ${cpu} min) =="
}

if git -C "$here" rev-parse --git-dir >/dev/null 2>&1; then
  phase "format (clang-format --dry-run, .clang-format)"
  (cd "$here" && git ls-files -z '*.h' '*.cc' '*.cu' '*.cuh' | xargs -0 -r clang-format --dry-run -Werror)
fi

# Both builds link with lld (deploy/install-deps.sh). nvcc compiles the CUDA code to PTX for
# compute_80 only (JIT-compiled for an A100 or an H100/H200 where a GPU runs the tests), which takes
# 40% less time than the SASS of the default sm_80 and sm_90; SPARSEPS_TEST_CUDA_ARCHITECTURES
# chooses others (CMAKE_CUDA_ARCHITECTURES, e.g. native on a GPU machine).
phase "build (build/)"
"$here/deploy/build.sh" "$here/build" -DSPARSEPS_BUILD_TESTS=ON -DSPARSEPS_DEBUG_INFO=lines \
  -DSPARSEPS_LINKER=lld -DCMAKE_CUDA_ARCHITECTURES="${SPARSEPS_TEST_CUDA_ARCHITECTURES:-80-virtual}"
phase "ctest (build/)"
run_ctest "$here/build" --timeout 300 "$@"

if [[ "${SPARSEPS_TEST_SANITIZE:-1}" != 0 ]]; then
  phase "build (build-sanitize/, clang, -fsanitize=address,undefined, libFuzzer targets)"
  CC=clang CXX=clang++ "$here/deploy/build.sh" "$here/build-sanitize" -DSPARSEPS_BUILD_TESTS=ON \
    -DSPARSEPS_BUILD_BENCH=OFF -DSPARSEPS_BUILD_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug \
    -DSPARSEPS_SANITIZE=address,undefined -DSPARSEPS_CUDA=OFF -DSPARSEPS_DEBUG_INFO=lines \
    -DSPARSEPS_LINKER=lld
  phase "ctest (build-sanitize/)"
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:${ASAN_OPTIONS:-}"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
  run_ctest "$here/build-sanitize" --timeout 600 "$@"

  if [[ "${SPARSEPS_TEST_FUZZ:-1}" != 0 ]]; then
    # One libFuzzer target per decoder and per state machine (shard server, scheduler, peer
    # group), each run for a bounded time on its own corpus, $jobs of them at once.
    fuzz_s="${SPARSEPS_FUZZ_SECONDS:-10}"
    phase "fuzz (${fuzz_s} s per target, ${jobs} at once)"
    fuzz_dir="$here/build-sanitize/tests/fuzz"
    targets=(dense topk sbc sketch golomb varint shard_server scheduler peer_group)
    for ((i = 0; i < ${#targets[@]}; i += jobs)); do
      batch=("${targets[@]:i:jobs}")
      pids=()
      for t in "${batch[@]}"; do
        mkdir -p "$fuzz_dir/corpus/$t" "$fuzz_dir/crashes/$t"
        "$fuzz_dir/fuzz_$t" -max_total_time="$fuzz_s" -print_final_stats=1 \
          -artifact_prefix="$fuzz_dir/crashes/$t/" "$fuzz_dir/corpus/$t" >"$fuzz_dir/fuzz_$t.log" 2>&1 &
        pids+=($!)
      done
      for j in "${!batch[@]}"; do
        t="${batch[j]}"
        if ! wait "${pids[j]}"; then
          tail -n 40 "$fuzz_dir/fuzz_$t.log"
          echo "test.sh: fuzz_$t found a crash (input saved in $fuzz_dir/crashes/$t/)" >&2
          exit 1
        fi
        echo "fuzz_$t: $(grep -o 'Done [0-9]* runs' "$fuzz_dir/fuzz_$t.log"), no crash"
      done
    done
  fi
fi
phase "end"
echo "test.sh: all tests passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
