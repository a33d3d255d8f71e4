"""Network time per training step of each sparseps method: the cost models of
docs/algorithms.md §6, fed with a step's measured bytes (a calibration run of the job) and a
link's bandwidth and latency (probe.py). Plain functions, no state; thread-safe.

Units: bytes, bytes per second, seconds. `sent` and `received` are one worker's bytes per step
(as the job's metrics count them: payload and headers); `bandwidth` is one host's link, each
direction (full duplex); `rtt` the round trip between two hosts.
"""
import math

# Rounds of messages a step waits for in turn, per method (P workers): each costs half a round
# trip (one way), docs/algorithms.md §5's table.
ROUNDS = {
    "ring": lambda p: 2 * (p - 1),
    "gloo": lambda p: 2 * (p - 1),
    "topk_allgather": lambda p: math.ceil(math.log2(p)) if p > 1 else 0,
    "gtopk": lambda p: 2 * math.ceil(math.log2(p)) if p > 1 else 0,
    "spardl": lambda p: 2 * math.ceil(math.log2(p)) if p > 1 else 0,
    # keys all-gathered (Bruck), values by the ring
    "exdyna": lambda p: (math.ceil(math.log2(p)) if p > 1 else 0) + 2 * (p - 1),
    # two rings (P, then Q)
    "powersgd": lambda p: 4 * (p - 1),
}


def method_of(overrides, worker=""):
    """The method a setting's `set` overrides name: ("ps", encoding) or ("allreduce",
    collective.algorithm), with the job's defaults (aggregation ps, encoding topk, collective
    ring) where a key is not overridden. A `worker` command of torch DDP with its PowerSGD hook
    (the examples' `--ddp --ddp-hook powersgd`) is ("allreduce", "powersgd"): the hook's two
    rings a step (P, then Q), whatever collective the job names."""
    kv = dict(o.split("=", 1) for o in overrides if "=" in o)
    words = worker.split()
    if "--ddp" in words and "--ddp-hook" in words and \
            words[words.index("--ddp-hook") + 1:][:1] == ["powersgd"]:
        return "allreduce", "powersgd"
    if kv.get("aggregation", "ps") == "allreduce":
        return "allreduce", kv.get("collective.algorithm", "ring")
    return "ps", kv.get("compression.encoding", "topk")


def ps_network_s(workers, server_hosts, sent, received, bandwidth, rtt):
    """PS (any encoding), BSP: every worker pushes `sent` bytes spread over the server hosts,
    each of which takes W/H of every worker's push through its one link (the incast), then the
    pulls come back the same way. One round trip each for push and pull."""
    hosts = max(1, server_hosts)
    push = max(sent, workers * sent / hosts) / bandwidth
    pull = max(received, workers * received / hosts) / bandwidth
    return push + pull + 2 * rtt


def allreduce_network_s(algorithm, workers, sent, received, bandwidth, rtt):
    """A collective among P workers: every link carries its worker's bytes at once (the ring and
    the exchanges of the sparse collectives are balanced), so the busier direction's bytes over
    the bandwidth, plus the rounds it waits for in turn (half a round trip each). gTop-k's tree
    is the exception: its root (worker 0, whose bytes the job reports) receives in the rounds up
    and sends in the rounds down, one after the other, so its bytes add."""
    rounds = ROUNDS.get(algorithm, ROUNDS["ring"])(workers)
    volume = sent + received if algorithm == "gtopk" else max(sent, received)
    return volume / bandwidth + rounds * rtt / 2


def network_s(kind, name, workers, server_hosts, sent, received, bandwidth, rtt):
    """One step's network time of a method (kind "ps" or "allreduce", name: the encoding or the
    collective) with one worker's bytes per step, on links of `bandwidth` bytes/s and `rtt`."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth {bandwidth}: must be positive")
    if kind == "ps":
        return ps_network_s(workers, server_hosts, sent, received, bandwidth, rtt)
    return allreduce_network_s(name, workers, sent, received, bandwidth, rtt)


def predict(calibrated, network_lo, network_at):
    """A setting's step and time to target on another network: the calibration run's own figures
    (on loopback: compute, encode, the CPU side of communication, and the steps it needed) plus
    the network time the model gives there less what it gives for the calibration's network.

    calibrated: dict with kind, name, workers, server_hosts, sent, received (bytes per worker per
    step), step_s (median), steps_to_target (None: not reached), train_s_to_target.
    network_lo / network_at: dicts with bandwidth (bytes/s) and rtt (s).
    Returns dict: step_s, network_s (the added part), time_to_target_s (None when not reached)."""
    def net(n):
        return network_s(calibrated["kind"], calibrated["name"], calibrated["workers"],
                         calibrated["server_hosts"], calibrated["sent"], calibrated["received"],
                         n["bandwidth"], n["rtt"])
    extra = max(0.0, net(network_at) - net(network_lo))
    out = {"step_s": calibrated["step_s"] + extra, "network_s": extra, "time_to_target_s": None}
    if calibrated.get("steps_to_target") is not None:
        out["time_to_target_s"] = (calibrated["train_s_to_target"] +
                                   calibrated["steps_to_target"] * extra)
    return out
