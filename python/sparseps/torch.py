"""sparseps for PyTorch: a DistributedOptimizer wrapper and a DDP communication hook.

DistributedOptimizer (as Horovod's and BytePS's): wraps any torch.optim optimizer. At start the
model's parameters become worker 0's on every worker; each step() aggregates the gradients
through the sparseps job (its encoding and selection, PS or allreduce, error feedback kept by
sparseps) and hands the wrapped optimizer the aggregated gradient:

    worker = sparseps.Worker("job.yaml")
    opt = sparseps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                              worker)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    worker.finish(test_accuracy=acc)

With torch.optim.SGD(lr=train.lr) and no torch momentum the model holds the job's parameters
after every step, as the C++ worker does (the changed ones are copied, a sparse step; DGC's
momentum correction, train.momentum, is inside sparseps). Any other optimizer (Adam, SGD with
momentum, with train.momentum: 0) gets the job's aggregated gradient, update / train.lr (zero
where nothing changed), as .grad and steps with it.

With aggregate="update" the wrapped optimizer (Adam, AdamW, ...) steps on each worker's own
gradient and sparseps aggregates those steps instead, with error feedback on the update (the job
needs train.momentum: 0): what Adam needs at low density, where a sparse aggregated gradient
would feed its second moment zeros and bursts.

sparse_allreduce_hook: a torch DDP communication hook that aggregates DDP's gradient buckets with
a sparse collective of sparseps (topk_allgather, gtopk, spardl, exdyna; collective.algorithm)
instead of Gloo's dense allreduce, as torch's own PowerSGD hook does with its state:

    state = sparseps.torch.SparseAllreduceState(sparseps.Worker("job.yaml"), ddp_model)
    ddp_model.register_comm_hook(state, sparseps.torch.sparse_allreduce_hook)

The job must use `aggregation: allreduce` (no servers); the hook hands DDP the averaged
aggregated gradient (update / train.lr), so train.lr: 1 is exact.

Only torch is imported here, not linked: any PyTorch with DLPack works (Debian's 1.13 is tested).
"""
import time

import torch

__all__ = ["DistributedOptimizer", "SparseAllreduceState", "sparse_allreduce_hook"]


