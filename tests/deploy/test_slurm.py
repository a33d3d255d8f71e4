"""deploy/slurm/sparseps.sbatch on a real Slurm: deploy/slurm/local-slurm.sh starts munged,
slurmctld and three slurmd nodes (each an emulated host in a network namespace; one node on
127.0.0.1 where ip netns does not work here), the quickstart is submitted with sbatch and waited
for with a deadline; the accuracy comes from the job's summary.json, the state and exit code from
scontrol; a stopped job resumes with --resume to a never-stopped one's parameters; a worker
killed with kill -9 does not end the job, a killed server ends it with its own exit code, and
with --max-restarts both are replaced and the job completes; a requeued job goes on from its
checkpoint;
sparseps-advise --slurm measures the nodes' shaped links through srun from an allocation. Skips, saying why, only where slurmctld cannot start (not root, Slurm not installed).
Run by ctest with Debian's python3 -m pytest."""
import csv
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import ADVISE, advise_inputs, cannot_run, distinct_hosts
from test_metrics import free_base  # a port below the ephemeral range

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
LOCAL_SLURM = ROOT / "deploy" / "slurm" / "local-slurm.sh"
SBATCH = ROOT / "deploy" / "slurm" / "sparseps.sbatch"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


class Slurm:
    def __init__(self, tmp):
        self.dir = pathlib.Path(tmp) / "slurm"
        netns = distinct_hosts()
        self.nodes = 3 if netns else 1
        # A prefix and subnet of this test's own (the process id keeps two runs apart).
        self.args = ["--dir", str(self.dir), "--nodes", str(self.nodes), "--cpus", "2",
                     "--prefix", f"spsl{os.getpid() % 100000}",
                     "--subnet", f"10.{100 + os.getpid() % 100}.0"]

    def up(self):
        return subprocess.run([str(LOCAL_SLURM), "up", *self.args], capture_output=True,
                              text=True, timeout=120)

    def down(self):
        subprocess.run([str(LOCAL_SLURM), "down", *self.args], capture_output=True, timeout=120)

    def run(self, *cmd, env=None, timeout=60):
        return subprocess.run([str(LOCAL_SLURM), "run", "--dir", str(self.dir), *cmd],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)

    def submit(self, ntasks, *args, env=()):
        env = dict(os.environ, SPARSEPS_BUILD_DIR=str(BUILD),
                   SPARSEPS_SCHEDULER_PORT=str(free_base(1)), **dict(env))
        r = self.run("sbatch", "--parsable", f"--ntasks={ntasks}",
                     f"--output={self.dir}/job-%j.out", str(SBATCH), *args, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def wait(self, job, deadline_s=400):
        """The job's JobState and ExitCode once it has ended; fails naming the state it was
        left in when the deadline passes."""
        end = time.time() + deadline_s
        state = "?"
        while time.time() < end:
            out = self.run("scontrol", "show", "job", "-o", job).stdout
            m = re.search(r"JobState=(\S+)", out)
            state = m.group(1) if m else "?"
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                         "OUT_OF_MEMORY"):
                return state, re.search(r"ExitCode=(\S+)", out).group(1)
            time.sleep(1)
        pytest.fail(f"job {job} still {state} after {deadline_s} s:\n{self.output(job)}")

    def completed(self, job):
        """Waits for the job (wait) and returns its output, asserting that it completed well."""
        state, code = self.wait(job)
        out = self.output(job)
        assert (state, code) == ("COMPLETED", "0:0"), out
        return out

    def output(self, job):
        p = self.dir / f"job-{job}.out"
        return p.read_text() if p.exists() else "(no output file)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        cannot_run("slurmctld cannot start: Slurm's daemons need root here")
    for b in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(b) is None:
            cannot_run(f"slurmctld cannot start: {b} is not installed (deploy/install-deps.sh)")
    # munged wants every directory above its socket searchable by all, which pytest's own
    # temporary directories (mode 0700) are not.
    top = tempfile.mkdtemp(prefix="sparseps-slurm-")
    os.chmod(top, 0o755)
    s = Slurm(top)
    try:
        r = s.up()
        assert r.returncode == 0, f"local-slurm.sh up failed:\n{r.stdout}\n{r.stderr}"
        yield s
    finally:
        s.down()
        shutil.rmtree(top, ignore_errors=True)


