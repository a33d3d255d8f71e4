"""PyTorch on a CUDA device through sparseps (the path a PyTorch user with a GPU takes): the
example trains the CNN with CUDA tensors through sparseps.torch.DistributedOptimizer, the PS's
top-k compressing on the device, to the CPU run's test accuracy within half a point; DDP with
sparse_allreduce_hook on CUDA tensors keeps the workers equal and the averaged gradient sparse;
train.overlap: backward pushes each key range, compressed on the device, during the backward
pass.

Where torch sees no CUDA device (CI) every test here skips. sparseps.capi loads in any Python 3
and any PyTorch (a GPU machine's own); the pybind11 module's cases run where it was built for
this Python (python/build_module.sh) and skip elsewhere. bench/device_run.sh's `pytorch` phase
builds the module there and runs this file."""
import csv
import json
import sys

import pytest
import torch

from conftest import (DATA, DDP_HOOK_SETS, ROOT, ddp_hook_keeps_the_workers_equal_and_sparse,
                      launch_example, overlap_pushes_during_the_backward_pass_and_changes_nothing,
                      run_ddp_workers, set_trained_model_takes_a_tensor)
from sparseps import capi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def module_worker():
    """sparseps.Worker (the pybind11 module) where it loads in this Python, else None."""
    import sparseps
    try:
        return sparseps.Worker
    except ImportError:
        return None


needs_module = pytest.mark.skipif(
    module_worker() is None,
    reason="the pybind11 module is not built for this Python (python/build_module.sh)")


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_library_sees_torch_tensors_on_the_device():
    assert capi.cuda(), "libsparseps_client was built without CUDA"
    lib = capi.library()
    t = torch.zeros(4, device="cuda")
    assert lib.sparseps_device_of(t.data_ptr()) == t.device.index
    assert lib.sparseps_device_of(torch.zeros(4).data_ptr()) == capi.HOST


@pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (deploy/install-deps.sh)")
def test_example_trains_on_the_gpu_to_the_cpu_accuracy(tmp_path):
    """examples/torch_cnn.yaml (2 workers, 2 servers, top-k 1% with DGC momentum correction) for
    its 2 epochs, on the GPU and on the CPU: the same data order and initial model, so the two
    test accuracies differ by rounding's drift alone."""
    accuracy = {}
    for device in ("cuda", "cpu"):
        run = launch_example(
            tmp_path, "torch_cnn.yaml",
            f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --capi --model cnn "
            f"--device {device}" + (" --profile-memcpy 20" if device == "cuda" else ""),
            name=device, timeout=900)
        log = (run / "worker-0.log").read_text()
        assert f"parameters on {device}" in log and "through sparseps.capi" in log
        rows = read_csv(run / "metrics-worker-0.csv")
        assert len(rows) == 936  # 2 epochs of 30,000 samples in batches of 64
        assert {int(r["selected"]) for r in rows} == {2154}  # k of 215,370 at 1%
        accuracy[device] = float(read_csv(run / "eval-worker-0.csv")[-1]["test_accuracy"])
        compute = sorted(float(r["compute_ms"]) for r in rows[10:])
        encode = sorted(float(r["encode_ms"]) for r in rows[10:])
        print(f"{device}: test accuracy {100 * accuracy[device]:.2f}%, median compute "
              f"{compute[len(compute) // 2]:.2f} ms, encode {encode[len(encode) // 2]:.2f} ms")
    # The GPU run's host-device copies (torch.profiler over steps 11-30): the compressed
    # gradient comes down, the changed parameters go up; far less than the 215,370 floats.
    copies = json.loads((tmp_path / "cuda" / "memcpy-worker-0.json").read_text())
    print(f"cuda: host-device copies per step {copies}")
    assert 0 < copies["d2h_bytes_per_step"] < 4 * 215370, copies
    assert 0 < copies["h2d_bytes_per_step"] < 4 * 215370, copies
    assert accuracy["cuda"] > 0.85, accuracy
    assert abs(accuracy["cuda"] - accuracy["cpu"]) <= 0.005, accuracy


@pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (deploy/install-deps.sh)")
@pytest.mark.parametrize("method", ["sparseps", "ddp"])
def test_example_trains_under_fp16_autocast(tmp_path, method):
    """--amp fp16: the CNN's forward pass in float16 with loss scaling (sparseps.torch.GradScaler
    through PS top-k; torch's GradScaler under --ddp), 200 steps of 2 workers on the GPU: every
    step has its row, the loss falls and the test accuracy is the float32 run's kind (about 85%
    there on the CPU); the steps skipped for an overflow (nothing pushed) are printed."""
    run = launch_example(
        tmp_path, "torch_cnn.yaml",
        f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --capi --model cnn "
        "--device cuda --amp fp16" + (" --ddp" if method == "ddp" else ""),
        sets=["train.max_steps=200", "data.max_test_samples=1000"] +
        (["aggregation=allreduce"] if method == "ddp" else []), timeout=600)
    assert "; fp16 autocast" in (run / "worker-0.log").read_text()
    rows = read_csv(run / "metrics-worker-0.csv")
    assert len(rows) == 200
    loss = [float(r["loss"]) for r in rows]
    assert sum(loss[-20:]) < 0.5 * sum(loss[:20]), (loss[:20], loss[-20:])
    skipped = [r["step"] for r in rows if method == "sparseps" and int(r["selected"]) == 0]
    accuracy = float(read_csv(run / "eval-worker-0.csv")[-1]["test_accuracy"])
    print(f"{method}, fp16 autocast: test accuracy {100 * accuracy:.2f}% after 200 steps; "
          f"steps skipped for an overflow: {skipped}")
    assert accuracy > 0.7, accuracy


