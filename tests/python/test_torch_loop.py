"""What a Horovod or torch DDP user's training loop does with sparseps.torch.DistributedOptimizer
besides step(): an LR scheduler made over the wrapper (it is a torch.optim.Optimizer whose
param_groups are the wrapped optimizer's), Horovod's named_parameters and metric average
(Worker.allreduce_values), and freezing part of the model for a while: a parameter left out of
the job and unfrozen later is an error naming it, not a silent parting of the workers' models,
and the way that works (zeroed gradients) keeps the part still and then trains it on every
worker alike."""
import types

import numpy as np
import pytest
import torch

import sparseps
import sparseps.torch
from sparseps import capi
from conftest import run_threads

JOB = "train: {lr: 0.5, momentum: 0}\ncompression: {encoding: topk, density: 0.1}\n"


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def two_layers():
    """A model (each worker's its own at first: DistributedOptimizer makes them worker 0's)."""
    return torch.nn.Sequential(torch.nn.Linear(30, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


def backward(model, rank, step):
    """Each worker's own batch of the step (a generator of its own: the workers are threads)."""
    batch = torch.randn(8, 30, generator=torch.Generator().manual_seed(100 * rank + step))
    model(batch).pow(2).mean().backward()


def test_lr_schedulers_take_the_distributed_optimizer_and_set_the_wrapped_rates(cluster):
    """StepLR and ReduceLROnPlateau are made over the DistributedOptimizer as over any torch
    optimizer (as Horovod's users do); they set the wrapped optimizer's rate, which its step then
    uses: the workers' models stay equal and move as the halved rates say. state_dict() is the
    wrapped optimizer's, and add_param_group is refused (the job's keys are fixed)."""
    c = cluster(JOB)

    def worker(rank):
        model = two_layers()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = sparseps.torch.DistributedOptimizer(
            inner, sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides))
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        moved = []
        for t in range(5):
            before = flat(model)
            opt.zero_grad()
            backward(model, rank, t)
            opt.step()
            step_lr.step()
            moved.append(float((flat(model) - before).norm()))
        rates = [inner.param_groups[0]["lr"]]
        assert opt._step_count == 5  # the scheduler counted the optimizer's steps: no warning
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        plateau.step(1.0)
        plateau.step(2.0)  # worse: halves the rate
        rates.append(inner.param_groups[0]["lr"])
        assert opt.state_dict() == inner.state_dict()
        with pytest.raises(RuntimeError, match="add_param_group: the parameters are the job's"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
        opt.synchronize()
        opt.worker.finish()
        return flat(model), rates, moved

    (p0, rates0, moved0), (p1, rates1, moved1) = run_threads([lambda r=r: worker(r)
                                                              for r in range(2)])
    assert torch.equal(p0, p1)
    assert rates0 == rates1 == [pytest.approx(0.025), pytest.approx(0.0125)]
    assert moved0 == moved1 and all(m > 0 for m in moved0), moved0


def test_a_parameter_unfrozen_after_wrapping_is_an_error_naming_it(cluster):
    """A layer that required no gradient when the DistributedOptimizer was made is not part of the
    job: unfrozen later, step() raises before anything is pushed, naming it (without the check the
    wrapped optimizer stepped it on each worker's own gradient and the models parted), and the
    job still ends well."""
    c = cluster(JOB)

    def worker(rank):
        model = two_layers()
        model[0].requires_grad_(False)
        names = [n for n, _ in model.named_parameters()]
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides), names=names)
        for t in range(2):
            opt.zero_grad()
            backward(model, rank, t)
            opt.step()
        model[0].requires_grad_(True)
        opt.zero_grad()
        backward(model, rank, 2)
        with pytest.raises(RuntimeError, match=r"0\.weight; 0\.bias required no gradient when the "
                                               r"DistributedOptimizer was made.*unfrozen since"):
            opt.step()
        assert opt.worker.step == 2  # nothing pushed
        opt.worker.finish()

    run_threads([lambda r=r: worker(r) for r in range(2)])


