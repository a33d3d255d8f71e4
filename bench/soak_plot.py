#!/usr/bin/env python3
"""Plots and summarizes a soak (bench/soak.sh): RSS and open file descriptors of each daemon over
time, the servers' queue depths (queues-server-S.csv), and per process the RSS growth from the end
of the warm-up to the end.

    bench/soak_plot.py SOAK_CSV RUN_DIR WARMUP_S OUT_PNG
"""
import argparse
import csv
import glob
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("soak_csv", help="soak.csv written by bench/soak.sh")
    p.add_argument("run_dir", help="the job's run directory (holds queues-server-S.csv)")
    p.add_argument("warmup_s", type=float, help="seconds after the start excluded from the growth")
    p.add_argument("out_png", help="where to write the plot")
    a = p.parse_args()
    soak_csv, run_dir, warmup, out_png = a.soak_csv, a.run_dir, a.warmup_s, a.out_png
    series = {}
    with open(soak_csv) as f:
        for row in csv.DictReader(f):
            s = series.setdefault(row["process"], {"t": [], "rss": [], "fds": []})
            s["t"].append(float(row["time_s"]))
            s["rss"].append(float(row["rss_bytes"]) / 1e6)
            s["fds"].append(int(row["fds"]))
    queues = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "queues-server-*.csv"))):
        name = os.path.basename(path)[len("queues-"):-len(".csv")]
        with open(path) as f:
            rows = list(csv.DictReader(f))
        queues[name] = rows
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for name, s in sorted(series.items()):
        axes[0].plot(s["t"], s["rss"], label=name)
        axes[1].plot(s["t"], s["fds"], label=name)
    for name, rows in sorted(queues.items()):
        t = [float(r["time_s"]) for r in rows]
        held = [float(r["waiting_pulls"]) + float(r["waiting_candidate_requests"]) +
                float(r["stored_pushes"]) for r in rows]
        axes[2].plot(t, held, label=name + " (pulls + candidate requests + stored pushes)")
    axes[0].set_ylabel("RSS (MB)")
    axes[1].set_ylabel("open file descriptors")
    axes[2].set_ylabel("held by a server")
    axes[2].set_xlabel("seconds since the job started")
    for a in axes:
        a.axvline(warmup, color="grey", linestyle=":")
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle("soak: resident set, descriptors and queues (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"plot: {out_png}")
    print(f"{'process':<12} {'RSS at warm-up':>15} {'RSS at end':>11} {'growth':>8} "
          f"{'fds min-max':>12}")
    for name, s in sorted(series.items()):
        after = [i for i, t in enumerate(s["t"]) if t >= warmup]
        if not after:
            continue
        base, end = s["rss"][after[0]], s["rss"][-1]
        print(f"{name:<12} {base:>12.1f} MB {end:>8.1f} MB {100 * (end - base) / base:>+7.2f}% "
              f"{min(s['fds']):>5}-{max(s['fds'])}")
    for name, rows in sorted(queues.items()):
        peak = {k: max(float(r[k]) for r in rows) for k in
                ("waiting_pulls", "waiting_candidate_requests", "stored_pushes")}
        last = rows[-1] if rows else {}
        print(f"{name}: at most {peak['waiting_pulls']:.0f} waiting pulls, "
              f"{peak['waiting_candidate_requests']:.0f} candidate requests, "
              f"{peak['stored_pushes']:.0f} stored pushes; {last.get('rejected', '0')} rejected, "
              f"version {last.get('version', '?')}")


if __name__ == "__main__":
    main()
