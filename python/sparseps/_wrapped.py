"""WrappedOptimizer: the torch.optim.Optimizer face of sparseps.torch.DistributedOptimizer, whose
param_groups, state and defaults are those of the optimizer it wraps (as Horovod's and BytePS's
are), so that what takes a torch optimizer (an LR scheduler) takes it."""
import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that is another, self.optimizer (set first by the subclass): its
    param_groups, state and defaults are the wrapped optimizer's own objects, so an LR scheduler
    made over it (StepLR(opt, ...), ReduceLROnPlateau(opt)) sets the wrapped optimizer's rates;
    state_dict() and load_state_dict() are the wrapped optimizer's, and any other attribute too.
    Optimizer.__init__ is not called: it holds no parameters of its own. Its parameters are fixed
    when it is made (the subclass's step() sees them all): add_param_group raises RuntimeError,
    and _check_left_out does where a parameter left out then (_leave_out_frozen) has a gradient
    now. Not thread-safe, as torch's optimizers."""

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, groups: setattr(self.optimizer, "param_groups", groups))
    state = property(lambda self: self.optimizer.state,
                     lambda self, state: setattr(self.optimizer, "state", state))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, defaults: setattr(self.optimizer, "defaults", defaults))

    # torch's GradScaler.step hands itself to an optimizer that says so (its contract for
    # optimizers that handle the scale: grad_scaler=, or the found_inf attribute) instead of
    # skipping the step on an overflowed worker alone, which would part it from the others.
    _step_supports_amp_scaling = True

    def _refuse_torch_grad_scaler(self, grad_scaler):
        """TypeError where step() came from torch's GradScaler (see above)."""
        if grad_scaler is not None or getattr(self, "found_inf", None) is not None:
            raise TypeError(f"{type(self).__name__}: torch's GradScaler skips the step on a "
                            "worker whose gradients overflowed alone, and its push would then "
                            "come a batch late: use sparseps.torch.GradScaler (the same calls; "
                            "every worker skips together)")

    def state_dict(self):
        """The wrapped optimizer's state_dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        """The wrapped optimizer's load_state_dict."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        """Refused (RuntimeError): the parameters are fixed when the wrapper is made."""
        raise RuntimeError(f"{type(self).__name__}.add_param_group: the parameters are the job's "
                           f"keys, fixed when the {type(self).__name__} is made; give the "
                           "wrapped optimizer every parameter group before wrapping it")

    def _leave_out_frozen(self, names=None, named_parameters=None):
        """Notes the wrapped optimizer's parameters that require no gradient now (left out of the
        job) for _check_left_out, by their names: `names` (one per parameter, in the optimizer's
        order), or `named_parameters` ((name, parameter) pairs, as module.named_parameters(): by
        identity), or their place. Returns the names of the others, in order (None without
        names); ValueError where the names do not fit the parameters."""
        what = type(self).__name__
        every = [p for group in self.optimizer.param_groups for p in group["params"]]
        if names is not None and named_parameters is not None:
            raise ValueError(f"{what}: names or named_parameters, not both")
        if named_parameters is not None:
            by_id = {id(p): str(n) for n, p in named_parameters}
            unnamed = [i for i, p in enumerate(every) if id(p) not in by_id]
            if unnamed:
                raise ValueError(f"{what}: named_parameters does not name the optimizer's "
                                 f"parameters {unnamed[:5]} (in its order; of another module?)")
            names = [by_id[id(p)] for p in every]
        if names is not None and len(names) != len(every):
            raise ValueError(f"{what}: {len(names)} names for the optimizer's {len(every)} "
                             "parameters")
        self._left_out = []
        i = 0
        for g, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if not p.requires_grad:
                    self._left_out.append((p, str(names[i]) if names is not None else
                                           f"parameter {j} of group {g} (shape {tuple(p.shape)})"))
                i += 1
        if names is None:
            return None
        return [str(n) for n, p in zip(names, every) if p.requires_grad]

    def _check_left_out(self):
        """RuntimeError where a parameter left out of the job (_leave_out_frozen) has a gradient
        now (unfrozen since): the wrapped optimizer would step it on this worker's own gradient,
        and the workers' models would part. Call it before anything is pushed."""
        grown = [name for p, name in self._left_out if p.grad is not None]
        if grown:
            named = "; ".join(grown[:3]) + (f" and {len(grown) - 3} more" if len(grown) > 3 else "")
            one = len(grown) == 1
            raise RuntimeError(
                f"{type(self).__name__}: {named} required no gradient when the "
                f"{type(self).__name__} was made, so the job does not aggregate "
                f"{'it' if one else 'them'}, but {'has a gradient' if one else 'have gradients'} "
                "now (unfrozen since?): make it with every parameter that will train requiring a "
                "gradient (to keep some still for a while, zero their gradients before step(), or "
                "give them a parameter group with lr 0), or set their .grad to None")

    def __repr__(self):
        return f"sparseps.torch.{type(self).__name__}({self.optimizer!r})"

    def __getattr__(self, name):
        if name == "optimizer":  # not set yet: no recursion through the properties above
            raise AttributeError(name)
        return getattr(self.optimizer, name)
