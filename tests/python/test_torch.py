"""sparseps.torch with Debian's PyTorch: the example (examples/fashion_mnist.py, through
sparseps.torch.DistributedOptimizer) trains a small CNN with 2 workers and 2 servers through the
local launcher and its loss falls; DDP with sparse_allreduce_hook keeps the workers' models equal
and sparse; bad tensors are clear exceptions."""
import csv
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import sparseps
import sparseps.torch
from sparseps import capi
from conftest import (BUILD, DATA, DDP_HOOK_SETS, PS_HOOK_SETS, ROOT,
                      ddp_hook_keeps_the_workers_equal_and_sparse, example_env, launch_example,
                      overlap_pushes_during_the_backward_pass_and_changes_nothing,
                      run_ddp_workers, run_threads, set_trained_model_takes_a_tensor)

needs_data = pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                                reason="Fashion-MNIST not installed (deploy/install-deps.sh)")


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@needs_data
@pytest.mark.parametrize("backend", ["module", "capi"])
def test_example_trains_a_cnn_through_two_servers(tmp_path, backend):
    """The example's worker is the pybind11 module's, or with --capi sparseps.capi's (what a
    Python the module is not built for gets, e.g. a GPU machine's: tests/python/test_gpu.py).
    The module's run trains 100 steps and is held to an accuracy; the same job through capi
    trains 40 (its last 10 steps' loss at 0.43-0.45 of its first 10's; its pushes the same)."""
    steps = 100 if backend == "module" else 40
    run = launch_example(
        tmp_path, "torch_cnn.yaml",
        f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model cnn"
        + (" --capi" if backend == "capi" else ""),
        [f"train.max_steps={steps}",
         "data.max_test_samples=" + ("2000" if backend == "module" else "200")])
    for w in range(2):
        rows = read_csv(run / f"metrics-worker-{w}.csv")
        assert len(rows) == steps
        loss = [float(r["loss"]) for r in rows]
        assert sum(loss[-10:]) < 0.5 * sum(loss[:10]), (loss[:10], loss[-10:])
        # top-k at 1% of 215,370: k = 2,154 entries selected and pushed per step.
        assert {int(r["selected"]) for r in rows} == {2154}
        assert all(0 < int(r["bytes_sent"]) < 0.05 * 4 * 215370 for r in rows[1:])
    summary = (run / "summary.json").read_text()
    assert '"status": "ok"' in summary
    if backend == "module":
        accuracy = float(read_csv(run / "eval-worker-0.csv")[-1]["test_accuracy"])
        assert accuracy > 0.75  # 100 steps of 2 x 64 samples; 82.55% when measured


def test_the_examples_epochs_follow_the_live_workers_as_sparseps_worker_does():
    """sparseps.EpochPlan (examples/torch_job.py's): 1000 samples, batch 2, 3 epochs. Every
    worker takes (samples // count) // batch steps an epoch: 166 with 3 workers, whose shards
    hold 334, 333 and 333 samples (len(shard) // batch would give worker 0 167, a step more than
    the others every epoch). Worker 0 lost at iteration 200 (Membership.splits: [1, 2] from
    iteration 200 on): the epoch that begins after step 332 is the first without it, with 250
    steps, and the run ends at step 582; seek() finds each step's epoch (a resumed or replaced
    worker's) as the loop walked into it; the learning-rate schedule's end moves with the plan;
    train.max_steps cuts the run."""
    def split(rank):
        return lambda begin: (rank, 3) if begin <= 200 else ([1, 2].index(rank), 2)
    plan = sparseps.EpochPlan(split(1), 1000, 2, 3, 0)
    assert (plan.index, plan.count, plan.steps, plan.total, plan.epochs) == (1, 3, 166, 498, 3)
    assert not plan.next()
    assert (plan.epoch, plan.begin, plan.steps, plan.total) == (1, 166, 166, 498)
    assert plan.next()  # begins after step 332 > 200
    assert (plan.epoch, plan.begin, plan.index, plan.count) == (2, 332, 0, 2)
    assert (plan.steps, plan.total, plan.horizon, plan.epochs) == (250, 582, 582, 3)
    for step, (epoch, begin) in ((0, (0, 0)), (165, (0, 0)), (166, (1, 166)), (331, (1, 166)),
                                 (332, (2, 332)), (581, (2, 332)), (582, (2, 332))):
        plan.seek(step)
        assert (plan.epoch, plan.begin) == (epoch, begin), step
    assert plan.total == 582
    cut = sparseps.EpochPlan(split(2), 1000, 2, 3, 400)
    assert (cut.total, cut.horizon, cut.epochs) == (400, 498, 3)
    cut.seek(399)
    assert (cut.epoch, cut.count, cut.steps, cut.total, cut.horizon) == (2, 2, 250, 400, 582)
    with pytest.raises(ValueError, match="333 training samples on this worker: fewer than one "
                       "batch of train.batch_size 400"):
        sparseps.EpochPlan(split(0), 1000, 400, 3, 0)


class SplitWorker:
    """What ElasticSampler reads of a worker: 3 workers, worker 0 lost at iteration 200."""

    def __init__(self, rank, step=0):
        self.rank, self.step = rank, step

    def data_split(self, begin):
        return (self.rank, 3) if begin <= 200 else ([1, 2].index(self.rank), 2)


def test_the_elastic_sampler_shares_the_data_among_the_live_workers():
    """sparseps.torch.ElasticSampler over 1000 samples, batch 2 (the plan of the test above): in
    epochs 0 and 1 each of the 3 workers gets 332 samples (166 whole batches), the three sets
    disjoint; epoch 2 begins after worker 0 was lost, and workers 1 and 2 get 500 each, all 1000
    between them; the order is reshuffled every epoch and differs by rank, the same on every
    run. A worker at step 400 (a resumed one) is in epoch 2, and set_epoch leaves out its 68
    batches done; through a DataLoader the batches are the sampler's. shuffle=False deals the
    data set in its order."""
    def sampler(rank, step=0, shuffle=True):
        return sparseps.torch.ElasticSampler(1000, SplitWorker(rank, step), 2, shuffle, seed=7)
    first = [sampler(r) for r in range(3)]
    epoch0 = [set(s) for s in first]
    assert [len(s) for s in first] == [332] * 3 and [len(e) for e in epoch0] == [332] * 3
    assert not (epoch0[0] & epoch0[1] or epoch0[0] & epoch0[2] or epoch0[1] & epoch0[2])
    assert list(first[1]) == list(sampler(1)) and list(first[1]) != list(first[2])
    first[1].set_epoch(1)
    assert first[1].steps == 166 and list(first[1]) != list(sampler(1))
    later = [sampler(r) for r in (1, 2)]
    for s in later:
        s.set_epoch(2)
    assert [len(s) for s in later] == [500, 500] and later[0].steps == 250
    assert sorted(list(later[0]) + list(later[1])) == list(range(1000))
    resumed = sampler(1, step=400)
    assert resumed.epoch_of(400) == 2 and resumed.epoch_of(331) == 1
    resumed.set_epoch(2)
    assert len(resumed) == (250 - 68) * 2
    assert list(resumed) == later[0].order()[68 * 2:].tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(1000)),
                                         batch_size=2, sampler=resumed)
    batches = [b.tolist() for (b,) in loader]
    assert len(batches) == 250 - 68 and sum(batches, []) == list(resumed)
    plain = sampler(2, shuffle=False)
    assert list(plain) == list(range(2, 1000, 3))[:332]
    planned = sparseps.torch.ElasticSampler(1000, SplitWorker(1), 2, epochs=3, max_steps=400)
    assert (planned.plan.total, planned.plan.horizon, planned.plan.epochs) == (400, 498, 3)


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
def test_data_split_before_init_is_an_error_and_the_sampler_waits_for_it(tmp_path, backend):
    """Before init the worker's rank may not be known (the scheduler gives it): data_split is
    the binding's Error saying to call init; an ElasticSampler made then (as a DataLoader usually
    is) reads the membership only at its first use, which is that Error too."""
    job = tmp_path / "job.yaml"
    job.write_text("cluster: {num_workers: 3}\n")
    w = backend(str(job))
    error = capi.Error if backend is capi.Worker else sparseps.Error
    with pytest.raises(error, match="call init"):
        w.data_split(0)
    s = sparseps.torch.ElasticSampler(1000, w, 10)
    with pytest.raises(error, match="call init"):
        s.set_epoch(0)


