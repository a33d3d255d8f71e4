"""One process of tests/python/test_torch.py's DDP tests: torch DDP (Gloo process group, for DDP's
own broadcast) whose gradient buckets are aggregated by sparseps.torch.sparse_allreduce_hook.

    ddp_worker.py RANK WORLD INIT_FILE JOB_YAML OUT_FILE [--set k=v ...] [--steps N]
                  [--stop-after N] [--momentum M] [--batchnorm] [--amp] [--overflow-at T]
                  [--skip T] [--kill-at T --kill-pid PID] [--conserve] [--bucket-view]

Trains a small MLP on seeded random data (step t's batch fixed by the rank and t) with torch SGD
at lr 0.5 (momentum M) and a StepLR halving it every 8 steps, both kept in sparseps's checkpoints
(SparseAllreduceState's optimizer and extra_state), from worker.step (a resumed job's) to N
(default 40), and saves {loss, params, nonzero, first, buffers} to OUT_FILE (torch.save): the
losses, the final parameters, the number of nonzero entries of each step's averaged gradient, the
first step and the model's buffers (its state_dict's). --batchnorm: a BatchNorm1d after the first
layer, and a buffer registered with persistent=False.
--stop-after N: exits after step N without finishing (workers that die). --amp: loss scaling
with torch's GradScaler given to SparseAllreduceState and kept in its extra_state (and fp16
autocast on a GPU; on the CPU of a torch without one for it, PowerOfTwoScaler below).
--overflow-at T: the last rank's loss is inf at step T. --skip T: every rank leaves step T out.
The file also holds {steps, skipped, overflows}: worker.step after each step, the steps whose
gradients came back non-finite and the state's overflows.
--kill-at T --kill-pid PID: rank 0 kills PID (a server) with SIGKILL after step T, once; the
loop goes back to worker.step when the hook says it rolled back (state.rolled_back), and the file
holds {rolled}: the (step, checkpoint's step) of each rollback.
--bucket-view: DDP's gradient_as_bucket_view=True (the gradients are views of DDP's buckets).
--conserve (momentum 0): the file also holds {local_sum, hook_sum, residual}: the sum over the
steps of this worker's own gradient (torch.autograd.grad through the module, not DDP), of what
the hook gave DDP (the parameters' .grad) and the worker's final residual, flat.
DDP_DEVICE=cuda trains on the GPU (tests/python/test_gpu.py); the worker is sparseps.capi's where
the pybind11 module is not built for this Python.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sparseps
import sparseps.torch
from sparseps import capi


class PowerOfTwoScaler:
    """torch.amp.GradScaler's dynamic loss scaling (the same calls and rule: skip the step and
    halve the scale on an inf or NaN, double it after growth_interval steps without one), for
    Debian's torch 1.13, whose GradScaler is CUDA's only (disabled on the CPU)."""

    def __init__(self, init_scale, growth_interval):
        self.scale_, self.interval, self.tracker, self.found = init_scale, growth_interval, 0, 0

    def is_enabled(self):
        return True

    def get_scale(self):
        return self.scale_

    def scale(self, loss):
        return loss * self.scale_

    def step(self, opt):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        for g in grads:
            g.mul_(1.0 / self.scale_)
        self.found = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not self.found:
            opt.step()

    def state_dict(self):
        return {"scale": self.scale_, "_growth_tracker": self.tracker}

    def load_state_dict(self, state):
        self.scale_, self.tracker = float(state["scale"]), int(state["_growth_tracker"])

    def update(self):
        self.tracker = 0 if self.found else self.tracker + 1
        if self.found:
            self.scale_ *= 0.5
        elif self.tracker == self.interval:
            self.scale_, self.tracker = self.scale_ * 2.0, 0


def grad_scaler(device):
    """torch's GradScaler for `device` where this torch has one, else PowerOfTwoScaler."""
    kwargs = {"init_scale": 2.0 ** 10, "growth_interval": 3}
    if hasattr(torch.amp, "GradScaler"):  # torch >= 2.3: the CPU's too
        return torch.amp.GradScaler(device.type, **kwargs)
    if device.type == "cuda":
        return torch.cuda.amp.GradScaler(**kwargs)
    return PowerOfTwoScaler(**kwargs)