def test_a_part_kept_still_by_zeroed_gradients_stays_and_then_trains_alike(cluster):
    """The way to freeze a part for a while: it requires a gradient when the optimizer is made and
    the loop zeroes its gradients before step() while it is to stay still. Plain SGD at train.lr
    (the model follows the job's parameters): the part stays exactly still for 3 steps while the
    rest trains, then moves, and both workers' models stay equal throughout."""
    c = cluster(JOB)

    def worker(rank):
        model = two_layers()
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides))
        first = flat(model[0])  # worker 0's
        still = []
        for t in range(6):
            opt.zero_grad()
            backward(model, rank, t)
            if t < 3:
                for p in model[0].parameters():
                    p.grad.zero_()
            opt.step()
            still.append(torch.equal(flat(model[0]), first))
        opt.worker.finish()
        return flat(model), still

    (p0, still0), (p1, still1) = run_threads([lambda r=r: worker(r) for r in range(2)])
    assert torch.equal(p0, p1)
    assert still0 == still1 == [True, True, True, False, False, False]


def test_named_parameters_names_the_model_file_by_identity_as_horovods(cluster):
    """DistributedOptimizer(opt, worker, named_parameters=model.named_parameters()), as a Horovod
    user writes it, with the optimizer's parameter groups in another order than the module's
    (the head first, at its own rate): the model file holds each trained tensor under its own
    module name. A parameter it does not name, or names given twice over, are errors."""
    from test_model_file import read_safetensors
    c = cluster(JOB, workers=1)
    model = two_layers()
    groups = [{"params": list(model[2].parameters()), "lr": 0.05},
              {"params": list(model[0].parameters())}]
    opt = sparseps.torch.DistributedOptimizer(
        torch.optim.SGD(groups, lr=0.1), sparseps.Worker(str(c.job), rank=0, overrides=c.overrides),
        named_parameters=model.named_parameters())
    for t in range(3):
        opt.zero_grad()
        backward(model, 0, t)
        opt.step()
    with pytest.raises(ValueError, match=r"does not name the optimizer's parameters \[0, 1\]"):
        sparseps.torch.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1), opt.worker,
                                            named_parameters=model[0].named_parameters())
    with pytest.raises(ValueError, match="names or named_parameters, not both"):
        sparseps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            opt.worker, names=["a"] * 4,
                                            named_parameters=model.named_parameters())
    opt.synchronize()
    opt.worker.finish()
    tensors, _ = read_safetensors(c.run_dir / "model.safetensors")
    assert sorted(tensors) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, p in model.named_parameters():
        assert tensors[name].shape == tuple(p.shape)
        assert torch.equal(torch.from_numpy(tensors[name].copy()), p.detach()), name


@pytest.mark.parametrize("backend", [sparseps.Worker, capi.Worker], ids=["module", "capi"])
def test_allreduce_values_averages_a_metric_over_the_workers_as_horovods(cluster, backend):
    """Horovod's metric_average (hvd.allreduce of each worker's validation loss): each of 3
    workers gives its own numbers after its steps and every one gets their mean, or with
    op="sum" their sum, the same everywhere; a list, a NumPy array and a tensor are taken. No
    numbers, or an op other than mean and sum, are ValueErrors."""
    c = cluster(JOB, servers=1, workers=3)

    def worker(rank):
        model = two_layers()
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            backend(str(c.job), rank=rank, overrides=c.overrides))
        for t in range(2):
            opt.zero_grad()
            backward(model, rank, t)
            opt.step()
        w = opt.worker
        got = [w.allreduce_values([rank, 10.0 * rank + 0.5]),
               w.allreduce_values(np.array([1.0]), op="sum"),
               w.allreduce_values(torch.tensor([float(rank), 2.0 ** 40 * rank]), op="sum")]
        for bad, match in (([], "1 to 4096"), ([1.0], "'mean' or 'sum'")):
            with pytest.raises(ValueError, match=match):
                w.allreduce_values(bad, op="mean" if bad == [] else "max")
        w.finish()
        return [g.tolist() for g in got]

    results = run_threads([lambda r=r: worker(r) for r in range(3)])
    assert results[0] == results[1] == results[2]
    assert results[0] == [[1.0, 10.5], [3.0], [3.0, 3 * 2.0 ** 40]]


