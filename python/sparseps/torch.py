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
a sparse collective of sparseps (topk_allgather, gtopk, spardl, exdyna) or its servers instead of
Gloo's dense allreduce, as torch's own PowerSGD hook does with its state:

    state = sparseps.torch.SparseAllreduceState(sparseps.Worker("job.yaml"), ddp_model,
                                                optimizer=opt)
    ddp_model.register_comm_hook(state, sparseps.torch.sparse_allreduce_hook)
    ...  # the loop, from worker.step
    state.synchronize()  # every worker: the model file and the last checkpoint get the model

The job aggregates by a collective or through its servers (aggregation: ps under BSP); the hook
hands DDP the averaged aggregated gradient (update / train.lr), so train.lr: 1 is exact.
GradScaler: fp16 mixed precision's loss scaling, torch.cuda.amp.GradScaler's interface, with the
workers skipping an overflow together (with the DDP hook: torch's, as its state's grad_scaler).

load_model_file: the model file a job writes (<run.dir>/model.safetensors, a checkpoint's) as a
state_dict, for model.load_state_dict(..., strict=True) without the safetensors package.

ElasticSampler: a DataLoader's sampler of this worker's share of the data, as DistributedSampler,
that follows the membership (the live workers share the data anew after one is lost or joins).

Only torch is imported here, not linked: any PyTorch with DLPack works (Debian's 1.13 is tested).
"""
import time
import warnings

import torch

from sparseps import _rollback, _state
from sparseps._model_file import read_model_file
from sparseps._sampler import ElasticSampler
from sparseps._ddp_hook import SparseAllreduceState, sparse_allreduce_hook
from sparseps._grad_scaler import GradScaler
from sparseps._frozen_adam import (_check_freeze, _frozen, _frozen_adam_step,
                                   _frozen_denominator, _step_count)
from sparseps._state import ModuleBuffers
from sparseps._tensors import _finished, _float32_params
from sparseps._wrapped import WrappedOptimizer

__all__ = ["DistributedOptimizer", "ElasticSampler", "GradScaler", "ModuleBuffers",
           "SparseAllreduceState", "load_model_file", "sparse_allreduce_hook"]


def load_model_file(path, device="cpu"):
    """The model file a sparseps job writes (<run.dir>/model.safetensors by worker 0 at finish,
    or a checkpoint folder's) as a state_dict: a dict of name -> tensor on `device`, under the
    names the model gave (init(names=...); DistributedOptimizer(names=...), the DDP hook and
    examples/torch_job.py give the module's), parameters and, where the loop handed them over
    (ModuleBuffers, the DDP hook, set_model_buffers), buffers, all float32 as the file holds
    them: model.load_state_dict(load_model_file(path), strict=True) copies each into its
    parameter or buffer, casting to its dtype (BatchNorm's num_batches_tracked: int64). Errors
    as sparseps.read_model_file's (OSError, ValueError naming the file)."""
    tensors, _ = read_model_file(path)
    return {name: torch.from_numpy(array).to(device) for name, array in tensors.items()}


class DistributedOptimizer(WrappedOptimizer):
    """Wraps `optimizer` so that step() aggregates through `worker` (a sparseps.Worker or
    capi.Worker, not yet initialised: this calls its init) either its parameters' gradients
    (aggregate="gradient", the default) or its own steps (aggregate="update").

    It is a torch.optim.Optimizer (as Horovod's): param_groups, state and defaults are the wrapped
    optimizer's own objects, so an LR scheduler made over it (StepLR(opt, ...),
    ReduceLROnPlateau(opt), ...) sets the wrapped optimizer's rates, and state_dict() and
    load_state_dict() are the wrapped optimizer's. Its parameters are fixed when it is made (they
    are the job's keys): add_param_group raises RuntimeError, and so does step() when a parameter
    that did not require a gradient then (left out of the job) has one now (unfrozen since: each
    worker would step it on its own gradient, and the models would part); make it with every
    parameter that will train requiring a gradient, and keep a part still for a while by zeroing
    its gradients before step() (or by a parameter group with lr 0).

    aggregate="update" is error feedback on the optimizer's update: each worker's optimizer
    (Adam, AdamW, any) steps on the worker's own gradient, and the step it took (old minus new
    parameters) goes through sparseps instead of the gradient; sparseps's residual keeps what the
    compression left out for the next steps, and every worker's model becomes the job's, old
    minus the aggregated step (Chen et al., "Efficient-Adam: Communication-Efficient Distributed
    Adam", IEEE Trans. Signal Processing 2023, compress Adam's update with error feedback the
    same way). Each worker's optimizer state (Adam's moments) is its own, from its own gradients,
    so sparse aggregation never feeds Adam's second moment the zeros and bursts of a sparse
    gradient. Needs train.momentum: 0 (the optimizer has its own) and works for any train.lr.

    freeze_variance_step=N (torch Adam or AdamW, without amsgrad or maximize) is 1-bit Adam's
    scheme (Tang et al., ICML 2021): the first N steps are the optimizer's own, and then its
    second moment freezes, so each step is linear in the gradients (_frozen_adam_step) and error
    feedback compensates the compression exactly. Run the first N steps dense or nearly so
    (compression.warmup_epochs: 1 with warmup_density: 1 and N the steps of an epoch: the
    paper's uncompressed warm-up), since the frozen variance is what they leave. With
    aggregate="gradient" the pushed gradient is then divided by the frozen denominators and the
    aggregate multiplied back: top-k ranks the entries by the step each would take (a raw
    gradient's size says little once Adam rescales it) and the residual keeps the rest in those
    units (docs/results.md, "AdamW at density 0.1%", measures it on the language model).

    overlap=True (a job with train.overlap: backward, ps mode; CPU tensors, or CUDA tensors
    where the encoding has a device compressor, each range then compressed on the GPU) pushes
    each server's key range of the gradient while the backward pass goes on, as torch DDP's
    buckets and Horovod's hooks do: a hook on each parameter's gradient accumulation starts the
    step (worker.begin_step) at the first gradient of the step and reports the part of the flat
    buffer whose gradients are all in (worker.gradient_ready; on a GPU once the backward pass's
    stream has run that far); step() then waits for the rest. One
    backward pass per step (the pushes leave as the first one ends); with aggregate="gradient"
    only and without freeze_variance_step (both change the gradient in step(), after the pushes
    left). Where the job does not overlap, step() does the whole step as without it.

    The gradients live in one flat float32 buffer of which every parameter's .grad is a view, so
    push_pull takes them without a copy (keep zero_grad's set_to_none False, the default here).
    Everything else (param_groups, state_dict, ...) is the wrapped optimizer's.

    local_view=True (with aggregate="update", or with freeze_variance_step once frozen): each
    worker computes its gradients at its own view of the model, the job's parameters moved by
    what its own residual would move them once sent (_residual_displacement), instead of at the
    job's parameters. A worker then sees all of its own updates at once and the others' as the
    compression delivers them, as in local SGD with error feedback (CSER, Xie et al.,
    "CSER: Communication-efficient SGD with Error Reset", NeurIPS 2020, whose local models are
    the global one plus the local error; Qsparse-local-SGD, Basu et al., NeurIPS 2019). The
    workers' models differ by their residuals (the leader's is what it evaluates and saves);
    step() moves the parameters back to the job's before it aggregates, so what is pushed and
    conserved is unchanged, and synchronize() gives the job's parameters moved by this worker's
    view. With AdamW at density 0.1% on the language model and the variance frozen after a dense
    epoch, it ends within 1.02x of dense AdamW's perplexity on three seeds, where the same
    schedule without it ends at 1.04x to 1.05x (docs/results.md, "each worker computing at its
    own view"); on the CNN with Adam's update aggregated it is no rule: measure it.

    Checkpoints (checkpoint.every_steps, every_s): at each one, step() hands the worker its own
    state of that step (worker.set_checkpoint_state: the wrapped optimizer's state_dict, the
    model where it is not the job's parameters, local_view's shift, the frozen denominators), and
    worker 0's checkpoint model file gets the model (with extra_state's ModuleBuffers' buffers
    beside the parameters); on a resumed job the constructor restores them, and after a rollback
    (a lost server replaced) step() or worker.allreduce_values (GradScaler's too) restores them
    before raising sparseps.RolledBack, so the loop only goes back to worker.step in its data.

    A replacement worker (node.rejoin=true, after a worker was lost; ps mode) computes its first
    step at the job's parameters, and at its next step() takes the model, the wrapped
    optimizer's state and extra_state's that the leader has after that first step (the leader's
    step() hands them over: worker.send_handoff, worker.receive_handoff), so that where each
    worker's optimizer keeps a model of its own (Adam over the aggregated gradient) the
    replacement trains the same model as the others from then on (in BSP, bit for bit); with
    aggregate="update" it takes the leader's optimizer state as its start.

    extra_state (optional): the loop's other state to keep with it, as a dict of name -> object
    with state_dict() and load_state_dict() (torch's Stateful: an LR scheduler, a GradScaler, an
    object of the loop's own), for instance {"scheduler": scheduler}. Its state is taken as the
    loop leaves it between two steps (at the next step(), or at synchronize() after the last:
    after the loop's scheduler.step(), as torch orders it) and restored with the optimizer's, so
    a resumed or rolled-back job goes on with the same learning rates. State_dicts of tensors,
    numbers, strings and None only (a TypeError at construction names what else: OneCycleLR in
    torch 1.13 keeps a method; LambdaLR leaves its functions out). An object with a step_ended()
    method has it called at the end of the checkpoint's step, for state the next forward pass
    changes: ModuleBuffers(model), the model's buffers (BatchNorm's running statistics), which
    sparseps does not checkpoint otherwise (synchronize() also hands them to the trained model
    file). Call synchronize() on every worker after the last step.

    names (optional): one per parameter, in the optimizer's order, for instance
    [n for n, _ in model.named_parameters()] when the optimizer was made from
    model.parameters(): the trained model file (<run.dir>/model.safetensors) then holds the
    tensors under the model's own names and shapes (model.load_state_dict takes them), and the
    traces (metrics.trace_steps) name the layers so. Without them: "param0", "param1", ...
    named_parameters (as Horovod's and BytePS's): model.named_parameters(), each parameter's name
    found by identity instead (ValueError where the optimizer has a parameter it does not name).
    """

    def __init__(self, optimizer, worker, aggregate="gradient", freeze_variance_step=None,
                 overlap=False, names=None, local_view=False, extra_state=None,
                 named_parameters=None):
        if aggregate not in ("gradient", "update"):
            raise ValueError(f"DistributedOptimizer: aggregate={aggregate!r}; 'gradient' or "
                             "'update'")
        if local_view and (overlap or (aggregate == "gradient" and freeze_variance_step is None)):
            raise ValueError("DistributedOptimizer: local_view=True needs aggregate='update' or "
                             "freeze_variance_step (a step linear in what is pushed, so that the "
                             "residual's displacement is known), and no overlap")
        if overlap and (aggregate != "gradient" or freeze_variance_step is not None):
            raise ValueError("DistributedOptimizer: overlap=True needs aggregate='gradient' and "
                             "no freeze_variance_step (they change the gradient after the pushes "
                             "would have left)")
        _check_freeze(optimizer, freeze_variance_step)
        self._loop = _state.LoopState(extra_state, "DistributedOptimizer")
        self.freeze_variance_step = freeze_variance_step
        self._frozen_denoms = {}  # _frozen_adam_step's cache: parameter -> [v, denominator, unseen]
        self._scale = None  # aggregate="gradient", frozen: (first v, flat denominators)
        if aggregate == "update" and worker.get("train.momentum") != 0:
            raise ValueError("DistributedOptimizer(aggregate='update'): the job's train.momentum "
                             f"is {worker.get('train.momentum')}; set it to 0 (the optimizer "
                             "steps with its own momentum)")
        self.optimizer = optimizer
        self.worker = worker
        self.aggregate = aggregate
        self.local_view = local_view
        self.overlap = overlap  # (sparseps.torch.GradScaler refuses it)
        self._view_shift = None  # local_view: the flat shift now subtracted from the parameters
        self.last_push_pull_ms = 0.0  # wall time of the last push_pull
        self._dense = None  # push_pull's out or params_out (on the CPU), made at first use
        every = [p for group in optimizer.param_groups for p in group["params"]]
        names = self._leave_out_frozen(names, named_parameters)  # those of the job's parameters
        self._params = _float32_params(every, "DistributedOptimizer")
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
        self._start_keys = starts + [offset]  # the same as a list, made once
        self._starts = torch.tensor(self._start_keys, dtype=torch.int64, device=device)
        # Every worker starts from worker 0's parameters (written into the model in place).
        _finished(self._flat)
        with torch.no_grad():
            worker.init([p.detach() for p in self._params], names=names)
        if worker.resumed:
            self._restore("resumed from")
        _rollback.listen(worker, self._restore, "rolled back to")  # a rollback outside step()
        # A replacement (worker.rejoined) computes its first step at the job's parameters, then
        # takes its donor's model and state (_take_handoff, at the next step()) and trains theirs.
        self._accumulators = []  # overlap: each parameter's gradient accumulation node, hooked
        if overlap:
            self._end_step()
            for i, p in enumerate(self._params):
                node = p.expand_as(p).grad_fn.next_functions[0][0]
                node.register_hook(lambda *_, i=i: self._gradient_in(i))
                self._accumulators.append(node)

    def _end_step(self):
        """overlap: no step begun, no gradient in."""
        self._begun = None  # None: not tried this step; then begin_step's answer
        self._in = [False] * len(self._params)
        self._ready_from = len(self._params)  # parameters [_ready_from:] all have their gradient

    def _gradient_in(self, i):
        """overlap, after parameter i's gradient accumulated in the backward pass: begins the step
        at its first gradient and reports the flat buffer's longest suffix whose gradients are
        all in."""
        if self._begun is None:
            self._submit_pending(handoff=False)  # step() does it, with the backward pass done
            self._begun = self.worker.begin_step(self._flat)
        if not self._begun:
            return
        with torch.no_grad():
            self._copy_replaced(i)  # its values go out with the flat buffer
        self._in[i] = True
        ready = self._ready_from
        while ready > 0 and self._in[ready - 1]:
            ready -= 1
        if ready < self._ready_from:
            self._ready_from = ready
            if self._flat.is_cuda:
                # The library reads the range on streams of its own: the gradient's kernels and
                # the copies above, queued on the backward pass's stream, must have run.
                torch.cuda.current_stream(self._flat.device).synchronize()
            self.worker.gradient_ready(self._start_keys[ready])

    def _copy_replaced(self, i):
        """Parameter i's .grad into the flat buffer where it was replaced behind our back
        (zero_grad(set_to_none=True) elsewhere; none: zeros)."""
        p = self._params[i]
        if p.grad is None:
            self._views[i].zero_()
        elif p.grad.data_ptr() != self._views[i].data_ptr():
            self._views[i].copy_(p.grad)

    def _gather(self):
        # Every .grad into the flat buffer, and a view of it again.
        for i, p in enumerate(self._params):
            self._copy_replaced(i)
            p.grad = self._views[i]

    def _plain_sgd(self):
        """True when the wrapped optimizer is SGD at train.lr without momentum, weight decay or
        Nesterov: its step would set the parameters to the job's, so they are copied instead."""
        if type(self.optimizer) is not torch.optim.SGD:
            return False
        return all(g["lr"] == self.worker.lr and not g.get("momentum") and
                   not g.get("weight_decay") and not g.get("nesterov") and
                   not g.get("maximize") for g in self.optimizer.param_groups)

    def step(self, closure=None, loss=None, grad_scaler=None):
        """Aggregates the gradients (sparseps.Worker.push_pull) and applies the result: with plain
        SGD at train.lr the changed parameters become the job's (a sparse copy; .grad keeps the
        local gradient); otherwise each .grad becomes the job's aggregated gradient, update /
        train.lr (zero where nothing changed), and the wrapped optimizer steps.
        The step's training loss goes to the live metrics (metrics.port: sparseps_worker_loss):
        `loss` when given (a float or a one-element tensor; a tensor on a GPU is read with a
        device sync), else what `closure` returned. Returns the closure's loss, as torch does.
        From torch's GradScaler (grad_scaler) a TypeError: sparseps.torch.GradScaler's instead."""
        self._refuse_torch_grad_scaler(grad_scaler)
        closure_loss = None
        if closure is not None:
            with torch.enable_grad():
                closure_loss = closure()
        self._check_left_out()
        reported = loss if loss is not None else closure_loss
        reported = None if reported is None else float(reported)
        self._submit_pending()
        self._shift_parameters(None)  # local_view: back to the job's parameters
        try:
            scale = self._aggregate_and_step(reported)
        except Exception as e:
            if type(e).__name__ == "RolledBack":  # sparseps.RolledBack or sparseps.capi's
                self._restore("rolled back to")
            raise
        if self.local_view and (self.aggregate == "update" or scale is not None):
            self._shift_parameters(self._residual_displacement())
        if self.worker.checkpoint_due:
            self._checkpoint_after_step()
        return closure_loss

    def _own_model(self):
        """True where the model's parameters are not the job's: another optimizer than plain SGD
        over the aggregated gradient (its own copy), or local_view's view."""
        return (self.aggregate != "update" and not self._plain_sgd()) or \
            self._view_shift is not None

    def _checkpoint_after_step(self):
        """At the end of the step whose push_pull took a checkpoint: its state now, or with
        extra_state as the loop leaves it before the next push (_submit_pending)."""
        if self._loop.extra:
            self._loop.step_ended()
        else:
            self._checkpoint()

    def _submit_pending(self, handoff=True):
        """Before the next push (step, its overlap's begin, average_views) or synchronize: the
        checkpoint waiting for the loop's state gets it; with `handoff` (not in the backward
        pass, whose parameters must not change), a replacement that joined at the last step gets
        this loop's state (on its donor), or takes its donor's (on the replacement)."""
        if self._loop.take():
            self._checkpoint()
        if handoff and self.worker.handoff_due:
            try:
                self.worker.send_handoff(_state.dumps(self._state(handoff=True)))
            except ValueError as e:  # over the bound: the replacement goes on without it
                warnings.warn(f"DistributedOptimizer: no hand-over to the replacement ({e}); "
                              "it goes on with its own optimizer's state and model")
        elif handoff and self.worker.handoff_expected:
            self._take_handoff()

    def _state(self, handoff=False):
        """This optimizer's state as the loop leaves it between two steps, for a checkpoint or a
        replacement's hand-over: the wrapped optimizer's state_dict, the model's parameters where
        they are not the job's, local_view's shift, the frozen denominators and extra_state's.
        A hand-over's model is without this worker's view and has no shift: the replacement's
        residual is empty. _load_state reads it back."""
        own = self._own_model()
        shift = self._view_shift
        if handoff:
            own = self.aggregate != "update" and not self._plain_sgd()
        flat = None
        if own:
            flat = torch.cat([p.detach().reshape(-1) for p in self._params])
            if handoff and shift is not None:
                flat = flat + shift  # the parameters are the model minus the view's shift
            flat = flat.cpu()
        if handoff:
            shift = None
        return {"format": "sparseps.torch.DistributedOptimizer/1",
                "optimizer": self.optimizer.state_dict(), "params": flat,
                "view_shift": None if shift is None else shift.cpu(),
                "scale": None if self._scale is None else self._scale[1].cpu(),
                "extra": self._loop.state_dicts()}

    def _take_handoff(self):
        """On a replacement, after its first step: the model and optimizer state its donor (the
        leader) has after that step, so that it trains the others' model from now on; without
        them (the donor left, its loop handed none) a warning, and it goes on as it is."""
        got = self.worker.receive_handoff()
        if not got["state"]:
            warnings.warn(f"DistributedOptimizer: this replacement got no state from worker "
                          f"{got['from']} ({got['missing'] or 'its loop handed none over'}); it "
                          "goes on with its own optimizer's state and model")
            return
        where = f"DistributedOptimizer: worker {got['from']}'s hand-over at step {self.worker.step}"
        self._load_state(_state.loads(got["state"]), where)

    def _checkpoint(self):
        """After the step whose push_pull took a checkpoint: hands the worker this optimizer's
        state of the step (worker.set_checkpoint_state, in the worker's checkpoint file; _state);
        the model then also goes to the checkpoint's model file. _restore reads it back."""
        state = self._state()
        flat = state["params"]
        buffers = self._module_buffers(state["extra"])
        if buffers:  # beside the parameters in the checkpoint's model file
            self.worker.set_model_buffers(buffers)
        self.worker.set_checkpoint_state(_state.dumps(state),
                                         None if flat is None else flat.numpy())

    def _module_buffers(self, saved=None):
        """The buffers of extra_state's ModuleBuffers (BatchNorm's running statistics; those of
        the module's state_dict), by the module's names, for the model files: as `saved` (the
        checkpoint's state_dicts of extra_state: the buffers as the checkpoint's step left them)
        holds them, or as they are now."""
        buffers = {}
        for name, obj in self._loop.extra.items():
            if isinstance(obj, _state.ModuleBuffers):
                buffers.update(_state.persistent_buffers(
                    obj.module, saved[name] if saved is not None else None))
        return buffers

    def _restore(self, how):
        """On a resumed job (after init) or after a rollback (how: "resumed from", "rolled back
        to"): the state _checkpoint saved at the checkpoint's step, or, in a checkpoint without it,
        the job's parameters (a warning: the optimizer's state starts again; RuntimeError where
        the model is not the job's parameters, which the checkpoint then lacks)."""
        raw = self.worker.checkpoint_state
        device = self._flat.device
        self._frozen_denoms, self._scale, self._view_shift = {}, None, None
        self._loop.waiting = False
        if not raw:
            what = (f"DistributedOptimizer: the checkpoint of step {self.worker.step} the job "
                    f"{how} holds no state of this optimizer (taken by a loop without it)")
            if self._own_model() or self.local_view:
                raise RuntimeError(what + "; its model is not the job's parameters, so it cannot "
                                   "go on from it: resume from a checkpoint DistributedOptimizer "
                                   "took")
            if self.optimizer.state or self._loop.extra:
                warnings.warn(what + "; the wrapped optimizer's state" +
                              "".join(f", {n}'s" for n in self._loop.extra) + " starts again")
            self.optimizer.state.clear()
            self._copy_in(torch.from_numpy(self.worker.params()).to(device))
            return
        self._load_state(_state.loads(raw), f"DistributedOptimizer: the checkpoint of step "
                                            f"{self.worker.step} the job {how}")

    def _load_state(self, state, where):
        """_state's dict back into the optimizer, the model and extra_state (`where` names its
        source in warnings)."""
        device = self._flat.device
        self._frozen_denoms, self._scale, self._view_shift = {}, None, None
        self._loop.waiting = False
        self.optimizer.load_state_dict(state["optimizer"])
        params = state["params"]
        self._copy_in((torch.from_numpy(self.worker.params()) if params is None else params)
                      .to(device))
        if state["view_shift"] is not None:
            self._view_shift = state["view_shift"].to(device)
        if state["scale"] is not None:
            first = self.optimizer.state[self._params[0]]["exp_avg_sq"]
            self._scale = (first, state["scale"].to(device))
        self._loop.restore(state.get("extra", {}), where)

    def _copy_in(self, flat):
        """The model's parameters from one flat tensor."""
        with torch.no_grad():
            for p, start in zip(self._params, self._start_keys):
                p.view(-1).copy_(flat[start:start + p.numel()])

    def _aggregate_and_step(self, reported):
        """step()'s aggregation (push_pull) and update; returns the frozen denominators by which
        the push was divided (aggregate="gradient" after freeze_variance_step), else None."""
        self._gather()
        scale = None
        if self.aggregate == "update":
            self._local_step()  # the flat buffer now holds the step / train.lr
        else:
            scale = self._frozen_scale()
            if scale is not None:
                self._flat.div_(scale)
        _finished(self._flat)
        # A dense method's result comes into one array kept from step to step (not two new arrays
        # of the model's size a step): the new parameters where they are copied into the model
        # (plain SGD, aggregate="update"), else the update.
        copy_params = self.aggregate == "update" or self._plain_sgd()
        out = params_out = None
        if self._flat.device.type == "cpu":
            if self._dense is None:
                self._dense = torch.empty_like(self._flat)
            if copy_params:
                params_out = self._dense
            else:
                out = self._dense
        t = time.monotonic()
        try:
            keys, update, params = self.worker.push_pull(self._flat, sparse=True, loss=reported,
                                                         out=out, params_out=params_out)
        finally:
            if self._accumulators:
                self._end_step()
        self.last_push_pull_ms = 1000 * (time.monotonic() - t)
        device = self._flat.device
        # Every key changed (a dense method: ring, Gloo, PowerSGD): copies, not scatters (and the
        # keys, then one read-only array, are not read).
        dense = len(keys) == self._flat.numel()
        if not dense:
            keys = torch.from_numpy(keys).to(device)
        with torch.no_grad():
            if copy_params:
                if params is not params_out:
                    params = torch.from_numpy(params).to(device)
                if dense:
                    for p, start in zip(self._params, self._start_keys):
                        p.view(-1).copy_(params[start:start + p.numel()])
                    return scale
                bounds = torch.searchsorted(keys, self._starts).tolist()
                for p, start, lo, hi in zip(self._params, self._start_keys, bounds[:-1],
                                            bounds[1:]):
                    if hi > lo:
                        p.view(-1).index_copy_(0, keys[lo:hi] - start, params[lo:hi])
                return scale
            if update is not out:
                update = torch.from_numpy(update).to(device)
            if dense:
                torch.div(update, self.worker.lr, out=self._flat)
            else:
                self._flat.zero_()
                self._flat.index_put_((keys,), update / self.worker.lr)
            if scale is not None:
                self._flat.mul_(scale)
        self._optimizer_step()
        return scale

    def _residual_displacement(self):
        """local_view: how far this worker's residual would move the job's parameters once sent
        (flat, float32): each pushed value v moves them by lr v / W (W: the live workers, over
        whose pushes the servers and collectives average; cluster.num_workers until one is lost
        under cluster.on_worker_failure: continue): the job's train.lr with
        aggregate="update"; with the variance frozen, each parameter group's Adam lr (through
        Adam's first moment over the following steps, exact up to its bias correction 1 /
        (1 - beta1^t), within 1e-6 of 1 past 130 steps at beta1 0.9). One copy of the residual a
        step (sparseps.Worker.residual)."""
        shift = torch.from_numpy(self.worker.residual()).to(self._flat.device)
        workers = len(self.worker.live_workers)
        if self.aggregate == "update":
            return shift.mul_(self.worker.lr / workers)
        return self._times_group_lr(shift, 1.0 / workers)

    def _times_group_lr(self, flat, factor):
        """flat (in self._params' order) times each parameter group's lr times factor, in
        place."""
        offset = 0
        for group in self.optimizer.param_groups:
            for p in (p for p in group["params"] if p.requires_grad):  # self._params' order
                flat[offset:offset + p.numel()].mul_(group["lr"] * factor)
                offset += p.numel()
        return flat

    def average_views(self):
        """local_view: makes every worker's model the average of the workers' views (and the
        job's parameters, with aggregate="update") and empties the residuals: one step of the
        job in which each worker sends its whole residual scaled by 1/W, every worker at the same
        point (after the last step, before the final evaluation and synchronize(); training may
        go on after it). The model moves by the mean of the views' displacements, what CSER's
        error reset does (Xie et al., NeurIPS 2020, Algorithm 2, with the reset period of the
        whole run). Before the freeze (aggregate="gradient") every view is the model and nothing
        is sent. Needs ps mode with encoding topk, train.momentum 0 and no server-side top-k
        (ValueError; RuntimeError when a residual stays after the step); raises RolledBack as
        step() does."""
        if not self.local_view:
            raise ValueError("DistributedOptimizer.average_views: needs local_view=True")
        if self.worker.aggregation != "ps" or self.worker.get("compression.encoding") != "topk" \
                or self.worker.get("train.momentum") != 0:
            raise ValueError("DistributedOptimizer.average_views: needs aggregation ps with "
                             "compression.encoding topk and train.momentum 0")
        if self._view_shift is None:
            return
        self._submit_pending()
        self._shift_parameters(None)  # the job's parameters, or Adam's own copy
        workers = len(self.worker.live_workers)  # the servers average over these
        residual = torch.from_numpy(self.worker.residual()).to(self._flat.device)
        # The push is this plus the residual: the residual / W, every entry of it.
        torch.mul(residual, 1.0 / workers - 1.0, out=self._flat)
        _finished(self._flat)
        self.worker.set_density_scale(float(self._flat.numel()))
        try:
            keys, update, _ = self.worker.push_pull(self._flat, sparse=True)
        except Exception as e:
            if type(e).__name__ == "RolledBack":
                self._restore("rolled back to")
            raise
        finally:
            self.worker.set_density_scale(1.0)
        if self.worker.residual().any():
            raise RuntimeError("DistributedOptimizer.average_views: the step left a residual "
                               "(a selection that does not send every key at k = all)")
        device = self._flat.device
        shift = torch.zeros_like(self._flat)
        shift.index_put_((torch.from_numpy(keys).to(device),), torch.from_numpy(update).to(device))
        if self.aggregate == "gradient":  # each group's Adam lr per train.lr of the aggregate
            self._times_group_lr(shift, 1.0 / self.worker.lr)
        self._shift_parameters(shift)  # the mean of the views, the model from now on
        self._view_shift = None
        if self.worker.checkpoint_due:
            self._checkpoint_after_step()

    def _shift_parameters(self, shift):
        """local_view: moves the parameters from the job's to this worker's view (shift, flat:
        subtracted) or, with None, back by the shift now applied."""
        back, self._view_shift = self._view_shift, shift
        with torch.no_grad():
            for tensor, sign in ((back, 1), (shift, -1)):
                if tensor is None:
                    continue
                for p, start in zip(self._params, self._start_keys):
                    p.view(-1).add_(tensor[start:start + p.numel()], alpha=sign)

    def _local_step(self):
        """aggregate="update": the wrapped optimizer steps on this worker's gradient, the
        parameters go back to where they were, and the flat buffer gets the step / train.lr (the
        job applies train.lr times the aggregate)."""
        with torch.no_grad():
            before = [p.detach().clone() for p in self._params]
            self._optimizer_step()
            for p, b, view in zip(self._params, before, self._views):
                torch.sub(b, p, out=view)  # the step: old minus new
                p.copy_(b)
            self._flat.div_(self.worker.lr)

    def _frozen_scale(self):
        """aggregate="gradient" with the variance frozen: the flat frozen denominators (Adam's
        sqrt(v / (1 - beta2^t_frozen)) + eps; 1 where the second moment is still 0), by which the
        pushed gradient is divided and the aggregate multiplied back, so that the compression
        selects by the step each entry would take and its residual is kept in those units (exact
        while the denominators stay fixed; rebuilt when the optimizer's state is replaced, as by
        load_state_dict). None before the freeze."""
        if not _frozen(self.optimizer, self.freeze_variance_step):
            return None
        first = self.optimizer.state[self._params[0]]["exp_avg_sq"]
        if self._scale is None or self._scale[0] is not first:
            parts = []
            for group in self.optimizer.param_groups:
                beta2 = group["betas"][1]
                for p in (p for p in group["params"] if p.requires_grad):  # self._params'
                    state = self.optimizer.state[p]
                    frozen_at = state.get("variance_frozen_step", _step_count(state))
                    v = state["exp_avg_sq"]
                    d = _frozen_denominator(v, beta2, frozen_at, group["eps"])
                    parts.append(torch.where(v == 0, torch.ones_like(d), d).reshape(-1))
            self._scale = (first, torch.cat(parts))
        return self._scale[1]

    def _optimizer_step(self):
        """The wrapped optimizer's step, or after freeze_variance_step of them Adam's with its
        second moment frozen (_frozen_adam_step)."""
        if not _frozen(self.optimizer, self.freeze_variance_step):
            self.optimizer.step()
            return
        with torch.no_grad():
            _frozen_adam_step(self.optimizer, self._frozen_denoms)

    def synchronize(self):
        """train.consistency ssp / async: waits until every worker has pushed as many steps as
        this one and copies the job's parameters then (no staleness) into the model's: call it
        before the final evaluation and before the worker's finish(). bsp: nothing changes. Where
        the model is not the job's (another optimizer than plain SGD with aggregate="gradient":
        each worker's optimizer steps on its own copy) it only waits. Where the model is not the
        job's parameters (that case, or local_view's own view), the model's parameters become
        what the leader saves as the trained model at finish (<run.dir>/model.safetensors:
        worker.set_trained_model), not the job's. The buffers of extra_state's ModuleBuffers
        (BatchNorm's running statistics) go into that file beside the parameters
        (worker.set_model_buffers), under the module's names. With extra_state, a checkpoint
        taken at the last step gets the loop's state here: call it on every worker then."""
        self._submit_pending()  # the checkpoint of the last step, if one waits
        params = self.worker.synchronize()
        own = self.aggregate != "update" and not self._plain_sgd()
        if not own:
            self._copy_in(torch.from_numpy(params).to(self._flat.device))
            if self._view_shift is not None:  # local_view: the job's parameters, then this view
                shift, self._view_shift = self._view_shift, None
                self._shift_parameters(shift)
        if own or self._view_shift is not None:
            flat = torch.cat([p.detach().reshape(-1) for p in self._params])
            self.worker.set_trained_model(flat.cpu().numpy())
        buffers = self._module_buffers()
        if buffers:
            self.worker.set_model_buffers(buffers)

    def zero_grad(self, set_to_none=False):
        """Zeroes the flat gradient buffer (set_to_none would drop the views; it is ignored)."""
        self._flat.zero_()