@pytest.mark.skipif(not pathlib.Path("/usr/share/games/fortunes/fortunes").exists(),
                    reason="Debian's fortunes not installed (deploy/install-deps.sh)")
def test_the_language_model_trains_through_sparseps(tmp_path):
    """examples/language_model.py (the Transformer on Debian's fortunes, examples/torch_lm.yaml:
    AdamW with aggregate="update" through PS top-k 1%) trains 40 steps of 16 windows on 2 workers:
    the loss falls (by a quarter when measured), k = 1% of 2,506,240 entries a step, and the test
    perplexity is written."""
    run = launch_example(
        tmp_path, "torch_lm.yaml",
        f"{sys.executable} {ROOT / 'examples' / 'language_model.py'} --optimizer adamw "
        "--aggregate update",
        ["train.max_steps=40", "train.batch_size=16", "data.max_test_samples=100"])
    rows = read_csv(run / "metrics-worker-0.csv")
    assert len(rows) == 40
    assert {int(r["selected"]) for r in rows} == {25062}
    loss = [float(r["loss"]) for r in rows]
    assert sum(loss[-5:]) < 0.9 * sum(loss[:5]), loss  # from ln(8192) = 9.0 down
    assert "test perplexity" in (run / "worker-0.log").read_text()


@pytest.mark.parametrize("model", ["resnet18", "resnet50"])
def test_the_resnets_train_through_sparseps(tmp_path, model):
    """ResNet-18 (CIFAR-style, Fashion-MNIST padded to 32x32) learns 16 training samples through
    PS top-k: 8 steps of 8 samples a worker at lr 0.01 (each step the same 16 samples), and its
    loss falls to under 0.6 of its first steps' (2.29, 1.82, ... 0.93, 0.77 when measured, the
    same in every run; 16 steps of 16 fresh samples at lr 0.05 took 2.3 times the CPU and fell by
    a quarter only). ResNet-50 on --synthetic data (a large model without its data set) runs and
    records each step's bytes: 23.5M parameters at density 1%. Each evaluates 20 test samples
    (ResNet-50's forward pass over 200 took a minute of the suite's CPU)."""
    if model == "resnet18" and not (DATA / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST not installed (deploy/install-deps.sh)")
    steps, batch = (8, 8) if model == "resnet18" else (2, 2)
    command = f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model {model}"
    sets = [f"train.max_steps={steps}", f"train.batch_size={batch}", "data.max_test_samples=20"]
    if model == "resnet50":
        command += " --synthetic"
    else:
        sets += ["data.max_train_samples=16", "train.epochs=100", "train.lr=0.01"]
    run = launch_example(tmp_path, "torch_cnn.yaml", command, sets, timeout=600)
    rows = read_csv(run / "metrics-worker-0.csv")
    assert len(rows) == steps
    n = 11172810 if model == "resnet18" else 23519690
    assert {int(r["selected"]) for r in rows} == {round(0.01 * n)}
    if model == "resnet18":
        loss = [float(r["loss"]) for r in rows]
        assert sum(loss[-2:]) < 0.6 * sum(loss[:2]), loss


@needs_data
@pytest.mark.parametrize("method", ["sparseps", "ddp"])
def test_example_trains_under_bfloat16_autocast(tmp_path, method):
    """--amp bf16: the forward pass under torch.autocast in bfloat16 (on the CPU here), through
    sparseps's PS top-k and under torch DDP: 32 steps of the MLP on 2 workers, the loss falls and
    the log says so. (The MLP: this VM's CPU has no bfloat16 instructions, and the CNN's
    convolutions took about 0.8 s a step there against 0.06 s in float32, the MLP's 0.05 s.)
    --amp fp16 needs a GPU: tests/python/test_gpu.py."""
    command = (f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model mlp --amp bf16"
               + (" --ddp" if method == "ddp" else ""))
    sets = ["train.max_steps=32", "data.max_test_samples=100"]
    if method == "ddp":
        sets.append("aggregation=allreduce")
    run = launch_example(tmp_path, "torch_cnn.yaml", command, sets)
    for w in range(2):
        loss = [float(r["loss"]) for r in read_csv(run / f"metrics-worker-{w}.csv")]
        assert len(loss) == 32
        assert sum(loss[-8:]) < 0.75 * sum(loss[:8]), (loss[:8], loss[-8:])
    assert "; bf16 autocast" in (run / "worker-0.log").read_text()


def test_example_refuses_fp16_autocast_off_a_gpu(cluster):
    """--amp fp16 on the CPU: a clear error and exit code 2 (fp16's loss scaling is CUDA's)."""
    c = cluster("train: {lr: 0.1}\n", servers=1, workers=1)
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fashion_mnist.py"), "--config", str(c.job),
         "--device", "cpu", "--amp", "fp16"] + sum((["--set", s] for s in c.overrides), []),
        capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--amp fp16: CUDA's (autocast and loss scaling); --amp bf16 needs no scaling" in \
        p.stderr, p.stderr


@needs_data
@pytest.mark.parametrize("method", ["ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd_4",
                                    "sparseps_powersgd", "sparseps_powersgd_capi", "ddp_sparseps",
                                    "ddp_sparseps_spardl"])
