#!/usr/bin/env bash
# Hosts reachable over real OpenSSH on this one machine, to try `deploy/launch.sh --hosts` without
# a cluster (and for its test): N emulated hosts (deploy/netns.sh: network namespaces at
# SUBNET.1 ... SUBNET.N) with an sshd of their own each (Debian's openssh-server), host and user
# keys made here, everything configured, logged and kept under DIR. With --hosts 1 and no network
# namespaces the one host is 127.0.0.1 on a free port. Needs root (ip netns, sshd).
#
#   deploy/ssh/local-ssh.sh up --dir DIR [--hosts N] [--prefix P] [--subnet A.B.C]
#   deploy/ssh/local-ssh.sh run --dir DIR CMD ...   # CMD on host 1 (the "login node"), with
#                                                   # SPARSEPS_SSH="ssh -F DIR/ssh_config"
#   deploy/ssh/local-ssh.sh down --dir DIR          # stops the sshds, deletes the namespaces
#
# `up` writes DIR/ssh_config (user root, DIR/id_ed25519, DIR/known_hosts with the hosts' key:
# StrictHostKeyChecking stays on) and DIR/hosts, one ssh destination per line in host order, and
# waits (deadline 30 s) until every sshd takes a login, naming those that do not.
# For example, the quickstart across 3 hosts:
#   deploy/ssh/local-ssh.sh up --dir /tmp/ssh --hosts 3
#   printf '%s scheduler server\n%s server worker\n%s worker\n' $(cat /tmp/ssh/hosts) >/tmp/hosts
#   deploy/ssh/local-ssh.sh run --dir /tmp/ssh deploy/launch.sh --hosts /tmp/hosts
#   deploy/ssh/local-ssh.sh down --dir /tmp/ssh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
cmd="${1:-}"
[[ $# -gt 0 ]] && shift
dir="" hosts=1 prefix="spsssh" subnet="10.79.0"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --hosts) hosts="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --subnet) subnet="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
case "$cmd" in
  -h|--help|help) usage; exit 0 ;;
  up|run|down) [[ -n "$dir" ]] || { echo "local-ssh.sh: --dir DIR is required" >&2; exit 2; } ;;
  *) usage >&2; exit 2 ;;
esac
die() { echo "local-ssh.sh: $*" >&2; exit 1; }

# on_host K CMD...: CMD in host K's network namespace (joined by its network only), or here.
on_host() {
  local k="$1"; shift
  if [[ -s "$dir/netns" ]]; then nsenter --net="/run/netns/$(cat "$dir/netns")-h$k" "$@"; else "$@"; fi
}

down() {
  [[ -d "$dir" ]] || return 0
  local f p pids=()
  for f in "$dir"/run/sshd-*.pid; do
    [[ -s "$f" ]] && pids+=("$(cat "$f")")
  done
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  local deadline=$((SECONDS + 10))
  for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  rm -f "$dir"/run/sshd-*.pid
  # What still runs inside the hosts (sshd's per-connection processes, whose client may hold its
  # connection open a while: ControlPersist), found by namespace: once a namespace is deleted
  # their connections could never close.
  if [[ -s "$dir/netns" ]]; then
    local ns left=()
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$(cat "$dir/netns")-h[0-9]+$" || true); do
      left+=($(ip netns pids "$ns" 2>/dev/null))
    done
    for p in "${left[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    deadline=$((SECONDS + 10))
    for p in "${left[@]}"; do
      while kill -0 "$p" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
      kill -KILL "$p" 2>/dev/null || true
    done
  fi
  if [[ -s "$dir/netns" ]]; then
    "$here/deploy/netns.sh" down --prefix "$(cat "$dir/netns")" >/dev/null
    rm -f "$dir/netns"
  fi
}

