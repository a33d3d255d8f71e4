#!/usr/bin/python3
"""The network between two hosts, measured with ZeroMQ as the job uses it (Debian's python3-zmq
over the same libzmq): bandwidth each way and the round-trip latency.

    probe.py serve --bind ADDR:PORT [--timeout S]     # on host A: answers one client, then exits
                                                      # (PORT * : a free one); prints {"port": N}
    probe.py measure --connect ADDR:PORT [--seconds 2] [--transfers 2]
                     [--message-bytes 1048576]       # on host B: prints one JSON line
Output (measure): {"up_Bps": B->A bytes/s, "down_Bps": A->B bytes/s, "rtt_s": median round
trip of a 1-byte message, "seconds": each transfer's length, "transfers": how many each way}. A
transfer streams messages of --message-bytes for --seconds (at least 2 s keeps a tc-shaped rate
within a few percent); the rate counts from the first to the last message the receiver got, and
each way's is the best of --transfers: a receiver or sender kept off the CPU for a moment (a busy
host) leaves the link idle and lowers that transfer's rate, never raises it. Errors: a peer
silent for --timeout seconds (default 30) ends the command with exit code 2, naming the address.
"""
import argparse
import json
import socket
import statistics
import sys
import time


def fail(text):
    print(f"probe on {socket.gethostname()}: {text}", file=sys.stderr)
    sys.exit(2)


try:
    import zmq
except ImportError:
    fail("python3-zmq is missing here (apt-get install python3-zmq)")


def recv(sock, timeout_s, who):
    if not sock.poll(int(timeout_s * 1000)):
        fail(f"{who} sent nothing for {timeout_s} s")
    return sock.recv_multipart(copy=False)


def stream_socket(kind):
    """A socket with a few messages in flight, whose full pipe blocks the sender (a ROUTER too,
    not dropping): a stream then runs at the link's rate instead of filling memory."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDHWM, 8)
    sock.setsockopt(zmq.RCVHWM, 8)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def receive_stream(sock, timeout_s, who, at):
    """Receives "data" messages until "end" (their kind in frame `at`: 1 behind a ROUTER's peer
    frame, else 0); returns (bytes, seconds) counted from the first message, which starts the
    clock and is not counted, to the last."""
    total, first, last = 0, None, None
    while True:
        f = recv(sock, timeout_s, who)
        if f[at].bytes == b"end":
            break
        last = time.monotonic()
        if first is None:
            first = last
        else:
            total += len(f[at + 1])
    return total, (last - first if first is not None else 0.0)


def serve(args):
    """Prints the port it bound ({"port": N}, one line) and answers one measuring client: ping,
    an upload it counts, a download it streams."""
    sock = stream_socket(zmq.ROUTER)
    try:
        sock.bind(f"tcp://{args.bind}")
    except zmq.ZMQError as e:
        fail(f"cannot bind tcp://{args.bind}: {e}")
    port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    print(json.dumps({"port": port}), flush=True)
    who = f"the client of tcp://{args.bind}"
    while True:
        frames = recv(sock, args.timeout, who)
        peer, kind = frames[0].bytes, frames[1].bytes
        if kind == b"ping":
            sock.send_multipart([peer, b"pong"])
        elif kind == b"up":
            total, seconds = receive_stream(sock, args.timeout, who, 1)
            sock.send_multipart([peer, b"got", json.dumps(
                {"bytes": total, "seconds": seconds}).encode()])
        elif kind == b"down":
            spec = json.loads(frames[2].bytes)
            payload = b"\0" * spec["message_bytes"]
            end = time.monotonic() + spec["seconds"]
            while time.monotonic() < end:
                sock.send_multipart([peer, b"data", payload])
            sock.send_multipart([peer, b"end", b""])
        elif kind == b"bye":
            return


def measure(args):
    sock = stream_socket(zmq.DEALER)
    sock.connect(f"tcp://{args.connect}")
    who = f"the probe server at tcp://{args.connect}"
    rtts = []
    for _ in range(args.pings):
        t = time.monotonic()
        sock.send_multipart([b"ping"])
        recv(sock, args.timeout, who)
        rtts.append(time.monotonic() - t)
    payload = b"\0" * args.message_bytes
    up = down = 0.0
    for _ in range(args.transfers):
        sock.send_multipart([b"up"])
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            sock.send_multipart([b"data", payload])
        sock.send_multipart([b"end"])
        got = json.loads(recv(sock, args.timeout, who)[1].bytes)
        up = max(up, got["bytes"] / got["seconds"] if got["seconds"] > 0 else 0.0)
        sock.send_multipart([b"down", json.dumps({"message_bytes": args.message_bytes,
                                                    "seconds": args.seconds}).encode()])
        total, seconds = receive_stream(sock, args.timeout, who, 0)
        down = max(down, total / seconds if seconds > 0 else 0.0)
    sock.send_multipart([b"bye"])
    print(json.dumps({"up_Bps": up, "down_Bps": down, "rtt_s": statistics.median(rtts),
                      "seconds": args.seconds, "transfers": args.transfers}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True, help="ADDR:PORT (PORT *: a free one, printed)")
    s.add_argument("--timeout", type=float, default=30)
    m = sub.add_parser("measure")
    m.add_argument("--connect", required=True, help="ADDR:PORT")
    m.add_argument("--seconds", type=float, default=2.0)
    m.add_argument("--transfers", type=int, default=2, choices=range(1, 11), metavar="1..10",
                   help="transfers each way; the best one's rate counts")
    m.add_argument("--message-bytes", type=int, default=1 << 20)
    m.add_argument("--pings", type=int, default=50)
    m.add_argument("--timeout", type=float, default=30)
    args = ap.parse_args()
    serve(args) if args.cmd == "serve" else measure(args)


if __name__ == "__main__":
    main()