def test_example_runs_the_baselines_and_sparseps_powersgd(tmp_path, method):
    """The comparison's torch settings: the example under torch DDP over Gloo (plain, with DDP's
    fp16 hook, with its PowerSGD hook, also at 4 ranks, where Debian's torch 1.13 aborted until
    the example ended each bucket's chain of allreduces before the next; plain DDP with
    --lr-schedule cosine; DDP with sparseps's own hook through the job's servers, top-k 1%, and
    through SparDL: a DDP user's way in, its gradients views of DDP's buckets by default) and
    through sparseps.torch with collective.algorithm: powersgd (the torch model's tensors are its
    layers; through the pybind11 module or sparseps.capi, which hands the library their shapes
    too); each trains 40 steps of the CNN on 2 workers (20 of the MLP on 4) and its loss
    falls (its last 10 steps' at 0.39-0.49 of its first 10's when measured, 2 workers)."""
    run = tmp_path / "run"
    env = example_env(GLOO_SOCKET_IFNAME="lo")
    # At 4 ranks the comparison's MLP (5.8M parameters) in DDP buckets of 1 MB: 23 buckets whose
    # chains of allreduces interleave differently on the ranks without the example's
    # serialization (then Gloo aborts at the third step, on loopback too; checked by undoing it).
    workers = 4 if method.endswith("_4") else 2
    model = "mlp --bucket-cap-mb 1" if workers == 4 else "cnn"
    command = f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model {model}"
    steps = 20 if workers == 4 else 40
    sets = ["--set", f"train.max_steps={steps}", "--set", "data.max_test_samples=1000"]
    sets += ["--set", f"cluster.num_workers={workers}"]
    if workers == 4:
        sets += ["--set", "model.hidden=[2048,2048]"]
    if method.startswith("ddp_sparseps"):
        command += " --ddp --ddp-hook sparseps"
        if method.endswith("spardl"):
            sets += ["--set", "aggregation=allreduce", "--set", "collective.algorithm=spardl"]
    elif method.startswith("ddp"):
        command += " --ddp" + (" --ddp-hook fp16" if method == "ddp_fp16" else
                               " --ddp-hook powersgd" if "powersgd" in method else
                               " --lr-schedule cosine --warmup-steps 10")  # plain DDP
        sets += ["--set", "aggregation=allreduce"]
    else:
        command += " --capi" if method.endswith("capi") else ""
        sets += ["--set", "aggregation=allreduce", "--set", "collective.algorithm=powersgd",
                 "--set", "collective.momentum=aggregated"]
    p = subprocess.run(
        ["bash", str(ROOT / "deploy" / "launch.sh"), "--build-dir", str(BUILD), "--config",
         str(ROOT / "examples" / "torch_cnn.yaml"), "--run-dir", str(run), "--quiet",
         "--worker-command", command] + sets,
        capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for w in range(workers):
        loss = [float(r["loss"]) for r in read_csv(run / f"metrics-worker-{w}.csv")]
        assert len(loss) == steps
        assert sum(loss[-10:]) < 0.7 * sum(loss[:10]), (method, loss[:10], loss[-10:])
    said = {"ddp": "torch DDP (gloo, none hook)", "ddp_fp16": "torch DDP (gloo, fp16 hook)",
            "ddp_powersgd": "torch DDP (gloo, powersgd hook)",
            "ddp_powersgd_4": "torch DDP (gloo, powersgd hook)",
            "sparseps_powersgd": "allreduce powersgd",
            "sparseps_powersgd_capi": "allreduce powersgd",
            "ddp_sparseps": "torch DDP (gloo) with sparseps's hook: ps topk",
            "ddp_sparseps_spardl":
                "torch DDP (gloo) with sparseps's hook: allreduce spardl"}[method]
    log = (run / "worker-0.log").read_text()
    assert said in log
    # DDP's gradients are views of its buckets by default with sparseps's hook only.
    assert ("gradients as views of DDP's buckets" in log) == method.startswith("ddp_sparseps")
    if method == "ddp":  # the torch optimizer's schedule, under DDP too
        assert "its rate warmed up over 10 steps and cosine-decayed over" in log
    rows = read_csv(run / "metrics-worker-0.csv")
    if method.startswith("ddp_sparseps"):
        # Measured: top-k 1% of the 215,370 floats, 2,154 keys and values a push (SparDL's
        # blocks a little more), far from the dense 861 KB.
        assert all(0 < int(r["bytes_sent"]) < 0.05 * 4 * 215370 for r in rows[1:])
    elif method.startswith("sparseps"):
        # Rank-4 factors of the conv and dense layers: far fewer bytes than the 215,370 floats.
        assert all(0 < int(r["bytes_sent"]) < 0.2 * 4 * 215370 for r in rows[1:])
    else:
        # Gloo's ring, counted: 2 (P - 1) / P of the gradient's bytes each way; after its first
        # 2 steps torch's PowerSGD hook allreduces the rank-4 factors of the layers where they are
        # under half the layer (by hand: the CNN's 9,414 floats of 215,370, the MLP's 40,050 of
        # 5,824,522), the biases whole.
        dense = {2: 2 * 1 / 2 * 4 * 215370, 4: 2 * 3 / 4 * 4 * 5824522}[workers]
        factors = {2: 2 * 1 / 2 * 4 * 9414, 4: 2 * 3 / 4 * 4 * 40050}[workers]
        want = [dense / 2 if method == "ddp_fp16" else
                factors if "powersgd" in method and step > 2 else dense
                for step in range(1, steps + 1)]
        assert [int(r["bytes_sent"]) for r in rows] == want, method
        assert [int(r["bytes_received"]) for r in rows] == want, method


@pytest.mark.parametrize("aggregation,kind", [("ps", "module"), ("allreduce", "module"),
                                              ("ps", "capi"), ("ring", "module"), ("ring", "capi")])
def test_distributed_optimizer_starts_every_worker_from_worker_0(cluster, aggregation, kind):
    """Through the pybind11 module or sparseps.capi (a list of torch tensors through data_ptr);
    ring: a dense method, whose new parameters come through push_pull's params_out."""
    make = sparseps.Worker if kind == "module" else capi.Worker
    sets = {"allreduce": ["aggregation=allreduce", "collective.algorithm=gtopk"],
            "ring": ["aggregation=allreduce", "collective.algorithm=ring"]}.get(aggregation, [])
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n",
                servers=0 if sets else 2, sets=sets)

    def worker(rank):
        torch.manual_seed(rank)  # different models until init
        model = torch.nn.Linear(30, 5)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            make(str(c.job), rank=rank, overrides=c.overrides + sets))
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 30)).pow(2).mean().backward()
            opt.step()
        # Plain SGD at train.lr: the model holds the job's parameters, exactly.
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.testing.assert_array_equal(flat, opt.worker.params())
        opt.worker.finish()
        return start, flat

    (s0, f0), (s1, f1) = run_threads([lambda r=r: worker(r) for r in range(2)])
    for a, b in zip(s0, s1):
        assert torch.equal(a, b), "init did not make worker 0's parameters everyone's"
    np.testing.assert_array_equal(f0, f1)


@pytest.mark.parametrize("kind", ["module", "capi"])
def test_a_dense_methods_gradient_comes_through_out(cluster, kind):
    """A dense method (ring) with an optimizer that is not plain SGD at train.lr: .grad becomes
    the job's update / train.lr exactly (push_pull's out), and the optimizer steps with it."""
    make = sparseps.Worker if kind == "module" else capi.Worker
    sets = ["aggregation=allreduce", "collective.algorithm=ring"]
    c = cluster("train: {lr: 0.5, momentum: 0}\n", servers=0, sets=sets)

    def worker(rank):
        torch.manual_seed(rank)
        model = torch.nn.Linear(30, 5)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.25),
            make(str(c.job), rank=rank, overrides=c.overrides + sets))
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 30)).pow(2).mean().backward()
            job_before = opt.worker.params()
            model_before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            opt.step()
            update = job_before - opt.worker.params()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
            np.testing.assert_array_equal(grad, update / 0.5)
            # the update came through the array kept from step to step
            np.testing.assert_array_equal(opt._dense.numpy(), update)
            model_after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert torch.equal(model_after, model_before - 0.25 * torch.from_numpy(grad))
        opt.worker.finish()

    run_threads([lambda r=r: worker(r) for r in range(2)])