up() {
  [[ $(id -u) -eq 0 ]] || die "needs root (sshd, ip netns)"
  [[ -x /usr/sbin/sshd ]] || die "/usr/sbin/sshd not found (deploy/install-deps.sh installs openssh-server)"
  command -v ssh >/dev/null || die "ssh not found (openssh-client)"
  [[ "$hosts" =~ ^[1-9][0-9]*$ ]] || die "--hosts must be a positive number"
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  down
  mkdir -p "$dir"/{run,log}
  chmod 700 "$dir"
  # sshd's privilege separation directory (what the openssh-server service makes at its start).
  mkdir -p /run/sshd && chmod 755 /run/sshd
  [[ -s "$dir/host_ed25519" ]] || ssh-keygen -q -t ed25519 -N '' -C sparseps-local-host -f "$dir/host_ed25519"
  [[ -s "$dir/id_ed25519" ]] || ssh-keygen -q -t ed25519 -N '' -C sparseps-local-user -f "$dir/id_ed25519"
  cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
  chmod 600 "$dir/authorized_keys"

  local addrs=() port=22 dests=() k
  if "$here/deploy/netns.sh" check >/dev/null 2>&1; then
    "$here/deploy/netns.sh" up --hosts "$hosts" --rate 10gbit --prefix "$prefix" --subnet "$subnet" >/dev/null
    echo "$prefix" >"$dir/netns"
    for ((k = 1; k <= hosts; k++)); do addrs+=("$subnet.$k"); dests+=("$subnet.$k"); done
  else
    ((hosts == 1)) || die "--hosts $hosts needs network namespaces: $("$here/deploy/netns.sh" check 2>&1)"
    : >"$dir/netns"
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    addrs=(127.0.0.1)
    dests=("127.0.0.1:$port")
  fi
  {
    echo "# Written by deploy/ssh/local-ssh.sh up; everything under $dir."
    echo "Port $port"
    [[ -s "$dir/netns" ]] || echo "ListenAddress 127.0.0.1"
    echo "HostKey $dir/host_ed25519"
    echo "AuthorizedKeysFile $dir/authorized_keys"
    # DIR may be below /tmp (world-writable), which StrictModes refuses for key files.
    echo "StrictModes no"
    echo "PermitRootLogin prohibit-password"
    echo "PubkeyAuthentication yes"
    echo "PasswordAuthentication no"
    echo "KbdInteractiveAuthentication no"
    echo "UsePAM no"
    echo "X11Forwarding no"
    echo "AllowTcpForwarding no"
    echo "PrintMotd no"
    # A session whose client vanished (no FIN ever comes) ends after 30 s.
    echo "ClientAliveInterval 10"
    echo "ClientAliveCountMax 3"
    echo "MaxStartups 100"
    echo "MaxSessions 100"
  } >"$dir/sshd_config"
  {
    echo "Host *"
    echo "  User root"
    echo "  IdentityFile $dir/id_ed25519"
    echo "  IdentitiesOnly yes"
    echo "  UserKnownHostsFile $dir/known_hosts"
    echo "  StrictHostKeyChecking yes"
    echo "  LogLevel ERROR"
  } >"$dir/ssh_config"
  local known
  known="$(printf '%s\n' "${addrs[@]}" | sed "s/.*/[&]:$port/; s/^\[\(.*\)\]:22$/\1/" | paste -sd,)"
  echo "$known $(cut -d' ' -f1,2 "$dir/host_ed25519.pub")" >"$dir/known_hosts"
  printf '%s\n' "${dests[@]}" >"$dir/hosts"
  for ((k = 1; k <= ${#addrs[@]}; k++)); do
    on_host "$k" /usr/sbin/sshd -f "$dir/sshd_config" -o "PidFile=$dir/run/sshd-$k.pid" \
      -E "$dir/log/sshd-$k.log"
  done
  # Every sshd takes a login (from host 1, as `run` does).
  local deadline=$((SECONDS + 30)) missing
  while true; do
    missing=()
    for ((k = 1; k <= ${#addrs[@]}; k++)); do
      local p=()
      [[ $port != 22 ]] && p=(-p "$port")
      on_host 1 ssh -F "$dir/ssh_config" -o BatchMode=yes -o ConnectTimeout=5 "${p[@]}" \
        "${addrs[$((k - 1))]}" true </dev/null >/dev/null 2>&1 || missing+=("${addrs[$((k - 1))]}")
    done
    ((${#missing[@]} == 0)) && break
    if ((SECONDS > deadline)); then
      tail -n 5 "$dir"/log/sshd-*.log >&2 || true
      die "no login after 30 s on ${missing[*]} (logs in $dir/log)"
    fi
    sleep 0.3
  done
  echo "local-ssh.sh: ${#addrs[@]} host(s) with sshd at ${dests[*]}; ssh -F $dir/ssh_config"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  run)
    [[ $# -gt 0 ]] || die "run needs a command"
    export SPARSEPS_SSH="ssh -F $dir/ssh_config"
    # exec: CMD gets this process's signals (a TERM or Ctrl-C meant for the launcher).
    if [[ -s "$dir/netns" ]]; then exec nsenter --net="/run/netns/$(cat "$dir/netns")-h1" "$@"; fi
    exec "$@"
    ;;
esac
