"""sparseps.capi, the worker through libsparseps_client's C interface and ctypes, against a real
job (scheduler and servers as daemons, workers as threads): the job's parameters after each
push_pull equal the C++ worker's (tests/python/replay_worker.cc) bitwise, and the update (dense
or sparse) is what they moved by; sparseps.torch's DistributedOptimizer runs on a capi.Worker; a
bad config is a clear error naming the key; Ctrl-C ends a wait; and capi loads where the pybind11
module does not (another Python version)."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import sparseps.torch
from conftest import BUILD, run_threads
from sparseps import capi
from test_worker import BASE, N, SETTINGS, STEPS, gradient, initial, replay, servers_for


@pytest.mark.parametrize("name", ["ps_topk", "ps_sketch_second_round", "allreduce_gtopk"])
def test_push_pull_equals_the_cpp_worker_bitwise(cluster, name):
    sets = SETTINGS[name]
    cpp = replay(cluster(BASE, servers=servers_for(sets), sets=sets), sets, STEPS)
    p = cluster(BASE, servers=servers_for(sets), sets=sets)

    def c_worker(rank):
        w = capi.Worker(str(p.job), rank=rank, overrides=p.overrides + sets)
        params = initial()
        w.init(params)
        assert (w.rank, w.num_workers, w.num_params) == (rank, 2, N)
        before, got = w.params(), []
        for t in range(STEPS):
            if t % 2:
                keys, values, now = w.push_pull(gradient(rank, t), sparse=True)
                after = w.params()
                assert keys.dtype == np.int64 and np.all(np.diff(keys) > 0)
                np.testing.assert_array_equal(now, after[keys])
                update = np.zeros(N, dtype=np.float32)
                update[keys] = values
            else:
                update = w.push_pull(gradient(rank, t), loss=1.0)
                after = w.params()
            got.append((before, update, after))
            before = after
        assert w.step == STEPS and w.bytes_sent > 0 and w.last_step["bytes_sent"] > 0
        assert w.live_workers == [0, 1] and w.get("cluster.num_workers") == 2
        assert w.residual().shape == (N,)
        w.finish()
        w.close()
        return got

    got = run_threads([lambda r=r: c_worker(r) for r in range(2)])
    assert p.wait() == {k: 0 for k in p.wait()}
    for r in range(2):
        for t, (before, update, after) in enumerate(got[r]):
            np.testing.assert_array_equal(after, cpp[r][t], err_msg=f"{name} {r} step {t}")
            np.testing.assert_array_equal(update, before - after, err_msg=f"{name} {r} step {t}")


def test_distributed_optimizer_runs_on_a_capi_worker(cluster):
    """sparseps.torch with a capi.Worker: a list of torch tensors in, every worker starts from
    worker 0's parameters and holds the job's after each plain SGD step."""
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n")

    def worker(rank):
        torch.manual_seed(rank)
        model = torch.nn.Linear(30, 5)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            capi.Worker(str(c.job), rank=rank, overrides=c.overrides))
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 30)).pow(2).mean().backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.testing.assert_array_equal(flat, opt.worker.params())
        opt.worker.finish()
        return start, flat

    (s0, f0), (s1, f1) = run_threads([lambda r=r: worker(r) for r in range(2)])
    for a, b in zip(s0, s1):
        assert torch.equal(a, b), "init did not make worker 0's parameters everyone's"
    np.testing.assert_array_equal(f0, f1)
    assert c.wait() == {k: 0 for k in c.wait()}


def test_ctrl_c_ends_a_wait_as_keyboard_interrupt():
    w = capi.Worker("", overrides=["cluster.scheduler_port=1", "cluster.register_timeout_s=60"])
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="stopped by a signal"):
        w.init(initial())
    assert time.monotonic() - start < 20
    timer.join()
    w.close()


def test_a_bad_config_is_an_error_naming_the_key(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  lr: -1\n")
    with pytest.raises(capi.Error) as e:
        capi.Worker(str(job))
    assert e.value.code == capi.INVALID_ARGUMENT
    assert "job.yaml:2" in str(e.value) and "train.lr" in str(e.value)
    job.write_text("train:\n  lr: 0.1\n  overlap: delay\n")
    with pytest.raises(capi.Error, match="train.overlap: delay"):
        capi.Worker(str(job))


def test_arrays_that_are_not_float32_are_refused_before_the_library_sees_them(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("train: {lr: 0.1}\n")
    w = capi.Worker(str(job))
    with pytest.raises(capi.Error, match="float32"):
        w.init(np.zeros(10, dtype=np.float64))
    w.close()


def test_loads_where_the_pybind_module_does_not():
    """As on a Python the module was not built for: _sparseps cannot be imported, sparseps.capi
    still works, and sparseps.Worker says where to go."""
    code = """
import sys
sys.modules["sparseps._sparseps"] = None  # an import of it now fails, as on another Python
from sparseps import capi
print(capi.library().sparseps_version().decode())
import sparseps
try:
    sparseps.Worker
except ImportError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(BUILD / "python"), "PATH": "/usr/bin:/bin"})
    lines = out.stdout.splitlines()
    assert lines[0].count(".") == 2, out  # the version, "0.1.0"
    assert lines[1].startswith("refused:") and "sparseps import capi" in lines[1], out
