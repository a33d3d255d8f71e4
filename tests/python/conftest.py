"""Test support for the Python module: a sparseps job's scheduler and servers started as the real
daemons (from the build, SPARSEPS_BUILD_DIR), stopped by pid when a test ends, and workers run as
threads of the test (each sparseps.Worker releases the GIL while it waits)."""
import atexit
import csv
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
DATA = pathlib.Path("/usr/share/datasets/fashion-mnist")
_example_cache = None


def example_env(**extra):
    """The environment of an example's job: this one with SPARSEPS_CACHE, the examples' data cache
    of this pytest run (one temporary directory for every example job of the run: Fashion-MNIST
    unpacked into it once, about 0.5 CPU-s, instead of in each job; the examples replace its files
    atomically; removed when the run ends), and `extra`."""
    global _example_cache
    if _example_cache is None:
        _example_cache = tempfile.mkdtemp(prefix="sparseps-examples-")
        atexit.register(shutil.rmtree, _example_cache, True)
    return dict(os.environ, SPARSEPS_CACHE=_example_cache, **extra)


class Cluster:
    """A scheduler and `servers` servers for the job `config` (YAML text) with the `sets`
    overrides ("key=value"), on loopback. Its workers need `overrides` on top of the same."""

    def __init__(self, tmp, config, servers, workers, sets):
        self.dir = pathlib.Path(tmp)
        self.dir.mkdir(parents=True)
        self.run_dir = self.dir / "run"
        self.job = self.dir / "job.yaml"
        self.job.write_text(config)
        common = ["--config", str(self.job), "--set", f"run.dir={self.run_dir}",
                  "--set", f"cluster.num_servers={max(servers, 1)}",
                  "--set", f"cluster.num_workers={workers}"]
        for s in sets:
            common += ["--set", s]
        self.procs = []
        self._start("scheduler", BUILD / "scheduler" / "sparseps-scheduler", common +
                    ["--set", "cluster.scheduler_port=0"])
        port_file = self.run_dir / "scheduler.port"
        deadline = time.time() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.time() > deadline or self.procs[0][1].poll() is not None:
                raise RuntimeError("the scheduler did not start:\n" + self.log("scheduler"))
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        # What every node of the job needs besides the config file.
        self.overrides = [f"run.dir={self.run_dir}", f"cluster.scheduler_port={self.port}",
                          f"cluster.num_servers={max(servers, 1)}",
                          f"cluster.num_workers={workers}"]
        self._common = common
        for s in range(servers):
            self.start_server(s)

    def start_server(self, rank, extra=()):
        """Starts server `rank` (again: extra=["--rejoin"] for a replacement of a lost one)."""
        name = f"server-{rank}" + ("-replacement" if "--rejoin" in extra else "")
        self._start(name, BUILD / "server" / "sparseps-server",
                    self._common + ["--set", f"cluster.scheduler_port={self.port}",
                                    "--set", f"node.rank={rank}"] + list(extra))

    def kill(self, name):
        """kill -9 of the daemon `name` ("server-0"), by its pid."""
        p = dict(self.procs)[name]
        p.kill()
        p.wait()

    def _start(self, name, binary, args):
        log = open(self.dir / f"{name}.log", "w")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self.procs.append((name, subprocess.Popen([str(binary)] + args, stdout=log,
                                                  stderr=subprocess.STDOUT, env=env)))

    def log(self, name):
        return (self.dir / f"{name}.log").read_text()

    def wait(self, timeout=60):
        """Waits for every daemon to exit; returns {name: exit code}."""
        deadline = time.time() + timeout
        codes = {}
        for name, p in self.procs:
            try:
                codes[name] = p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def stop(self):
        for _, p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def cluster(tmp_path):
    """cluster(config_text, servers=2, workers=2, sets=()) -> Cluster; stopped when the test
    ends."""
    made = []

    def make(config, servers=2, workers=2, sets=()):
        c = Cluster(tmp_path / f"job{len(made)}", config, servers, workers, sets)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def run_threads(targets, timeout_s=120):
    """Runs each callable on a thread of its own; returns their results, raising the first
    exception one of them raised. A thread still running after timeout_s (in all) fails the
    test: its assertions have not all run, and a late exception would be lost."""
    results = [None] * len(targets)
    errors = []

    def wrap(i, f):
        try:
            results[i] = f()
        except BaseException as e:  # noqa: B902 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i, f), daemon=True)
               for i, f in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise AssertionError(f"threads {hung} of {len(threads)} still running after {timeout_s} s")
    return results