def main():
    ap = argparse.ArgumentParser()
    for name in ("rank", "world"):
        ap.add_argument(name, type=int)
    for name in ("init_file", "job", "out"):
        ap.add_argument(name)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--batchnorm", action="store_true")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--overflow-at", type=int, default=None)
    ap.add_argument("--skip", type=int, default=None)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--kill-pid", type=int, default=None)
    ap.add_argument("--conserve", action="store_true")
    ap.add_argument("--bucket-view", action="store_true")
    args = ap.parse_args()
    rank = args.rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=rank,
                            world_size=args.world)
    device = torch.device(os.environ.get("DDP_DEVICE", "cpu"))
    try:
        Worker = sparseps.Worker
    except ImportError:  # the module is not built for this Python
        Worker = capi.Worker
    torch.manual_seed(rank)  # different initial models: DDP broadcasts rank 0's
    hidden = [nn.Linear(20, 64)] + ([nn.BatchNorm1d(64)] if args.batchnorm else [])
    model = nn.Sequential(*hidden, nn.ReLU(), nn.Linear(64, 4)).to(device)
    if args.batchnorm:  # and a buffer that is no part of the state (a causal mask's kind)
        model.register_buffer("scratch", torch.ones(3, device=device), persistent=False)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001,  # several buckets
                                              gradient_as_bucket_view=args.bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.5)
    worker = Worker(args.job, rank=rank, overrides=args.set)
    scaler = grad_scaler(device) if args.amp else None
    extra = {"scheduler": scheduler}
    if scaler is not None:
        extra["scaler"] = scaler
    state = sparseps.torch.SparseAllreduceState(worker, ddp, optimizer=opt, extra_state=extra,
                                                grad_scaler=scaler)
    ddp.register_comm_hook(state, sparseps.torch.sparse_allreduce_hook)
    w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    losses, nonzero, steps, skipped, rolled = [], [], [], [], []
    first = t = worker.step
    autocast = args.amp and device.type == "cuda"
    local_sum = hook_sum = 0
    while t < args.steps:
        if t == args.skip:
            scheduler.step()  # as a loop with a scaler steps it after a skipped step
            t += 1
            continue
        x = torch.randn(32, 20, generator=torch.Generator().manual_seed(1000 * rank + t))
        y = (x @ w_true).argmax(1)
        x, y = x.to(device), y.to(device)
        if args.conserve:  # this worker's own gradient, as DDP's backward computes it
            mine = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
            local_sum = local_sum + torch.cat([g.reshape(-1) for g in mine]).double()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            loss = F.cross_entropy(ddp(x), y)
        if t == args.overflow_at and rank == args.world - 1:
            loss = loss * float("inf")
        (loss if scaler is None else scaler.scale(loss)).backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            skipped.append(t)
        nonzero.append(sum(int((p.grad != 0).sum()) for p in model.parameters()))
        if args.conserve:
            hook_sum = hook_sum + torch.cat([p.grad.reshape(-1) for p in model.parameters()]) \
                .double()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        scheduler.step()
        if state.rolled_back:  # the model and optimizer come back before the next forward
            rolled.append((t + 1, worker.step))
            t = worker.step
            continue
        t += 1
        losses.append(loss.item())
        steps.append(worker.step)
        if rank == 0 and args.kill_at == t and not rolled:
            os.kill(args.kill_pid, signal.SIGKILL)
        if args.stop_after == t:
            # Both die after the step, once neither waits for the other's part of it (one gone
            # within the collective would end the other's job first).
            dist.barrier()
            os._exit(0)  # no finish, no checkpoint handed over after this
    state.synchronize()
    residual = torch.from_numpy(worker.residual()).double() if args.conserve else None
    worker.finish()
    torch.save({"loss": losses, "nonzero": nonzero, "first": first, "steps": steps,
                "skipped": skipped, "overflows": state.overflows, "rolled": rolled,
                "local_sum": local_sum, "hook_sum": hook_sum, "residual": residual,
                "buffers": {n: b.detach().cpu() for n, b in model.state_dict().items()
                            if n not in dict(model.named_parameters())},
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()},
               args.out)


if __name__ == "__main__":
    main()