@pytest.mark.parametrize("method", ["allgather", "ps", "ring", "ps_bucket_view"])
def test_ddp_hook_keeps_the_workers_equal_and_sparse(cluster, tmp_path, method):
    ddp_hook_keeps_the_workers_equal_and_sparse(cluster, tmp_path, "cpu",
                                                method=method.removesuffix("_bucket_view"),
                                                bucket_view=method.endswith("_bucket_view"))


@pytest.mark.parametrize("consistency", ["ssp", "async"])
def test_ddp_hook_refuses_a_ps_job_that_is_not_bsp(cluster, consistency):
    """Through the servers under ssp or async the workers would get different updates and DDP's
    models would part: the state is a ValueError naming the key and what to use."""
    sets = PS_HOOK_SETS + [f"train.consistency={consistency}"]
    c = cluster("", workers=1, sets=sets)
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides + sets)
    with pytest.raises(ValueError, match=f"train.consistency {consistency} gives the workers "
                                         "different updates.*use bsp"):
        sparseps.torch.SparseAllreduceState(w, torch.nn.Linear(5, 3))


def test_ddp_hook_with_a_grad_scaler_has_every_worker_skip_an_overflow(cluster, tmp_path):
    """Loss scaling with the DDP hook (torch's GradScaler given to SparseAllreduceState; Debian's
    torch has none for the CPU: tests/python/ddp_worker.py's PowerOfTwoScaler, the same rule):
    worker 1's loss is inf at step 3 of 12. Both workers' buckets come back inf, both scalers
    skip the step and halve the scale, nothing is pushed (worker.step stays), and, the residuals
    holding unscaled values whatever the scale does, both models equal bit for bit those of the
    same job without a scaler whose workers left batch 3 out."""
    steps = ["--steps", "12"]
    amp = run_ddp_workers(cluster("cluster: {register_timeout_s: 60}\n", servers=0,
                                  sets=DDP_HOOK_SETS), tmp_path, "cpu",
                          args=steps + ["--amp", "--overflow-at", "3"], name="amp")
    plain = run_ddp_workers(cluster("cluster: {register_timeout_s: 60}\n", servers=0,
                                    sets=DDP_HOOK_SETS), tmp_path, "cpu",
                            args=steps + ["--skip", "3"], name="plain")
    for got in amp:
        assert got["skipped"] == [3] and got["overflows"] == 1
        assert got["steps"] == [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert plain[0]["steps"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert plain[0]["skipped"] == []
    assert torch.equal(amp[0]["params"], amp[1]["params"])
    assert torch.equal(amp[0]["params"], plain[0]["params"])


def test_ddp_hook_names_the_grad_scaler_for_an_overflow_without_one(cluster, tmp_path):
    """Without a GradScaler given to the state, an inf in a worker's gradient is a ValueError
    that says how to give it (one worker: nobody waits for it)."""
    c = cluster("cluster: {register_timeout_s: 60}\n", servers=0, workers=1,
                sets=DDP_HOOK_SETS)
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "python" / "ddp_worker.py"), "0", "1",
         str(tmp_path / "init"), str(c.job), str(tmp_path / "out.pt"), "--overflow-at", "2"] +
        sum((["--set", s] for s in c.overrides + DDP_HOOK_SETS), []),
        capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "holds NaN or Inf at step 2 (nothing was pushed)" in p.stderr, p.stderr
    assert "SparseAllreduceState(..., grad_scaler=scaler)" in p.stderr, p.stderr


