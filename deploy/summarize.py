#!/usr/bin/env python3
"""Prints a Markdown table of one or more sparseps run directories (their summary.json).

    deploy/summarize.py runs/quickstart-* runs/quickstart-dense-*

Columns: job, encoding, density, workers, servers, final test accuracy, wall-clock seconds,
training seconds, steps, bytes sent and received per worker per step, cluster samples/s.
"""
import json
import os
import sys


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
        rows.append((os.path.basename(os.path.normpath(d)), s))
    print("| run | encoding | density | W | S | status | test acc | wall s | train s | steps "
          "| sent B/worker/step | recv B/worker/step | samples/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s.get('encoding', '').lower()} | {s.get('density', 0):g} "
              f"| {s.get('num_workers', 0)} | {s.get('num_servers', 0)} | {s.get('status', '')} "
              f"| {100 * s.get('final_test_accuracy', 0):.2f}% | {s.get('wall_clock_s', 0):.1f} "
              f"| {s.get('train_s', 0):.1f} | {s.get('steps', 0)} "
              f"| {s.get('bytes_sent_per_worker_per_step', 0):.0f} "
              f"| {s.get('bytes_received_per_worker_per_step', 0):.0f} "
              f"| {s.get('samples_per_s', 0):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