def test_torchs_grad_scaler_is_refused_by_the_distributed_optimizer(cluster):
    """torch's own GradScaler (enabled: CUDA) stepping a DistributedOptimizer: a TypeError that
    names sparseps.torch.GradScaler, before anything is pushed (torch's would skip the step on an
    overflowed worker alone)."""
    import sparseps.torch
    c = cluster("train: {lr: 0.1, momentum: 0}\n", workers=1)
    model = torch.nn.Linear(4, 2).cuda()
    opt = sparseps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              capi.Worker(str(c.job), rank=0,
                                                          overrides=c.overrides))
    scaler = torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else \
        torch.cuda.amp.GradScaler()
    scaler.scale(model(torch.ones(3, 4, device="cuda")).sum()).backward()
    with pytest.raises(TypeError, match="use sparseps.torch.GradScaler"):
        scaler.step(opt)
    assert opt.worker.step == 0
    opt.worker.finish()


def test_ddp_hook_on_cuda_tensors_keeps_the_workers_equal_and_sparse(cluster, tmp_path):
    ddp_hook_keeps_the_workers_equal_and_sparse(cluster, tmp_path, "cuda")


def test_ddp_hook_with_fp16_autocast_and_torchs_grad_scaler(cluster, tmp_path):
    """DDP with sparse_allreduce_hook, fp16 autocast and torch's own GradScaler (growing its scale
    every 3 steps, so that fp16 overflows come by themselves too) given to SparseAllreduceState;
    worker 1's loss is inf at step 3. Every overflow, on either worker, is skipped by both
    (worker.step stays there and advances on every other step), the models stay equal and the
    loss falls."""
    c = cluster("cluster: {register_timeout_s: 60}\n", servers=0, sets=DDP_HOOK_SETS)
    got = run_ddp_workers(c, tmp_path, "cuda", args=["--amp", "--overflow-at", "3"])
    skipped = got[0]["skipped"]
    print(f"fp16 autocast, GradScaler: steps skipped for an overflow {skipped}")
    assert 3 in skipped and got[1]["skipped"] == skipped
    for g in got:
        assert g["overflows"] == len(skipped)
        assert g["steps"] == [t + 1 - sum(s <= t for s in skipped) for t in range(40)]
    assert torch.equal(got[0]["params"], got[1]["params"])
    loss = got[0]["loss"]
    assert sum(loss[-5:]) < 0.6 * sum(loss[:5]), loss


def test_overlap_pushes_during_the_backward_pass_on_the_gpu(cluster):
    """train.overlap: backward with CUDA tensors: each key range compressed on the GPU and pushed
    while the backward pass goes on, the result bit for bit the job stepped without the hooks."""
    overlap_pushes_during_the_backward_pass_and_changes_nothing(cluster, capi.Worker, "cuda")


@needs_module
def test_overlap_through_the_pybind11_module_on_the_gpu(cluster):
    """The same through the pybind11 module (DLPack's view of the CUDA tensors, not data_ptr)."""
    overlap_pushes_during_the_backward_pass_and_changes_nothing(cluster, module_worker(), "cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one CUDA device: a second is needed")
def test_tensors_on_another_gpu_than_the_current_one(cluster):
    """A host with several GPUs: the model on the last one while the calling thread's current
    device stays 0 (no torch.cuda.set_device). The library allocates, compresses and pushes on
    the tensors' GPU, its pushes' own thread too (train.overlap: backward), with the same result
    as stepped without the overlap. (Before, the library allocated on the current GPU and its
    kernels read the other's memory.)"""
    last = torch.cuda.device_count() - 1
    assert torch.cuda.current_device() == 0
    overlap_pushes_during_the_backward_pass_and_changes_nothing(cluster, capi.Worker,
                                                                f"cuda:{last}")


def test_set_trained_model_takes_a_cuda_tensor_through_capi(cluster):
    """The trained model and a buffer handed over as CUDA tensors: copied to the host, the model
    file exact."""
    set_trained_model_takes_a_tensor(cluster, capi.Worker, "cuda")


@needs_module
def test_set_trained_model_takes_a_cuda_tensor_through_the_pybind11_module(cluster):
    set_trained_model_takes_a_tensor(cluster, module_worker(), "cuda")


@needs_module
@pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (deploy/install-deps.sh)")
def test_example_trains_on_the_gpu_through_the_pybind11_module(tmp_path):
    """The example without --capi takes the module where it loads: the CNN on the GPU, 200 steps
    of examples/torch_cnn.yaml, learns (the CPU reaches about 85% there)."""
    run = launch_example(
        tmp_path, "torch_cnn.yaml",
        f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model cnn --device cuda",
        sets=["train.max_steps=200", "data.max_test_samples=1000"], timeout=600)
    log = (run / "worker-0.log").read_text()
    assert "parameters on cuda" in log and "through the pybind11 module" in log
    rows = read_csv(run / "metrics-worker-0.csv")
    assert len(rows) == 200
    assert {int(r["selected"]) for r in rows} == {2154}
    accuracy = float(read_csv(run / "eval-worker-0.csv")[-1]["test_accuracy"])
    print(f"module, cuda: test accuracy {100 * accuracy:.2f}% after 200 steps")
    assert accuracy > 0.7, accuracy