def test_the_ddp_hooks_model_file_holds_the_models_buffers(cluster, tmp_path):
    """SparseAllreduceState.synchronize() hands the DDP model's buffers to the worker: worker 0's
    model file holds BatchNorm's running statistics as rank 0's model has them (DDP broadcasts
    rank 0's buffers), beside the parameters; so does each checkpoint's model file (every 4
    steps), as the checkpoint's step left them (not the next step's forward pass)."""
    from test_model_file import read_safetensors
    sets = ["checkpoint.every_steps=4", "checkpoint.keep=0"]
    c = cluster("cluster: {register_timeout_s: 60}\n", servers=0, sets=DDP_HOOK_SETS + sets)
    got = run_ddp_workers(c, tmp_path, "cpu", args=["--batchnorm", "--steps", "10"], sets=sets)
    c.wait()
    for step in (4, 8):
        held, _ = read_safetensors(c.run_dir / "checkpoints" / f"iter-{step:010d}" /
                                   "model.safetensors")
        assert sorted(held) == ["0.bias", "0.weight", "1.bias", "1.num_batches_tracked",
                                "1.running_mean", "1.running_var", "1.weight", "3.bias",
                                "3.weight"], step
        assert float(held["1.num_batches_tracked"]) == step
    tensors, _ = read_safetensors(c.run_dir / "model.safetensors")
    buffers = got[0]["buffers"]
    assert sorted(buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for name, value in buffers.items():
        assert np.array_equal(tensors[name], value.float().numpy()), name
    assert float(tensors["1.num_batches_tracked"]) == 10
    bn_weight = got[0]["params"][64 * 21:64 * 22]  # after 0.weight [64, 20] and 0.bias [64]
    assert np.array_equal(tensors["1.weight"].reshape(-1), bn_weight.numpy())


def test_bad_tensors_are_clear_exceptions(cluster):
    c = cluster("compression: {encoding: topk, density: 0.1}\n", workers=1)
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
    with pytest.raises(ValueError, match="detach"):
        w.init(torch.zeros(10, 10, requires_grad=True))
    with pytest.raises(ValueError, match="params\\[1\\]: named 'a' as an earlier tensor"):
        w.init([torch.zeros(3), torch.zeros(4)], names=["a", "a"])
    w.init(torch.zeros(10, 10))
    with pytest.raises(ValueError, match="float32"):
        w.push_pull(torch.zeros(10, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        w.push_pull(torch.zeros(10, 10).t())
    with pytest.raises(ValueError, match="90 elements; init's params had 100"):
        w.push_pull(torch.zeros(9, 10))
    bad = torch.ones(10, 10)
    bad[3, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        w.push_pull(bad)
    if torch.cuda.is_available() and not sparseps.cuda:
        with pytest.raises(ValueError, match="built without CUDA"):
            w.push_pull(torch.zeros(10, 10, device="cuda"))
    update = w.push_pull(torch.ones(10, 10))
    assert update.shape == (100,) and np.count_nonzero(update) == 10  # k = 10
    w.finish()


def test_distributed_optimizer_hands_other_optimizers_the_aggregated_gradient(cluster):
    """Adam (train.momentum 0): every worker's .grad is the same sparse aggregated gradient,
    update / train.lr, so the models stay equal and move only where the job applied. Each
    worker's model is its own optimizer's, not the job's (the servers' SGD at train.lr), so
    synchronize() waits but copies nothing into it."""
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n")

    def worker(rank):
        torch.manual_seed(rank)
        model = torch.nn.Linear(30, 5)
        opt = sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                                  sparseps.Worker(str(c.job), rank=rank,
                                                                  overrides=c.overrides))
        nonzero = []
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 30)).pow(2).mean().backward()
            opt.step()
            nonzero.append(sum(int((p.grad != 0).sum()) for p in model.parameters()))
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        opt.synchronize()
        job = torch.from_numpy(opt.worker.params())
        opt.worker.finish()
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.equal(before, after) and not torch.equal(after, job)
        return after, nonzero

    (p0, nz0), (p1, nz1) = run_threads([lambda r=r: worker(r) for r in range(2)])
    assert torch.equal(p0, p1)
    assert nz0 == nz1
    assert all(16 <= nz <= 32 for nz in nz0), nz0  # k = 16 of 155 per worker; the union


@pytest.mark.parametrize("aggregation,freeze,view", [
    ("ps", None, False), ("allreduce", None, False), ("ps", 10, False), ("ps", None, True)])
def test_aggregating_the_optimizers_update_loses_nothing(cluster, aggregation, freeze, view):
    """aggregate="update" (error feedback on Adam's update): each worker's Adam steps on its own
    gradient and only that step goes through sparseps. Conservation, exact up to rounding: the
    model moved by the mean of every worker's every Adam step, less what the residuals hold back,
    x0 - xT = (sum of steps - train.lr * sum of residuals) / W; the models stay equal and the
    Adam states stay each worker's own. With freeze_variance_step (1-bit Adam's frozen
    variance) the same holds, and the second moment after the freeze is the one at it, bit for
    bit. With local_view each worker's model is the job's moved by its own residual, xT -
    train.lr * residual / W, and the same conservation holds for the job's."""
    sets = ["aggregation=allreduce", "collective.algorithm=topk_allgather"] \
        if aggregation == "allreduce" else []
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.05}\n",
                servers=0 if aggregation == "allreduce" else 2, sets=sets)

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Tanh(),
                                    torch.nn.Linear(20, 5))
        adam = torch.optim.Adam(model.parameters(), lr=0.01)
        opt = sparseps.torch.DistributedOptimizer(
            adam, sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets),
            aggregate="update", freeze_variance_step=freeze, local_view=view)
        start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        steps = torch.zeros_like(start)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for i in range(30):
            opt.zero_grad()
            x = torch.randn(16, 30, generator=g)
            loss = (model(x) - x[:, :5]).pow(2).mean()
            loss.backward()
            opt.step()
            steps += opt._flat.double() * opt.worker.lr  # this step: the pushed buffer x lr
            losses.append(loss.item())
            if freeze is not None and i + 1 == freeze:
                at_freeze = adam.state[model[0].weight]["exp_avg_sq"].clone()
        if freeze is not None:
            weight = adam.state[model[0].weight]
            assert torch.equal(weight["exp_avg_sq"], at_freeze)
            assert weight["variance_frozen_step"] == freeze and int(weight["step"]) == 30
        end = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        residual = torch.from_numpy(opt.worker.residual()).double()
        state = adam.state[model[0].weight]["exp_avg_sq"].clone()
        opt.worker.finish()
        return start, end, steps, residual, state, losses

    (s0, e0, d0, r0, v0, l0), (s1, e1, d1, r1, v1, l1) = run_threads(
        [lambda r=r: worker(r) for r in range(2)])
    if view:  # each worker's view: the job's parameters less 0.5 * residual / 2
        assert not torch.equal(e0, e1)
        e0, e1 = e0 + 0.25 * r0, e1 + 0.25 * r1
        assert torch.allclose(e0, e1, rtol=0, atol=1e-6), (e0 - e1).abs().max()
    else:
        assert torch.equal(e0, e1)
    assert torch.equal(s0, s1)
    moved = s0 - e0
    expected = (d0 + d1 - 0.5 * (r0 + r1)) / 2
    assert torch.allclose(moved, expected, rtol=0, atol=1e-5), (moved - expected).abs().max()
    assert r0.abs().sum() > 0  # density 5%: the residuals do hold steps back
    assert not torch.equal(v0, v1)  # each worker's Adam saw its own gradients
    assert sum(l0[-5:]) < sum(l0[:5]), l0


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_frozen_variance_adam_is_adam_with_the_second_moment_held(cluster, cls):
    """freeze_variance_step=5 with aggregate="gradient": the first 5 steps are torch's own, then
    1-bit Adam's compression stage (Tang et al. 2021, Algorithm 1): the first moment and the bias
    correction of the step go on, the second moment and its bias correction stay at step 5.
    Against a float64 reference of that algorithm fed the same aggregated gradients (.grad after
    each step), with weight decay (Adam's L2, AdamW's decoupled). An entry without any gradient
    before the freeze has a second moment of 0 there (AdamW; Adam's L2 term gives every entry a
    gradient): it freezes at the entry's first gradient instead of dividing it by eps. Top-k 30% may
    or may not leave such entries (PS sums are not bitwise repeatable), so with AdamW input 0 is
    zero until the freeze and large after it: the 4 weights it feeds surely have them."""
    c = cluster("train: {lr: 1, momentum: 0}\ncompression: {encoding: topk, density: 0.3}\n")
    lr, wd, (b1, b2), eps, freeze = 0.02, 0.1, (0.9, 0.999), 1e-8, 5

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Linear(12, 4)
        opt = sparseps.torch.DistributedOptimizer(
            cls(model.parameters(), lr=lr, weight_decay=wd),
            sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides),
            freeze_variance_step=freeze)
        start = [p.detach().double().clone() for p in model.parameters()]
        grads = []
        g = torch.Generator().manual_seed(rank)
        for step in range(24):
            opt.zero_grad()
            inputs = torch.randn(8, 12, generator=g)
            if cls is torch.optim.AdamW:  # the weights input 0 feeds: their first gradient late
                inputs[:, 0] *= 0 if step < freeze else 10
            model(inputs).pow(2).mean().backward()
            opt.step()
            grads.append([p.grad.double().clone() for p in model.parameters()])
        end = [p.detach().double() for p in model.parameters()]
        opt.worker.finish()
        return start, grads, end

    for start, grads, end in run_threads([lambda r=r: worker(r) for r in range(2)]):
        late = 0  # entries whose second moment froze after the freeze step
        for i, x in enumerate(start):
            m, v = torch.zeros_like(x), torch.zeros_like(x)
            for t, step_grads in enumerate(grads, start=1):
                grad = step_grads[i]
                if cls is torch.optim.AdamW:
                    x = x * (1 - lr * wd)
                else:
                    grad = grad + wd * x
                m = b1 * m + (1 - b1) * grad
                if t <= freeze:
                    v = b2 * v + (1 - b2) * grad * grad
                else:
                    late += int(((v == 0) & (grad != 0)).sum())
                    v = torch.where(v == 0, (1 - b2) * grad * grad, v)
                denom = (v / (1 - b2**min(t, freeze))).sqrt() + eps
                x = x - lr / (1 - b1**t) * m / denom
            assert torch.allclose(end[i], x, rtol=0, atol=1e-5), (end[i] - x).abs().max()
        assert late >= 4 if cls is torch.optim.AdamW else late == 0, late


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
def test_overlap_pushes_during_the_backward_pass_and_changes_nothing(cluster, backend):
    """Through the pybind11 module and through capi, on the CPU (test_gpu.py: on a GPU)."""
    overlap_pushes_during_the_backward_pass_and_changes_nothing(cluster, backend, "cpu")


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
def test_the_model_file_holds_the_models_own_names(cluster, backend):
    """DistributedOptimizer(names=...) with the model's named_parameters (a frozen one among them,
    which the optimizer holds but sparseps leaves out): <run.dir>/model.safetensors holds the
    trained tensors under those names and shapes, and load_state_dict takes them back."""
    from test_model_file import read_safetensors
    c = cluster("train: {lr: 0.1, momentum: 0}\n"
                "compression: {encoding: topk, density: 0.5}\n", workers=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model[2].bias.requires_grad_(False)
    named = list(model.named_parameters())
    opt = sparseps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        backend(str(c.job), rank=0, overrides=c.overrides), names=[n for n, _ in named])
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()
    opt.worker.finish()
    tensors, _ = read_safetensors(c.run_dir / "model.safetensors")
    trained = {n: p for n, p in named if p.requires_grad}
    assert sorted(tensors) == sorted(trained) == ["0.bias", "0.weight", "2.weight"]
    for n, p in trained.items():
        assert tensors[n].shape == tuple(p.shape)
        assert np.array_equal(tensors[n], p.detach().numpy()), n
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh.load_state_dict({n: torch.from_numpy(t.copy()) for n, t in tensors.items()},
                          strict=False)
    assert torch.equal(fresh[0].weight, model[0].weight.detach())
    with pytest.raises(ValueError, match="2 names for the optimizer's 4 parameters"):
        sparseps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            opt.worker, names=["a", "b"])


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
@pytest.mark.parametrize("kind", ["adam_gradient", "adam_update_view"])
def test_the_model_file_holds_the_model_the_optimizer_trained(cluster, backend, kind):
    """Where the model is not the job's parameters (Adam over the aggregated gradient: its own
    copy; local_view: the worker's view), synchronize() hands the model to the worker
    (set_trained_model) and the leader's model file holds it, not the job's parameters, which
    differ from it here. A size other than the model's is refused."""
    from test_model_file import read_safetensors
    c = cluster("train: {lr: 0.1, momentum: 0}\n"
                "compression: {encoding: topk, density: 0.5}\n", workers=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    named = list(model.named_parameters())
    opt = sparseps.torch.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        backend(str(c.job), rank=0, overrides=c.overrides), names=[n for n, _ in named],
        aggregate="update" if kind == "adam_update_view" else "gradient",
        local_view=kind == "adam_update_view")
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()
    opt.synchronize()
    job = opt.worker.params()
    with pytest.raises(ValueError, match="SetTrainedModel: params has 3 elements; "
                                         "the job has 26"):
        opt.worker.set_trained_model(np.zeros(3, dtype=np.float32))
    opt.worker.finish()
    tensors, _ = read_safetensors(c.run_dir / "model.safetensors")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert not np.array_equal(flat, job)  # the job's parameters are not the model here
    for n, p in named:
        assert np.array_equal(tensors[n], p.detach().numpy()), n


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
def test_set_trained_model_takes_a_tensor_as_both_bindings_do(cluster, backend):
    set_trained_model_takes_a_tensor(cluster, backend, "cpu")


