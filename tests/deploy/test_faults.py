"""Network faults on emulated hosts (deploy/netns.sh loss / cut / heal: iptables rules inside each
host's network namespace), the quickstart job started by deploy/launch.sh --netns as users start
it. Hosts: 1 the scheduler and server 0, 2 server 1, 3 worker 0, 4 worker 1.

- Random loss of 0.1% and 1% of the packets arriving at every host: the job ends as without loss,
  to the same accuracy (TCP resends; two workers' sums do not depend on arrival order).
- A worker's host cut off for less than cluster.heartbeat_timeout_s: nobody is lost, the same
  accuracy; for longer: the scheduler drops the worker, which exits with code 3 naming the
  scheduler it lost, and the job ends without it at the quickstart's accuracy.
- A server's host cut off past the timeout, with --max-restarts: a replacement takes its key range,
  the job rolls back to its newest checkpoint and ends at the accuracy.
- The scheduler's host cut off for good: every process on another host ends naming the scheduler,
  and the launcher ends the job with an error within a deadline.

Needs root (ip netns, iptables): skips elsewhere, fails in CI (tests/deploy/conftest.py). Run by
ctest with Debian's python3 -m pytest."""
import json
import os
import subprocess
import time
import uuid

import pytest

from conftest import ROOT, cannot_run

NETNS = str(ROOT / "deploy" / "netns.sh")
BUILD = os.environ.get("SPARSEPS_BUILD_DIR", str(ROOT / "build"))
TIMEOUT_S = 6  # cluster.heartbeat_timeout_s of these jobs (heartbeats every 0.5 s)
# 3 of the quickstart's 6 epochs (1,404 steps, 87.3% when measured) where a test checks the
# accuracy (>= 0.85, which 2 epochs come too close to); 2 (936 steps) where a job's accuracy is
# only compared with the baseline's, bit for bit. Every fault below starts by step 500.
SETS = ["cluster.heartbeat_interval_s=0.5", f"cluster.heartbeat_timeout_s={TIMEOUT_S}"]
SAME_AS_BASELINE_EPOCHS = 2


