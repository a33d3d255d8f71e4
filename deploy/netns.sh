#!/usr/bin/env bash
# Emulated commodity Ethernet on one Linux machine: N hosts as network namespaces on one bridge
# (the "switch", in a namespace of its own so the machine's own network is never touched), each
# host linked by a veth pair whose both directions are shaped with `tc tbf` to RATE (host egress
# on the host side, host ingress on the switch side), with optional one-way DELAY (netem).
# RATE `unshaped` leaves the links at veth speed (the same hosts with the network free: the
# reference a compute-bound job's time is held against), still with DELAY if given.
# Addresses: SUBNET.1 ... SUBNET.N (/24), inside the namespaces only. Needs root (ip netns).
# Faults (loss, cut, heal) are iptables rules inside the host namespaces (iptables: the machine's
# own firewall is never touched), tagged with the comment sparseps-fault.
#
#   deploy/netns.sh up --hosts 4 --rate 1gbit [--delay 0.1ms] [--prefix sps] [--subnet 10.77.0]
#   deploy/netns.sh shape [--prefix P] --rate 100mbit [--delay D] 3   # host 3's link, both ways,
#                                      # at another rate from now on (a slow host; delay anew)
#   deploy/netns.sh exec [--prefix P] 2 CMD ...   # run CMD on host 2 (1-based)
#   deploy/netns.sh addr [--prefix P] 2  # host 2's address, as its namespace has it (whatever
#                                      # --subnet made it)
#   deploy/netns.sh loss [--prefix P] 1% [HOST ...]  # drop that share of the packets arriving at
#                                      # each host (all hosts when none named; 0% ends it)
#   deploy/netns.sh cut [--prefix P] HOST ...   # cut the hosts off: nothing in or out of eth0
#   deploy/netns.sh heal [--prefix P] [HOST ...]  # undo loss and cut (all hosts when none named)
#   deploy/netns.sh down [--prefix sps]   # deletes every namespace of the prefix (idempotent)
#   deploy/netns.sh check              # exit 0 when ip netns works here, else 1 with the reason
set -euo pipefail

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  -h|--help|help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
hosts=2
rate=1gbit
delay=""
prefix="${SPARSEPS_NETNS_PREFIX:-sps}"
subnet="${SPARSEPS_NETNS_SUBNET:-10.77.0}"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) hosts="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --subnet) subnet="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) args=("$@"); break ;;  # HOST and CMD: taken verbatim (options come first)
  esac
done
sw="${prefix}-sw"

die() { echo "netns.sh: $*" >&2; exit 1; }

# Bytes per second of a tc rate such as 1gbit, 100mbit, 500kbit (0 for unshaped).
rate_bytes() {
  local r="${1,,}" n unit
  [[ "$r" == unshaped ]] && { echo 0; return; }
  n="${r%%[a-z]*}"
  unit="${r#"$n"}"
  case "$unit" in
    gbit) echo $((n * 125000000)) ;;
    mbit) echo $((n * 125000)) ;;
    kbit) echo $((n * 125)) ;;
    bit) echo $((n / 8)) ;;
    *) die "rate '$1': use Nkbit, Nmbit, Ngbit or unshaped" ;;
  esac
}

# shape NS DEV: tbf at $rate (bucket of 1 ms of traffic, at least 64 KiB), behind netem if a delay
# is asked for; with rate unshaped only the netem delay, if any.
shape() {
  local ns="$1" dev="$2" bytes burst
  bytes="$(rate_bytes "$rate")"
  if ((bytes == 0)); then
    if [[ -n "$delay" ]]; then
      ip -n "$ns" link set "$dev" txqueuelen 10000
      ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000
    fi
    return 0
  fi
  burst=$((bytes / 1000))
  ((burst < 65536)) && burst=65536
  if [[ -n "$delay" ]]; then
    ip -n "$ns" link set "$dev" txqueuelen 10000
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" burst "$burst" latency 50ms
  else
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 50ms
  fi
}