def test_module_buffers_loaded_drop_the_copy_held_for_a_checkpoint():
    """ModuleBuffers.state_dict() gives the copy step_ended() took (the checkpoint's step, before
    the next forward pass moves the statistics) once, then the buffers as they are; a
    load_state_dict (a rollback behind that checkpoint, before its state was taken) drops the
    copy, so that a later state_dict (a replacement's hand-over) is the loaded state, not the
    abandoned step's."""
    model = torch.nn.BatchNorm1d(3)
    buffers = sparseps.torch.ModuleBuffers(model)
    saved = {n: b.clone() for n, b in buffers.state_dict().items()}  # the initial statistics
    model(torch.randn(8, 3) + 5)
    buffers.step_ended()  # the checkpoint's step
    at_checkpoint = model.running_mean.clone()
    model(torch.randn(8, 3) - 5)  # the next step's forward pass
    assert torch.equal(buffers.state_dict()["running_mean"], at_checkpoint)
    assert torch.equal(buffers.state_dict()["running_mean"], model.running_mean)  # taken once
    buffers.step_ended()
    buffers.load_state_dict(saved)  # rolled back to an older checkpoint
    got = buffers.state_dict()
    assert sorted(got) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
def test_the_model_file_holds_the_buffers_of_module_buffers(cluster, backend):
    """A BatchNorm model through DistributedOptimizer with extra_state ModuleBuffers(model):
    synchronize() hands its buffers over (set_model_buffers), and the leader's model file holds
    parameters and buffers under the module's names (those of its state_dict, not a buffer
    registered with persistent=False), so that a fresh model loads it strictly and evaluates as
    the trained one. A buffer named as a layer, or a broken one, is refused."""
    from test_model_file import read_safetensors
    c = cluster("train: {lr: 0.1, momentum: 0}\n", workers=1)
    torch.manual_seed(0)

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 2))
        # No part of the state (a causal mask's kind): not in the model file.
        m.register_buffer("scratch", torch.ones(3), persistent=False)
        return m

    model = make()
    named = list(model.named_parameters())
    worker = backend(str(c.job), rank=0, overrides=c.overrides)
    opt = sparseps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), worker, names=[n for n, _ in named],
        extra_state={"buffers": sparseps.torch.ModuleBuffers(model)})
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 5) * 3 + 1).pow(2).mean().backward()
        opt.step()
    with pytest.raises(ValueError, match="'0.bias' is named twice, or as one of the model's"):
        worker.set_model_buffers({"0.bias": torch.zeros(4)})
    with pytest.raises(ValueError, match="set_model_buffers: bad: expected a float32 array"):
        worker.set_model_buffers({"bad": object()})
    with pytest.raises(ValueError, match="a buffer has no name"):
        worker.set_model_buffers({"": torch.zeros(1)})
    opt.synchronize()
    worker.finish()
    tensors, meta = read_safetensors(c.run_dir / "model.safetensors")
    state = model.state_dict()
    assert sorted(tensors) == sorted(state)  # 1.running_mean, 1.num_batches_tracked, ...
    assert float(tensors["1.num_batches_tracked"]) == 5
    assert not np.allclose(tensors["1.running_mean"], 0)  # moved by the 5 steps' batches
    # sparseps's own reader reads what the format's definition reads.
    got, got_meta = sparseps.read_model_file(c.run_dir / "model.safetensors")
    assert got_meta == meta and list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and np.array_equal(got[name], t), name
    fresh = make()
    fresh.load_state_dict(sparseps.torch.load_model_file(c.run_dir / "model.safetensors"),
                          strict=True)
    model.eval()
    fresh.eval()
    x = torch.randn(16, 5)
    assert torch.equal(fresh(x), model(x))