def netns(*args):
    return subprocess.run([NETNS, *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def hosts():
    """Four emulated hosts at 1 Gbit/s on a prefix of these tests' own, deleted afterwards."""
    check = subprocess.run([NETNS, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        cannot_run("network namespaces unavailable: " + check.stderr.strip())
    if subprocess.run(["sh", "-c", "command -v iptables"], capture_output=True).returncode != 0:
        cannot_run("iptables not installed (deploy/install-deps.sh)")
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        cannot_run("Fashion-MNIST not installed (dataset-fashion-mnist)")
    prefix = "flt" + uuid.uuid4().hex[:5]
    netns("up", "--prefix", prefix, "--hosts", "4", "--rate", "1gbit")
    try:
        yield prefix
    finally:
        subprocess.run([NETNS, "down", "--prefix", prefix], capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed, "namespaces left behind: " + listed


class Job:
    """deploy/launch.sh --netns on the hosts: the quickstart (2 servers, 2 workers), `epochs`."""

    def __init__(self, prefix, run_dir, extra=(), epochs=3):
        self.run_dir = str(run_dir)
        os.makedirs(os.path.dirname(self.run_dir), exist_ok=True)
        self.log = open(os.path.join(os.path.dirname(self.run_dir), "launch.log"), "w")
        cmd = [str(ROOT / "deploy" / "launch.sh"), "--build-dir", BUILD, "--run-dir", self.run_dir,
               "--netns", prefix, "--quiet", "--config", str(ROOT / "configs" / "quickstart.yaml")]
        for kv in SETS + [f"train.epochs={epochs}"]:
            cmd += ["--set", kv]
        self.proc = subprocess.Popen(cmd + list(extra), stdout=self.log, stderr=subprocess.STDOUT)

    def wait_step(self, step, timeout=120):
        """Waits until worker 0 has logged `step` steps in its metrics."""
        path = os.path.join(self.run_dir, "metrics-worker-0.csv")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the job ended early:\n" + self.output()
            if os.path.exists(path):
                with open(path) as f:
                    if sum(1 for _ in f) > step:
                        return
            time.sleep(0.1)
        pytest.fail(f"worker 0 did not reach step {step} in {timeout} s:\n" + self.output())

    def wait(self, timeout=240):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # launch.sh stops every process it started
            self.proc.wait(30)
            pytest.fail(f"the job still ran {timeout} s on:\n" + self.output())

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def file(self, name):
        with open(os.path.join(self.run_dir, name)) as f:
            return f.read()

    def summary(self):
        return json.loads(self.file("summary.json"))


@pytest.fixture(autouse=True)
def healed(request):
    """Every fault a test made is gone before the next test."""
    yield
    if "hosts" in request.fixturenames:
        netns("heal", "--prefix", request.getfixturevalue("hosts"))


def cut_for(prefix, host, seconds):
    netns("cut", "--prefix", prefix, str(host))
    try:
        time.sleep(seconds)
    finally:
        netns("heal", "--prefix", prefix, str(host))


@pytest.fixture(scope="module")
def baseline(hosts, tmp_path_factory):
    """The job's accuracy on these hosts without a fault (SAME_AS_BASELINE_EPOCHS)."""
    job = Job(hosts, tmp_path_factory.mktemp("baseline") / "run", epochs=SAME_AS_BASELINE_EPOCHS)
    assert job.wait() == 0, job.output()
    return job.summary()["final_test_accuracy"]


@pytest.mark.parametrize("loss", ["0.1%", "1%"])
def test_random_loss_on_every_host_changes_nothing_but_time(hosts, baseline, tmp_path, loss):
    netns("loss", "--prefix", hosts, loss)
    rules = subprocess.run(["ip", "netns", "exec", f"{hosts}-h3", "iptables", "-S", "INPUT"],
                           capture_output=True, text=True).stdout
    assert "sparseps-fault-loss" in rules and "--probability" in rules, rules
    job = Job(hosts, tmp_path / "lossy" / "run", epochs=SAME_AS_BASELINE_EPOCHS)
    assert job.wait() == 0, job.output()
    s = job.summary()
    assert s["status"] == "ok"
    assert s["final_test_accuracy"] == baseline  # nothing lost, nothing counted twice
    assert all(w["steps_run"] == s["steps"] for w in s["workers"])


def test_a_worker_cut_off_for_less_than_the_timeout_is_not_lost(hosts, baseline, tmp_path):
    job = Job(hosts, tmp_path / "short" / "run", epochs=SAME_AS_BASELINE_EPOCHS)
    job.wait_step(300)
    cut_for(hosts, 4, TIMEOUT_S / 4)
    assert job.wait() == 0, job.output()
    s = job.summary()
    assert s["status"] == "ok" and s["final_test_accuracy"] == baseline
    assert "removed" not in job.file("scheduler.log")
    assert all(w["steps_run"] == s["steps"] for w in s["workers"])


def test_a_worker_cut_off_for_longer_is_dropped_and_the_job_ends_without_it(hosts, tmp_path):
    job = Job(hosts, tmp_path / "long" / "run")
    job.wait_step(300)
    cut_for(hosts, 4, TIMEOUT_S + 4)
    assert job.wait() == 0, job.output()
    out = job.output()
    assert "worker-1 exited with code 3; the job goes on without it" in out, out
    assert "dead or unreachable" in job.file("worker-1.log")
    assert "worker 1" in job.file("scheduler.log") and "removed" in job.file("scheduler.log")
    s = job.summary()
    assert s["status"] == "ok", s
    assert s["final_test_accuracy"] >= 0.85, s


def test_a_server_cut_off_past_the_timeout_is_replaced_and_the_job_rolls_back(hosts, tmp_path):
    job = Job(hosts, tmp_path / "server" / "run",
              ["--set", "checkpoint.every_steps=200", "--max-restarts", "2"])
    job.wait_step(500)
    cut_for(hosts, 2, TIMEOUT_S + 4)
    assert job.wait() == 0, job.output()
    restarts = job.file("restarts.log")
    assert "server-1" in restarts, restarts
    assert "dead or unreachable" in job.file("server-1.log")
    s = job.summary()
    assert s["status"] == "ok", s
    assert s["final_test_accuracy"] >= 0.85, s


def test_the_schedulers_host_cut_off_ends_every_process_naming_it(hosts, tmp_path):
    job = Job(hosts, tmp_path / "scheduler" / "run")
    job.wait_step(300)
    netns("cut", "--prefix", hosts, "1")
    start = time.monotonic()
    try:
        rc = job.wait(timeout=TIMEOUT_S + 60)
    finally:
        netns("heal", "--prefix", hosts, "1")
    assert rc == 1, job.output()
    assert time.monotonic() - start < TIMEOUT_S + 30
    # The processes on the other hosts named the scheduler they lost (server 0 shares its host).
    for name in ("server-1", "worker-0", "worker-1"):
        log = job.file(f"{name}.log")
        assert "the scheduler at tcp://" in log and "dead or unreachable" in log, name