def test_grad_scaler_has_every_worker_skip_an_overflow_together(cluster):
    """sparseps.torch.GradScaler (fp16 mixed precision's dynamic loss scaling; float32 here):
    worker 1's gradient overflows (an inf) at step 3 of 8. Both workers skip that step together
    (nothing pushed: the job's step count stays), halve their scale alike and double it after
    growth_interval steps without one; every other step unscales exactly (powers of two), so the
    models equal, bit for bit, those of a run without the scaler whose workers both left batch 3
    out. (torch's GradScaler skips on worker 1 alone: its step(), handing itself over, is
    refused.) Anything but a DistributedOptimizer, and overlap=True, are refused; enabled=False
    passes everything through."""
    jobs = {True: cluster(JOB), False: cluster(JOB)}

    def worker(rank, scaled):
        model = two_layers()
        with torch.no_grad():  # the same worker 0's model in both jobs (threads share torch's RNG)
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
        c = jobs[scaled]
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides))
        scaler = sparseps.torch.GradScaler(init_scale=2.0 ** 10, growth_interval=3)
        scales, steps = [], []
        for t in range(8):
            opt.zero_grad()
            if scaled:
                batch = torch.randn(8, 30, generator=torch.Generator().manual_seed(100 * rank + t))
                loss = model(batch).pow(2).mean()
                if rank == 1 and t == 3:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            elif t != 3:
                backward(model, rank, t)
                opt.step()
            steps.append(opt.worker.step)
        # torch's GradScaler hands itself to step() (its contract for an optimizer with
        # _step_supports_amp_scaling): refused before anything is pushed.
        with pytest.raises(TypeError, match="torch's GradScaler skips the step on a worker"):
            opt.step(grad_scaler=object())
        opt.found_inf = torch.zeros(1)  # newer torch's contract: attributes, not the keyword
        with pytest.raises(TypeError, match="torch's GradScaler skips the step on a worker"):
            opt.step()
        del opt.found_inf
        opt.synchronize()
        opt.worker.finish()
        return flat(model), scales, steps, scaler.state_dict()

    scaled = run_threads([lambda r=r: worker(r, True) for r in range(2)])
    plain = run_threads([lambda r=r: worker(r, False) for r in range(2)])
    for (p, scales, steps, state), (q, _, plain_steps, _) in zip(scaled, plain):
        assert scales == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0]
        assert steps == plain_steps == [1, 2, 3, 3, 4, 5, 6, 7]
        assert torch.equal(p, q)
        assert state["scale"] == 2048.0 and state["_growth_tracker"] == 1
    assert torch.equal(scaled[0][0], scaled[1][0])

    with pytest.raises(TypeError, match="takes a sparseps.torch.DistributedOptimizer"):
        sparseps.torch.GradScaler().step(torch.optim.SGD(two_layers().parameters(), lr=0.1))
    overlapping = types.SimpleNamespace(worker=object(), overlap=True, param_groups=[])
    with pytest.raises(ValueError, match="not with DistributedOptimizer\\(overlap=True\\)"):
        sparseps.torch.GradScaler().unscale_(overlapping)
    off = sparseps.torch.GradScaler(enabled=False)
    loss = torch.ones(1)
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}
    assert off.step(types.SimpleNamespace(step=lambda: "stepped")) == "stepped"
    with pytest.raises(ValueError, match="growth_interval"):
        sparseps.torch.GradScaler(growth_interval=0)