def test_read_model_file_refuses_a_broken_file_naming_it(tmp_path):
    """sparseps.read_model_file on files made by the format's definition: a whole one reads back
    (dtypes, shapes, metadata, a scalar, an empty tensor); a broken one is a ValueError naming
    the file and the fault, as the C++ reader refuses it."""
    import json
    import struct

    def write(header, data, name="m.safetensors", length=None):
        text = json.dumps(header).encode()
        path = tmp_path / name
        path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
        return path

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    n = np.array(7, dtype=np.int64)
    good = {"__metadata__": {"format": "sparseps-model"},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "n": {"dtype": "I64", "shape": [], "data_offsets": [24, 32]},
            "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [32, 32]}}
    data = a.tobytes() + n.tobytes()
    tensors, meta = sparseps.read_model_file(write(good, data))
    assert meta == {"format": "sparseps-model"} and list(tensors) == ["a", "n", "e"]
    assert np.array_equal(tensors["a"], a) and tensors["n"].shape == () and tensors["n"] == 7
    assert tensors["e"].shape == (0, 4)
    tensors["a"][0, 0] = 1  # writable: a state_dict's tensors may be changed in place
    state = sparseps.torch.load_model_file(tmp_path / "m.safetensors")
    assert state["a"].dtype == torch.float32 and state["n"].dtype == torch.int64

    def refused(fault, header=good, body=data, **kw):
        path = write(header, body, name="bad.safetensors", **kw)
        with pytest.raises(ValueError, match=f"bad.safetensors: not a safetensors model file: "
                                             f"{fault}"):
            sparseps.read_model_file(path)

    refused("tensor 'n' lies at \\[24, 32\\) beyond the 31 data bytes", body=data[:-1])
    refused("1 bytes after the last tensor", body=data + b"\0")
    refused("a header of 4096 bytes in a file of", length=4096)
    refused("the header is not JSON", length=5)
    refused("tensor 'a' has unsupported dtype F8",
            header={**good, "a": {**good["a"], "dtype": "F8"}})
    refused("tensor 'a' holds 24 bytes, not what its shape and dtype need",
            header={**good, "a": {**good["a"], "shape": [2, 2]}})
    refused("tensor 'n' does not follow the previous one",
            header={**good, "n": {**good["n"], "data_offsets": [16, 24]},
                    "e": {**good["e"], "data_offsets": [24, 24]}}, body=data[:24])
    refused("tensor 'a' lacks dtype, shape or data_offsets",
            header={**good, "a": {"dtype": "F32"}})
    (tmp_path / "short.safetensors").write_bytes(b"\1\0")
    with pytest.raises(ValueError, match="short.safetensors: .*2 bytes, fewer than the header"):
        sparseps.read_model_file(tmp_path / "short.safetensors")
    with pytest.raises(OSError):
        sparseps.read_model_file(tmp_path / "absent.safetensors")


def test_overlap_is_refused_where_step_changes_the_gradient(cluster):
    c = cluster("train: {lr: 1, momentum: 0}\n", workers=1)
    model = torch.nn.Linear(3, 2)
    worker = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
    for kwargs in ({"aggregate": "update"}, {"freeze_variance_step": 3}):
        with pytest.raises(ValueError, match="overlap=True needs"):
            sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), worker,
                                                overlap=True, **kwargs)


def test_frozen_variance_selects_by_the_step_each_entry_would_take(cluster):
    """aggregate="gradient" after the freeze: the pushed gradient is divided by Adam's frozen
    denominators, so top-k ranks entries by the step they would take, not by raw size, and the
    residual keeps the rest in those units. Two entries, a dense warm-up epoch (warmup_density 1)
    with gradients (10, 1), then k = 1: the gradient (5, 1) sends the second (1 / 1 > 5 / 10) and
    keeps 0.5 of the first."""
    c = cluster("train: {lr: 1, momentum: 0}\ncompression: {encoding: topk, density: 0.5, "
                "warmup_epochs: 1, warmup_density: 1}\n", workers=1, servers=1)
    x = torch.nn.Parameter(torch.zeros(2))
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
    opt = sparseps.torch.DistributedOptimizer(torch.optim.Adam([x], lr=0.01), w,
                                              freeze_variance_step=3)
    for grad in [(10.0, 1.0)] * 3:
        opt.zero_grad()
        (x * torch.tensor(grad)).sum().backward()
        opt.step()
        assert torch.equal(x.grad, torch.tensor(grad))  # dense: both entries every step
    w.set_epoch(1)  # k = 1 of 2
    opt.zero_grad()
    (x * torch.tensor([5.0, 1.0])).sum().backward()
    opt.step()
    assert x.grad[0] == 0 and torch.isclose(x.grad[1], torch.tensor(1.0), rtol=1e-6), x.grad
    residual = torch.from_numpy(w.residual())
    assert torch.allclose(residual, torch.tensor([0.5, 0.0]), rtol=1e-6, atol=0), residual
    w.finish()


def test_local_view_computes_at_the_job_parameters_moved_by_the_own_residual(cluster):
    """local_view with the variance frozen (aggregate="gradient"): each worker's gradient is taken
    at the job's parameters less Adam's lr times its own residual over W, and step() aggregates
    from the job's parameters, so the job's stay the same on both workers (up to rounding) while
    the views differ; synchronize() leaves the view. Before the freeze (a dense warm-up epoch) the
    models are equal. Without a known displacement (aggregate="gradient" and no freeze) or with
    overlap it is refused."""
    c = cluster("train: {lr: 1, momentum: 0}\ncompression: {encoding: topk, density: 0.05, "
                "warmup_epochs: 1, warmup_density: 1}\n")

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Tanh(),
                                    torch.nn.Linear(20, 5))
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides)
        opt = sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                                  w, freeze_variance_step=5, local_view=True)
        g = torch.Generator().manual_seed(rank)
        flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        models, residuals, losses = [], [], []
        for i in range(25):
            if i == 5:
                w.set_epoch(1)  # density 5% from here on
            opt.zero_grad()
            x = torch.randn(16, 30, generator=g)
            loss = (model(x) - x[:, :5]).pow(2).mean()
            loss.backward()
            opt.step()
            models.append(flat())
            residuals.append(torch.from_numpy(w.residual()).double())
            losses.append(loss.item())
        opt.synchronize()
        assert torch.equal(flat(), models[-1])
        w.finish()
        return models, residuals, losses

    (m0, r0, l0), (m1, r1, l1) = run_threads([lambda r=r: worker(r) for r in range(2)])
    for i in range(5):  # dense before the freeze: the same model, no view
        assert torch.equal(m0[i], m1[i]) and not r0[i].any(), i
    for i in range(5, 25):
        assert not torch.equal(m0[i], m1[i]), i
        job0, job1 = m0[i] + 0.005 * r0[i], m1[i] + 0.005 * r1[i]  # lr 0.01 / W
        assert torch.allclose(job0, job1, rtol=0, atol=1e-6), (i, (job0 - job1).abs().max())
    assert sum(l0[-5:]) < sum(l0[:5]), l0
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
    params = list(torch.nn.Linear(4, 2).parameters())
    for kwargs in [{}, {"overlap": True, "freeze_variance_step": 5}]:
        with pytest.raises(ValueError, match="local_view=True needs aggregate='update' or "
                                             "freeze_variance_step"):
            sparseps.torch.DistributedOptimizer(torch.optim.Adam(params), w, local_view=True,
                                                **kwargs)


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
@pytest.mark.parametrize("aggregate", ["update", "gradient"])
def test_average_views_gives_every_worker_the_mean_of_the_views(cluster, aggregate, backend):
    """average_views() after 12 steps of local_view (AdamW's update aggregated, or the gradient
    with the variance frozen at step 4; PS top-k 10%, two servers): both workers' models become
    the mean of their two views, the residuals are empty, with aggregate="update" the job's
    parameters are that mean too, and the next step starts from it (equal models, each moved by
    its own new residual only). Without local_view it is refused, and so is a density scale that is
not positive."""
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n")

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        w = backend(str(c.job), rank=rank, overrides=c.overrides)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01), w, aggregate=aggregate,
            freeze_variance_step=4 if aggregate == "gradient" else None, local_view=True)
        g = torch.Generator().manual_seed(rank)
        flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()

        def step():
            opt.zero_grad()
            x = torch.randn(4, 8, generator=g)
            (model(x) - x[:, :2]).pow(2).mean().backward()
            opt.step()
        for _ in range(12):
            step()
        view = flat()
        assert w.residual().any()
        opt.average_views()
        out = (view, flat(), w.residual(), torch.from_numpy(w.params()).double())
        step()
        w.finish()
        return out
    (v0, a0, r0, j0), (v1, a1, r1, j1) = run_threads([lambda r=r: worker(r) for r in range(2)])
    assert not torch.equal(v0, v1)
    mean = (v0 + v1) / 2
    for a in (a0, a1):
        assert torch.allclose(a, mean, rtol=0, atol=1e-6), (a - mean).abs().max()
    assert not r0.any() and not r1.any()
    if aggregate == "update":
        assert torch.allclose(j0, mean, rtol=0, atol=1e-6) and torch.equal(j0, j1)
    one = cluster("train: {lr: 0.5, momentum: 0}\n", workers=1)
    w = sparseps.Worker(str(one.job), rank=0, overrides=one.overrides)
    opt = sparseps.torch.DistributedOptimizer(
        torch.optim.Adam(torch.nn.Linear(3, 2).parameters()), w, aggregate="update")
    with pytest.raises(ValueError, match="average_views: needs local_view=True"):
        opt.average_views()
    with pytest.raises(ValueError, match="SetDensityScale: scale 0.000000; a positive finite"):
        w.set_density_scale(0)
    w.finish()


