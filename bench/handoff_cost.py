#!/usr/bin/env python3
"""What a replacement's hand-over costs (docs/user-guide.md, "A replacement worker"): one job
through deploy/launch.sh --max-restarts 1 (a PyTorch example under Adam over the aggregated
gradient, so that each worker keeps a model of its own), worker 1 killed with SIGKILL after
--kill-at of its steps; its replacement takes worker 0's model and optimizer state. Prints the
hand-over's bytes and chunks, the donor's time to queue them, the transfer (the replacement's
first chunk to its last), the replacement's whole wait (the donor's step included), and the
donor's step that handed it over against its median step (metrics-worker-0.csv).

    bench/handoff_cost.py [--kill-at STEPS] [--out DIR] -- LAUNCH_ARGS...
    bench/handoff_cost.py --kill-at 5 -- --config examples/torch_cnn.yaml \\
      --worker-command "python3 examples/fashion_mnist.py --model resnet18 --optimizer adam" \\
      --set train.momentum=0 --set train.batch_size=16 --set train.max_steps=40
"""
import argparse
import csv
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def read(path):
    with open(path) as f:
        return f.read()


def wall_steps(path):
    """{step: seconds of that step} from a metrics CSV's wall_s column."""
    with open(path) as f:
        rows = [(int(r["step"]), float(r["wall_s"])) for r in csv.DictReader(f)]
    return {step: wall - prev for (_, prev), (step, wall) in zip(rows, rows[1:])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill-at", type=int, default=5, help="worker 1's steps before the kill")
    ap.add_argument("--out", default="", help="the run directory (default: a new one in /tmp)")
    ap.add_argument("launch", nargs=argparse.REMAINDER, help="-- then deploy/launch.sh's arguments")
    args = ap.parse_args()
    launch = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    run = args.out or tempfile.mkdtemp(prefix="sparseps-handoff-")
    job = subprocess.Popen([os.path.join(ROOT, "deploy", "launch.sh"), "--quiet", "--run-dir", run,
                            "--max-restarts", "1"] + launch,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(run, "metrics-worker-1.csv")
    while job.poll() is None:
        if os.path.exists(metrics) and len(read(metrics).splitlines()) > args.kill_at:
            break
        time.sleep(0.05)
    victim = re.search(r"\(pid (\d+)\)", read(os.path.join(run, "worker-1.log")))
    if job.poll() is not None or not victim:
        sys.exit(f"handoff_cost.py: worker 1 did not reach step {args.kill_at}:\n"
                 + job.stdout.read())
    os.kill(int(victim.group(1)), signal.SIGKILL)
    out, _ = job.communicate()
    if job.returncode != 0:
        sys.exit(f"handoff_cost.py: the job failed:\n{out}")
    took = re.search(r"took worker 0's hand-over of iteration (\d+): (\d+) bytes in (\d+) chunks "
                     r"over ([0-9.]+) s, after waiting ([0-9.]+) s",
                     read(os.path.join(run, "worker-1.log")))
    queued = re.search(r"handed this loop's state \((\d+) bytes\).* \(([0-9.]+) s to queue",
                       read(os.path.join(run, "worker-0.log")))
    if not took or not queued:
        sys.exit(f"handoff_cost.py: no hand-over in the logs of {run}")
    joined = int(took.group(1))
    steps = wall_steps(os.path.join(run, "metrics-worker-0.csv"))
    # Worker 0 hands over at the start of its step J + 2 (1-based): after the join iteration J.
    sending = steps.get(joined + 2, float("nan"))
    median = statistics.median(v for k, v in steps.items() if k not in (joined + 1, joined + 2))
    print(f"run directory: {run}")
    print(f"joined at iteration {joined}; hand-over {int(took.group(2))} bytes in "
          f"{took.group(3)} chunks")
    print(f"donor: {float(queued.group(2)):.3f} s to queue the chunks; its step {joined + 2} "
          f"took {sending:.3f} s against a median of {median:.3f} s "
          f"({sending - median:+.3f} s)")
    print(f"replacement: the chunks arrived over {float(took.group(4)):.3f} s, its wait for them "
          f"{float(took.group(5)):.3f} s")


if __name__ == "__main__":
    main()