def test_quickstart_trains_across_nodes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    # The run directory as a --set (the other tests give --run-dir): the script's logs and the
    # daemons' files land in the same one.
    job = slurm.submit(5, "--config", str(QUICKSTART), "--set", "train.epochs=1",
                       "--set", f"run.dir={run_dir}")
    out = slurm.completed(job)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["final_test_accuracy"] >= 0.83, summary
    # Every process's log in the one run directory, and worker 0's progress in the job output.
    for name in ("scheduler", "server-0", "server-1", "worker-0", "worker-1"):
        assert (run_dir / f"{name}.log").stat().st_size > 0, name
    assert "final test accuracy" in out
    # Each task bound its own node's address: with three nodes, three distinct hosts.
    hosts = set()
    for name in ("scheduler", "server-0", "server-1", "worker-0", "worker-1"):
        m = re.search(r'node\.host = "([^"]+)"', (run_dir / f"{name}.log").read_text())
        assert m, name
        hosts.add(m.group(1))
    assert len(hosts) == slurm.nodes, hosts


@pytest.mark.skipif(not pathlib.Path("/usr/share/datasets/fashion-mnist").exists(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_a_python_training_loop_runs_as_the_workers(slurm, tmp_path):
    """--worker-command: each worker task runs examples/fashion_mnist.py (the MLP through the
    pybind11 module, from the build tree's python/) instead of sparseps-worker, finding the
    scheduler, its rank and its node's address in the task's environment: the job completes,
    each worker's metrics have every step, the leader's progress is in the job's output, and
    the model learns. Three workers on three nodes (6 tasks, block distribution): two share the
    last node, and their local ranks (SPARSEPS_LOCAL_RANK) are 0 and 1."""
    run_dir = tmp_path / "run"
    # The example behind a shell that writes what sparseps.sbatch set into the worker's log.
    wrapper = tmp_path / "worker"
    wrapper.write_text('#!/bin/bash\n'
                       'echo "node $SLURMD_NODENAME SPARSEPS_LOCAL_RANK=$SPARSEPS_LOCAL_RANK"\n'
                       f'exec {sys.executable} {ROOT / "examples" / "fashion_mnist.py"} "$@"\n')
    wrapper.chmod(0o755)
    command = f"{wrapper} --model mlp"
    job = slurm.submit(6, "--config", str(ROOT / "examples" / "torch_cnn.yaml"),
                       "--set", "cluster.num_workers=3", "--set", "train.max_steps=150",
                       "--set", "data.max_test_samples=1000",
                       "--set", "run.progress_interval_s=0.5", "--run-dir", str(run_dir),
                       "--worker-command", command, env={"SPARSEPS_CACHE": str(tmp_path / "c")})
    out = slurm.completed(job)
    assert "progress epoch" in out and "final test accuracy" in out, out
    for w in range(3):
        with open(run_dir / f"metrics-worker-{w}.csv") as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 151)), w
        assert "model: torch mlp" in (run_dir / f"worker-{w}.log").read_text(), w  # the example
    # Each worker's rank among its node's workers (not SLURM_LOCALID, which counts the
    # scheduler's and servers' tasks too): its GPU where the node has several.
    node, local = {}, {}
    for w in range(3):
        log = (run_dir / f"worker-{w}.log").read_text()
        m = re.search(r"node (\S+) SPARSEPS_LOCAL_RANK=(\d+)", log)
        assert m, log
        node[w], local[w] = m.group(1), int(m.group(2))
    assert local == {w: sum(node[v] == node[w] for v in range(w)) for w in range(3)}, (node, local)
    if slurm.nodes == 3:
        assert sorted(local.values()) == [0, 0, 1], (node, local)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert summary["final_test_accuracy"] > 0.7, summary


