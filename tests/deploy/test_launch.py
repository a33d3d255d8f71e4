"""deploy/launch.sh with a run directory used before (--run-dir of an earlier job, as
bench/sparseps-compare --resume does for a setting that did not finish): the stale
scheduler.port of the last job must not send the workers to a dead scheduler; its supervision
once the job ended, and of a replacement that comes after the end; a whole job stopped and
continued. Run by ctest with Debian's python3 -m pytest."""
import json
import os
import signal
import subprocess
import time

import pytest
from conftest import ROOT, cannot_run

BUILD = os.environ.get("SPARSEPS_BUILD_DIR", str(ROOT / "build"))


def test_a_reused_run_directory_starts_a_fresh_job(tmp_path):
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        cannot_run("Fashion-MNIST not installed (dataset-fashion-mnist)")
    run = tmp_path / "run"
    run.mkdir()
    # What a finished (or killed) job leaves: the port its scheduler had, and its summary.
    (run / "scheduler.port").write_text("1\n")
    (run / "summary.json").write_text('{"status": "an old job"}\n')
    cmd = [str(ROOT / "deploy" / "launch.sh"), "--build-dir", BUILD, "--run-dir", str(run),
           "--quiet", "--config", str(ROOT / "configs" / "quickstart.yaml"),
           "--set", "model.hidden=[32]", "--set", "data.max_train_samples=2048",
           "--set", "data.max_test_samples=500", "--set", "train.max_steps=20",
           "--set", "cluster.register_timeout_s=20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (run / "scheduler.port").read_text().strip() != "1"
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"


STAND_IN = """#!/bin/bash
# A stand-in for sparseps-{role}: --get goes to the real worker (launch.sh reads the config so);
# otherwise it finds run.dir, {action}
for a in "$@"; do [[ $a == --get ]] && exec "{real}" "$@"; done
# What launch.sh sets per worker (its GPU on a host with several), into the worker's log.
echo "SPARSEPS_LOCAL_RANK=$SPARSEPS_LOCAL_RANK"
for a in "$@"; do [[ $a == run.dir=* ]] && dir="${{a#run.dir=}}"; done
echo "started: $*" >>"$dir/{role}.starts"
{body}
"""


def test_nothing_is_restarted_once_the_scheduler_ended_the_job(tmp_path):
    """With --max-restarts: the scheduler exits 0 (the job ended), then server 0 exits with code 3
    (the scheduler fell silent before its SHUTDOWN reached it), which mid-job would start a
    replacement. After the end launch.sh restarts nothing, says why, and exits 0. The daemons are
    stand-ins (SPARSEPS_BIN_DIR: shell scripts that exit with these codes), since what is tested is
    launch.sh's supervision; tests/common/control_client_test.cc has a worker's side of it."""
    bins = tmp_path / "bin"
    bins.mkdir()
    real = os.path.join(BUILD, "worker", "sparseps-worker")
    bodies = {
        "scheduler": ("writes a port and ends the job", 'echo 1 >"$dir/scheduler.port"; sleep 1'),
        "server": ("outlives the scheduler and exits with code 3", "sleep 3; exit 3"),
        "worker": ("ends well", "sleep 0.5"),
    }
    for role, (action, body) in bodies.items():
        path = bins / f"sparseps-{role}"
        path.write_text(STAND_IN.format(role=role, action=action, real=real, body=body))
        path.chmod(0o755)
    run = tmp_path / "run"
    cmd = [str(ROOT / "deploy" / "launch.sh"), "--run-dir", str(run), "--quiet",
           "--max-restarts", "2", "--config", str(ROOT / "configs" / "quickstart.yaml"),
           "--set", "cluster.num_servers=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SPARSEPS_BIN_DIR": str(bins)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "server-0 exited with code 3 after the job had ended" in out.stderr, out.stderr
    assert not (run / "restarts.log").exists(), out.stderr
    starts = {r: len((run / f"{r}.starts").read_text().splitlines()) for r in bodies}
    assert starts == {"scheduler": 1, "server": 1, "worker": 2}, starts


def launch_and_act(cmd, metrics, act, steps=20):
    """Runs launch.sh (cmd) in a session of its own; once `metrics` (a worker's CSV) has more
    than `steps` rows, calls act(launcher), then waits for the end. Returns (exit code, output);
    the session is killed if anything fails on the way."""
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > steps):
            assert time.time() < deadline and launcher.poll() is None, f"no step {steps}"
            time.sleep(0.02)
        act(launcher)
        out, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    return launcher.returncode, out


SLOW_REPLACEMENT = """#!/bin/bash
# sparseps-worker, but a replacement (--rejoin) starts only after the job ended: the scheduler
# wrote summary.json, and a second later has exited.
# What launch.sh sets per worker (its GPU on a host with several), into the worker's log.
echo "SPARSEPS_LOCAL_RANK=$SPARSEPS_LOCAL_RANK"
for a in "$@"; do [[ $a == run.dir=* ]] && dir="${{a#run.dir=}}"; done
if [[ " $* " == *" --rejoin "* ]]; then
  while [[ ! -e "$dir/summary.json" ]]; do sleep 0.05; done
  sleep 1
fi
exec "{real}" "$@"
"""


def test_a_replacement_that_comes_after_the_end_does_not_fail_the_job(tmp_path):
    """--max-restarts 1, worker 1 killed with kill -9 at step 20 of 300: launch.sh starts a
    replacement, which here starts only after worker 0 alone ended the job and the scheduler
    exited (a replacement slow to start, as a Python one importing torch: ci85). It finds the
    scheduler's port refusing connections and exits with code 3 after
    cluster.heartbeat_timeout_s, saying the job may have ended; launch.sh takes code 3 after the
    end as finished and exits 0. (Unanswered, it waited 70 s and exited 1, failing the launch.)"""
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        cannot_run("Fashion-MNIST not installed (dataset-fashion-mnist)")
    wrapper = tmp_path / "slow-replacement"
    wrapper.write_text(SLOW_REPLACEMENT.format(
        real=os.path.join(BUILD, "worker", "sparseps-worker")))
    wrapper.chmod(0o755)
    run = tmp_path / "run"
    cmd = [str(ROOT / "deploy" / "launch.sh"), "--build-dir", BUILD, "--run-dir", str(run),
           "--quiet", "--max-restarts", "1", "--worker-command", str(wrapper),
           "--config", str(ROOT / "configs" / "quickstart.yaml"),
           "--set", "model.hidden=[32]", "--set", "data.max_train_samples=4096",
           "--set", "data.max_test_samples=500", "--set", "train.epochs=100",
           "--set", "train.max_steps=300",
           "--set", "cluster.heartbeat_interval_s=0.25", "--set", "cluster.heartbeat_timeout_s=4"]
    def kill_worker1(_):
        log = (run / "worker-1.log").read_text()
        os.kill(int(log.split("starting (pid ", 1)[1].split(")", 1)[0]), signal.SIGKILL)

    code, out = launch_and_act(cmd, run / "metrics-worker-1.csv", kill_worker1)
    assert code == 0, out
    assert "restart 1 of 1: worker-1 exited with code 137" in out, out
    assert "worker-1 exited with code 3 after the job had ended" in out, out
    log = (run / "worker-1.log").read_text()
    assert "no scheduler at tcp://" in log and "has the job ended" in log, log
    # Each worker's rank among this host's workers, the replacement's its predecessor's.
    assert log.count("SPARSEPS_LOCAL_RANK=1\n") == 2, log
    assert "SPARSEPS_LOCAL_RANK=0\n" in (run / "worker-0.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["joined_workers"] == [], summary


def test_a_job_stopped_whole_past_its_timeouts_goes_on(tmp_path):
    """The whole job stopped (as Ctrl-Z of launch.sh in a terminal stops its process group) for
    longer than cluster.heartbeat_timeout_s, request_timeout_s and barrier_timeout_s, then
    continued (fg): nobody is declared dead (the scheduler does not count the time it was stopped
    as the nodes' silence, nor a node as the scheduler's), no wait times out (the deadlines leave
    the stop out) and the job ends well, with no worker lost; summary.json's wall_clock_s counts
    the stop."""
    if os.environ.get("SPARSEPS_SANITIZE"):
        pytest.skip("a whole job and an 8 s stop: the plain build only (common_test's "
                    "StoppedTimeTest runs under the sanitizers)")
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        cannot_run("Fashion-MNIST not installed (dataset-fashion-mnist)")
    run = tmp_path / "run"
    cmd = [str(ROOT / "deploy" / "launch.sh"), "--build-dir", BUILD, "--run-dir", str(run),
           "--quiet", "--config", str(ROOT / "configs" / "quickstart.yaml"),
           "--set", "model.hidden=[32]", "--set", "data.max_train_samples=4096",
           "--set", "data.max_test_samples=500", "--set", "train.epochs=100",
           "--set", "train.max_steps=1500",
           "--set", "cluster.heartbeat_interval_s=0.25", "--set", "cluster.heartbeat_timeout_s=5",
           "--set", "cluster.request_timeout_s=6", "--set", "cluster.barrier_timeout_s=6"]
    def stop_the_whole_job(launcher):
        os.killpg(launcher.pid, signal.SIGSTOP)
        time.sleep(8)
        os.killpg(launcher.pid, signal.SIGCONT)

    metrics = run / "metrics-worker-0.csv"
    code, out = launch_and_act(cmd, metrics, stop_the_whole_job)
    assert code == 0, out
    last = int(metrics.read_text().splitlines()[-1].split(",")[0])
    assert last == 1500, last
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["lost_workers"] == [], summary
    assert summary["wall_clock_s"] >= 8, summary
    assert "the scheduler did not run for" in (run / "scheduler.log").read_text()