DDP_HOOK_SETS = ["aggregation=allreduce", "collective.algorithm=topk_allgather", "train.lr=1",
                 "train.momentum=0", "compression.density=0.1"]
# The DDP hook through the servers (aggregation: ps, BSP): top-k 10% at the workers.
PS_HOOK_SETS = ["aggregation=ps", "compression.encoding=topk", "train.lr=1", "train.momentum=0",
                "compression.density=0.1"]


def run_ddp_workers(c, tmp_path, device, args=(), sets=(), name="ddp", hook_sets=DDP_HOOK_SETS,
                    during=None):
    """Two processes of tests/python/ddp_worker.py on cluster `c` (started with hook_sets +
    sets), the model on `device`, each given `args`; during(): called once they run; returns
    what each saved (None for one that stopped early: --stop-after)."""
    import torch  # only the tests that use it need it
    init = tmp_path / f"{name}_init"
    outs = [tmp_path / f"{name}-{r}.pt" for r in range(2)]
    env = dict(os.environ, DDP_DEVICE=device)
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "python" / "ddp_worker.py"), str(r), "2", str(init),
         str(c.job), str(outs[r])] + list(args) +
        sum((["--set", s] for s in c.overrides + list(hook_sets) + list(sets)), []),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    try:
        if during:
            during()
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [torch.load(o) if o.exists() else None for o in outs]


def ddp_hook_keeps_the_workers_equal_and_sparse(cluster, tmp_path, device, method="allgather",
                                                bucket_view=False):
    """Two processes of tests/python/ddp_worker.py (DDP with sparse_allreduce_hook, the model on
    `device`; method: TopK-AllGather, "ps" through the job's servers, or sparseps's dense
    "ring"; bucket_view: DDP's gradient_as_bucket_view): their final models are equal, each
    step's averaged gradient holds at most the union of the two workers' k entries (the ring's:
    more), the loss falls, and nothing is lost: the sum over the steps of what the hook gave DDP
    equals the workers' mean of the sum of their own gradients less their final residuals
    (train.lr 1, momentum 0)."""
    import torch  # only the tests that use it need it
    sets = {"allgather": DDP_HOOK_SETS, "ps": PS_HOOK_SETS,
            "ring": DDP_HOOK_SETS + ["collective.algorithm=ring"]}[method]
    c = cluster("cluster: {register_timeout_s: 60}\n", servers=2 if method == "ps" else 0,
                sets=sets)
    args = ["--conserve"] + (["--bucket-view"] if bucket_view else [])
    got = run_ddp_workers(c, tmp_path, device, args=args, hook_sets=sets)
    assert torch.equal(got[0]["params"], got[1]["params"])
    kept = sum(g["local_sum"] - g["residual"] for g in got) / 2
    assert float(kept.abs().max()) > 0.1  # something was trained
    torch.testing.assert_close(got[0]["hook_sum"], kept, rtol=1e-5, atol=1e-5)
    n = got[0]["params"].numel()  # 20*64 + 64 + 64*4 + 4 = 1604; k = 160 per worker
    for nz in got[0]["nonzero"]:
        if method == "ring":
            assert nz > 2 * round(0.1 * n), got[0]["nonzero"]
        else:
            assert 0 < nz <= 2 * round(0.1 * n), got[0]["nonzero"]
    loss = got[0]["loss"]
    assert sum(loss[-5:]) < 0.6 * sum(loss[:5]), loss


