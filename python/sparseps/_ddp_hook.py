"""sparseps.torch's DDP communication hook: sparse_allreduce_hook and its SparseAllreduceState (see
sparseps.torch)."""
import time

import torch

from sparseps import _rollback, _state
from sparseps._tensors import _finished, _float32_params

__all__ = ["SparseAllreduceState", "sparse_allreduce_hook"]

_FORMAT = "sparseps.torch.SparseAllreduceState/1"


class SparseAllreduceState:
    """The state of sparse_allreduce_hook for one DDP model: the sparseps.Worker (not yet
    initialised: this calls its init with the model's parameters) and one flat gradient of the
    whole model, each parameter at a fixed offset whatever DDP's bucket layout (DDP rebuilds its
    buckets after the first step), so that the residuals stay with their keys.

    The model is DDP's, stepped by the loop's torch optimizer, not the job's parameters (the job
    applies train.lr times the aggregate to a copy of its own). So that the files hold the model:
    at each checkpoint (checkpoint.every_steps) the worker's checkpoint file gets the model's
    parameters, `optimizer`'s state_dict and `extra_state`'s (as DistributedOptimizer's
    extra_state: a dict of name -> object with state_dict() and load_state_dict(), such as an LR
    scheduler), taken as the loop leaves them between two steps (at the next step's last bucket,
    after the loop's optimizer.step() and scheduler.step()), and worker 0's checkpoint model file
    the model, its buffers (BatchNorm's running statistics) beside the parameters; on a resumed
    job (checkpoint.resume) the constructor restores them (RuntimeError when the checkpoint holds
    none: its job's parameters are not the DDP model), so the loop starts at worker.step.
    synchronize() after the last step, on every worker, hands over a checkpoint of that step and
    makes the model the trained model file's (<run.dir>/model.safetensors), which otherwise holds
    the job's parameters.

    grad_scaler: the loop's torch GradScaler (torch.amp.GradScaler, torch.cuda.amp.GradScaler),
    for fp16 mixed precision (Micikevicius et al., ICLR 2018, section 3.2). With DDP's allreduce
    an overflow (an inf or a NaN) on one worker reaches every worker and each one's scaler skips
    the step; sparseps's collectives take no inf, so given an enabled scaler the hook sums the
    workers' overflow flags at each step's last bucket (Worker.allreduce_values: one round trip
    through the scheduler a step) and, where any worker overflowed, hands DDP inf buckets on
    every worker and pushes nothing (worker.step stays; overflows counts them): every scaler
    skips the step and backs off alike. Otherwise it pushes the gradient divided by the scale
    and multiplies the update back, so that the residuals (error feedback) hold unscaled values
    whatever the scale does (a power of two: exact). Without one, a gradient with NaN or Inf is
    a ValueError on its worker (nothing is pushed).

    The job aggregates with a collective (aggregation: allreduce) or through its servers
    (aggregation: ps, train.consistency bsp: every worker gets the same update, so the DDP
    models stay equal; ssp and async are a ValueError). Where a lost server was replaced, the
    job rolls back to its newest complete checkpoint (sparseps.RolledBack from push_pull, or from
    the loop's own worker.allreduce_values, which raises it after the same restore); an
    exception inside a hook would break DDP's reducer for good, so the hook hands DDP zero
    buckets instead, sets rolled_back (True until the next forward pass) and, before that
    forward pass (a forward pre-hook on the module), restores the model, the optimizer's and
    extra_state's state of the checkpoint, overwriting what the loop's optimizer step did in
    between. The loop goes back to worker.step in its data when it sees rolled_back after its
    optimizer step; one that does not goes on with its own count (the model is the
    checkpoint's all the same). Not thread-safe: one loop's, as DDP's reducer.
    Wrap the model with DDP's gradient_as_bucket_view=True: the hook writes the update into
    DDP's buckets, and the gradients then are views of them (one copy of the model less a step:
    the MLP's step 274 to 251 ms, docs/results.md)."""

    def __init__(self, worker, model, optimizer=None, extra_state=None, grad_scaler=None):
        if worker.aggregation == "ps" and worker.get("train.consistency") != "bsp":
            raise ValueError(f"sparse_allreduce_hook: train.consistency "
                             f"{worker.get('train.consistency')} gives the workers different "
                             "updates, and DDP's models must stay equal: use bsp (or "
                             "DistributedOptimizer, which keeps a model per worker)")
        self._loop = _state.LoopState(extra_state, "SparseAllreduceState")
        self.optimizer = optimizer
        module = getattr(model, "module", model)
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = _float32_params([p for _, p in named], "SparseAllreduceState")
        self.offset = {}  # id(parameter) -> (its first key, its elements)
        self._index = {}  # id(parameter) -> its place in self.params
        offset = 0
        for i, p in enumerate(self.params):
            self.offset[id(p)] = (offset, p.numel())
            self._index[id(p)] = i
            offset += p.numel()
        self.flat = torch.zeros(offset, dtype=torch.float32, device=self.params[0].device)
        # Each parameter's first key, and the end.
        self._bounds = torch.tensor([self.offset[id(p)][0] for p in self.params] + [offset],
                                   dtype=torch.int64, device=self.flat.device)
        self.pending = []  # (bucket, future) of this step
        self._dense = None  # push_pull's out for a dense method (CPU), made at first use
        self.grad_scaler = grad_scaler
        self.overflows = 0  # steps every worker skipped for an overflow (grad_scaler)
        # Wall time of the last step's aggregation inside the backward pass (milliseconds: the
        # last bucket's work, push_pull included), as DistributedOptimizer's.
        self.last_push_pull_ms = 0.0
        self._held_buffers = {}  # the module's buffers at the checkpoint's step (_step_ended)
        self.rolled_back = False  # a rollback's backward pass, until the next forward pass
        self._restore_due = False  # a rollback's state, restored before the next forward pass
        module.register_forward_pre_hook(lambda _module, _inputs: self._before_forward())
        self.worker = worker
        _finished(self.flat)
        with torch.no_grad():
            # The model file and the traces under the module's own names.
            worker.init([p.detach() for p in self.params], names=[n for n, _ in named])
        if worker.resumed:
            self._restore()
        _rollback.listen(worker, self._rolled_back)  # a rollback outside the hook

    def _loss_scale(self):
        """The scale of this step's gradients (a float), None without an enabled scaler."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return float(scaler.get_scale())

    def _any_overflow(self):
        """Whether any worker's gradient of this step holds an inf or a NaN (every worker asks,
        at its last bucket)."""
        local = not bool(torch.isfinite(self.flat).all())
        return self.worker.allreduce_values([1.0 if local else 0.0], op="sum")[0] > 0

    def _model(self):
        """The model's parameters, flat, on the CPU (a copy)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params]).cpu()

    def _submit_pending(self):
        """Before the next push (or at synchronize): the checkpoint of the last step gets the
        model, the optimizer's and extra_state's state as the loop left them."""
        if not self._loop.take():
            return
        flat = self._model()
        state = {"format": _FORMAT, "params": flat,
                 "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                 "extra": self._loop.state_dicts()}
        buffers, self._held_buffers = self._held_buffers, {}
        if buffers:  # beside the parameters in the checkpoint's model file
            self.worker.set_model_buffers(buffers)
        self.worker.set_checkpoint_state(_state.dumps(state), flat.numpy())

    def _step_ended(self):
        """At the last bucket of a step that took a checkpoint: its forward pass is done, so the
        module's buffers (BatchNorm's running statistics) are that step's; worker 0 keeps a copy
        for the checkpoint's model file, which the next step's forward pass would change."""
        self._loop.step_ended()
        if self.worker.is_leader:
            self._held_buffers = {n: b.detach().clone() for n, b in
                                  _state.persistent_buffers(self.module).items()}

    def _rolled_back(self):
        """push_pull raised RolledBack: the worker is at the checkpoint's step; its state (not the
        last step's, which waits for nothing now) comes back before the next forward pass."""
        self._loop.waiting = False
        self._held_buffers = {}
        self.rolled_back = self._restore_due = True

    def _before_forward(self):
        """The module's forward pre-hook: after a rollback, the checkpoint's state."""
        self.rolled_back = False
        if self._restore_due:
            self._restore_due = False
            self._restore("rolled back to")

    def _restore(self, how="resumed from"):
        """A resumed job, or after a rollback (how): the model, the optimizer's and extra_state's
        state of the checkpoint."""
        raw = self.worker.checkpoint_state
        where = (f"SparseAllreduceState: the checkpoint of step {self.worker.step} the job "
                 f"{how}")
        if not raw:
            raise RuntimeError(where + " holds no model of this DDP hook (taken without it, or "
                               "before it saved one): the job's parameters there are not the "
                               "DDP model, so it cannot go on from it")
        state = _state.loads(raw)
        if state.get("format") != _FORMAT:
            raise RuntimeError(f"{where} holds the state of another loop ({state.get('format')})")
        with torch.no_grad():
            for p in self.params:
                start, n = self.offset[id(p)]
                p.copy_(state["params"][start:start + n].view_as(p))
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._loop.restore(state["extra"], where)

    def synchronize(self):
        """After the last step, on every worker, before worker.finish: a checkpoint taken at that
        step gets the model's state, and the trained model file (written by worker 0 at finish)
        gets this model's parameters instead of the job's, and its buffers (BatchNorm's running
        statistics, under the module's names) beside them. After a rollback in the last step, the
        model is the checkpoint's first."""
        self._before_forward()
        self._submit_pending()
        self.worker.set_trained_model(self._model().numpy())
        buffers = _state.persistent_buffers(self.module)
        if buffers:
            self.worker.set_model_buffers(buffers)


def sparse_allreduce_hook(state, bucket):
    """DDP communication hook: collects the step's buckets into state.flat and, at the last one,
    aggregates it in one push_pull (a sparse collective or the servers; residuals stay in
    sparseps, per key) and completes every bucket's future with its part of update / train.lr,
    the averaged aggregated gradient. A checkpoint waiting for the model gets it before the push
    (SparseAllreduceState). With the state's grad_scaler, an overflow on any worker comes back as
    inf buckets on every worker; a rollback as zero buckets and state.rolled_back."""
    t = time.monotonic()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        start, n = state.offset[id(p)]
        state.flat[start:start + n].copy_(g.reshape(-1))
    future = torch.futures.Future()
    state.pending.append((bucket, future))
    if bucket.is_last():
        _finished(state.flat)
        try:
            _aggregate(state)
        except Exception as e:
            if type(e).__name__ != "RolledBack":  # sparseps.RolledBack or sparseps.capi's
                raise
            state._rolled_back()
            for b, f in state.pending:
                f.set_result(b.buffer().zero_())
        state.pending = []
        state.last_push_pull_ms = 1000 * (time.monotonic() - t)
    return future


def _aggregate(state):
    """The last bucket's work: the step's flat gradient aggregated (or, with an overflow on any
    worker under the state's grad_scaler, nothing pushed) and every pending bucket's future
    completed."""
    # First: the job may go back to the last step's checkpoint while the overflow check waits.
    state._submit_pending()
    scale = state._loss_scale()
    if scale is not None and state._any_overflow():
        state.overflows += 1
        for b, f in state.pending:
            f.set_result(b.buffer().fill_(float("inf")))
        return
    if scale is not None:
        state.flat.mul_(1.0 / scale)
    flat = state.flat
    # A dense method's update comes into one array kept from step to step (CPU), a sparse one as
    # its changed keys: no array of the model's size a step.
    if flat.device.type == "cpu" and state._dense is None:
        state._dense = torch.empty_like(flat)
    try:
        keys, update, _ = state.worker.push_pull(flat, sparse=True, out=state._dense)
    except ValueError as e:
        if scale is None and not bool(torch.isfinite(state.flat).all()):
            raise ValueError(
                f"sparse_allreduce_hook: this worker's gradient holds NaN or Inf at step "
                f"{state.worker.step} (nothing was pushed); with a torch GradScaler (fp16 "
                "mixed precision) give it to SparseAllreduceState(..., grad_scaler=scaler), "
                "so that every worker skips an overflowed step together") from e
        raise
    if state.worker.checkpoint_due:
        state._step_ended()  # the model of this step: after the loop's optimizer step
    _complete(state, keys, update, scale)


def _complete(state, keys, update, scale):
    """Each pending bucket's future completed with its part of update / train.lr (times the loss
    scale), written straight into the bucket (one pass over the model): a dense method's update
    divided in place, a sparse one's changed keys scattered over zeros."""
    lr = state.worker.lr
    device = state.flat.device
    dense = len(keys) == state.flat.numel()  # every key changed (ring, Gloo, PowerSGD)
    with torch.no_grad():
        if dense:
            src = (update if update is state._dense else torch.from_numpy(update)).to(device)
        else:
            keys = torch.from_numpy(keys).to(device)
            src = torch.from_numpy(update).to(device) / lr
            if scale is not None:
                src.mul_(scale)
            # Where each parameter's keys start and end among the changed keys.
            bounds = torch.searchsorted(keys, state._bounds).tolist()
        for b, f in state.pending:
            out = b.buffer()
            if not dense:
                out.zero_()
            pos = 0
            for p in b.parameters():
                start, n = state.offset[id(p)]
                part = out[pos:pos + n]
                if dense:
                    torch.div(src[start:start + n], lr, out=part)
                    if scale is not None:
                        part.mul_(scale)
                else:
                    i = state._index[id(p)]
                    lo, hi = bounds[i], bounds[i + 1]
                    if hi > lo:
                        part.index_copy_(0, keys[lo:hi] - start, src[lo:hi])
                pos += n
            f.set_result(out)
