"""sparseps.capi, the worker through libsparseps_client's C interface and ctypes, against a real
job (scheduler and servers as daemons, workers as threads): the job's parameters after each
push_pull equal the C++ worker's (tests/python/replay_worker.cc) bitwise, and the update (dense
or sparse) is what they moved by (sparseps.torch's DistributedOptimizer on a capi.Worker is in
test_torch.py); a bad config is a clear error naming the key; capi loads where the pybind11
module does not (another Python version); and python/build_module.sh builds the module for a
Python of the user's choosing, over the client library, which then passes the module's own
bitwise and conservation tests."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import BUILD, ROOT
from sparseps import capi
from test_worker import N, STEPS, equals_the_cpp_worker


@pytest.mark.parametrize("name", ["ps_topk", "ps_sketch_second_round", "allreduce_gtopk",
                                  "allreduce_ring_aggregated"])
def test_push_pull_equals_the_cpp_worker_bitwise(cluster, name):
    """allreduce_ring_aggregated: a dense method, whose steps with out / params_out copy there."""
    def check(w, rank):
        assert (w.rank, w.num_workers, w.num_params) == (rank, 2, N)
        assert w.step == STEPS and w.bytes_sent > 0 and w.last_step["bytes_sent"] > 0
        assert w.live_workers == [0, 1] and w.get("cluster.num_workers") == 2
        assert w.residual().shape == (N,)
        # out / params_out are refused before the library sees the step
        g = np.zeros(N, dtype=np.float32)
        with pytest.raises(ValueError, match="out is for sparse=True"):
            w.push_pull(g, out=np.empty(N, dtype=np.float32))
        with pytest.raises(ValueError, match=f"params_out must be .* of the model's {N} elements"):
            w.push_pull(g, sparse=True, params_out=np.empty(N + 1, dtype=np.float32))
        frozen = np.empty(N, dtype=np.float32)
        frozen.setflags(write=False)
        with pytest.raises(ValueError, match="out must be a writable"):
            w.push_pull(g, sparse=True, out=frozen)
        assert w.step == STEPS  # nothing was pushed

    equals_the_cpp_worker(cluster, name, capi.Worker, check)


def test_a_bad_config_is_an_error_naming_the_key(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  lr: -1\n")
    with pytest.raises(capi.Error) as e:
        capi.Worker(str(job))
    assert e.value.code == capi.INVALID_ARGUMENT
    assert "job.yaml:2" in str(e.value) and "train.lr" in str(e.value)
    # A ValueError too, as the pybind11 module raises it: `except ValueError` serves both.
    assert isinstance(e.value, capi.InvalidArgument) and isinstance(e.value, ValueError)
    job.write_text("train:\n  lr: 0.1\n  overlap: delay\n")
    with pytest.raises(capi.Error, match="train.overlap: delay"):
        capi.Worker(str(job))


def test_a_missing_scheduler_is_a_timeout_error_naming_it():
    """A deadline is capi.DeadlineExceeded, a capi.Error and a TimeoutError, as the pybind11
    module raises TimeoutError for it."""
    w = capi.Worker("", overrides=["cluster.scheduler_port=1", "cluster.register_timeout_s=0.5"])
    with pytest.raises(TimeoutError, match="membership") as e:
        w.init(np.zeros(4, dtype=np.float32))
    assert isinstance(e.value, capi.DeadlineExceeded) and e.value.code == capi.DEADLINE_EXCEEDED


def test_arrays_that_are_not_float32_are_refused_before_the_library_sees_them(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("train: {lr: 0.1}\n")
    w = capi.Worker(str(job))
    with pytest.raises(capi.Error, match="float32"):
        w.init(np.zeros(10, dtype=np.float64))
    w.close()


def test_a_shape_that_is_not_its_buffers_size_is_refused(tmp_path):
    """sparseps_worker_init_tensors, which capi.Worker.init calls with each tensor's shape: a
    shape whose product is not its buffer's size is an error naming the tensor, before the job
    is joined (no scheduler here to join)."""
    job = tmp_path / "job.yaml"
    job.write_text("train: {lr: 0.1}\n")
    w = capi.Worker(str(job))
    a, b = np.zeros(6, dtype=np.float32), np.zeros(16, dtype=np.float32)
    array = (capi._Buffer * 2)(capi._Buffer(a.ctypes.data, 6, capi.HOST),
                               capi._Buffer(b.ctypes.data, 16, capi.HOST))
    ndims = (ctypes.c_size_t * 2)(2, 2)
    dims = (ctypes.c_uint64 * 4)(2, 3, 3, 5)  # 6 elements, then 15 for a buffer of 16
    with pytest.raises(capi.Error, match=r"params\[1\]: its shape has 15 elements, its buffer 16"):
        w._call(capi.library().sparseps_worker_init_tensors, w._handle, array, 2, None, ndims,
                dims)
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


def test_build_module_makes_a_module_that_passes_the_module_tests(tmp_path):
    """python/build_module.sh for this python3 over the build's client library (one compiler
    call, as on a GPU machine whose Python the CMake build did not target): the package it
    writes imports its own module, and test_worker.py's bitwise and conservation cases pass
    through it (a separate pytest, whose sparseps is the one built here). Compiled with
    CXXFLAGS=-O0 (after the script's -O2): 16 CPU-s against 26 here."""
    out = tmp_path / "pymod"
    built = subprocess.run(
        ["bash", str(ROOT / "python" / "build_module.sh"), "--client-lib", str(BUILD / "client"),
         "--python", sys.executable, "--out", str(out)], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, CXXFLAGS="-O0"))
    assert built.returncode == 0, built.stdout + built.stderr
    env = dict(os.environ, PYTHONPATH=str(out))
    where = subprocess.run(
        [sys.executable, "-c", "import sparseps, sparseps._sparseps as m; "
         "print(sparseps.__file__); print(m.__file__)"],
        capture_output=True, text=True, env=env, timeout=60)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(out)) for line in where.stdout.split("\n")[:2]), where.stdout
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "python" / "test_worker.py"), "-k",
         "test_push_pull_equals_the_cpp_worker_bitwise and ps_topk or "
         "test_conservation_with_integer_gradients"],
        capture_output=True, text=True, env=env, timeout=500)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout, tests.stdout[-2000:]


def test_build_module_names_what_is_missing(tmp_path):
    """No client library where --client-lib points, or no such interpreter: exit 1 naming it."""
    script = str(ROOT / "python" / "build_module.sh")
    p = subprocess.run(["bash", script, "--client-lib", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and f"no libsparseps_client.so in {tmp_path}" in p.stderr, p.stderr
    p = subprocess.run(["bash", script, "--client-lib", str(BUILD / "client"), "--python",
                        "/nonexistent/python3"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no interpreter '/nonexistent/python3'" in p.stderr, p.stderr
