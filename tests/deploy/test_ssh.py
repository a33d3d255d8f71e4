"""deploy/launch.sh --hosts over real OpenSSH: deploy/ssh/local-ssh.sh starts three emulated
hosts (network namespaces), each with an sshd of its own (Debian's openssh-server) and keys made
for the test, and the launcher runs on host 1 as on a login node. Checked: the quickstart trains
across the hosts with every process on its host's address, worker 0's progress streamed and every
host's files copied back; a failing worker, a SIGTERM and a SIGKILL of the launcher each leave no
process of the job on any host; --resume, and --max-restarts after a worker killed on its host
(replaced there, or the whole job restarted), go on to the right end; a bad hosts file is refused
naming its line; sparseps-advise --hosts measures the hosts' shaped links over ssh. Skips, saying
why, only where sshd cannot start (not root, openssh-server missing). With no network namespaces
here the one host is 127.0.0.1. Run by ctest with Debian's python3 -m pytest."""
import csv
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from conftest import ADVISE, advise_inputs, cannot_run, distinct_hosts

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
LOCAL_SSH = ROOT / "deploy" / "ssh" / "local-ssh.sh"
LAUNCH = ROOT / "deploy" / "launch.sh"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
NAMES = ("scheduler", "server-0", "server-1", "worker-0", "worker-1")


class Hosts:
    def __init__(self, tmp):
        self.dir = pathlib.Path(tmp) / "ssh"
        netns = distinct_hosts()
        self.count = 3 if netns else 1
        # A prefix and subnet of this test's own (the process id keeps two runs apart).
        self.args = ["--dir", str(self.dir), "--hosts", str(self.count),
                     "--prefix", f"spss{os.getpid() % 100000}",
                     "--subnet", f"10.{150 + os.getpid() % 100}.0"]

    def up(self):
        r = subprocess.run([str(LOCAL_SSH), "up", *self.args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"local-ssh.sh up failed:\n{r.stdout}\n{r.stderr}"
        self.dests = (self.dir / "hosts").read_text().split()

    def down(self):
        subprocess.run([str(LOCAL_SSH), "down", *self.args], capture_output=True, timeout=120)

    def hosts_file(self, path, lines=None):
        """The quickstart's layout: scheduler and server 0 on host 1, server 1 and worker 0 on
        host 2, worker 1 on host 3 (all on the one host without namespaces)."""
        if lines is None:
            d = self.dests if self.count == 3 else self.dests * 3
            lines = [f"{d[0]} scheduler server   # the login node",
                     f"{d[1]} server worker", "", f"{d[2]} worker"]
        path.write_text("\n".join(lines) + "\n")
        return path

    def launch(self, hosts, run_dir, *sets, wait=True, args=(), env=None):
        """deploy/launch.sh --hosts HOSTS with the quickstart's config into RUN_DIR (env: more
        environment variables for it)."""
        return self._launcher(hosts, run_dir, ["--config", str(QUICKSTART), "--run-dir",
                                               str(run_dir), *args], sets, wait, env)

    def resume(self, hosts, run_dir, *sets):
        """deploy/launch.sh --hosts HOSTS --resume RUN_DIR (the same --remote-dir as launch)."""
        return self._launcher(hosts, run_dir, ["--resume", str(run_dir)], sets, True)

    def _launcher(self, hosts, run_dir, args, sets, wait, env=None):
        cmd = [str(LOCAL_SSH), "run", "--dir", str(self.dir), str(LAUNCH), "--hosts", str(hosts),
               "--remote-dir", str(run_dir) + "-remote", *args]
        for s in sets:
            cmd += ["--set", s]
        env = dict(os.environ, SPARSEPS_BUILD_DIR=str(BUILD), **(env or {}))
        if not wait:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=env, cwd=ROOT)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)


def job_processes(marker):
    """Pids of the processes whose command line names MARKER (the job's remote directory): the
    daemons, the remote shells and the ssh clients of one job."""
    found = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append((int(p.name), cmdline[:120]))
    return found


