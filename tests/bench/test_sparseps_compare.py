"""bench/sparseps-compare on synthetic run directories: the numbers it writes to results.csv and
results.md (median and p90 step time, the ratio to gloo, bytes per worker per step, time to the
target accuracy or "not reached", final accuracy) are checked against values computed by hand.
Run by ctest (tests/CMakeLists.txt) with Debian's python3 -m pytest."""
import csv
import importlib.machinery
import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "..")


def load_driver():
    path = os.path.join(SOURCE, "bench", "sparseps-compare")
    loader = importlib.machinery.SourceFileLoader("sparseps_compare", path)
    spec = importlib.util.spec_from_loader("sparseps_compare", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


driver = load_driver()

METRICS = ["step", "epoch", "loss", "bytes_sent", "bytes_received", "selected", "compute_ms",
           "encode_ms", "comm_ms", "wall_s", "applied", "topk_mass"]
EVALS = ["epoch", "step", "wall_s", "test_loss", "test_accuracy", "train_s"]


def write_csv(path, columns, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def make_run(run_dir, steps, step_ms, sent, received, evals, workers=2, losses=None):
    """A run directory as the workers write it. Step i (1-based) of every worker takes
    compute 10 ms, encode 5 ms and comm step_ms(i) - 15 ms, and moves sent(w, i) and
    received(w, i) bytes; evals are (train_s, test_accuracy) pairs, with test losses `losses`
    (0.5 each when None)."""
    os.makedirs(run_dir)
    for w in range(workers):
        rows = [[i, 1, 1.0, sent(w, i), received(w, i), 10, 10.0, 5.0, step_ms(i) - 15.0,
                 0.01 * i, -1, -1] for i in range(1, steps + 1)]
        write_csv(os.path.join(run_dir, f"metrics-worker-{w}.csv"), METRICS, rows)
    write_csv(os.path.join(run_dir, "eval-worker-0.csv"), EVALS,
              [[1, 10 * (j + 1), t + 1.0, 0.5 if losses is None else losses[j], acc, t]
               for j, (t, acc) in enumerate(evals)])


def test_summarize_computes_the_figures(tmp_path):
    run = str(tmp_path / "ps_topk")
    # 20 steps: the first 2 (a tenth) are warm-up and left out. Steps 3..20 take 103..120 ms.
    make_run(run, 20, step_ms=lambda i: 100.0 + i, sent=lambda w, i: 1000 * (w + 1),
             received=lambda w, i: 4000 + i,
             evals=[(1.5, 0.62), (3.0, 0.81), (4.5, 0.85)])
    r = driver.summarize("ps_topk", run, target=0.80, workers=2)
    assert r["steps"] == 20
    # 18 values 103..120: median (111 + 112) / 2; p90 the value at index round(0.9 * 17) = 15.
    assert r["step_ms_median"] == pytest.approx(111.5)
    assert r["step_ms_p90"] == pytest.approx(118.0)
    assert r["compute_ms_median"] == 10.0
    assert r["encode_ms_median"] == 5.0
    assert r["comm_ms_median"] == pytest.approx(96.5)
    # Mean over both workers' steps 3..20: (1000 + 2000) / 2; received 4000 + mean(3..20).
    assert r["sent_bytes_per_step"] == pytest.approx(1500.0)
    assert r["received_bytes_per_step"] == pytest.approx(4011.5)
    # The first evaluation at or above the target, on the training clock; the compute to it:
    # 10 ms a step over the 20 steps done by that evaluation (its step column says 20).
    assert r["time_to_target_s"] == 3.0
    assert r["compute_to_target_s"] == pytest.approx(0.2)
    assert r["final_accuracy"] == 0.85
    assert r["train_s"] == 4.5
    assert r["curve"] == [(1.5, 0.62), (3.0, 0.81), (4.5, 0.85)]


def test_a_run_that_lost_worker_0_is_read_from_the_worker_that_went_on(tmp_path):
    """Worker 0 lost after step 8 of 20: the step figures come from worker 1, which did all 20,
    and the curve joins worker 0's evaluation with those of worker 1, which took over."""
    run = str(tmp_path / "ps_topk")
    make_run(run, 20, step_ms=lambda i: 100.0 + i, sent=lambda w, i: 1000 * (w + 1),
             received=lambda w, i: 4000 + i,
             evals=[(1.5, 0.62), (3.0, 0.81), (4.5, 0.85)])
    path = os.path.join(run, "metrics-worker-0.csv")
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(lines[:9]) + "\n")  # the header and steps 1..8
    path = os.path.join(run, "eval-worker-0.csv")
    with open(path) as f:
        header, first, *later = f.read().splitlines()
    with open(path, "w") as f:
        f.write(f"{header}\n{first}\n")
    with open(os.path.join(run, "eval-worker-1.csv"), "w") as f:
        f.write("\n".join([header] + later) + "\n")
    r = driver.summarize("ps_topk", run, target=0.80, workers=2)
    assert r["steps"] == 20
    assert r["step_ms_median"] == pytest.approx(111.5)
    assert r["curve"] == [(1.5, 0.62), (3.0, 0.81), (4.5, 0.85)]
    assert r["time_to_target_s"] == 3.0 and r["final_accuracy"] == 0.85


def test_target_not_reached_and_missing_runs(tmp_path):
    run = str(tmp_path / "slow")
    make_run(run, 10, step_ms=lambda i: 50.0, sent=lambda w, i: 1, received=lambda w, i: 1,
             evals=[(1.0, 0.5), (2.0, 0.7)])
    r = driver.summarize("slow", run, target=0.80, workers=2)
    assert r["time_to_target_s"] != r["time_to_target_s"]  # NaN: never reached
    assert r["compute_to_target_s"] != r["compute_to_target_s"]
    assert r["final_accuracy"] == 0.7
    assert driver.summarize("none", str(tmp_path / "absent"), 0.8, 2) is None


def read_results(out):
    with open(os.path.join(out, "results.csv")) as f:
        return {r["setting"]: r for r in csv.DictReader(f)}


def test_outputs_hold_the_ratio_to_gloo_and_every_number(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    results = []
    for name, ms, evals in [("gloo", 200.0, [(5.0, 0.79), (10.0, 0.82)]),
                            ("ps_topk", 50.0, [(1.0, 0.81), (2.0, 0.84)]),
                            ("exdyna", 40.0, [(1.0, 0.6), (2.0, 0.7)])]:
        run = str(tmp_path / name)
        make_run(run, 10, step_ms=lambda i, ms=ms: ms, sent=lambda w, i: 2500,
                 received=lambda w, i: 3500, evals=evals)
        results.append(driver.summarize(name, run, target=0.8, workers=2))
    cfg = {"name": "synthetic", "target_accuracy": 0.8}
    header = ["machine: test", "network: loopback (unshaped)", "model: MLP; density 0.01",
              "command: test"]
    driver.write_outputs(out, cfg, header, results)

    csv_rows = read_results(out)
    assert list(csv_rows) == ["gloo", "ps_topk", "exdyna"]
    assert float(csv_rows["ps_topk"]["step_ms_median"]) == 50.0
    assert float(csv_rows["gloo"]["time_to_target_s"]) == 10.0
    assert csv_rows["exdyna"]["time_to_target_s"] == "nan"
    assert float(csv_rows["exdyna"]["final_accuracy"]) == 0.7
    assert float(csv_rows["ps_topk"]["sent_bytes_per_step"]) == 2500.0

    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert "# synthetic" in md
    assert "- machine: test" in md
    # Time to the target first, then the final accuracy, then step time and bytes.
    assert ("| setting | time to target (s) | compute to target (s) | final accuracy | "
            "step ms (median) | p90 | vs gloo |") in md
    # Compute to target: 10 ms of compute a step, all 10 steps done by the reaching evaluation.
    assert "| gloo | 10.0 | 0.1 | 82.00% | 200.0 | 200.0 | 1.00x | 10 / 5 / 185 | 2.5 | 3.5 |" in md
    assert "| ps_topk | 1.0 | 0.1 | 84.00% | 50.0 | 50.0 | 0.25x | 10 / 5 / 35 | 2.5 | 3.5 |" in md
    assert "| exdyna | not reached |  | 70.00% | 40.0 | 40.0 | 0.20x | 10 / 5 / 25 | 2.5 | 3.5 |" \
        in md
    for png in ("step_time.png", "bytes.png", "accuracy.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000, png


def test_a_target_relative_to_a_baseline_is_its_final_accuracy_minus_the_margin(tmp_path):
    """target: {baseline: torch_ddp, minus: 0.005}: the target is the baseline's final accuracy
    minus half a point, and each setting's time to it comes from its own curve."""
    results = []
    for name, evals in [("torch_ddp", [(4.0, 0.80), (8.0, 0.86), (12.0, 0.88)]),
                        ("ps_topk", [(1.0, 0.85), (2.0, 0.876), (3.0, 0.90)]),
                        ("exdyna", [(1.0, 0.80), (2.0, 0.87)])]:
        run = str(tmp_path / name)
        make_run(run, 10, step_ms=lambda i: 50.0, sent=lambda w, i: 1, received=lambda w, i: 1,
                 evals=evals)
        results.append(driver.summarize(name, run, target=0.8, workers=2))
    cfg = {"target": {"baseline": "torch_ddp", "minus": 0.005}}
    target, line = driver.apply_target(cfg, results)
    assert target == pytest.approx(0.875)
    assert line == "target: 87.50% test accuracy (torch_ddp's final 88.00% minus 0.5 point)"
    times = {r["setting"]: r["time_to_target_s"] for r in results}
    assert times["torch_ddp"] == 12.0 and times["ps_topk"] == 2.0
    assert times["exdyna"] != times["exdyna"]  # 0.87 < 0.875: not reached
    # Without the baseline's run there is no target: nothing is reached.
    target, line = driver.apply_target(cfg, results[1:])
    assert target != target and "did not finish" in line
    assert all(r["time_to_target_s"] != r["time_to_target_s"] for r in results[1:])
    # A fixed target_accuracy is still taken as it is.
    target, line = driver.apply_target({"target_accuracy": 0.85}, results)
    assert target == 0.85 and line == "target: 85.0% test accuracy"
    assert results[1]["time_to_target_s"] == 1.0


def test_each_seed_is_judged_against_the_baselines_run_of_the_same_seed(tmp_path):
    """NAME_seedN against BASELINE_seedN's final accuracy minus the margin; NAME (the job's own
    seed) and settings without a seeded baseline against the baseline itself."""
    results = []
    for name, evals in [("ddp", [(4.0, 0.86), (8.0, 0.88)]),
                        ("ddp_seed43", [(4.0, 0.84), (8.0, 0.85)]),
                        ("ps", [(1.0, 0.86), (2.0, 0.875)]),
                        ("ps_seed43", [(1.0, 0.846), (2.0, 0.85)]),
                        ("ps_seed44", [(1.0, 0.846), (2.0, 0.876)])]:
        run = str(tmp_path / name)
        make_run(run, 10, step_ms=lambda i: 50.0, sent=lambda w, i: 1, received=lambda w, i: 1,
                 evals=evals)
        results.append(driver.summarize(name, run, target=0.8, workers=2))
    target, line = driver.apply_target({"target": {"baseline": "ddp", "minus": 0.005}}, results)
    assert target == pytest.approx(0.875)
    assert line.endswith("; NAME_seedN settings against BASELINE_seedN's own end")
    times = {r["setting"]: r["time_to_target_s"] for r in results}
    # Seed 43's target is 0.845: its DDP reaches it at 8 s, its PS top-k at 1 s.
    assert times["ddp_seed43"] == 8.0 and times["ps_seed43"] == 1.0
    assert times["ddp"] == 8.0 and times["ps"] == 2.0
    assert times["ps_seed44"] == 2.0  # no ddp_seed44: the baseline's own target, 0.875


def test_a_perplexity_target_is_the_baselines_final_perplexity_times_the_factor(tmp_path):
    """metric: perplexity (a language model): perplexity = exp(test loss), lower is better; the
    target is the baseline's final perplexity times `times`, and the table and CSV say it."""
    import math
    results = []
    for name, losses in [("torch_ddp", [6.0, 5.5, 5.0]), ("ps_topk", [5.8, 5.01, 4.9]),
                         ("sbc", [6.5, 6.0, 5.5])]:
        run = str(tmp_path / name)
        make_run(run, 10, step_ms=lambda i: 50.0, sent=lambda w, i: 1, received=lambda w, i: 1,
                 evals=[(4.0, 0.1), (8.0, 0.12), (12.0, 0.14)], losses=losses)
        results.append(driver.summarize(name, run, target=0.8, workers=2))
    cfg = {"name": "lm", "metric": "perplexity", "target": {"baseline": "torch_ddp", "times": 1.02}}
    target, line = driver.apply_target(cfg, results)
    assert target == pytest.approx(math.exp(5.0) * 1.02)
    assert line == f"target: test perplexity {target:.2f} (torch_ddp's final {math.exp(5.0):.2f} " \
        "times 1.02)"
    times = {r["setting"]: r["time_to_target_s"] for r in results}
    # exp(5.01) = 149.9 <= 1.02 * exp(5.0) = 151.4: ps_topk reaches it at its second evaluation.
    assert times["torch_ddp"] == 12.0 and times["ps_topk"] == 8.0
    assert times["sbc"] != times["sbc"]
    out = str(tmp_path / "out")
    os.makedirs(out)
    driver.write_outputs(out, cfg, ["m", "n", "o", "c", line], results)
    with open(os.path.join(out, "results.md")) as f:
        text = f.read()
    assert "| time to target (s) | compute to target (s) | final perplexity |" in text
    assert f"| ps_topk | 8.0 | 0.1 | {math.exp(4.9):.2f} |" in text
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert float(rows[2]["final_perplexity"]) == pytest.approx(math.exp(5.5))


def test_without_gloo_there_is_no_ratio(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    run = str(tmp_path / "ring")
    make_run(run, 10, step_ms=lambda i: 30.0, sent=lambda w, i: 1, received=lambda w, i: 1,
             evals=[(1.0, 0.9)])
    driver.write_outputs(out, {"name": "x"}, ["m", "n", "o", "c"],
                         [driver.summarize("ring", run, 0.8, 2)])
    with open(os.path.join(out, "results.md")) as f:
        assert "| ring | 1.0 | 0.1 | 90.00% | 30.0 | 30.0 |  | 10 / 5 / 15 |" in f.read()


def test_bad_comparison_configs_are_refused_naming_the_key(tmp_path, capsys):
    def refused(text):
        path = tmp_path / "cmp.yaml"
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            driver.load_config(str(path))
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "unknown key 'setings'" in refused("job: j.yaml\nworkers: 2\nsetings: []\n")
    assert "key 'workers' is missing" in refused("job: j.yaml\nsettings: []\n")
    assert "name 'a' used twice" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n  - {name: a}\n  - {name: a}\n")
    assert "settings[0] needs a name" in refused("job: j.yaml\nworkers: 2\nsettings:\n  - {}\n")
    assert "slow_worker must be {rank: R, rate: Nmbit}" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n  - {name: a, slow_worker: {rank: 2, rate: 1mbit}}\n")
    assert "loss must be a share of the packets such as 0.1%" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n  - {name: a, loss: 0.01}\n")
    assert "host_sysctl must be a list of net.KEY=VALUE" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n  - {name: a, host_sysctl: [kernel.x=1]}\n")
    assert "slow_worker must be" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n  - {name: a, slow_worker: {rank: 1, rate: fast}}\n")
    assert "with after_s: S (seconds, >= 0)" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n"
        "  - {name: a, slow_worker: {rank: 1, rate: 1mbit, after_s: -5}}\n")
    assert "slow_worker must be" in refused(
        "job: j.yaml\nworkers: 2\nsettings:\n"
        "  - {name: a, slow_worker: {rank: 1, rate: 1mbit, at: 5}}\n")
    assert "key 'target' must be {baseline: SETTING, minus: X}" in refused(
        "job: j.yaml\nworkers: 2\ntarget: {baseline: b, minus: 0.005}\nsettings:\n  - {name: a}\n")
    assert "metric: perplexity needs target" in refused(
        "job: j.yaml\nworkers: 2\nmetric: perplexity\nsettings:\n  - {name: a}\n")
    assert "key 'target' must be {baseline: SETTING, times: X}" in refused(
        "job: j.yaml\nworkers: 2\nmetric: perplexity\ntarget: {baseline: a, minus: 0.005}\n"
        "settings:\n  - {name: a}\n")
    assert "key 'metric' must be accuracy or perplexity" in refused(
        "job: j.yaml\nworkers: 2\nmetric: bleu\nsettings:\n  - {name: a}\n")
    assert "exclude each other" in refused(
        "job: j.yaml\nworkers: 2\ntarget_accuracy: 0.8\ntarget: {baseline: a, minus: 0.005}\n"
        "settings:\n  - {name: a}\n")


def test_a_slow_worker_is_named_in_the_table_and_the_csv(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    run = str(tmp_path / "ssp_slow")
    make_run(run, 10, step_ms=lambda i: 40.0, sent=lambda w, i: 1, received=lambda w, i: 1,
             evals=[(1.0, 0.9)])
    r = driver.summarize("ssp_slow", run, target=0.8, workers=2)
    r["slow_worker"] = "worker 1 at 100mbit"
    driver.write_outputs(out, {"name": "stragglers"}, ["machine: test", "network: x",
                                                       "model: y", "command: z"], [r])
    assert read_results(out)["ssp_slow"]["slow_worker"] == "worker 1 at 100mbit"
    with open(os.path.join(out, "results.md")) as f:
        assert "| ssp_slow (worker 1 at 100mbit) | 1.0 | 0.1 | 90.00% | 40.0 |" in f.read()


def test_scaling_compares_each_worker_count_with_gloo_at_it(tmp_path):
    """Settings of one method at several worker counts: the table gets a W + S column, each
    ratio is against gloo at the same W, and scaling.png is drawn."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    results = []
    for name, method, w, ms in [("gloo_w2", "gloo", 2, 100.0), ("gloo_w4", "gloo", 4, 200.0),
                                ("ps_topk_w2", "ps_topk", 2, 50.0),
                                ("ps_topk_w4", "ps_topk", 4, 50.0)]:
        run = str(tmp_path / name)
        make_run(run, 10, step_ms=lambda i, ms=ms: ms, sent=lambda w, i: 10 * w,
                 received=lambda w, i: 1, evals=[(1.0, 0.9)], workers=w)
        r = driver.summarize(name, run, target=0.8, workers=w)
        r["method"], r["servers"] = method, 2
        results.append(r)
    header = ["machine: test", "network: loopback (unshaped)", "model: MLP; density 0.01",
              "command: test"]
    driver.write_outputs(out, {"name": "scaling"}, header, results)
    rows = read_results(out)
    assert rows["ps_topk_w4"]["workers"] == "4" and rows["ps_topk_w4"]["method"] == "ps_topk"
    # Sent bytes: the mean over all W workers of 10 * w.
    assert float(rows["gloo_w4"]["sent_bytes_per_step"]) == pytest.approx(15.0)
    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert ("| setting | W + S | time to target (s) | compute to target (s) | final accuracy | "
            "step ms (median) |") in md
    assert "| ps_topk_w2 | 2 + 2 | 1.0 | 0.1 | 90.00% | 50.0 | 50.0 | 0.50x |" in md
    assert "| ps_topk_w4 | 4 + 2 | 1.0 | 0.1 | 90.00% | 50.0 | 50.0 | 0.25x |" in md
    assert os.path.getsize(os.path.join(out, "scaling.png")) > 0  # python3-matplotlib: deps


def test_resume_keeps_finished_settings_and_runs_the_rest(tmp_path):
    """--resume --out DIR: a setting whose runs/NAME/finished exists is summarized from its
    files, not run again; one without it is launched (here launch.sh fails at once: the build
    folder holds only a stand-in worker that answers --get), and --resume without --out is an
    error."""
    build = tmp_path / "build"
    (build / "worker").mkdir(parents=True)
    fake = build / "worker" / "sparseps-worker"
    fake.write_text("#!/bin/sh\nprintf '[256, 128]\\n0.01\\n2\\nps\\n'\n")
    fake.chmod(0o755)
    cfg = tmp_path / "c.yaml"
    job = os.path.abspath(os.path.join(SOURCE, "configs", "quickstart.yaml"))
    cfg.write_text(f"name: resumed\njob: {job}\n"
                   "workers: 2\nservers: 1\ntarget_accuracy: 0.8\n"
                   "settings:\n  - {name: kept, set: [compression.encoding=topk]}\n"
                   "  - {name: again, set: [compression.encoding=dense]}\n")
    out = tmp_path / "out"
    for name in ("kept", "again"):  # both ran before; only "kept" finished
        make_run(str(out / "runs" / name), 10, step_ms=lambda i: 40.0, sent=lambda w, i: 1,
                 received=lambda w, i: 1, evals=[(1.0, 0.85)])
    (out / "runs" / "kept" / "finished").write_text("launch.sh ...\nrun: 2026-11-01T10:00:00Z\n")
    driver_path = os.path.join(SOURCE, "bench", "sparseps-compare")
    run = subprocess.run([sys.executable, driver_path, "--config", str(cfg), "--out", str(out),
                          "--resume", "--no-netns", "--build-dir", str(build)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # a setting failed: the exit status says so
    assert "kept: finished before, kept" in run.stdout
    assert "again failed" in run.stderr
    assert list(read_results(str(out))) == ["kept"]
    # The kept setting keeps the invocation that ran it, in results.csv and in its finished file.
    assert read_results(str(out))["kept"]["run"] == "2026-11-01T10:00:00Z"
    assert (out / "runs" / "kept" / "finished").read_text().endswith(
        "run: 2026-11-01T10:00:00Z\n")
    assert not (out / "runs" / "again" / "finished").exists()
    run = subprocess.run([sys.executable, driver_path, "--config", str(cfg), "--resume"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--resume needs --out" in run.stderr


def test_the_seed_table_gives_median_and_range_and_names_seeds_run_apart(tmp_path):
    """Settings run with several seeds get a table of their spread in results.md: the median
    and the range of the time to the target (or how many seeds reached it) and of the final
    accuracy; seeds whose runs came from another invocation than the baseline's run of the same
    seed (added later with --resume) are named after it. Figures computed by hand."""
    early, late = "2026-11-28T10:00:00Z", "2026-11-28T11:00:00Z"
    runs = [("ddp", [(8.0, 0.88)], early), ("ddp_seed43", [(6.0, 0.86)], early),
            ("ddp_seed44", [(7.0, 0.87)], early),
            ("ps", [(1.0, 0.86), (3.0, 0.876)], early),  # 0.875: reached at 3 s
            ("ps_seed43", [(1.0, 0.85), (2.0, 0.856)], late),  # 0.855: at 2 s
            ("ps_seed44", [(1.0, 0.80), (2.0, 0.861)], early),  # 0.865: not reached
            ("gloo", [(9.0, 0.70)], early)]
    results = []
    for name, evals, run in runs:
        make_run(str(tmp_path / name), 10, step_ms=lambda i: 50.0, sent=lambda w, i: 1,
                 received=lambda w, i: 1, evals=evals)
        r = driver.summarize(name, str(tmp_path / name), target=0.8, workers=2)
        r["run"] = run
        results.append(r)
    cfg = {"name": "seeds", "target": {"baseline": "ddp", "minus": 0.005}}
    header = ["machine: test", "network: loopback (unshaped)", "model: MLP", "command: test",
              driver.apply_target(cfg, results)[1]]
    out = str(tmp_path / "out")
    os.makedirs(out)
    driver.write_outputs(out, cfg, header, results)
    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert "| ddp | 3 | 7.0 (6.0–8.0) | 87.00% (86.00%–88.00%) |" in md
    assert "| ps | 3 | reached by 2 of 3 (2.0–3.0) | 86.10% (85.60%–87.60%) |" in md
    assert "| gloo | 1 |" not in md  # one seed: no spread
    assert md.rstrip().endswith(
        "Run in another invocation than ddp's run of the same seed (added with --resume; not "
        "measured beside it): ps (seed43).")
    assert read_results(out)["ps_seed43"]["run"] == late
    # Text as read back from results.csv gives the same table; without `run` nothing is named.
    rows = [{k: str(v) for k, v in r.items() if k != "run"} for r in results]
    table = driver.seed_table(rows, False, "ddp")
    assert "| ps | 3 | reached by 2 of 3 (2.0–3.0) | 86.10% (85.60%–87.60%) |" in table
    assert not any("another invocation" in line for line in table)
    assert driver.seed_table(rows[-1:], False, "ddp") == []


def test_the_accuracy_plot_draws_seeds_as_a_median_run_and_a_band(tmp_path):
    """seed_curves: one entry per setting; with several seeds, the median run (median time and
    value at each evaluation every seed made) and the band (lowest and highest seed, each
    interpolated at every evaluation time within the span all seeds cover). Hand-computed."""
    def result(name, curve):
        return {"setting": name, "curve": curve, "perplexity_curve": []}

    results = [result("ddp", [(1.0, 0.5), (3.0, 0.7)]),
               result("ps", [(1.0, 0.6), (2.0, 0.8), (4.0, 0.9)]),
               result("ps_seed43", [(2.0, 0.4), (4.0, 0.6), (6.0, 0.7)]),
               result("ps_seed44", [(1.5, 0.5), (3.0, 0.7)]),
               result("empty_seed43", [])]
    groups = driver.seed_curves(results, perplexity=False)
    assert [g["name"] for g in groups] == ["ddp", "ps"]
    assert groups[0]["runs"] == [[(1.0, 50.0), (3.0, 70.0)]] and "band" not in groups[0]
    ps = groups[1]
    assert len(ps["runs"]) == 3
    # Two evaluations made by every seed: times (1, 2, 1.5) and (2, 4, 3); values (60, 40, 50)
    # and (80, 60, 70).
    assert ps["median"] == [(1.5, pytest.approx(50.0)), (3.0, pytest.approx(70.0))]
    # The span all three cover: 2 to 3 s; the times of any evaluation there: 2 and 3.
    grid, low, high = ps["band"]
    assert grid == [2.0, 3.0]
    # At 2 s: 80, 40 and 50 + 20 * 0.5 / 1.5; at 3 s: 80 + 10 / 2, 40 + 20 / 2, 70.
    assert low == [pytest.approx(40.0), pytest.approx(50.0)]
    assert high == [pytest.approx(80.0), pytest.approx(85.0)]
    # The plot itself, with the target drawn: written, and not empty.
    out = str(tmp_path / "out")
    os.makedirs(out)
    for r in results:
        r.update({"method": r["setting"], "workers": 2, "servers": 0, "steps": 1,
                  "step_ms_median": 1.0, "step_ms_p90": 1.0, "compute_ms_median": 1.0,
                  "encode_ms_median": 0.0, "comm_ms_median": 0.0, "sent_bytes_per_step": 1.0,
                  "received_bytes_per_step": 1.0, "time_to_target_s": float("nan"),
                  "compute_to_target_s": float("nan"), "train_s": 1.0, "final_accuracy": 0.7,
                  "final_perplexity": float("nan")})
    driver.write_outputs(out, {"name": "bands"}, ["m", "n", "o", "c"], results, target=0.75)
    assert os.path.getsize(os.path.join(out, "accuracy.png")) > 1000


def test_seeds_add_each_settings_runs_of_more_seeds_after_all_first_runs(tmp_path, capsys):
    """`seeds` (top level, or a setting's own, which replaces it) adds NAME_seedN with
    train.seed=N appended to the setting's set, seed by seed after every first run; bad lists
    and names made twice are refused, naming the setting."""
    path = tmp_path / "cmp.yaml"
    path.write_text("job: j.yaml\nworkers: 2\nseeds: [43, 44]\n"
                    "target: {baseline: ddp, minus: 0.005}\nsettings:\n"
                    "  - {name: ddp, set: [aggregation=allreduce], workers: 4}\n"
                    "  - {name: gloo, seeds: []}\n"
                    "  - {name: ps, seeds: [44, 45], worker: python3 w.py}\n")
    cfg = driver.load_config(str(path))
    got = [(s["name"], s.get("set"), s.get("workers"), s.get("worker"))
           for s in cfg["settings"]]
    assert got == [
        ("ddp", ["aggregation=allreduce"], 4, None), ("gloo", None, None, None),
        ("ps", None, None, "python3 w.py"),
        ("ddp_seed43", ["aggregation=allreduce", "train.seed=43"], 4, None),
        ("ddp_seed44", ["aggregation=allreduce", "train.seed=44"], 4, None),
        ("ps_seed44", ["train.seed=44"], None, "python3 w.py"),
        ("ps_seed45", ["train.seed=45"], None, "python3 w.py")]
    assert all("seeds" not in s for s in cfg["settings"])

    def refused(text):
        path.write_text("job: j.yaml\nworkers: 2\n" + text)
        with pytest.raises(SystemExit) as e:
            driver.load_config(str(path))
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "key 'seeds': seeds must be a list of distinct integers" in refused(
        "seeds: 43\nsettings:\n  - {name: a}\n")
    assert "settings[0] (a): seeds must be a list of distinct integers" in refused(
        "settings:\n  - {name: a, seeds: [43, 43]}\n")
    assert "setting 'a_seed43' is made by `seeds` and named in settings too" in refused(
        "settings:\n  - {name: a, seeds: [43]}\n  - {name: a_seed43}\n")
