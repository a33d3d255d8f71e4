"""One process of tests/python/test_torch.py's DDP test: torch DDP (Gloo process group, for
DDP's own broadcast) whose gradient buckets are aggregated by sparseps.torch.sparse_allreduce_hook.

    ddp_worker.py RANK WORLD INIT_FILE JOB_YAML OUT_FILE [--set k=v ...]

Trains a small MLP for 40 steps on seeded random data and saves {loss, params, nonzero} to
OUT_FILE (torch.save): the losses, the final parameters, and the number of nonzero entries of
each step's averaged gradient. DDP_DEVICE=cuda trains on the GPU (tests/python/test_gpu.py); the
worker is sparseps.capi's where the pybind11 module is not built for this Python."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sparseps
import sparseps.torch
from sparseps import capi


def main():
    rank, world, init_file, job, out = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
    sets = [a.split("=", 1)[0] + "=" + a.split("=", 1)[1] for a in sys.argv[7::2]]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device(os.environ.get("DDP_DEVICE", "cpu"))
    try:
        Worker = sparseps.Worker
    except ImportError:  # the module is not built for this Python
        Worker = capi.Worker
    torch.manual_seed(rank)  # different initial models: DDP broadcasts rank 0's
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    state = sparseps.torch.SparseAllreduceState(Worker(job, rank=rank, overrides=sets), ddp)
    ddp.register_comm_hook(state, sparseps.torch.sparse_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    losses, nonzero = [], []
    for _ in range(40):
        x = torch.randn(32, 20, generator=g)
        y = (x @ w_true).argmax(1)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        nonzero.append(sum(int((p.grad != 0).sum()) for p in model.parameters()))
        opt.step()
        losses.append(loss.item())
    state.worker.finish()
    torch.save({"loss": losses, "nonzero": nonzero,
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()},
               out)


if __name__ == "__main__":
    main()