def test_a_stopped_job_resumes_from_its_checkpoint(slurm, tmp_path):
    """sbatch ... --resume RUN_DIR: a job that stopped (here at train.max_steps 50, as a time
    limit would) goes on from its newest complete checkpoint (iteration 40) with a larger
    max_steps, to the parameters of a job that ran 80 steps at once, bitwise (two workers: the
    servers' sums do not depend on the order), its logs and metrics going on."""
    sets = ["--set", "model.hidden=[64]", "--set", "data.max_train_samples=6400",
            "--set", "data.max_test_samples=1000", "--set", "checkpoint.every_steps=20"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run_dir, steps in ((whole, 80), (cut, 50)):
        job = slurm.submit(5, "--config", str(QUICKSTART), *sets,
                           "--set", f"train.max_steps={steps}", "--run-dir", str(run_dir))
        state, code = slurm.wait(job)
        assert (state, code) == ("COMPLETED", "0:0"), slurm.output(job)
    job = slurm.submit(5, "--resume", str(cut), "--set", "train.max_steps=80")
    out = slurm.completed(job)
    assert "resuming the job in" in out, out
    log1 = (cut / "worker-1.log").read_text()
    assert log1.count(" starting (pid ") == 2, log1
    assert re.search(r"resumed from \S*/iter-0000000040/worker-1\.safetensors at iteration 40",
                     log1), log1
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    with open(cut / "metrics-worker-1.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == list(range(1, 81))
    assert json.loads((cut / "summary.json").read_text())["status"] == "ok"


def test_a_requeued_job_goes_on_from_its_checkpoint(slurm, tmp_path):
    """scontrol requeue of a running job (what a preemption, or a failed node under --requeue,
    does): Slurm cancels it and runs the script again under the same job id, so in the same run
    directory, where it goes on from the newest complete checkpoint; the job completes with every
    step in worker 0's metrics once, and its output keeps both runs."""
    run_dir = tmp_path / "run"
    job = slurm.submit(5, "--config", str(QUICKSTART), "--set", "model.hidden=[32]",
                       "--set", "data.max_train_samples=4096", "--set", "data.max_test_samples=500",
                       "--set", "train.epochs=200", "--set", "train.max_steps=4000",
                       "--set", "checkpoint.every_steps=200", "--run-dir", str(run_dir))
    deadline = time.time() + 120
    while not list((run_dir / "checkpoints").glob("iter-*/MANIFEST.json")):
        assert time.time() < deadline, f"no complete checkpoint:\n{slurm.output(job)}"
        time.sleep(0.05)
    r = slurm.run("scontrol", "requeue", job)
    assert r.returncode == 0, r.stderr
    # A requeued job, once pending again, waits minutes before it may start (Reason=BeginTime):
    # it may start now.
    deadline = time.time() + 60
    while "Reason=BeginTime" not in slurm.run("scontrol", "show", "job", "-o", job).stdout:
        assert time.time() < deadline, slurm.run("scontrol", "show", "job", "-o", job).stdout
        time.sleep(0.2)
    r = slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")
    assert r.returncode == 0, r.stderr
    out = slurm.completed(job)
    assert "requeued (restart 1): going on from the newest complete checkpoint" in out, out
    log0 = (run_dir / "worker-0.log").read_text()
    assert log0.count(" starting (pid ") == 2, log0
    m = re.search(r"resumed from \S*/iter-(\d+)/worker-0\.safetensors at iteration (\d+)", log0)
    assert m and int(m.group(1)) == int(m.group(2)) > 0, log0
    with open(run_dir / "metrics-worker-0.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == list(range(1, 4001))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"


def test_a_failing_training_fails_the_job_with_its_exit_code(slurm, tmp_path):
    # A learning rate that makes the loss NaN within a few steps: the worker exits with 1.
    job = slurm.submit(5, "--config", str(QUICKSTART), "--set", "train.epochs=1",
                       "--set", "train.lr=900", "--run-dir", str(tmp_path / "run"))
    state, code = slurm.wait(job)
    out = slurm.output(job)
    assert (state, code) == ("FAILED", "1:0"), out
    assert "NaN" in out and "the job failed (exit 1)" in out, out


def test_a_killed_worker_does_not_end_the_job(slurm, tmp_path):
    """kill -9 of worker 1's daemon at step 20 of 1,500 (ps mode, cluster.on_worker_failure:
    continue, the default): its task ends well, so srun stops nobody; the scheduler drops the
    worker and worker 0 trains to the end alone. The job completes with exit code 0, its output
    names the lost worker, and summary.json lists it under lost_workers."""
    run_dir = tmp_path / "run"
    job = slurm.submit(5, "--config", str(QUICKSTART), "--set", "model.hidden=[32]",
                       "--set", "data.max_train_samples=4096", "--set", "data.max_test_samples=500",
                       "--set", "train.epochs=100", "--set", "train.max_steps=1500",
                       "--run-dir", str(run_dir))
    metrics, log = run_dir / "metrics-worker-1.csv", run_dir / "worker-1.log"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 20):
        assert time.time() < deadline, f"worker 1 took no 20 steps:\n{slurm.output(job)}"
        time.sleep(0.02)
    pid = int(re.search(r"starting \(pid (\d+)\)", log.read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    out = slurm.completed(job)
    assert "worker-1 exited with code 137; the job goes on without it" in out, out
    assert "worker-1 was lost (exit code 137)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [w["rank"] for w in summary["lost_workers"]] == [1], summary
    with open(run_dir / "metrics-worker-0.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["step"]) == 1500


def test_with_max_restarts_a_killed_worker_and_a_killed_server_are_replaced(slurm, tmp_path):
    """--max-restarts 1: kill -9 of worker 1's daemon at step 20: its task starts it again with
    --rejoin, and the replacement joins the running job; then, once a checkpoint after the join
    is complete, kill -9 of server 1: its task starts a replacement that takes its key range,
    and the job rolls back to that checkpoint. The job completes with exit code 0, worker 0
    reaches the last step, the output names both restarts, and summary.json lists worker 1 as
    lost and joined and server 1 as replaced."""
    run_dir = tmp_path / "run"
    job = slurm.submit(5, "--config", str(QUICKSTART), "--set", "model.hidden=[32]",
                       "--set", "data.max_train_samples=4096", "--set", "data.max_test_samples=500",
                       "--set", "train.epochs=200", "--set", "train.max_steps=4000",
                       "--set", "checkpoint.every_steps=100", "--run-dir", str(run_dir),
                       "--max-restarts", "1")

    def pid_of(name, nth):  # the pid of the nth start (1-based) in the daemon's log
        starts = re.findall(r"starting \(pid (\d+)\)", (run_dir / f"{name}.log").read_text())
        return int(starts[nth - 1]) if len(starts) >= nth else None

    def wait_for(what, done, deadline_s=120):
        end = time.time() + deadline_s
        while not done():
            assert time.time() < end, f"{what}:\n{slurm.output(job)}"
            time.sleep(0.02)

    metrics = run_dir / "metrics-worker-1.csv"
    wait_for("worker 1 took no 20 steps",
             lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 20)
    os.kill(pid_of("worker-1", 1), signal.SIGKILL)
    joined = re.compile(r"joined the running job as worker 1: pushing from iteration (\d+) on")
    wait_for("worker 1's replacement did not join",
             lambda: joined.search((run_dir / "worker-1.log").read_text()))
    after = int(joined.search((run_dir / "worker-1.log").read_text()).group(1))
    wait_for(f"no complete checkpoint after iteration {after}",
             lambda: any(int(m.parent.name[len("iter-"):]) > after
                         for m in (run_dir / "checkpoints").glob("iter-*/MANIFEST.json")))
    os.kill(pid_of("server-1", 1), signal.SIGKILL)
    out = slurm.completed(job)
    assert "worker-1 exited with code 137; restart 1 of 1: a replacement joins the running job" \
        in out, out
    assert "server-1 exited with code 137; restart 1 of 1: a replacement takes its key range" \
        in out, out
    assert "worker-1 was replaced 1 time(s) (exit codes 137)" in out, out
    assert "server-1 was replaced 1 time(s) (exit codes 137)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [w["rank"] for w in summary["lost_workers"]] == [1], summary
    assert [(w["rank"], int(w["iteration"])) for w in summary["joined_workers"]] == \
        [(1, after)], summary
    assert [s["rank"] for s in summary["replaced_servers"]] == [1], summary
    assert pid_of("server-1", 2) is not None and pid_of("worker-1", 2) is not None
    with open(run_dir / "metrics-worker-0.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["step"]) == 4000


def test_with_max_restarts_a_failed_allreduce_job_goes_on_from_its_checkpoint(slurm, tmp_path):
    """Allreduce mode (the ring; 1 + 2 tasks), --max-restarts 1: kill -9 of worker 1 after the
    first complete checkpoint fails the job (an allreduce's group is fixed), and the script runs
    it again in the allocation from that checkpoint, as a requeue would: the job completes with
    exit code 0, its output names the restart, and worker 0's metrics have every step once."""
    run_dir = tmp_path / "run"
    job = slurm.submit(3, "--config", str(QUICKSTART), "--set", "aggregation=allreduce",
                       "--set", "model.hidden=[32]", "--set", "data.max_train_samples=4096",
                       "--set", "data.max_test_samples=500", "--set", "train.epochs=200",
                       "--set", "train.max_steps=4000", "--set", "checkpoint.every_steps=100",
                       "--run-dir", str(run_dir), "--max-restarts", "1")
    deadline = time.time() + 120
    while not list((run_dir / "checkpoints").glob("iter-*/MANIFEST.json")):
        assert time.time() < deadline, f"no complete checkpoint:\n{slurm.output(job)}"
        time.sleep(0.02)
    log = (run_dir / "worker-1.log").read_text()
    os.kill(int(re.search(r"starting \(pid (\d+)\)", log).group(1)), signal.SIGKILL)
    out = slurm.completed(job)
    assert re.search(r"worker-1 failed \(exit code 137\); restart 1 of 1: the whole job from the "
                     r"newest complete checkpoint", out), out
    assert (run_dir / "worker-1.log").read_text().count(" starting (pid ") == 2
    with open(run_dir / "metrics-worker-0.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 4001))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"


def test_a_killed_server_fails_the_job_naming_it(slurm, tmp_path):
    """kill -9 of server 1 (no --max-restarts): nothing replaces it, so its task fails and srun
    stops the others (each then exits with code 1, "stopped by a signal"); the job's exit code is
    the server's own, 137, and the output names it as the process that failed first."""
    run_dir = tmp_path / "run"
    job = slurm.submit(5, "--config", str(QUICKSTART), "--set", "model.hidden=[32]",
                       "--set", "data.max_train_samples=4096", "--set", "data.max_test_samples=500",
                       "--set", "train.epochs=100", "--set", "train.max_steps=1500",
                       "--run-dir", str(run_dir))
    metrics = run_dir / "metrics-worker-0.csv"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 20):
        assert time.time() < deadline, f"worker 0 took no 20 steps:\n{slurm.output(job)}"
        time.sleep(0.02)
    log = (run_dir / "server-1.log").read_text()
    os.kill(int(re.search(r"starting \(pid (\d+)\)", log).group(1)), signal.SIGKILL)
    state, code = slurm.wait(job)
    out = slurm.output(job)
    # Each task's exit code and when it wrote it (the script's verdict), for a failure's message.
    exits = "".join(f"\nexit/{f.name}: {f.read_text().strip()}"
                    for f in sorted((run_dir / "exit").glob("*")))
    assert (state, code) == ("FAILED", "137:0"), out + exits
    assert "server-1 failed first (exit code 137, killed by signal 9)" in out, out + exits
    # The workers srun stopped were stopped, not lost (no SIGPIPE from their output's filter).
    assert "goes on without it" not in out, out
    assert "run directory" in out.splitlines()[-1], out  # the script ran to its end


def test_a_task_count_that_does_not_match_the_config_is_refused(slurm, tmp_path):
    job = slurm.submit(4, "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"))
    state, code = slurm.wait(job, deadline_s=60)
    out = slurm.output(job)
    assert (state, code) == ("FAILED", "2:0"), out
    assert "sbatch --ntasks=5" in out, out


def test_the_advisor_probes_the_allocation_through_srun(slurm, tmp_path):
    """sparseps-advise --slurm inside an sbatch allocation of every node: probe.py runs on each
    node through srun (the script on its stdin), node 1 against nodes 2 and 3, each node's link
    shaped to 100 Mbit/s (tc tbf both ways): every pair at most 20% above 12.5 MB/s each way and
    at least half of it (test_advise.py's probe test says why)."""
    if slurm.nodes < 2:
        cannot_run("one Slurm node only (no network namespaces here): nothing to measure between")
    netns = str(ROOT / "deploy" / "netns.sh")
    prefix = slurm.args[slurm.args.index("--prefix") + 1]
    nodes = [str(k) for k in range(1, slurm.nodes + 1)]
    cfg, cal = advise_inputs(tmp_path)
    out = tmp_path / "out"
    try:
        for k in nodes:
            r = subprocess.run([netns, "shape", "--prefix", prefix, "--rate", "100mbit", k],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        r = slurm.run("sbatch", "--parsable", f"--nodes={slurm.nodes}",
                      f"--ntasks={slurm.nodes}", f"--output={slurm.dir}/job-%j.out", "--wrap",
                      f"/usr/bin/python3 {ADVISE / 'sparseps-advise'} --config {cfg} "
                      f"--calibration {cal} --slurm --out {out}")
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        state, code = slurm.wait(job, deadline_s=300)
    finally:
        for k in nodes:
            subprocess.run([netns, "shape", "--prefix", prefix, "--rate", "10gbit", k],
                           capture_output=True)
    assert (state, code) == ("COMPLETED", "0:0"), slurm.output(job)
    net = json.loads((out / "advice.json").read_text())["network"]
    assert [(p["from"], p["to"]) for p in net["pairs"]] == [
        ("node1", f"node{k}") for k in nodes[1:]]
    for p in net["pairs"]:
        for direction in ("up_Bps", "down_Bps"):
            assert 0.5 * 12.5e6 <= p[direction] <= 1.2 * 12.5e6, p
    assert net["bandwidth_Bps"] == min(min(p["up_Bps"], p["down_Bps"]) for p in net["pairs"])
    assert "best: " in slurm.output(job)
