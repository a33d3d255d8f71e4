#!/usr/bin/env bash
# Configures and builds sparseps into a build directory (default build/, Release-with-debug-info).
#
#   deploy/build.sh [BUILD_DIR] [extra cmake -D options ...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${1:-$here/build}"
shift $(( $# > 0 ? 1 : 0 ))
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake -S "$here" -B "$build_dir" "${generator[@]}" "$@"
elif [[ $# -gt 0 ]]; then
  cmake "$build_dir" "$@"
fi
cmake --build "$build_dir" --parallel "$(nproc)"
