#!/usr/bin/env bash
# Installs what the tests need, builds with tests and runs them with ctest, then runs the suite
# again under AddressSanitizer + UndefinedBehaviorSanitizer in a second build directory.
#
#   deploy/test.sh                 # both builds (what CI runs)
#   SPARSEPS_TEST_SANITIZE=0 deploy/test.sh   # skip the sanitizer build
#   deploy/test.sh -R Codec        # extra arguments go to ctest
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$here/deploy/install-deps.sh"
jobs="$(nproc)"

if git -C "$here" rev-parse --git-dir >/dev/null 2>&1; then
  echo "== format (clang-format --dry-run, .clang-format) =="
  (cd "$here" && git ls-files -z '*.h' '*.cc' '*.cu' '*.cuh' | xargs -0 -r clang-format --dry-run -Werror)
fi

echo "== build (build/) =="
"$here/deploy/build.sh" "$here/build" -DSPARSEPS_BUILD_TESTS=ON
echo "== ctest (build/) =="
(cd "$here/build" && ctest --output-on-failure --timeout 300 -j "$jobs" "$@")

if [[ "${SPARSEPS_TEST_SANITIZE:-1}" != 0 ]]; then
  echo "== build (build-asan/, -fsanitize=address,undefined) =="
  "$here/deploy/build.sh" "$here/build-asan" -DSPARSEPS_BUILD_TESTS=ON -DSPARSEPS_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=Debug -DSPARSEPS_SANITIZE=address,undefined
  echo "== ctest (build-asan/) =="
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:${ASAN_OPTIONS:-}"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
  (cd "$here/build-asan" && ctest --output-on-failure --timeout 600 -j "$jobs" "$@")
fi
echo "test.sh: all tests passed"
