#!/usr/bin/python3
"""plot_timeline: one training step of a worker, layer by layer and key range by key range.

Draws trace-worker-<rank>.csv files (written by workers with metrics.trace_steps > 0; the columns
are in worker/step_trace.h) as a timeline of one step each, one panel per trace, on one time
axis: the compute lane (forward, then each layer's backward pass in order), per server key range
its encoding, push (to the ack) and pull (to the reply applied) (in allreduce mode per bucket its
encoding and ring allreduce), and what the step waited after the backward pass. Comparing train.overlap: none with backward shows what the overlap hid.

  bench/plot_timeline.py --trace NAME=RUN_DIR/trace-worker-0.csv [--trace ...] --out timeline.png
                         [--step N]

--step picks the step (default: the one of median length among the steps after the fifth, per
trace). Needs Debian's python3-matplotlib (install-deps.sh adds it).
"""
import argparse
import csv
import statistics
import sys


def read_trace(path):
    """{step: [(lane, event, start_ms, end_ms), ...]} of one trace file."""
    steps = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            steps.setdefault(int(r["step"]), []).append(
                (r["lane"], r["event"], float(r["start_ms"]), float(r["end_ms"])))
    if not steps:
        raise ValueError(f"{path}: no traced steps")
    return steps


def step_length(rows):
    return max(end for _, _, _, end in rows)


def median_step(steps):
    """The step of median length among those after the fifth (the warm-up), else all."""
    keys = [s for s in sorted(steps) if s > 5] or sorted(steps)
    lengths = sorted((step_length(steps[s]), s) for s in keys)
    return lengths[len(lengths) // 2][1]


COLORS = {"encode": "#e08a2c", "push": "#4878a8", "pull": "#9cc69b", "allreduce": "#8172b2",
          "wait": "#c44e52"}


def plot(traces, out, step=None):
    """Draws traces [(name, path)] into the PNG `out`; returns {name: (step, length_ms)}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loaded = []
    for name, path in traces:
        steps = read_trace(path)
        s = step if step is not None else median_step(steps)
        if s not in steps:
            raise ValueError(f"{path}: step {s} is not in the trace")
        loaded.append((name, s, steps[s]))
    longest = max(step_length(rows) for _, _, rows in loaded)
    fig, axes = plt.subplots(len(loaded), 1, figsize=(11, 1.0 + 1.9 * len(loaded)), sharex=True,
                             squeeze=False)
    summary = {}
    for ax, (name, s, rows) in zip(axes[:, 0], loaded):
        lanes = ["compute"] + sorted(
            {l for l, _, _, _ in rows if l.startswith(("range", "bucket"))},
            key=lambda l: (l.rstrip("0123456789"), int(l[len(l.rstrip("0123456789")):]))) + \
            ["step"]
        y = {l: len(lanes) - 1 - i for i, l in enumerate(lanes)}
        shade = 0
        for lane, event, start, end in rows:
            if lane == "compute":
                color = ("#8c8c8c", "#b5b5b5")[shade % 2]
                shade += 1
                ax.broken_barh([(start, end - start)], (y[lane] - 0.4, 0.8), color=color)
                label = event.replace("forward + backward ", "fwd+bwd ").replace("backward ", "")
                if end - start > 0.012 * longest * len(label):  # room for the label
                    ax.text(start + (end - start) / 2, y[lane], label, ha="center", va="center",
                            fontsize=7)
            elif event == "pull":
                ax.broken_barh([(start, end - start)], (y[lane] - 0.12, 0.24),
                               color=COLORS["pull"])
            else:
                h = 0.8 if event != "push" else 0.5
                ax.broken_barh([(start, end - start)], (y[lane] - h / 2, h),
                               color=COLORS.get(event, "#666666"))
        ax.set_yticks([y[l] for l in lanes], [l if l != "step" else "waited" for l in lanes],
                      fontsize=8)
        length = step_length(rows)
        summary[name] = (s, length)
        ax.set_title(f"{name}: step {s}, {length:.1f} ms", fontsize=9, loc="left")
        ax.set_xlim(0, longest * 1.02)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the step's start")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="append", required=True, help="NAME=PATH (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--step", type=int, default=None)
    args = ap.parse_args()
    traces = []
    for t in args.trace:
        name, sep, path = t.partition("=")
        if not sep:
            name, path = t, t
        traces.append((name, path))
    try:
        summary = plot(traces, args.out, args.step)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_timeline: {e}", file=sys.stderr)
        return 1
    for name, (s, length) in summary.items():
        print(f"{name}: step {s}, {length:.1f} ms")
    print(f"plot_timeline: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