# hosts_or_all: the named hosts' namespaces, or every host of the prefix when none is named.
hosts_or_all() {
  local all
  all="$(ip netns list | awk '{print $1}' | grep -E "^${prefix}-h[0-9]+$" | sort -V || true)"
  [[ -n "$all" ]] || die "no hosts with prefix $prefix (netns.sh up --prefix $prefix first)"
  if [[ $# -eq 0 ]]; then echo "$all"; return; fi
  for n in "$@"; do
    grep -qx "${prefix}-h$n" <<<"$all" || die "no host ${prefix}-h$n"
    echo "${prefix}-h$n"
  done
}

need_iptables() {
  command -v iptables >/dev/null || die "iptables not installed (deploy/install-deps.sh)"
}

# heal_ns NS [TAG]: deletes NS's rules commented TAG (default: every sparseps-fault* rule).
heal_ns() {
  local ns="$1" tag="${2:-sparseps-fault}" chain line spec
  for chain in INPUT OUTPUT; do
    while read -r line; do
      [[ -n "$line" ]] || continue
      read -ra spec <<<"${line#-A }"
      ip netns exec "$ns" iptables -D "${spec[@]}"
    done < <(ip netns exec "$ns" iptables -S "$chain" | grep -e "--comment $tag" || true)
  done
}

case "$cmd" in
  loss)
    [[ ${#args[@]} -ge 1 && "${args[0]}" =~ ^[0-9]*\.?[0-9]+%$ ]] ||
      die "usage: netns.sh loss [--prefix P] PERCENT% [HOST ...] (e.g. 0.1%)"
    need_iptables
    p="$(awk -v x="${args[0]%\%}" 'BEGIN { if (x > 100) exit 1; printf "%.6f", x / 100 }')" ||
      die "loss ${args[0]}: at most 100%"
    hs="$(hosts_or_all "${args[@]:1}")"
    for h in $hs; do
      heal_ns "$h" sparseps-fault-loss
      if [[ "$p" != "0.000000" ]]; then
        ip netns exec "$h" iptables -A INPUT -i eth0 -m statistic --mode random --probability "$p" \
          -m comment --comment sparseps-fault-loss -j DROP
      fi
    done
    echo "netns.sh: ${args[0]} of the packets arriving at" $hs "dropped"
    ;;
  cut)
    [[ ${#args[@]} -ge 1 ]] || die "usage: netns.sh cut [--prefix P] HOST ..."
    need_iptables
    hs="$(hosts_or_all "${args[@]}")"
    for h in $hs; do
      ip netns exec "$h" iptables -I INPUT -i eth0 -m comment --comment sparseps-fault-cut -j DROP
      ip netns exec "$h" iptables -I OUTPUT -o eth0 -m comment --comment sparseps-fault-cut -j DROP
      echo "netns.sh: $h cut off"
    done
    ;;
  heal)
    need_iptables
    hs="$(hosts_or_all "${args[@]}")"
    for h in $hs; do heal_ns "$h"; done
    echo "netns.sh: faults removed"
    ;;
  check)
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces)"
    command -v tc >/dev/null || die "tc (iproute2) not installed"
    probe="${prefix}-probe-$$"
    ip netns add "$probe" 2>/dev/null || die "ip netns add failed (no CAP_SYS_ADMIN here?)"
    ip netns del "$probe"
    ;;
  up)
    [[ "$hosts" =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 250)) || die "--hosts must be 1..250"
    rate_bytes "$rate" >/dev/null
    if ip netns list | grep -q "^${sw}\b"; then die "prefix '$prefix' is up already (netns.sh down --prefix $prefix)"; fi
    trap 'echo "netns.sh: up failed; tearing down" >&2; "$0" down --prefix "$prefix"' ERR
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    ip -n "$sw" link set lo up
    for ((i = 1; i <= hosts; i++)); do
      h="${prefix}-h$i"
      ip netns add "$h"
      ip -n "$h" link set lo up
      ip link add "${prefix}h${i}a" netns "$h" type veth peer name "p$i" netns "$sw"
      ip -n "$h" link set "${prefix}h${i}a" name eth0
      ip -n "$h" addr add "$subnet.$i/24" dev eth0
      ip -n "$h" link set eth0 up
      ip -n "$sw" link set "p$i" master br0
      ip -n "$sw" link set "p$i" up
      shape "$h" eth0      # host egress
      shape "$sw" "p$i"    # host ingress
    done
    trap - ERR
    links="$rate each way"
    [[ "${rate,,}" == unshaped ]] && links="links unshaped"
    echo "netns.sh: $hosts hosts ${prefix}-h1..${prefix}-h$hosts at $subnet.1..$subnet.$hosts, $links${delay:+, delay $delay}"
    ;;
  shape)
    [[ ${#args[@]} -eq 1 && "${args[0]}" =~ ^[0-9]+$ ]] || die "usage: netns.sh shape [--prefix P] --rate R [--delay D] HOST"
    rate_bytes "$rate" >/dev/null
    h="$(hosts_or_all "${args[0]}")"
    # (an unshaped link without a delay has no root qdisc of ours to delete)
    ip netns exec "$h" tc qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$sw" tc qdisc del dev "p${args[0]}" root 2>/dev/null || true
    shape "$h" eth0
    shape "$sw" "p${args[0]}"
    echo "netns.sh: $h at $rate${delay:+, delay $delay} each way"
    ;;
  exec)
    [[ ${#args[@]} -ge 2 ]] || die "usage: netns.sh exec HOST CMD ..."
    exec ip netns exec "${prefix}-h${args[0]}" "${args[@]:1}"
    ;;
  addr)
    [[ ${#args[@]} -eq 1 ]] || die "usage: netns.sh addr [--prefix P] HOST"
    h="$(hosts_or_all "${args[0]}")"
    a="$(ip -n "$h" -4 -o addr show dev eth0 | awk '{split($4, a, "/"); print a[1]; exit}')"
    [[ -n "$a" ]] || die "$h has no IPv4 address on eth0"
    echo "$a"
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${prefix}-(sw|h[0-9]+)$" || true); do
      # Processes still inside would keep nothing alive (namespaces go with their last user),
      # but say so: the caller tracks and stops its own processes.
      ip netns pids "$ns" 2>/dev/null | grep -q . && echo "netns.sh: processes still in $ns" >&2
      ip netns del "$ns"
    done
    ;;
  *) die "unknown command '${cmd}' (up, shape, exec, addr, loss, cut, heal, down, check;" \
    "see --help)" ;;
esac
