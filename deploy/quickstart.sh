#!/usr/bin/env bash
# The main job in one command: installs the dependencies, builds, and trains an MLP on
# Fashion-MNIST with a local cluster (1 scheduler, 2 servers, 2 workers, top-k at density 1% with
# error feedback) from configs/quickstart.yaml. Extra arguments go to deploy/launch.sh:
#
#   deploy/quickstart.sh
#   deploy/quickstart.sh --set cluster.num_workers=3
#   deploy/quickstart.sh --config configs/quickstart_dense.yaml
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for a in "$@"; do
  if [[ "$a" == -h || "$a" == --help ]]; then
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    echo
    echo "deploy/launch.sh's options, which quickstart.sh passes on:"
    "$here/deploy/launch.sh" --help | sed 's/^/  /'
    exit 0
  fi
done
"$here/deploy/install-deps.sh"
echo "quickstart: building into $here/build (log: ${TMPDIR:-/tmp}/sparseps-build.log)"
"$here/deploy/build.sh" "$here/build" >"${TMPDIR:-/tmp}/sparseps-build.log" 2>&1 || {
  tail -n 40 "${TMPDIR:-/tmp}/sparseps-build.log" >&2
  echo "quickstart: build failed (full log: ${TMPDIR:-/tmp}/sparseps-build.log)" >&2
  exit 1
}
exec "$here/deploy/launch.sh" --build-dir "$here/build" "$@"
