"""Tensor helpers of sparseps.torch and its DDP hook: the parameters sparseps takes, and the wait for
a CUDA tensor's queued work before the library reads it."""
import torch


def _finished(t):
    """Waits until the work queued on `t`'s CUDA device is done (nothing for a CPU tensor): the
    library reads a device tensor on its own streams, which do not wait for PyTorch's."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _float32_params(params, what):
    """The parameters of `params` that require a gradient, checked to be float32 on one device
    (ValueError naming `what` otherwise, or when there are none)."""
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