def assert_none_left(marker, deadline_s=30):
    end = time.time() + deadline_s
    left = job_processes(marker)
    while left and time.time() < end:
        time.sleep(0.2)
        left = job_processes(marker)
    assert not left, f"still running {deadline_s} s after the job ended: {left}"


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        cannot_run("sshd cannot start: it needs root here")
    if not os.access("/usr/sbin/sshd", os.X_OK) or shutil.which("ssh") is None:
        cannot_run("sshd cannot start: openssh-server / openssh-client not installed "
                    "(deploy/install-deps.sh)")
    top = tempfile.mkdtemp(prefix="sparseps-ssh-")
    h = Hosts(top)
    try:
        h.up()
        yield h
    finally:
        h.down()
        shutil.rmtree(top, ignore_errors=True)


def test_quickstart_trains_across_hosts(hosts, tmp_path):
    run_dir = tmp_path / "run"
    r = hosts.launch(hosts.hosts_file(tmp_path / "hosts"), run_dir, "train.epochs=1")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["final_test_accuracy"] >= 0.83, summary
    # Worker 0's progress here; every process's log and the metrics copied back.
    assert re.search(r"eval epoch 1 step \d+: .*test accuracy", r.stdout), r.stdout
    assert "final test accuracy" in r.stdout
    for name in NAMES:
        assert "membership epoch 1" in (run_dir / f"{name}.log").read_text(), name
    for f in ("metrics-worker-0.csv", "metrics-worker-1.csv", "queues-server-1.csv",
              "model.safetensors"):
        assert (run_dir / f).stat().st_size > 0, f
    assert len(summary["servers"]) == 2 and all(s["pushes"] > 0 for s in summary["servers"])
    # Each process bound the address of the host the file put it on.
    addr = {}
    for name in NAMES:
        m = re.search(r'node\.host = "([^"]+)"', (run_dir / f"{name}.log").read_text())
        assert m, name
        addr[name] = m.group(1)
    if hosts.count == 3:
        assert addr["scheduler"] == addr["server-0"] != addr["server-1"] == addr["worker-0"]
        assert len(set(addr.values())) == 3, addr
    # The hosts keep nothing of the job.
    assert not (tmp_path / "run-remote").exists()


def test_a_failing_worker_stops_every_host(hosts, tmp_path):
    """A diverging job (train.lr 900) of three workers, one on the second host and two on the
    third, through a worker command that writes what launch.sh set: each worker's rank among its
    host's workers (SPARSEPS_LOCAL_RANK, its GPU where the host has several) is 0, 0 and 1."""
    run_dir = tmp_path / "run"
    d = hosts.dests if hosts.count == 3 else hosts.dests * 3
    layout = hosts.hosts_file(tmp_path / "hosts", [f"{d[0]} scheduler server",
                                                   f"{d[1]} server worker",
                                                   f"{d[2]} worker worker"])
    wrapper = tmp_path / "worker"
    wrapper.write_text('#!/bin/bash\necho "SPARSEPS_LOCAL_RANK=$SPARSEPS_LOCAL_RANK"\n'
                       f'exec {BUILD}/worker/sparseps-worker "$@"\n')
    wrapper.chmod(0o755)
    r = hosts.launch(layout, run_dir, "train.epochs=1", "train.lr=900", "cluster.num_workers=3",
                     args=("--worker-command", str(wrapper)))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NaN" in r.stdout + r.stderr
    assert_none_left(str(run_dir) + "-remote")
    for name in NAMES + ("worker-2",):
        assert (run_dir / f"{name}.log").exists(), name
    assert json.loads((run_dir / "summary.json").read_text())["status"] != "ok"
    for w, local in enumerate((0, 0, 1)):
        assert f"SPARSEPS_LOCAL_RANK={local}\n" in (run_dir / f"worker-{w}.log").read_text(), w