def _finished(t):
    """Waits until the work queued on `t`'s CUDA device is done (nothing for a CPU tensor): the
    library reads a device tensor on its own streams, which do not wait for PyTorch's."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _float32_params(params, what):
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError(f"{what}: no parameters that require a gradient")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"{what}: parameters on several devices ({devices}); sparseps takes one")
    for p in params:
        if p.dtype != torch.float32:
            raise ValueError(f"{what}: a parameter of dtype {p.dtype}; sparseps takes float32")
    return params


class DistributedOptimizer:
    """Wraps `optimizer` so that step() aggregates through `worker` (a sparseps.Worker or
    capi.Worker, not yet initialised: this calls its init) either its parameters' gradients
    (aggregate="gradient", the default) or its own steps (aggregate="update").

    aggregate="update" is error feedback on the optimizer's update: each worker's optimizer
    (Adam, AdamW, any) steps on the worker's own gradient, and the step it took (old minus new
    parameters) goes through sparseps instead of the gradient; sparseps's residual keeps what the
    compression left out for the next steps, and every worker's model becomes the job's, old
    minus the aggregated step (Chen et al., "Efficient-Adam: Communication-Efficient Distributed
    Adam", IEEE Trans. Signal Processing 2023, compress Adam's update with error feedback the
    same way). Each worker's optimizer state (Adam's moments) is its own, from its own gradients,
    so sparse aggregation never feeds Adam's second moment the zeros and bursts of a sparse
    gradient. Needs train.momentum: 0 (the optimizer has its own) and works for any train.lr.

    The gradients live in one flat float32 buffer of which every parameter's .grad is a view, so
    push_pull takes them without a copy (keep zero_grad's set_to_none False, the default here).
    Everything else (param_groups, state_dict, ...) is the wrapped optimizer's.
    """

    def __init__(self, optimizer, worker, aggregate="gradient"):
        if aggregate not in ("gradient", "update"):
            raise ValueError(f"DistributedOptimizer: aggregate={aggregate!r}; 'gradient' or "
                             "'update'")
        if aggregate == "update" and worker.get("train.momentum") != 0:
            raise ValueError("DistributedOptimizer(aggregate='update'): the job's train.momentum "
                             f"is {worker.get('train.momentum')}; set it to 0 (the optimizer "
                             "steps with its own momentum)")
        self.optimizer = optimizer
        self.worker = worker
        self.aggregate = aggregate
        self.last_push_pull_ms = 0.0  # wall time of the last push_pull
        self._params = _float32_params(
            [p for group in optimizer.param_groups for p in group["params"]],
            "DistributedOptimizer")
        total = sum(p.numel() for p in self._params)
        device = self._params[0].device
        self._flat = torch.zeros(total, dtype=torch.float32, device=device)
        self._views = []
        starts = []
        offset = 0
        for p in self._params:
            starts.append(offset)
            view = self._flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self._views.append(view)
            offset += p.numel()
        # Each parameter's first flat key, and the end: where its keys start in push_pull's list.
        self._starts = torch.tensor(starts + [offset], dtype=torch.int64, device=device)
        # Every worker starts from worker 0's parameters (written into the model in place).
        _finished(self._flat)
        with torch.no_grad():
            worker.init([p.detach() for p in self._params])

    def _gather(self):
        # A .grad replaced behind our back (zero_grad(set_to_none=True) elsewhere) goes back into
        # the flat buffer, and becomes a view again.
        for i, p in enumerate(self._params):
            if p.grad is None:
                self._views[i].zero_()
            elif p.grad.data_ptr() != self._views[i].data_ptr():
                self._views[i].copy_(p.grad)
            p.grad = self._views[i]

    def _plain_sgd(self):
        """True when the wrapped optimizer is SGD at train.lr without momentum, weight decay or
        Nesterov: its step would set the parameters to the job's, so they are copied instead."""
        if type(self.optimizer) is not torch.optim.SGD:
            return False
        return all(g["lr"] == self.worker.lr and not g.get("momentum") and
                   not g.get("weight_decay") and not g.get("nesterov") and
                   not g.get("maximize") for g in self.optimizer.param_groups)

    def step(self, closure=None, loss=None):
        """Aggregates the gradients (sparseps.Worker.push_pull) and applies the result: with plain
        SGD at train.lr the changed parameters become the job's (a sparse copy; .grad keeps the
        local gradient); otherwise each .grad becomes the job's aggregated gradient, update /
        train.lr (zero where nothing changed), and the wrapped optimizer steps.

        The step's training loss goes to the live metrics (metrics.port: sparseps_worker_loss):
        `loss` when given (a float or a one-element tensor; a tensor on a GPU is read with a
        device sync), else what `closure` returned. Returns the closure's loss, as torch does."""
        closure_loss = None
        if closure is not None:
            with torch.enable_grad():
                closure_loss = closure()
        reported = loss if loss is not None else closure_loss
        reported = None if reported is None else float(reported)
        self._gather()
        if self.aggregate == "update":
            self._local_step()  # the flat buffer now holds the step / train.lr
        _finished(self._flat)
        t = time.monotonic()
        keys, update, params = self.worker.push_pull(self._flat, sparse=True, loss=reported)
        self.last_push_pull_ms = 1000 * (time.monotonic() - t)
        device = self._flat.device
        # Every key changed (a dense method: ring, Gloo, PowerSGD): copies, not scatters.
        dense = len(keys) == self._flat.numel()
        keys = torch.from_numpy(keys).to(device)
        with torch.no_grad():
            if self.aggregate == "update" or self._plain_sgd():
                params = torch.from_numpy(params).to(device)
                if dense:
                    for p, start in zip(self._params, self._starts.tolist()):
                        p.view(-1).copy_(params[start:start + p.numel()])
                    return closure_loss
                bounds = torch.searchsorted(keys, self._starts).tolist()
                for p, start, lo, hi in zip(self._params, self._starts.tolist(), bounds[:-1],
                                            bounds[1:]):
                    if hi > lo:
                        p.view(-1).index_copy_(0, keys[lo:hi] - start, params[lo:hi])
                return closure_loss
            update = torch.from_numpy(update).to(device)
            if dense:
                torch.div(update, self.worker.lr, out=self._flat)
            else:
                self._flat.zero_()
                self._flat.index_put_((keys,), update / self.worker.lr)
        self.optimizer.step()
        return closure_loss

    def _local_step(self):
        """aggregate="update": the wrapped optimizer steps on this worker's gradient, the
        parameters go back to where they were, and the flat buffer gets the step / train.lr (the
        job applies train.lr times the aggregate)."""
        with torch.no_grad():
            before = [p.detach().clone() for p in self._params]
            self.optimizer.step()
            for p, b, view in zip(self._params, before, self._views):
                torch.sub(b, p, out=view)  # the step: old minus new
                p.copy_(b)
            self._flat.div_(self.worker.lr)

    def synchronize(self):
        """train.consistency ssp / async: waits until every worker has pushed as many steps as
        this one and copies the job's parameters then (no staleness) into the model's: call it
        before the final evaluation and before saving the model. bsp: nothing changes. Where the
        model is not the job's (another optimizer than plain SGD with aggregate="gradient": each
        worker's optimizer steps on its own copy) it only waits."""
        params = self.worker.synchronize()
        if self.aggregate != "update" and not self._plain_sgd():
            return
        params = torch.from_numpy(params).to(self._flat.device)
        with torch.no_grad():
            offset = 0
            for p in self._params:
                p.view(-1).copy_(params[offset:offset + p.numel()])
                offset += p.numel()

    def zero_grad(self, set_to_none=False):
        """Zeroes the flat gradient buffer (set_to_none would drop the views; it is ignored)."""
        self._flat.zero_()

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


class SparseAllreduceState:
    """The state of sparse_allreduce_hook for one DDP model: the sparseps.Worker (not yet
    initialised: this calls its init with the model's parameters) and one flat gradient of the
    whole model, each parameter at a fixed offset whatever DDP's bucket layout (DDP rebuilds its
    buckets after the first step), so that the residuals stay with their keys."""

    def __init__(self, worker, model):
        if worker.aggregation != "allreduce":
            raise ValueError("sparse_allreduce_hook needs a job with aggregation: allreduce")
        module = getattr(model, "module", model)
        self.params = _float32_params(list(module.parameters()), "SparseAllreduceState")
        self.offset = {}
        offset = 0
        for p in self.params:
            self.offset[id(p)] = (offset, p.numel())
            offset += p.numel()
        self.flat = torch.zeros(offset, dtype=torch.float32, device=self.params[0].device)
        self.pending = []  # (bucket, future) of this step
        self.worker = worker
        _finished(self.flat)
        with torch.no_grad():
            worker.init([p.detach() for p in self.params])


def sparse_allreduce_hook(state, bucket):
    """DDP communication hook: collects the step's buckets into state.flat and, at the last one,
    aggregates it in one push_pull (residuals stay in sparseps, per key) and completes every
    bucket's future with its part of update / train.lr, the averaged aggregated gradient."""
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        start, n = state.offset[id(p)]
        state.flat[start:start + n].copy_(g.reshape(-1))
    future = torch.futures.Future()
    state.pending.append((bucket, future))
    if bucket.is_last():
        _finished(state.flat)
        update = torch.from_numpy(state.worker.push_pull(state.flat))
        update = update.to(state.flat.device).div_(state.worker.lr)
        for b, f in state.pending:
            out = b.buffer()
            pos = 0
            for p in b.parameters():
                start, n = state.offset[id(p)]
                out[pos:pos + n].copy_(update[start:start + n])
                pos += n
            f.set_result(out)
        state.pending = []
    return future
