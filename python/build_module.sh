#!/usr/bin/env bash
# Builds sparseps's pybind11 module (sparseps._sparseps) for a python3 that the CMake build did
# not target (a GPU machine's own Python and PyTorch, a virtualenv's, a conda one), over a client
# library built elsewhere: one compiler call, no CMake, ZeroMQ or protobuf headers (the module
# needs only client/include/sparseps/client.h; libsparseps_client.so brings the rest).
#
#   python/build_module.sh --client-lib DIR [--python PY] [--out OUT] [--dlpack INC]
#
# DIR: holds libsparseps_client.so (a build's client/, an install's lib/, or a GPU bundle's
# build/client/); the module finds it there at run time (rpath). PY: the interpreter to build for
# (default python3). OUT (default build-python/): gets sparseps/ (the package's .py files and
# _sparseps<the interpreter's extension suffix>); then `PYTHONPATH=OUT PY -c "import sparseps"`.
# INC: a folder holding dlpack/dlpack.h where it is not on the compiler's path (Debian:
# libdlpack-dev). Needs a C++20 compiler (CXX, default c++; CXXFLAGS go after the script's -O2,
# e.g. -O0 to compile faster), the interpreter's headers and pybind11 (pip's, or
# Debian's pybind11-dev). Exit 1 naming what is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
lib="" py=python3 out=build-python dlpack=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --client-lib) lib="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --dlpack) dlpack="$2"; shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "build_module.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
fail() { echo "build_module.sh: $*" >&2; exit 1; }
[[ -n "$lib" ]] || fail "--client-lib DIR is required (the folder of libsparseps_client.so)"
[[ -f "$lib/libsparseps_client.so" ]] || fail "no libsparseps_client.so in $lib"
lib="$(cd "$lib" && pwd)"
command -v "$py" >/dev/null || fail "no interpreter '$py'"
cxx="${CXX:-c++}"
command -v "$cxx" >/dev/null || fail "no C++ compiler '$cxx' (set CXX)"
# The interpreter's headers, its extension suffix, and pybind11's headers (pip's package, else
# the system's /usr/include/pybind11).
read -r pyinc suffix < <("$py" -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
[[ -f "$pyinc/Python.h" ]] || fail "no Python.h in $pyinc (the interpreter's development headers)"
pbinc="$("$py" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null || true)"
if [[ -z "$pbinc" ]]; then
  [[ -f /usr/include/pybind11/pybind11.h ]] || fail "pybind11 not found for $py (pip install pybind11, or Debian's pybind11-dev)"
  pbinc=/usr/include
fi
flags=()
[[ -n "$dlpack" ]] && flags+=("-I$dlpack")
read -r -a extra <<<"${CXXFLAGS:-}"
flags+=("${extra[@]}")
mkdir -p "$out/sparseps"
cp "$here"/python/sparseps/*.py "$out/sparseps/"
# The module will ask for the library by its SONAME (libsparseps_client.so.0); a copy that kept
# only libsparseps_client.so (a GPU bundle) gets that name as a link next to the module.
soname="$(readelf -d "$lib/libsparseps_client.so" 2>/dev/null | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')"
if [[ -n "$soname" && ! -e "$lib/$soname" ]]; then
  ln -sfn "$lib/libsparseps_client.so" "$out/sparseps/$soname"
fi
"$cxx" -O2 -std=c++20 -shared -fPIC -fvisibility=hidden -I"$pyinc" -I"$pbinc" -I"$here" \
  -I"$here/client/include" "${flags[@]}" "$here/python/sparseps_module.cc" \
  "$here/python/module_tensors.cc" \
  -L"$lib" -lsparseps_client -Wl,-rpath,"$lib" -Wl,-rpath,'$ORIGIN' \
  -o "$out/sparseps/_sparseps$suffix" ||
  fail "compiling python/sparseps_module.cc failed (dlpack/dlpack.h missing? see --dlpack)"
echo "build_module.sh: $out/sparseps/_sparseps$suffix for $("$py" -c 'import sys; print(sys.version.split()[0])')"