def wait_for_training(proc, run_dir, deadline_s=120):
    """Until worker 1 trains: its log (streamed here) has the membership and its metrics CSV is
    open on its host (under the job's remote directory; copied here at the end). The membership
    alone came before the CSV, and a signal in between left nothing to copy (a flake seen once
    in a fresh-clone CI run)."""
    end = time.time() + deadline_s
    log = run_dir / "worker-1.log"
    remote = pathlib.Path(str(run_dir) + "-remote")
    while time.time() < end:
        if (log.exists() and "membership epoch 1" in log.read_text()
                and any(remote.rglob("metrics-worker-1.csv"))):
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    pytest.fail(f"no training after {deadline_s} s")


def test_sigterm_stops_every_host_and_copies_the_logs(hosts, tmp_path):
    run_dir = tmp_path / "run"
    proc = hosts.launch(hosts.hosts_file(tmp_path / "hosts"), run_dir, "train.epochs=50",
                        wait=False)
    wait_for_training(proc, run_dir)
    proc.send_signal(signal.SIGTERM)  # what Ctrl-C does (SIGINT) takes the same path
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted; stopping every process" in out
    assert_none_left(str(run_dir) + "-remote")
    assert "stopped by a signal" in (run_dir / "worker-1.log").read_text()
    assert (run_dir / "metrics-worker-1.csv").exists()
    assert not (tmp_path / "run-remote").exists()


