#!/usr/bin/env bash
# Builds the sparseps image (deploy/docker/Dockerfile) from a build directory's Debian package:
# packages the build (deploy/package.sh) unless a .deb is given, then `docker build` with it.
#
#   deploy/docker/build-image.sh [BUILD_DIR | PACKAGE.deb] [docker build options...]
#   deploy/docker/build-image.sh build --build-arg BASE=debian:bookworm-local -t sparseps:test
#
# The image is tagged sparseps:<version> unless a -t is given. DOCKER: the docker client to use
# (default: docker on PATH).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit 0
fi
src="${1:-$here/build}"
shift || true
if [[ "$src" == *.deb ]]; then
  deb="$src"
else
  deb="$("$here/deploy/package.sh" "$src" | tail -n 1)"
fi
[[ -f "$deb" ]] || { echo "build-image.sh: no package at $deb" >&2; exit 2; }
version="$(basename "$deb" | cut -d_ -f2)"
tag=(-t "sparseps:$version")
for a in "$@"; do [[ "$a" == -t || "$a" == --tag || "$a" == --tag=* ]] && tag=(); done
context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT
cp "$here/deploy/docker/Dockerfile" "$deb" "$context/"
"${DOCKER:-docker}" build "${tag[@]}" "$@" "$context"
