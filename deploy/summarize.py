#!/usr/bin/env python3
"""Prints a Markdown table of one or more sparseps run directories (their summary.json).

    deploy/summarize.py runs/quickstart-* runs/quickstart-dense-*

Columns: run (the directory's name), method (ps/ENCODING or allreduce/COLLECTIVE), density,
workers (W), servers (S), status, final test accuracy, wall-clock seconds, training seconds,
steps, bytes sent and received per worker per step, the cluster's training samples per second,
and the messages the servers rejected (the sum of their `servers` counters; "-" when none
reported, as with allreduce). docs/user-guide.md ("What a run writes") documents each field of summary.json.

Exit code: 0, or 1 when a directory has no readable summary.json (named on stderr).
"""
import json
import os
import sys

HEADER = ("| run | method | density | W | S | status | test acc | wall s | train s | steps "
          "| sent B/worker/step | recv B/worker/step | samples/s (cluster) | rejected (servers) |")


def method(s):
    """'ps/topk', 'allreduce/spardl', from a summary (older ones had only 'encoding')."""
    if s.get("aggregation") == "allreduce":
        return "allreduce/" + s.get("collective", "")
    return "ps/" + str(s.get("encoding", "")).lower()


def rejected(s):
    """The servers' rejected messages, summed; '-' when no server reported its counters."""
    servers = s.get("servers") or []
    if not servers:
        return "-"
    return str(sum(int(x.get("rejected", 0)) for x in servers))


def row(name, s):
    samples = s.get("cluster_samples_per_s", s.get("samples_per_s", 0))
    return (f"| {name} | {method(s)} | {s.get('density', 0):g} "
            f"| {s.get('num_workers', 0)} | {s.get('num_servers', 0)} | {s.get('status', '')} "
            f"| {100 * float(s.get('final_test_accuracy', 0)):.2f}% "
            f"| {float(s.get('wall_clock_s', 0)):.1f} | {float(s.get('train_s', 0)):.1f} "
            f"| {int(s.get('steps', 0))} "
            f"| {float(s.get('bytes_sent_per_worker_per_step', 0)):.0f} "
            f"| {float(s.get('bytes_received_per_worker_per_step', 0)):.0f} "
            f"| {float(samples):.0f} | {rejected(s)} |")


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    rows = []
    for d in argv[1:]:
        path = os.path.join(d, "summary.json")
        try:
            with open(path) as f:
                s = json.load(f)
        except (OSError, ValueError) as e:
            print(f"summarize: {path}: {e}", file=sys.stderr)
            return 1
        rows.append(row(os.path.basename(os.path.normpath(d)), s))
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