def test_a_killed_launcher_leaves_nothing_running(hosts, tmp_path):
    run_dir = tmp_path / "run"
    # The launcher's own temporary folder (mktemp -d: its ssh connections' sockets), which a
    # SIGKILL leaves behind, goes under one of the test's (short: a socket's path is at most
    # 107 bytes), removed at the end.
    keep = tempfile.mkdtemp(prefix="sps-", dir="/tmp")
    try:
        proc = hosts.launch(hosts.hosts_file(tmp_path / "hosts"), run_dir, "train.epochs=50",
                            wait=False, env={"TMPDIR": keep})
        wait_for_training(proc, run_dir)
        proc.kill()
        # Reaped at once, as a shell would: the progress stream's `tail --pid` follows the
        # launcher until then, holding our end of the pipe.
        proc.wait(timeout=60)
        proc.communicate(timeout=60)
        # Each ssh gets SIGTERM as its parent dies; each host then stops its processes.
        assert_none_left(str(run_dir) + "-remote")
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def test_a_job_resumes_across_hosts_from_its_checkpoint(hosts, tmp_path):
    """--resume with --hosts. The run directory here holds every host's files (copied back when
    the job ended); each host gets back its processes' logs, CSVs and checkpoint files, and the
    job goes on from the newest complete checkpoint to the parameters of a job never stopped,
    bitwise (two workers: the servers' sums do not depend on the order); the run directory then
    holds checkpoint.keep checkpoints, not the first run's besides."""
    sets = ("model.hidden=[64]", "data.max_train_samples=6400", "data.max_test_samples=1000",
            "checkpoint.every_steps=20")
    hosts_file = hosts.hosts_file(tmp_path / "hosts")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    r = hosts.launch(hosts_file, whole, *sets, "train.max_steps=80")
    assert r.returncode == 0, r.stdout + r.stderr
    r = hosts.launch(hosts_file, cut, *sets, "train.max_steps=50")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (cut / "checkpoints" / "iter-0000000040" / "MANIFEST.json").exists()
    assert not (tmp_path / "cut-remote").exists()

    r = hosts.resume(hosts_file, cut, "train.max_steps=80")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in NAMES:
        log = (cut / f"{name}.log").read_text()
        assert log.count(" starting (pid ") == 2, name  # the first run's log goes on
    assert re.search(r"resumed from \S*/iter-0000000040/worker-1\.safetensors at iteration 40",
                     (cut / "worker-1.log").read_text())
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    with open(cut / "metrics-worker-1.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == list(range(1, 81))
    assert json.loads((cut / "summary.json").read_text())["status"] == "ok"
    assert not (tmp_path / "cut-remote").exists()
    # checkpoint.keep (2) over what the two runs copied back: the first run's 20 and 40 are gone.
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == \
        ["iter-0000000060", "iter-0000000080"]


def kill_worker_1_after_checkpoint_40(proc, remote):
    """Once the job under `proc` completed its checkpoint of iteration 40 (in its remote directory
    `remote`, which the test's hosts share), worker 1 killed with kill -9 by the pid its host wrote;
    then the launcher's output once it ended."""
    end = time.time() + 120
    while not (remote / "checkpoints" / "iter-0000000040" / "MANIFEST.json").exists():
        assert proc.poll() is None and time.time() < end, proc.stdout.read()
        time.sleep(0.05)
    os.kill(int((remote / "worker-1.pid").read_text()), signal.SIGKILL)
    return proc.communicate(timeout=300)[0]


def test_max_restarts_goes_on_across_hosts_after_a_killed_worker(hosts, tmp_path):
    """--max-restarts with --hosts: worker 1 killed with kill -9 on its host (cluster.
    on_worker_failure: abort), the launcher stops every host, takes their files back and restarts
    the whole job from its newest complete checkpoint, as --resume does; the job ends on the
    parameters of one never stopped, bitwise, with every step's row once."""
    sets = ("model.hidden=[64]", "data.max_train_samples=6400", "data.max_test_samples=1000",
            "checkpoint.every_steps=20", "cluster.on_worker_failure=abort")  # 6 epochs, 300 steps
    hosts_file = hosts.hosts_file(tmp_path / "hosts")
    whole, run = tmp_path / "whole", tmp_path / "run"
    r = hosts.launch(hosts_file, whole, *sets)
    assert r.returncode == 0, r.stdout + r.stderr
    proc = hosts.launch(hosts_file, run, *sets, wait=False, args=("--max-restarts", "1"))
    remote = pathlib.Path(str(run) + "-remote")
    out = kill_worker_1_after_checkpoint_40(proc, remote)
    assert proc.returncode == 0, out
    restarts = (run / "restarts.log").read_text()
    assert "restart 1 of 1 after worker-1 failed: the whole job, from the newest complete " \
        "checkpoint" in restarts, restarts
    assert "resumed from" in (run / "worker-1.log").read_text()
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    with open(run / "metrics-worker-1.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == list(range(1, 301))
    assert not remote.exists()


def test_max_restarts_replaces_a_killed_worker_on_its_host(hosts, tmp_path):
    """--max-restarts with --hosts and cluster.on_worker_failure: continue (the default): worker 1
    killed with kill -9 on its host is started again there with --rejoin while worker 0 goes on;
    the replacement's log and metrics continue the lost worker's, and both end at the job's last
    step (train.max_steps: alone, worker 0 takes the whole of each epoch's data, so the epochs'
    steps depend on how long it was alone; 560 steps after the kill leave the replacement time to
    join under ctest -j2)."""
    sets = ("model.hidden=[64]", "data.max_train_samples=12800", "data.max_test_samples=1000",
            "checkpoint.every_steps=20", "train.max_steps=600")
    run = tmp_path / "run"
    proc = hosts.launch(hosts.hosts_file(tmp_path / "hosts"), run, *sets, wait=False,
                        args=("--max-restarts", "1"))
    remote = pathlib.Path(str(run) + "-remote")
    out = kill_worker_1_after_checkpoint_40(proc, remote)
    assert proc.returncode == 0, out
    assert "restart 1 of 1: worker-1 exited with code 137; a replacement joins the running job " \
        "(--rejoin)" in out, out
    log1 = (run / "worker-1.log").read_text()
    assert log1.count(" starting (pid ") == 2 and "pushing from iteration" in log1, log1
    steps = {}
    for w in (0, 1):
        with open(run / f"metrics-worker-{w}.csv") as f:
            steps[w] = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps[0] == list(range(1, 601))
    assert steps[1][-1] == 600 and steps[1] == sorted(set(steps[1])), steps[1]
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    assert not remote.exists()


def test_a_bad_hosts_file_is_refused_naming_the_line(hosts, tmp_path):
    d = hosts.dests * 3
    cases = [
        ([f"{d[0]} scheduler server:2", f"{d[1]} wrker worker"],
         r"hosts:2: 'wrker' is neither a role"),
        ([f"{d[0]} scheduler server:2 worker"],
         r"lists 2 server\(s\) and 1 worker\(s\); the config has 2 and 2"),
        ([f"{d[0]} scheduler", f"{d[1]} scheduler server:2 worker:2"],
         r"hosts:2: a second scheduler \(the first is on line 1\)"),
        ([f"{d[0]} scheduler server:0 worker:2"], r"the count after ':' must be a positive"),
    ]
    for lines, message in cases:
        r = hosts.launch(hosts.hosts_file(tmp_path / "hosts", lines), tmp_path / "run")
        assert r.returncode == 2, r.stdout + r.stderr
        assert re.search(message, r.stderr), r.stderr
    # A host that does not answer ssh (nothing listens on port 2): named, before anything starts.
    host = d[1].split(":")[0]
    r = hosts.launch(hosts.hosts_file(tmp_path / "hosts", [
        f"{d[0]} scheduler server:2 worker", f"{host}:2 worker"]), tmp_path / "run")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"host {host}:2 (" in r.stderr and "refused" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "scheduler.log").exists()


def test_the_advisor_probes_the_hosts_over_ssh(hosts, tmp_path):
    """sparseps-advise --hosts over the same hosts file, from the login node: probe.py goes over
    ssh to each host's python3; host 1 against hosts 2 and 3, each link shaped to 100 Mbit/s
    (tc tbf both ways): every pair within 20% of 12.5 MB/s each way, the slowest taken."""
    netns = str(ROOT / "deploy" / "netns.sh")
    prefix = hosts.args[hosts.args.index("--prefix") + 1]
    if hosts.count == 3:
        for h in ("1", "2", "3"):
            r = subprocess.run([netns, "shape", "--prefix", prefix, "--rate", "100mbit", h],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
    try:
        cfg, cal = advise_inputs(tmp_path)
        out = tmp_path / "out"
        r = subprocess.run([str(LOCAL_SSH), "run", "--dir", str(hosts.dir), "/usr/bin/python3",
                            str(ADVISE / "sparseps-advise"), "--config", str(cfg),
                            "--calibration", str(cal), "--hosts",
                            str(hosts.hosts_file(tmp_path / "hosts")), "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    finally:
        if hosts.count == 3:
            for h in ("1", "2", "3"):
                subprocess.run([netns, "shape", "--prefix", prefix, "--rate", "10gbit", h],
                               capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr
    net = json.loads((out / "advice.json").read_text())["network"]
    assert [(p["from"], p["to"]) for p in net["pairs"]] == [
        (hosts.dests[0], d) for d in (hosts.dests * 3)[1:3]]
    assert "over ssh, probed (2 pairs" in net["where"]
    assert net["bandwidth_Bps"] == min(min(p["up_Bps"], p["down_Bps"]) for p in net["pairs"])
    if hosts.count == 3:
        for p in net["pairs"]:
            for direction in ("up_Bps", "down_Bps"):
                assert p[direction] == pytest.approx(12.5e6, rel=0.2), p
    # Nothing of the probe is left: no ssh client of these hosts' config, no measure of host 1
    # (other tests may be probing hosts of their own meanwhile).
    assert not [c for _, c in job_processes(str(hosts.dir)) if "python3 -" in c]
    if hosts.count == 3:  # host 1's own address (loopback is everyone's)
        first = socket.gethostbyname(hosts.dests[0].rsplit("@", 1)[-1].split(":")[0])
        assert not job_processes(f"measure --connect {first}:")
