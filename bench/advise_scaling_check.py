#!/usr/bin/env python3
"""sparseps-advise's simulated steps at several W against comparisons measured at those W.

Usage: bench/advise_scaling_check.py ADVICE_JSON W=COMPARISON_DIR [W=COMPARISON_DIR ...]

ADVICE_JSON is sparseps-advise's advice.json made with --simulate (and, to match the measured
runs' servers, --simulate-server-hosts); each COMPARISON_DIR a bench/sparseps-compare output at W
workers on the same network. Prints a Markdown table per setting and W: the simulated step (the
calibration's CPU part plus the simulated network time), the measured median step and the error;
then the network part alone: the simulated network time against the measured step less its
compute and encode columns (what the network and the waiting for it took); and the simulated
step with the calibration's compute and encode replaced by those measured at that W (on machines
whose cores the workers share, the CPU part of a step grows with W; on hosts of their own it does
not), with its error. Ends with how many are within 15% and the median errors.
"""
import csv
import json
import statistics
import sys


def main(argv):
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        sys.exit(__doc__.split("\n\n")[1])
    with open(argv[0]) as f:
        advice = json.load(f)
    sim = advice["simulation"]
    calibrated = {a["setting"]: a["compute_ms"] + a["encode_ms"] for a in advice["settings"]}
    measured = {}
    for arg in argv[1:]:
        w, folder = arg.split("=", 1)
        with open(f"{folder}/results.csv") as f:
            measured[int(w)] = {r["setting"]: r for r in csv.DictReader(f)}
    print("| setting | W | simulated step ms | measured step ms | error | simulated network ms "
          "| measured step less compute and encode (ms) | simulated with the measured compute "
          "and encode (ms) | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors, rebased = [], []
    for s in sim["settings"]:
        for p in s["points"]:
            m = measured.get(p["workers"], {}).get(s["setting"])
            if m is None:
                continue
            step = float(m["step_ms_median"])
            rest = step - float(m["compute_ms_median"]) - float(m["encode_ms_median"])
            err = (p["step_ms"] - step) / step
            errors.append(abs(err))
            own = p["step_ms"] - calibrated[s["setting"]] + (step - rest)
            own_err = (own - step) / step
            rebased.append(abs(own_err))
            print(f"| {s['setting']} | {p['workers']} | {p['step_ms']:.1f} | {step:.1f} | "
                  f"{100 * err:+.1f}% | {p['network_ms']:.1f} | {rest:.1f} | {own:.1f} | "
                  f"{100 * own_err:+.1f}% |")
    for name, errs in (("as simulated", errors), ("with the measured compute and encode",
                                                   rebased)):
        if errs:
            print(f"\n{name}: {sum(e <= 0.15 for e in errs)} of {len(errs)} within 15%; median "
                  f"error {100 * statistics.median(errs):.1f}%, largest {100 * max(errs):.1f}%.")


if __name__ == "__main__":
    main(sys.argv[1:])
