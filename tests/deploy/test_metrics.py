"""Live Prometheus metrics (metrics.port): a real job started with deploy/launch.sh, every
daemon's /metrics scraped over HTTP while it trains and parsed with the Prometheus client's own
text-format parser (Debian's python3-prometheus-client). Run by ctest with Debian's python3."""
import os
import pathlib
import random
import re
import socket
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
LAUNCH = ROOT / "deploy" / "launch.sh"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# Scheduler, server 0, server 1, worker 0, worker 1: metrics.port + 0 .. 4.
DAEMONS = [("scheduler", 0), ("server", 0), ("server", 1), ("worker", 0), ("worker", 1)]


def free_base(count):
    """A port p such that p .. p + count - 1 are free on 127.0.0.1 now, below the kernel's
    ephemeral range: no connection another test (or ZeroMQ) makes meanwhile is given one of
    them as its local port, which in the ephemeral range made a daemon's bind fail now and then
    under ctest -j2."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    top = max(10000 + count, ephemeral_low - count)
    for _ in range(200):
        base = random.randint(10000, top)
        socks = []
        try:
            for i in range(count):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free range of ports")


def scrape(port, timeout=2.0):
    """{(name, frozenset(labels)): value} of every sample at 127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    matches = [v for (n, ls), v in samples.items()
               if n == name and all((k, str(x)) in ls for k, x in labels.items())]
    assert len(matches) == 1, f"{name} {labels}: {len(matches)} series"
    return matches[0]


def launch(tmp_path, port, *sets):
    args = [str(LAUNCH), "--quiet", "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"),
            "--set", f"metrics.port={port}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, SPARSEPS_BUILD_DIR=str(BUILD)))


def test_every_daemon_serves_its_metrics_while_the_job_trains(tmp_path):
    base = free_base(len(DAEMONS))
    job = launch(tmp_path, base, "train.epochs=4")
    try:
        # Every endpoint answers within the deadline (the servers' and workers' once their rank
        # is known), with the role and rank labels of its daemon.
        first = {}
        deadline = time.time() + 120
        for i, (role, rank) in enumerate(DAEMONS):
            while True:
                try:
                    first[i] = scrape(base + i)
                    if role != "worker" or value(first[i], "sparseps_worker_iteration") > 0:
                        break
                except (OSError, AssertionError):
                    pass
                assert job.poll() is None, job.stdout.read()
                assert time.time() < deadline, f"no metrics from {role} {rank} on {base + i}"
                time.sleep(0.2)
            ours = [labels for (name, labels) in first[i] if name.startswith("sparseps_")]
            assert ours, f"no sparseps_ series from {role} {rank}"
            for labels in ours:
                assert ("role", role) in labels and ("rank", str(rank)) in labels

        time.sleep(1.5)
        now = {i: scrape(base + i) for i in range(len(DAEMONS))}

        sched = now[0]
        assert value(sched, "sparseps_scheduler_membership_epoch") == 1
        assert value(sched, "sparseps_scheduler_registered_nodes") == 4
        for node in ("server-0", "server-1", "worker-0", "worker-1"):
            assert value(sched, "sparseps_scheduler_missed_heartbeats", node=node) < 3, node
        # One series per node of the job: none for a node before it had a rank.
        nodes = sorted(dict(ls)["node"] for (n, ls) in sched
                       if n == "sparseps_scheduler_missed_heartbeats")
        assert nodes == ["server-0", "server-1", "worker-0", "worker-1"], nodes
        assert value(sched, "sparseps_scheduler_rejected_messages_total", reason="impostor") == 0

        for i in (3, 4):
            w0, w1 = first[i], now[i]
            it0 = value(w0, "sparseps_worker_iteration")
            it1 = value(w1, "sparseps_worker_iteration")
            assert it1 > it0, "the iteration did not move"
            # One histogram observation and one steps_total per step of this process (a scrape
            # is not one instant across series: the step in progress may show in some only).
            steps = value(w1, "sparseps_worker_steps_total")
            assert abs(value(w1, "sparseps_worker_step_seconds_count") - steps) <= 1
            assert abs(value(w1, "sparseps_worker_push_pull_seconds_count") - steps) <= 1
            # Push and pull latency apart (ps): one observation of each per step.
            assert abs(value(w1, "sparseps_worker_push_seconds_count") - steps) <= 1
            assert abs(value(w1, "sparseps_worker_pull_seconds_count") - steps) <= 1
            assert value(w1, "sparseps_worker_pull_seconds_sum") > 0
            assert abs(steps - it1) <= 1  # a fresh run: every step was this process's
            assert value(w1, "sparseps_worker_step_seconds_sum") > 0
            # Bytes by message type: the pushes dominate what is sent, the pull replies what is
            # received; the pull requests are header-only.
            push = value(w1, "sparseps_worker_sent_bytes_total", type="push")
            pull = value(w1, "sparseps_worker_sent_bytes_total", type="pull")
            assert push > 10 * pull > 0, (push, pull)
            assert value(w1, "sparseps_worker_received_bytes_total", type="pull_reply") > 0
            assert value(w1, "sparseps_worker_received_bytes_total", type="push_ack") > 0
            # Top-k at density 0.01 of 235146 parameters: 2351 selected each step.
            assert value(w1, "sparseps_worker_selected_density") == pytest.approx(2351 / 235146,
                                                                                  rel=1e-3)
            assert value(w1, "sparseps_worker_applied_density") == -1  # ps mode
            assert value(w1, "sparseps_worker_residual_norm") > 0  # error feedback holds some

        for i in (1, 2):
            s = now[i]
            version = value(s, "sparseps_server_iteration")
            assert version > 0
            # Two workers push once per iteration; the iteration in progress may hold their
            # pushes, and the scrape may read the two series an iteration apart.
            pushes = value(s, "sparseps_server_pushes_total")
            assert 2 * (version - 1) <= pushes <= 2 * (version + 2), (version, pushes)
            assert value(s, "sparseps_server_received_bytes_total", type="push") > 0
            assert value(s, "sparseps_server_sent_bytes_total", type="pull_reply") > 0
            assert value(s, "sparseps_server_sent_bytes_total", type="push_ack") > 0
            for reason in ("impostor", "over_limit", "stale_push", "malformed_or_unexpected"):
                assert value(s, "sparseps_server_rejected_messages_total", reason=reason) == 0
            assert value(s, "sparseps_server_waiting_pulls") <= 2

        # The job would go on for a while yet (longer under the sanitizers): stop it.
        job.terminate()
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.terminate()
            job.wait(timeout=30)


