"""One process of tests/python/test_torch.py's DDP tests: torch DDP (Gloo process group, for DDP's
own broadcast) whose gradient buckets are aggregated by sparseps.torch.sparse_allreduce_hook.

    ddp_worker.py RANK WORLD INIT_FILE JOB_YAML OUT_FILE [--set k=v ...] [--steps N]
                  [--stop-after N] [--momentum M] [--batchnorm]

Trains a small MLP on seeded random data (step t's batch fixed by the rank and t) with torch SGD
at lr 0.5 (momentum M) and a StepLR halving it every 8 steps, both kept in sparseps's checkpoints
(SparseAllreduceState's optimizer and extra_state), from worker.step (a resumed job's) to N
(default 40), and saves {loss, params, nonzero, first, buffers} to OUT_FILE (torch.save): the
losses, the final parameters, the number of nonzero entries of each step's averaged gradient, the
first step and the model's buffers (its state_dict's). --batchnorm: a BatchNorm1d after the first
layer, and a buffer registered with persistent=False.
--stop-after N: exits after step N without finishing (workers that die). DDP_DEVICE=cuda trains
on the GPU (tests/python/test_gpu.py); the worker is sparseps.capi's where the pybind11
module is not built for this Python."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sparseps
import sparseps.torch
from sparseps import capi


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
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.5)
    worker = Worker(args.job, rank=rank, overrides=args.set)
    state = sparseps.torch.SparseAllreduceState(worker, ddp, optimizer=opt,
                                                extra_state={"scheduler": scheduler})
    ddp.register_comm_hook(state, sparseps.torch.sparse_allreduce_hook)
    w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    losses, nonzero = [], []
    first = worker.step
    for t in range(first, args.steps):
        x = torch.randn(32, 20, generator=torch.Generator().manual_seed(1000 * rank + t))
        y = (x @ w_true).argmax(1)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        nonzero.append(sum(int((p.grad != 0).sum()) for p in model.parameters()))
        opt.step()
        scheduler.step()
        losses.append(loss.item())
        if args.stop_after == t + 1:
            # Both die after the step, once neither waits for the other's part of it (one gone
            # within the collective would end the other's job first).
            dist.barrier()
            os._exit(0)  # no finish, no checkpoint handed over after this
    state.synchronize()
    worker.finish()
    torch.save({"loss": losses, "nonzero": nonzero, "first": first,
                "buffers": {n: b.detach().cpu() for n, b in model.state_dict().items()
                            if n not in dict(model.named_parameters())},
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()},
               args.out)


if __name__ == "__main__":
    main()
