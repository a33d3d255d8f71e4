#!/usr/bin/env bash
# Installs everything sparseps needs to build, test and run its quickstart on Debian 12, with
# apt-get. Idempotent: when every package is already installed it does nothing (no root needed).
#
#   deploy/install-deps.sh            # build + test + run dependencies
#
# Runs apt-get through sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libzmq3-dev cppzmq-dev
  libprotobuf-dev protobuf-compiler
  libyaml-cpp-dev libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  libopenblas-dev zlib1g-dev libxxhash-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  dataset-fashion-mnist fortunes
  clang-format clang libclang-rt-14-dev lld iproute2 iptables iperf3 socat procps python3 curl dpkg-dev
  slurm-wlm slurmctld slurmd slurm-client munge openssh-server openssh-client prometheus-cpp-dev libmicrohttpd-dev
  systemd
  libgloo-dev python3-yaml python3-matplotlib python3-pytest python3-prometheus-client
  pybind11-dev python3-dev libdlpack-dev python3-numpy python3-torch python3-torchvision
  docker.io docker-compose mmdebstrap python3-kubernetes python3-zmq
  python3-simgrid
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
# No daemon that a package brings is started by its installation (policy-rc.d, as Debian's own
# images do): docker.io's dockerd with its defaults would set the host's iptables FORWARD policy
# to DROP, cutting the bridge that deploy/netns.sh's hosts share. The tests start their own.
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  trap '"${sudo[@]}" rm -f "$policy"' EXIT
  printf '#!/bin/sh\n# deploy/install-deps.sh: no service starts while it installs\nexit 101\n' |
    "${sudo[@]}" tee "$policy" >/dev/null
  "${sudo[@]}" chmod 755 "$policy"
fi
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
