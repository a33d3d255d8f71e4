#!/usr/bin/env bash
# Builds the Debian package (sparseps_VERSION_ARCH.deb) from a build directory with CPack: the
# daemons and tools, the client library with its header and CMake package, the Python package,
# configs, docs, deploy scripts and systemd unit templates (see the install rules at the end of
# CMakeLists.txt). Install it with `apt install ./sparseps_*.deb` (apt pulls its Depends).
#
#   deploy/package.sh [BUILD_DIR] [OUT_DIR]     # defaults: build/ and BUILD_DIR/package
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit 0
fi
build_dir="${1:-$here/build}"
out_dir="${2:-$build_dir/package}"
[[ -f "$build_dir/CPackConfig.cmake" ]] ||
  { echo "package.sh: $build_dir is not a configured build (deploy/build.sh first)" >&2; exit 2; }
cmake --build "$build_dir" --parallel "$(nproc)"
mkdir -p "$out_dir"
(cd "$build_dir" && cpack -G DEB -B "$out_dir" >"$out_dir/cpack.log") ||
  { tail -n 30 "$out_dir/cpack.log" >&2; exit 1; }
ls "$out_dir"/sparseps_*.deb
