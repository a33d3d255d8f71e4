#!/usr/bin/env python3
"""Measures "how fast is the quickstart" and "how do the encodings compare" for docs/results.md:
trains configs/quickstart.yaml and configs/cnn.yaml through deploy/launch.sh, each several times,
then the quickstart's job once with each encoding, one run after the other, and writes each run's
final test accuracy, wall clock, training time and bytes per step (summary.json) with the machine,
date, commit and command to a JSON file (default docs/results/quickstart.json). Then
`python3 docs/render_results.py` puts them on the page.

    bench/results_quickstart.py [--build-dir build] [--runs 3] [--cnn-runs 2] [--out FILE]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def machine():
    """'AMD EPYC ..., 2 cores, Linux 6.1': what docs/results.md says a figure ran on."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, no GPU used"


# The quickstart's job with each encoding: (name, config).
ENCODINGS = (("topk 1%", "configs/quickstart.yaml"),
             ("dense", "configs/quickstart_dense.yaml"),
             ("topk 0.1%", "configs/topk_0.1pct.yaml"),
             ("sbc 1%", "configs/sbc.yaml"),
             ("sbc 0.1%", "configs/sbc_0.1pct.yaml"),
             ("sketch", "configs/sketch.yaml"),
             ("sketch, second round", "configs/sketch_second_round.yaml"),
             ("sketch, FetchSGD", "configs/sketch_fetchsgd.yaml"))


def run(build_dir, config, run_dir):
    subprocess.run([os.path.join(ROOT, "deploy", "launch.sh"), "--build-dir", build_dir,
                    "--config", os.path.join(ROOT, config), "--run-dir", run_dir, "--quiet"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    return {"final_test_accuracy": s["final_test_accuracy"],
            "wall_clock_s": round(s["wall_clock_s"], 2), "train_s": round(s["train_s"], 2),
            "sent_bytes_per_step": round(s.get("bytes_sent_per_worker_per_step", 0)),
            "received_bytes_per_step": round(s.get("bytes_received_per_worker_per_step", 0))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cnn-runs", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "quickstart.json"))
    a = p.parse_args()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=7", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, runs, what in (
                ("quickstart", "configs/quickstart.yaml", a.runs,
                 "MLP 784-256-128-10, top-k 1%, 6 epochs, 2 servers, 2 workers"),
                ("cnn", "configs/cnn.yaml", a.cnn_runs,
                 "CNN (215,370 parameters), top-k 1%, 2 epochs, 2 servers, 2 workers")):
            results = [run(a.build_dir, config, os.path.join(tmp, f"{name}-{i}"))
                       for i in range(runs)]
            jobs.append({"job": name, "what": what,
                         "command": f"./deploy/launch.sh --config {config} --quiet",
                         "runs": results})
        encodings = []
        for i, (name, config) in enumerate(ENCODINGS):
            r = run(a.build_dir, config, os.path.join(tmp, f"encoding-{i}"))
            encodings.append({"encoding": name, "config": config, **r})
    out = {"machine": machine(), "date": datetime.date.today().isoformat(), "commit": commit,
           "command": "bench/results_quickstart.py", "jobs": jobs, "encodings": encodings}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