def test_an_allreduce_workers_refusals_are_counted_in_its_metrics(tmp_path):
    """A stranger's junk to the data ports of an allreduce job's workers (the dense ring) is
    refused, and each worker counts it: sparseps_worker_rejected_messages_total{from="workers"}
    goes from 0 to 1, while the job trains on."""
    import zmq  # Debian's python3-zmq (deploy/install-deps.sh); only this test needs it
    base = free_base(len(DAEMONS))
    job = launch(tmp_path, base, "train.epochs=40", "aggregation=allreduce",
                 "collective.algorithm=ring")
    context = zmq.Context()
    try:
        workers = [base + 3, base + 4]  # the scheduler and the two unused server ports first
        deadline = time.time() + 120
        before = {}
        while len(before) < 2:
            for port in workers:
                try:
                    samples = scrape(port)
                    if value(samples, "sparseps_worker_iteration") > 0:
                        before[port] = samples
                except (OSError, AssertionError):
                    pass
            assert job.poll() is None, job.stdout.read()
            assert time.time() < deadline, "the workers did not train"
            time.sleep(0.2)
        for samples in before.values():
            for source in ("scheduler", "workers"):
                assert value(samples, "sparseps_worker_rejected_messages_total",
                             **{"from": source}) == 0
        log = (tmp_path / "run" / "scheduler.log").read_text()
        ports = [int(p) for p in re.findall(r"registered worker \(.*\) at [0-9.]+:(\d+)", log)]
        assert len(ports) == 2, log
        strangers = []  # kept open until the end: closing one may drop what it has not sent
        for port in ports:
            strangers.append(context.socket(zmq.DEALER))
            strangers[-1].setsockopt(zmq.LINGER, 0)
            strangers[-1].connect(f"tcp://127.0.0.1:{port}")
            strangers[-1].send(b"not a header")
        counts = {}
        while sorted(counts.values()) != [1, 1]:
            counts = {p: value(scrape(p), "sparseps_worker_rejected_messages_total",
                               **{"from": "workers"}) for p in workers}
            assert job.poll() is None, job.stdout.read()
            assert time.time() < deadline, counts
            time.sleep(0.2)
        for port in workers:
            assert value(scrape(port), "sparseps_worker_rejected_messages_total",
                         **{"from": "scheduler"}) == 0
        job.terminate()
        job.communicate(timeout=60)
    finally:
        context.destroy(linger=0)
        if job.poll() is None:
            job.terminate()
            job.wait(timeout=30)


def test_a_metrics_port_in_use_fails_the_daemon_naming_it(tmp_path):
    base = free_base(len(DAEMONS))
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", base))  # the scheduler's
    taken.listen(1)
    try:
        job = launch(tmp_path, base, "train.epochs=1")
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 1, out
        log = (tmp_path / "run" / "scheduler.log").read_text()
        assert f"cannot serve metrics on 127.0.0.1:{base}" in log, log
    finally:
        taken.close()
