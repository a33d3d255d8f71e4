"""sparseps.torch.GradScaler: dynamic loss scaling for fp16 mixed precision with a
DistributedOptimizer, the workers agreeing on every overflow."""
import torch


class GradScaler:
    """Dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section
    3.2) for a sparseps.torch.DistributedOptimizer, with torch.cuda.amp.GradScaler's interface
    (scale, unscale_, step, update, get_scale, is_enabled, state_dict, load_state_dict):

        scaler = sparseps.torch.GradScaler()
        for x, y in loader:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)       # optional: to clip the true gradients before the step
            scaler.step(opt)           # every worker steps, or every worker skips
            scaler.update()

    torch's own GradScaler skips optimizer.step() on a worker whose gradients overflowed (an inf
    or a NaN) alone, where DDP's allreduced gradients make every worker see the overflow: with
    sparseps that worker's push would come a batch late and its loop end a push short of the
    others'. Here unscale_ sums the workers' overflow flags (worker.allreduce_values: one round
    trip through the scheduler a step), so that every worker skips the step together (nothing is
    pushed, the parameters, residuals and optimizer state stay) and changes its scale alike: the
    scale is the same on every worker. The scale and the unscaling are powers of two, exact in
    float32.

    Not with DistributedOptimizer(overlap=True): its gradients leave during the backward pass,
    before they are unscaled (ValueError). enabled=False passes everything through, as torch's.
    A checkpoint keeps it through extra_state (state_dict, load_state_dict). Not thread-safe."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError("GradScaler: init_scale > 0, growth_factor > 1 and 0 < "
                             f"backoff_factor < 1 (got {init_scale}, {growth_factor}, "
                             f"{backoff_factor})")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError(f"GradScaler: growth_interval {growth_interval}; a positive integer")
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0  # steps without an overflow since the scale last changed
        self._found_inf = {}  # id(optimizer) -> whether any worker overflowed, this iteration
        self._stepped = set()  # id(optimizer) of those step() took this iteration

    def is_enabled(self):
        return self._enabled

    def get_scale(self):
        """The scale the next scale() multiplies by (a float; 1.0 when not enabled)."""
        return self._scale if self._enabled else 1.0

    def scale(self, outputs):
        """outputs (a tensor, or a list or tuple of them) times the scale."""
        if not self._enabled:
            return outputs
        if torch.is_tensor(outputs):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"GradScaler.scale: a tensor or a list or tuple of them, not "
                        f"{type(outputs).__name__}")

    def unscale_(self, optimizer):
        """Divides optimizer's gradients by the scale, in place, and learns from every worker
        whether any of them overflowed (each worker calls it at the same point of its step: it
        waits for the others). Once per iteration; step() calls it where the loop did not."""
        if not self._enabled:
            return
        if getattr(optimizer, "worker", None) is None or not hasattr(optimizer, "overlap"):
            raise TypeError("sparseps.torch.GradScaler takes a sparseps.torch."
                            "DistributedOptimizer (torch.cuda.amp.GradScaler takes the others)")
        if optimizer.overlap:
            raise ValueError("sparseps.torch.GradScaler: not with DistributedOptimizer("
                             "overlap=True): its gradients leave during the backward pass, "
                             "before they are unscaled")
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        inverse = 1.0 / self._scale
        finite = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inverse)
                    finite.append(torch.isfinite(p.grad).all())
        overflowed = bool(finite) and not bool(torch.stack(finite).all())  # one device sync
        # The checkpoint of the last step gets the loop's state first, as step() gives it: the
        # job may go back to that checkpoint while this waits for the others (then the optimizer,
        # extra_state and this scaler are back at its step, and sparseps.RolledBack is raised).
        optimizer._submit_pending(handoff=False)
        total = optimizer.worker.allreduce_values([1.0 if overflowed else 0.0], op="sum")
        self._found_inf[id(optimizer)] = bool(total[0] > 0)

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(*args, **kwargs) unless a worker overflowed this iteration (then every
        worker skips it and it returns None); unscales first where unscale_ was not called.
        Where optimizer.step raises (sparseps.RolledBack after a lost server was replaced: the
        optimizer and extra_state, this scaler too, are back at the checkpoint's step), the
        iteration is forgotten: the loop goes on from worker.step without calling update()."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        try:
            if id(optimizer) not in self._found_inf:
                self.unscale_(optimizer)
            self._stepped.add(id(optimizer))
            if self._found_inf[id(optimizer)]:
                return None
            return optimizer.step(*args, **kwargs)
        except Exception:
            # No step (sparseps.RolledBack: the job went back to a checkpoint, and the loop goes
            # on from worker.step without update()): the next iteration starts afresh.
            self._found_inf.clear()
            self._stepped.clear()
            raise

    def update(self, new_scale=None):
        """The next iteration's scale: new_scale when given (a float or a one-element tensor);
        else backoff_factor times it after an overflow of any worker, growth_factor times it
        after growth_interval steps without one."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        elif not self._found_inf:
            raise RuntimeError("No inf checks were recorded prior to update.")
        elif any(self._found_inf.values()):
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self):
        """torch.cuda.amp.GradScaler's keys; empty when not enabled."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
        self._found_inf.clear()  # (a rollback restores it within step(): nothing of that one)
        self._stepped.clear()
