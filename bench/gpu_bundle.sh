#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that lacks the build's dependencies (no apt there, no
# network): what bench/gpu_checks.sh runs (the GPU tests, worker_test for its device tests,
# integration_test for its GPU overlap cases, sparseps_gpu_bench and the three daemons) and the
# client library that sparseps.capi loads (a
# PyTorch worker in the GPU machine's own Python), stripped, with the shared libraries they load
# (but glibc's, libstdc++/libgcc, zlib, libffi and CUDA's runtime and cuBLAS, which the GPU
# machine has: a copy of those would shadow its PyTorch's; CUDA's runtime goes to lib-cuda/, for
# the end of LD_LIBRARY_PATH), and Fashion-MNIST.
#
#   bench/gpu_bundle.sh [--build-dir B] [--out DIR] [--data DIR]
#
# B: a build configured with -DSPARSEPS_CUDA=ON (default build-gpu/; the targets are built first);
# DIR: where the bundle goes (default .devrun/, which .gitignore lists); --data: Fashion-MNIST's
# four .gz files (default /usr/share/datasets/fashion-mnist).
# Writes DIR/bundle.tar.xz (build/{tests,bench,scheduler,server,worker,client}/..., lib/,
# lib-cuda/, net/: iproute2's ip and tc with their libraries, include/dlpack/dlpack.h) and
# DIR/data/ (Fashion-MNIST, and Debian's fortunes in data/fortunes/ where installed).
# On the GPU machine, from the repository root (DIR = .devrun):
#   mkdir -p .devrun/x && tar -xJf .devrun/bundle.tar.xz -C .devrun/x
#   export LD_LIBRARY_PATH=$PWD/.devrun/x/lib:/usr/local/cuda/lib64:$PWD/.devrun/x/lib-cuda
#   bash bench/gpu_checks.sh --build-dir .devrun/x/build --data $PWD/.devrun/data --steps tests
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="$here/build-gpu"
out="$here/.devrun"
data="/usr/share/datasets/fashion-mnist"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f "$build_dir/CMakeCache.txt" ]] || { echo "gpu_bundle.sh: $build_dir is not a CMake build" >&2; exit 1; }
ls "$data"/*.gz >/dev/null 2>&1 || { echo "gpu_bundle.sh: no Fashion-MNIST .gz files in $data" >&2; exit 1; }

# SASS for the GPU machine (sm_90, or the building machine's own with native): a build for PTX
# alone (deploy/test.sh's 80-virtual) would put the driver's JIT compilation of every kernel into
# the first timings there.
archs="$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build_dir/CMakeCache.txt")"
if [[ -n "$archs" && "$archs" != native && " ${archs//;/ } " != *" 90 "* &&
      " ${archs//;/ } " != *" 90-real "* ]]; then
  echo "gpu_bundle.sh: $build_dir compiles CUDA for '$archs'; reconfiguring it for 80;90" >&2
  cmake "$build_dir" -DCMAKE_CUDA_ARCHITECTURES="80;90" >/dev/null
fi

binaries=(tests/gpu_kernels_test tests/gpu_models_test tests/collectives_test tests/worker_test
  tests/integration_test bench/sparseps_gpu_bench scheduler/sparseps-scheduler server/sparseps-server
  worker/sparseps-worker client/libsparseps_client.so)
targets=()
for b in "${binaries[@]}"; do
  t="$(basename "$b")"
  [[ $t == lib*.so ]] && t="${t#lib}" && t="${t%.so}"
  targets+=("$t")
done
cmake --build "$build_dir" --target "${targets[@]}" ||
  { echo "gpu_bundle.sh: building ${targets[*]} in $build_dir failed (configured with -DSPARSEPS_CUDA=ON?)" >&2; exit 1; }

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for b in "${binaries[@]}"; do
  mkdir -p "$stage/build/$(dirname "$b")"
  cp -L "$build_dir/$b" "$stage/build/$b"
  strip --strip-unneeded "$stage/build/$b"
done
# The libraries the binaries load, but those the GPU machine must have its own of.
ldd "$stage"/build/*/* | awk '/=>/ {print $3}' | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libresolv.so* | libcublas* | \
      libgcc_s* | libstdc++* | libz.so* | libffi.so*) ;;
    libcudart*) mkdir -p "$stage/lib-cuda" && cp -L "$lib" "$stage/lib-cuda/" ;;  # a fallback
    *) cp -L "$lib" "$stage/lib/" ;;
  esac
done
# iproute2's ip and tc with their libraries, for deploy/netns.sh on a GPU machine without them
# (bench/device_run.sh's NET_TOOLS).
mkdir -p "$stage/net/bin" "$stage/net/lib"
for t in ip tc; do
  p="$(command -v $t || true)"
  [[ -n "$p" ]] || { echo "gpu_bundle.sh: $t (iproute2) not found: the bundle goes without it" >&2; continue; }
  cp -L "$p" "$stage/net/bin/$t"
  ldd "$p" | awk '/=>/ {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libz.so*) ;;
      *) cp -L "$lib" "$stage/net/lib/" ;;
    esac
  done
done
# dlpack/dlpack.h (Debian's libdlpack-dev), for python/build_module.sh on the GPU machine.
if [[ -f /usr/include/dlpack/dlpack.h ]]; then
  mkdir -p "$stage/include/dlpack" && cp /usr/include/dlpack/dlpack.h "$stage/include/dlpack/"
fi
rm -rf "$out" && mkdir -p "$out/data"
tar -C "$stage" -cJf "$out/bundle.tar.xz" .
cp "$data"/*.gz "$out/data/"
# Debian's fortunes, the language model's text (examples/language_model.py), where installed.
if [[ -d /usr/share/games/fortunes ]]; then
  mkdir -p "$out/data/fortunes" && cp -L /usr/share/games/fortunes/* "$out/data/fortunes/"
fi
du -sh "$out"/*
