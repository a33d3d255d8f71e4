"""One training step of each sparseps method on clusters larger than can be run here, as a
discrete-event network simulation (SimGrid, Debian's python3-simgrid): W worker hosts (+ H server
hosts for PS) on full-duplex links of one bandwidth and latency to a switch whose backbone carries
at most `bisection` bytes/s (default: non-blocking), flows sharing links max-min fairly (SimGrid's
CM02 model without cross traffic: no TCP factors on top, since the probe measured goodput).

A method is a sequence of rounds; in each round every flow of the round starts at once and the
round ends when the last one has arrived (incast at a server, a shared backbone, a busy link are
what the simulation resolves). The rounds follow docs/algorithms.md §5: the ring's 2(P-1)
neighbour steps (PowerSGD: two rings), Bruck's all-gather (TopK-AllGather; ExDyna's keys, then
its ring), gTop-k's binomial tree up to worker 0 and back down, SparDL's 2 log2 P pairwise
exchanges, and the PS push to every server host then the pull from each. A worker's bytes per step at W workers come from the calibration at its
W by each method's growth (scale_bytes). Thread-safety: one simulation per process (SimGrid's
engine is a singleton): simulate_steps runs each in a child process.
"""
import math
import multiprocessing

# How one worker's bytes per step grow with W (P), per method: a factor from P_cal to P.
SCALING = {
    "ring": lambda p: (p - 1) / p,
    "gloo": lambda p: (p - 1) / p,
    "powersgd": lambda p: (p - 1) / p,
    "topk_allgather": lambda p: p - 1,          # (P-1) k received
    "gtopk": lambda p: math.ceil(math.log2(p)),  # k per round, log2 P rounds
    "spardl": lambda p: (p - 1) / p,
    "exdyna": lambda p: (p - 1) / p,
}
# PS encodings whose pulls are the union of the workers' selections (grow with W until dense).
PS_UNION = ("topk", "sbc")


def scale_bytes(kind, name, p_cal, sent, received, p, union_cap=float("inf"), union=True):
    """(sent, received) per worker per step at P workers, from the calibration's at P_cal.
    PS: pushes keep their size; pulls of a union (topk, sbc; union False: with
    compression.server_topk, whose pulls are the top k of the sum) grow with P up to union_cap
    (the dense pull); other pulls keep theirs."""
    if kind == "ps":
        if name in PS_UNION and union:
            received = min(union_cap, received * p / p_cal)
        return sent, received
    f = SCALING.get(name, SCALING["ring"])
    r = f(p) / f(p_cal) if f(p_cal) else 1.0
    return sent * r, received * r


def rounds(kind, name, p, h, sent, received):
    """The method's rounds: each (flows, times), flows a list of (source, destination, bytes)
    between hosts ("w", i) and ("s", j), run `times` times in turn (the ring's rounds are alike:
    one is simulated and counted 2(P-1) times)."""
    if kind == "ps":
        push = [(("w", i), ("s", j), sent / h) for i in range(p) for j in range(h)]
        pull = [(("s", j), ("w", i), received / h) for i in range(p) for j in range(h)]
        return [(push, 1), (pull, 1)]
    if p < 2:
        return []
    volume = max(sent, received)
    log = math.ceil(math.log2(p))

    def ring(n, total=volume):
        return [([(("w", i), ("w", (i + 1) % p), total / n) for i in range(p)], n)]

    def bruck(total):
        chunk = total / (p - 1)
        return [([(("w", i), ("w", (i - 2 ** r) % p), min(2 ** r, p - 2 ** r) * chunk)
                  for i in range(p)], 1) for r in range(log)]

    def tree(total):
        # gTop-k: log2 P rounds up a binomial tree to worker 0, then log2 P rounds down
        up = [([(("w", i), ("w", i - 2 ** r), total / (2 * log)) for i in range(p)
                if i % 2 ** (r + 1) == 2 ** r], 1) for r in range(log)]
        down = [([(("w", i - 2 ** r), ("w", i), total / (2 * log)) for i in range(p)
                  if i % 2 ** (r + 1) == 2 ** r], 1) for r in reversed(range(log))]
        return up + down

    def pairwise(n):
        return [([(("w", i), ("w", i ^ (1 << (r % log))), volume / n) for i in range(p)
                  if (i ^ (1 << (r % log))) < p], 1) for r in range(n)]

    if name in ("ring", "gloo"):
        return ring(2 * (p - 1))
    if name == "powersgd":
        return ring(4 * (p - 1))
    if name == "topk_allgather":
        return bruck(volume)
    if name == "exdyna":
        # the keys (4 bytes each) all-gathered, then their values (4 each) summed by the ring
        return bruck(volume / 3) + ring(2 * (p - 1), 2 * volume / 3)
    if name == "gtopk":
        return tree(sent + received)
    return pairwise(2 * log)  # spardl


def _simulate(args, out):
    """Child process: builds the platform, runs the rounds, puts the network seconds in out."""
    kind, name, p, h, sent, received, bandwidth, rtt, bisection = args
    from simgrid import Actor, Comm, Engine, LinkInRoute, NetZone

    e = Engine(["simulate", "--cfg=network/model:CM02", "--cfg=network/crosstraffic:0",
                "--log=root.thres:critical"])
    zone = NetZone.create_star_zone("switch")
    hosts = {}
    names = [("w", i) for i in range(p)] + ([("s", j) for j in range(h)] if kind == "ps" else [])
    backbone = None
    if bisection:
        backbone = zone.create_link("backbone", bisection).seal()
    for n in names:
        host = zone.create_host(f"{n[0]}{n[1]}", 1e9).seal()
        # host -> switch -> host crosses two links: each a quarter of the round trip
        link = zone.create_split_duplex_link(f"l{n[0]}{n[1]}", bandwidth).set_latency(
            rtt / 4).seal()
        route = [LinkInRoute(link, LinkInRoute.UP)]
        if backbone is not None:
            route.append(LinkInRoute(backbone))
        zone.add_route(host.netpoint, None, None, None, route, True)
        hosts[n] = host
    zone.seal()

    def run():
        extra = 0.0  # the repeated rounds' further times
        for flows, times in rounds(kind, name, p, h, sent, received):
            start = e.clock
            comms = [Comm.sendto_async(hosts[s], hosts[d], max(1, int(b))) for s, d, b in flows]
            for c in comms:
                c.wait()
            extra += (times - 1) * (e.clock - start)
        out.put(e.clock + extra)

    Actor.create("driver", hosts[("w", 0)], run)
    e.run()


def network_step_s(kind, name, p, h, sent, received, bandwidth, rtt, bisection=None):
    """Simulated network seconds of one step (one process per simulation). Raises RuntimeError
    when the simulation fails (python3-simgrid missing: the message says so)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_simulate, args=((kind, name, p, h, sent, received, bandwidth, rtt,
                                                 bisection), out))
    proc.start()
    proc.join(600)
    if proc.exitcode != 0 or out.empty():
        raise RuntimeError(f"the simulation of {kind} {name} at W = {p} failed (exit "
                           f"{proc.exitcode}; needs Debian's python3-simgrid)")
    return out.get()


def stops_scaling(points):
    """The W beyond which samples per second (W / step) grow less than half as fast as W, from
    (W, step seconds) points in increasing W; None when it scales over the whole range."""
    for (w1, s1), (w2, s2) in zip(points, points[1:]):
        growth = (w2 / s2) / (w1 / s1) - 1
        if growth < 0.5 * (w2 / w1 - 1):
            return w1
    return None
