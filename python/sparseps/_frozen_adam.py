"""1-bit Adam's frozen second moment for sparseps.torch.DistributedOptimizer
(freeze_variance_step): the checks, the freeze and the frozen step."""
import math

import torch


def _check_freeze(optimizer, freeze_variance_step):
    """Raises ValueError unless freeze_variance_step is None, or a positive step count with a
    torch Adam or AdamW (without amsgrad or maximize) to freeze."""
    if freeze_variance_step is None:
        return
    if isinstance(freeze_variance_step, bool) or not isinstance(freeze_variance_step, int) or \
            freeze_variance_step < 1:
        raise ValueError(f"DistributedOptimizer: freeze_variance_step={freeze_variance_step!r}; "
                         "a step count of at least 1 (or None)")
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError("DistributedOptimizer: freeze_variance_step needs torch.optim.Adam or "
                         f"AdamW, not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"DistributedOptimizer: freeze_variance_step with {flag}=True "
                                 "(not supported: 1-bit Adam's step has neither)")


def _step_count(state):
    step = state["step"]
    return int(step.item()) if torch.is_tensor(step) else int(step)


def _frozen(optimizer, freeze_variance_step):
    """True once the optimizer has taken freeze_variance_step steps (its first parameter's); never
    when freeze_variance_step is None."""
    if freeze_variance_step is None:
        return False
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                return _step_count(state) >= freeze_variance_step
    return False


def _frozen_denominator(variance, beta2, frozen_at, eps):
    """Adam's denominator over a frozen second moment: sqrt(v / (1 - beta2^t_frozen)) + eps."""
    return (variance.sqrt() / math.sqrt(1 - beta2**frozen_at)).add_(eps)


def _frozen_adam_step(optimizer, denoms):
    """One step of torch's Adam / AdamW with the second moment frozen at its value after the
    last ordinary step (1-bit Adam's compression stage: Tang et al., "1-bit Adam:
    Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021, §4,
    Algorithm 1): the first moment and the step count go on as Adam's (exp_avg = beta1 exp_avg +
    (1 - beta1) grad, its bias correction at the current step), exp_avg_sq stays as it was and
    the denominator is sqrt(exp_avg_sq / (1 - beta2^t_frozen)) + eps, computed once per
    parameter (denoms: parameter -> [exp_avg_sq, denominator, unseen], the cache; rebuilt when the
    state is replaced, as by load_state_dict). The step then depends linearly on the gradients,
    which is what lets error feedback compensate the compression exactly.

    One departure from the paper: an entry that has had no gradient before the freeze (a sparse
    aggregated gradient that never selected it, an embedding row of a token not yet seen) has a
    second moment of 0, and m / (0 + eps) would step it 1e8 times its first gradient. Such an
    entry's second moment goes on as Adam's until its first nonzero gradient and freezes there
    (`unseen`, the entries still waiting; an entry of a dense gradient waits at most one step).
    Each parameter's state keeps variance_frozen_step, t_frozen, so a saved and reloaded
    optimizer stays frozen where it was. Call under torch.no_grad()."""
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if "exp_avg_sq" not in state:
                raise RuntimeError("DistributedOptimizer: a parameter without Adam's second moment "
                                   "at freeze_variance_step (it had no gradient before): freeze "
                                   "later")
            frozen_at = state.setdefault("variance_frozen_step", _step_count(state))
            cached = denoms.get(p)
            if cached is None or cached[0] is not state["exp_avg_sq"]:
                variance = state["exp_avg_sq"]
                unseen = variance == 0
                cached = denoms[p] = [variance,
                                      _frozen_denominator(variance, beta2, frozen_at, eps),
                                      unseen if bool(unseen.any()) else None]
            step = _step_count(state) + 1
            if torch.is_tensor(state["step"]):
                state["step"].fill_(step)
            else:
                state["step"] = step
            grad = p.grad
            if decoupled:
                p.mul_(1 - lr * weight_decay)
            elif weight_decay:
                grad = grad.add(p, alpha=weight_decay)
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            unseen = cached[2]
            if unseen is not None:  # Adam's second moment where it is still 0 (beta2 * 0 + ...)
                first = grad[unseen]
                state["exp_avg_sq"][unseen] = (1 - beta2) * first * first
                cached[1][unseen] = _frozen_denominator(state["exp_avg_sq"][unseen], beta2,
                                                        frozen_at, eps)
                unseen &= state["exp_avg_sq"] == 0
                if not bool(unseen.any()):
                    cached[2] = None
            p.addcdiv_(state["exp_avg"], cached[1], value=-lr / (1 - beta1**step))
