"""What the deploy tests share: whether a missing part skips a test or fails it, whether this
machine can make the network namespaces that give each emulated host its own address, and
sparseps-advise's inputs (a synthetic calibration) for the tests that probe through ssh, Slurm or
namespaces."""
import csv
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADVISE = ROOT / "deploy" / "advise"
MB = 1e6

# In CI (CI=true: root, deploy/install-deps.sh ran) every part of a test runs as written: a
# missing part fails it instead of narrowing it.
STRICT = os.environ.get("CI", "").lower() not in ("", "0", "false")


def cannot_run(why):
    """Skips the test where a part it needs is missing; fails it in CI."""
    if STRICT:
        pytest.fail(why + " (in CI, where deploy/install-deps.sh ran as root, this is a failure)")
    pytest.skip(why)


def distinct_hosts():
    """True when deploy/netns.sh can make network namespaces here (one address per host).
    Outside CI a machine that cannot falls back to one host; in CI that is a failure."""
    check = subprocess.run([str(ROOT / "deploy" / "netns.sh"), "check"],
                           capture_output=True, text=True)
    if check.returncode != 0 and STRICT:
        pytest.fail("deploy/netns.sh check failed, so the hosts would not be distinct: "
                    + check.stderr.strip())
    return check.returncode == 0


def write_calibration(folder):
    """A comparison folder as sparseps-compare writes it: results.csv, results.md's target and
    each run's evaluations: a dense ring (slow step, reaches at step 60) and PS top-k (fast step,
    reaches at step 90) and SBC (never reaches)."""
    rows = [("ring", 2, 0, 120, 60, 40, 20, 12 * MB, 12 * MB),
            ("ps_topk", 2, 2, 150, 60, 45, 45, 0.3 * MB, 0.6 * MB),
            ("ps_sbc", 2, 2, 120, 60, 30, 30, 0.1 * MB, 0.2 * MB)]
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setting", "method", "workers", "servers", "steps", "step_ms_median",
                    "step_ms_p90", "compute_ms_median", "encode_ms_median", "comm_ms_median",
                    "sent_bytes_per_step", "received_bytes_per_step", "time_to_target_s",
                    "compute_to_target_s", "train_s", "final_accuracy", "final_perplexity",
                    "slow_worker"])
        for name, wk, sv, step, comp, enc, comm, sent, recv in rows:
            w.writerow([name, name, wk, sv, 150, step, step * 1.1, comp, enc, comm, sent, recv,
                        "", "", "", 0.85, "", ""])
    (folder / "results.md").write_text("# c\n\n- target: 83.00% test accuracy (given)\n")
    reach = {"ring": 60, "ps_topk": 90, "ps_sbc": None}
    for name, *_ in rows:
        run = folder / "runs" / name
        run.mkdir(parents=True)
        with open(run / "eval-worker-0.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["epoch", "step", "wall_s", "test_loss", "test_accuracy", "train_s"])
            for step in (30, 60, 90, 120, 150):
                acc = 0.84 if reach[name] is not None and step >= reach[name] else 0.80
                w.writerow([1, step, step * 0.1, 0.5, acc, step * 0.05])


SETTINGS = {"ring": "[aggregation=allreduce, collective.algorithm=ring]",
            "ps_topk": "[aggregation=ps, compression.encoding=topk]",
            "ps_sbc": "[aggregation=ps, compression.encoding=sbc]"}


# The loopback a synthetic calibration keeps (sparseps-advise's loopback.json: the 7.3 Gbit/s
# probe.py measured on this 2-core VM, a round trip of 60 us), so that its advice does not probe
# for 8 s.
LOOPBACK = {"up_Bps": 9.1e8, "down_Bps": 9.3e8, "rtt_s": 6e-5, "bandwidth": 9.1e8, "rtt": 6e-5}


def advise_inputs(folder, settings=("ring", "ps_topk", "ps_sbc"), loopback=LOOPBACK):
    """sparseps-advise's inputs in folder: a comparison config of those settings (2 workers, 2
    servers) and write_calibration's folder, keeping `loopback` as its loopback.json (a dict as
    JSON, a str as it is; None: no file, the advice probes the loopback). Returns (config path,
    calibration path)."""
    cal = folder / "cal"
    cal.mkdir()
    write_calibration(cal)
    if loopback is not None:
        text = loopback if isinstance(loopback, str) else json.dumps(loopback)
        (cal / "loopback.json").write_text(text)
    cfg = folder / "c.yaml"
    cfg.write_text("name: c\njob: j.yaml\nworkers: 2\nservers: 2\nsettings:\n" + "".join(
        f"  - {{name: {s}, set: {SETTINGS[s]}}}\n" for s in settings))
    return cfg, cal