def test_local_view_after_a_lost_worker_moves_by_the_live_workers_share(cluster):
    """3 workers of local_view with AdamW's update aggregated; worker 2 leaves after 3 steps
    (capi's close() without finish: lost, cluster.on_worker_failure: continue) and the servers
    then average over 2 pushes. Each view is the job's parameters moved by its residual as
    sending it would move them: lr r / 2, not lr r / 3; average_views makes both models and the
    job's parameters the mean of the two views."""
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n",
                workers=3)

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        w = (capi.Worker if rank == 2 else sparseps.Worker)(str(c.job), rank=rank,
                                                           overrides=c.overrides)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01), w, aggregate="update",
            local_view=True)
        g = torch.Generator().manual_seed(rank)
        flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        for t in range(12):
            if rank == 2 and t == 3:
                w.close()
                return None
            opt.zero_grad()
            x = torch.randn(4, 8, generator=g)
            (model(x) - x[:, :2]).pow(2).mean().backward()
            opt.step()
        assert w.live_workers == [0, 1]
        view, job = flat(), torch.from_numpy(w.params()).double()
        residual = torch.from_numpy(w.residual()).double()
        assert residual.any()
        opt.average_views()
        out = (view, job, residual, flat(), torch.from_numpy(w.params()).double())
        w.finish()
        return out
    (v0, j0, r0, a0, p0), (v1, j1, r1, a1, p1), _ = run_threads(
        [lambda r=r: worker(r) for r in range(3)])
    for view, job, residual in ((v0, j0, r0), (v1, j1, r1)):
        assert torch.allclose(view, job - 0.5 / 2 * residual, rtol=0, atol=1e-6), \
            (view - (job - 0.5 / 2 * residual)).abs().max()
    mean = (v0 + v1) / 2
    for a in (a0, a1, p0, p1):
        assert torch.allclose(a, mean, rtol=0, atol=1e-6), (a - mean).abs().max()


def test_freeze_variance_step_needs_adam(cluster):
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n",
                workers=1)
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
    params = list(torch.nn.Linear(4, 2).parameters())
    for opt, freeze, message in [
            (torch.optim.SGD(params, lr=0.1), 10, "needs torch.optim.Adam or AdamW, not SGD"),
            (torch.optim.Adam(params), 0, "freeze_variance_step=0; a step count of at least 1"),
            (torch.optim.Adam(params), 2.5, "freeze_variance_step=2.5"),
            (torch.optim.AdamW(params, amsgrad=True), 10, "with amsgrad=True")]:
        with pytest.raises(ValueError, match=message):
            sparseps.torch.DistributedOptimizer(opt, w, freeze_variance_step=freeze)


def test_aggregating_the_update_needs_no_job_momentum(cluster):
    c = cluster("train: {lr: 0.5, momentum: 0.9}\ncompression: {encoding: topk, density: 0.1}\n",
                workers=1)
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="train.momentum is 0.9; set it to 0"):
        sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), w,
                                            aggregate="update")
    with pytest.raises(ValueError, match="'gradient' or 'update'"):
        sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), w,
                                            aggregate="weights")


def test_distributed_optimizer_reports_the_loss_to_the_live_metrics(cluster):
    """metrics.port: step(loss=...) and step(closure) set the worker's loss gauge, scraped over
    HTTP from each worker's endpoint (port + 1 + num_servers + rank)."""
    sys.path.insert(0, str(ROOT / "tests" / "deploy"))
    import test_metrics as live  # free_base, scrape, value (the daemons' metrics test)

    base = live.free_base(5)
    c = cluster("train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n")
    scraped = [[], []]
    barrier = threading.Barrier(2)

    def worker(rank):
        torch.manual_seed(rank)
        model = torch.nn.Linear(30, 5)
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + [
                f"metrics.port={base}", "metrics.host=127.0.0.1"]))
        x = torch.randn(8, 30)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)  # a tensor that requires grad
        scraped[rank].append((float(loss), live.scrape(base + 3 + rank)))

        def closure():
            opt.zero_grad()
            out = model(x).pow(2).mean()
            out.backward()
            return out

        returned = opt.step(closure)
        scraped[rank].append((float(returned), live.scrape(base + 3 + rank)))
        opt.step(loss=2.25)  # a float
        scraped[rank].append((2.25, live.scrape(base + 3 + rank)))
        barrier.wait(60)  # both scraped before either leaves the job
        opt.worker.finish()

    run_threads([lambda r=r: worker(r) for r in range(2)])
    for rank in range(2):
        assert len(scraped[rank]) == 3
        for step, (want, text) in enumerate(scraped[rank]):
            labels = {"role": "worker", "rank": rank}
            assert live.value(text, "sparseps_worker_steps_total", **labels) == step + 1
            assert live.value(text, "sparseps_worker_loss", **labels) == pytest.approx(want), step
