#!/usr/bin/env bash
# A real Slurm cluster on this one machine, to try deploy/slurm/sparseps.sbatch without a cluster
# (and for its test): munged with a key of its own, slurmctld, and one slurmd per node, all
# configured, logged and kept under DIR. With --nodes N > 1 each node is an emulated host of its
# own (deploy/netns.sh: a network namespace at SUBNET.k, joined only by its network, so the
# daemons still see the machine's /sys and cgroups); with --nodes 1 the node is 127.0.0.1. Needs
# root (Slurm's daemons, ip netns) and Debian's slurm-wlm and munge (deploy/install-deps.sh).
#
#   deploy/slurm/local-slurm.sh up --dir DIR [--nodes N] [--cpus C] [--prefix P] [--subnet A.B.C]
#   deploy/slurm/local-slurm.sh run --dir DIR CMD ...   # e.g. sbatch, squeue, scontrol, sinfo
#   deploy/slurm/local-slurm.sh down --dir DIR          # stops every daemon it started (idempotent)
#
# --cpus is what each node declares to Slurm (SlurmdParameters=config_overrides), so that a
# 1 + S + W task job fits on a small machine. `run` sets SLURM_CONF=DIR/slurm.conf and runs CMD
# where the controller is reachable (the first node's namespace with --nodes > 1).
# `up` waits until every node is idle (deadline 60 s, naming the nodes that are not).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
cmd="${1:-}"
[[ $# -gt 0 ]] && shift
dir="" nodes=1 cpus=4 prefix="spsslurm" subnet="10.78.0"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --cpus) cpus="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --subnet) subnet="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
[[ -n "$dir" || "$cmd" == -h || "$cmd" == --help || -z "$cmd" ]] ||
  { echo "local-slurm.sh: --dir DIR is required" >&2; exit 2; }

# The controller's namespace, as `up` recorded it ('' for a single node).
on_controller() {
  local ns=""
  [[ -f "$dir/netns" ]] && ns="$(cat "$dir/netns")"
  if [[ -n "$ns" ]]; then nsenter --net="/run/netns/$ns-h1" "$@"; else "$@"; fi
}

pid_of() { [[ -s "$1" ]] && cat "$1" || true; }
wait_gone() {  # wait_gone SECONDS PID...: kills with SIGKILL what is left after SECONDS
  local deadline=$((SECONDS + $1)); shift
  for p in "$@"; do
    while kill -0 "$p" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null || true
  done
}

down() {
  [[ -d "$dir" ]] || return 0
  export SLURM_CONF="$dir/slurm.conf"
  local pids=()
  for f in "$dir"/run/slurmctld.pid "$dir"/run/slurmd-*.pid; do
    [[ -e "$f" ]] && pids+=($(pid_of "$f"))
  done
  if ((${#pids[@]} > 0)); then
    on_controller scontrol shutdown >/dev/null 2>&1 || true
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait_gone 15 "${pids[@]}"
  fi
  local m
  m="$(pid_of "$dir/run/munged.pid")"
  if [[ -n "$m" ]]; then kill -TERM "$m" 2>/dev/null || true; wait_gone 5 "$m"; fi
  rm -f "$dir"/run/*.pid
  if [[ -f "$dir/netns" ]]; then
    "$here/deploy/netns.sh" down --prefix "$(cat "$dir/netns")" >/dev/null
    rm -f "$dir/netns"
  fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

up() {
  for b in munged mungekey slurmctld slurmd scontrol; do
    command -v "$b" >/dev/null || { echo "local-slurm.sh: $b not found (deploy/install-deps.sh installs slurm-wlm and munge)" >&2; exit 1; }
  done
  [[ $(id -u) -eq 0 ]] || { echo "local-slurm.sh: needs root (Slurm's daemons run as root here)" >&2; exit 1; }
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  down
  mkdir -p "$dir"/{munge,run,state,spool,log}
  chmod 700 "$dir/munge"
  chmod 755 "$dir/run"
  [[ -s "$dir/munge/munge.key" ]] || mungekey --create --keyfile="$dir/munge/munge.key"
  munged --socket="$dir/run/munge.socket" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/log/munged.log" --pid-file="$dir/run/munged.pid" \
    --seed-file="$dir/munge/munged.seed"

  local ctl_port=6817 d_port=6818 ctl_addr addrs=()
  if ((nodes > 1)); then
    "$here/deploy/netns.sh" up --hosts "$nodes" --rate 10gbit --prefix "$prefix" --subnet "$subnet" >/dev/null
    echo "$prefix" >"$dir/netns"
    for ((k = 1; k <= nodes; k++)); do addrs+=("$subnet.$k"); done
  else
    addrs=(127.0.0.1)
    ctl_port="$(free_port)" d_port="$(free_port)"
  fi
  ctl_addr="${addrs[0]}"
  {
    echo "# Written by deploy/slurm/local-slurm.sh up; everything under $dir."
    echo "ClusterName=sparseps-local"
    echo "SlurmctldHost=$(hostname -s)($ctl_addr)"
    echo "SlurmctldPort=$ctl_port"
    echo "SlurmdPort=$d_port"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$dir/run/munge.socket"
    echo "CredType=cred/munge"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
    echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SchedulerType=sched/builtin"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "ReturnToService=2"
    echo "MpiDefault=none"
    echo "MailProg=/bin/true"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/filetxt"
    echo "JobCompLoc=$dir/log/jobcomp.txt"
    echo "MinJobAge=3600"
    echo "SlurmdParameters=config_overrides"
    for ((k = 1; k <= ${#addrs[@]}; k++)); do
      echo "NodeName=node$k NodeAddr=${addrs[$((k - 1))]} CPUs=$cpus State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$dir/slurm.conf"
  export SLURM_CONF="$dir/slurm.conf"
  on_controller slurmctld -i
  for ((k = 1; k <= ${#addrs[@]}; k++)); do
    if ((nodes > 1)); then nsenter --net="/run/netns/$prefix-h$k" slurmd -N "node$k"
    else slurmd -N "node$k"; fi
  done
  local deadline=$((SECONDS + 60)) not_idle
  while true; do
    not_idle="$(on_controller sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 != "idle" { print $1 }' | paste -sd' ')"
    if [[ -z "$not_idle" ]] && on_controller sinfo -h >/dev/null 2>&1; then break; fi
    if ((SECONDS > deadline)); then
      echo "local-slurm.sh: nodes not idle after 60 s: ${not_idle:-(the controller does not answer)}; logs in $dir/log" >&2
      tail -n 5 "$dir"/log/*.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  echo "local-slurm.sh: $nodes node(s) idle at ${addrs[*]}, $cpus CPUs each; SLURM_CONF=$dir/slurm.conf"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  run)
    [[ $# -gt 0 ]] || { echo "local-slurm.sh: run needs a command" >&2; exit 2; }
    export SLURM_CONF="$dir/slurm.conf"
    on_controller "$@"
    ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