def set_trained_model_takes_a_tensor(cluster, backend, device):
    """`backend` (sparseps.Worker or sparseps.capi.Worker) takes the trained model as a
    torch.Tensor on `device` that requires grad and is of another float type (detached, copied to
    the host, converted), and a buffer as a tensor on `device`: the leader's model file holds
    exactly their values and the buffer's shape; something that is neither an array nor a tensor
    is a ValueError naming the argument."""
    import numpy as np
    import torch  # only the tests that use it need it
    from test_model_file import read_safetensors
    c = cluster("train: {lr: 0.1, momentum: 0}\n", workers=1)
    worker = backend(str(c.job), rank=0, overrides=c.overrides)
    n = 26
    worker.init(np.zeros(n, dtype=np.float32))
    model = (torch.arange(n, dtype=torch.float64, device=device) * 0.5).requires_grad_()
    with pytest.raises(ValueError, match="params: expected a float32 array or tensor"):
        worker.set_trained_model(object())
    worker.set_trained_model(model)
    worker.set_model_buffers({"bn.running_var": torch.full((2, 1), 0.5, device=device)})
    worker.finish()
    tensors, _ = read_safetensors(c.run_dir / "model.safetensors")
    assert np.array_equal(tensors.pop("bn.running_var"), np.full((2, 1), 0.5, np.float32))
    written = np.sort(np.concatenate([t.reshape(-1) for t in tensors.values()]))
    assert np.array_equal(written, np.arange(n, dtype=np.float32) * 0.5)


def launch_example(tmp_path, config, command, sets=(), name="run", timeout=300):
    """Runs a job of examples/CONFIG through deploy/launch.sh (1 scheduler, its servers, workers
    started as COMMAND, a Python example) on loopback with the `sets` overrides; asserts that it
    ended well and returns its run directory. The examples' data cache is the pytest run's
    (example_env())."""
    run = tmp_path / name
    env = example_env()
    args = ["bash", str(ROOT / "deploy" / "launch.sh"), "--build-dir", str(BUILD), "--config",
            str(ROOT / "examples" / config), "--run-dir", str(run), "--quiet",
            "--worker-command", command]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return run


def overlap_pushes_during_the_backward_pass_and_changes_nothing(cluster, backend, device):
    """DistributedOptimizer(overlap=True) with train.overlap: backward, one worker, two servers
    (two key ranges), PS top-k 30% with momentum, the model on `device` (cuda: each range
    compressed on the GPU): the last layer (keys 52 to 371) covers the second range, so its push
    leaves while the first layer's gradient is still to come (a hook on that gradient waits for
    bytes_sent to grow; without the overlap nothing has left then). The same job stepped without
    the hooks (the ranges compressed one after the other in step()) ends with the same
    parameters bit for bit. The trace (metrics.trace_steps, trace-worker-0.csv) shows it: with
    the hooks range 1's encoding starts before the backward pass ends, without them after.
    `backend`: sparseps.Worker or sparseps.capi.Worker."""
    import torch  # only the tests that use it need it
    import sparseps.torch

    def train(overlap):
        c = cluster("train: {lr: 0.1, momentum: 0.9, overlap: backward}\n"
                    "compression: {encoding: topk, density: 0.3}\n"
                    "metrics: {trace_steps: 10}\n", workers=1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 4), torch.nn.ReLU(),
                                    torch.nn.Linear(4, 64)).to(device)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            backend(str(c.job), rank=0, overrides=c.overrides), overlap=overlap)
        sent_early = []

        def first_layer_gradient(grad):
            deadline = time.monotonic() + (20 if overlap else 0)
            while opt.worker.bytes_sent == before and time.monotonic() < deadline:
                time.sleep(0.001)
            sent_early.append(opt.worker.bytes_sent > before)

        model[0].weight.register_hook(first_layer_gradient)
        g = torch.Generator().manual_seed(1)
        for _ in range(10):
            opt.zero_grad()
            before = opt.worker.bytes_sent
            model(torch.randn(8, 12, generator=g).to(device)).pow(2).mean().backward()
            assert sent_early == [overlap] * len(sent_early), sent_early
            opt.step()
        params = [p.detach().cpu().clone() for p in model.parameters()]
        opt.worker.finish()
        assert len(sent_early) == 10
        backward_end, range1_from = {}, {}
        with open(c.run_dir / "trace-worker-0.csv") as f:
            for row in csv.DictReader(f):
                step = int(row["step"])
                if row["lane"] == "compute":
                    backward_end[step] = max(backward_end.get(step, 0.0), float(row["end_ms"]))
                if row["lane"] == "range1" and row["event"] == "encode":
                    range1_from[step] = float(row["start_ms"])
        assert sorted(backward_end) == sorted(range1_from) == list(range(1, 11))
        early = [range1_from[s] < backward_end[s] for s in range(1, 11)]
        assert early == [overlap] * 10, (backward_end, range1_from)
        return params

    overlapped = train(True)
    plain = train(False)
    for a, b in zip(overlapped, plain):
        assert torch.equal(a, b)
