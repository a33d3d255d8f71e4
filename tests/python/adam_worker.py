"""A PyTorch training loop as a process of its own, for tests that kill one
(test_torch_checkpoint.py): test_torch_checkpoint.make_model under Adam over the aggregated
gradient (sparseps.torch.DistributedOptimizer, each worker's Adam keeping its own copy of the
model) as worker RANK, STEPS steps from where init puts it (a replacement: its join iteration),
each step's batch fixed by rank and step, SLEEP seconds after each. Prints "start STEP REJOINED",
then "step N" after each step, and writes the final parameters (float32, flat) to OUT.

    adam_worker.py JOB RANK STEPS SLEEP OUT {module|capi} [key=value ...]
"""
import sys
import time

import torch

import sparseps
import sparseps.torch
from sparseps import capi
from test_torch_checkpoint import make_model


def main():
    job, rank, steps, sleep, out, backend = sys.argv[1:7]
    rank, steps, sleep = int(rank), int(steps), float(sleep)
    make = sparseps.Worker if backend == "module" else capi.Worker
    w = make(job, rank=rank, overrides=sys.argv[7:])
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = sparseps.torch.DistributedOptimizer(
        adam, w, extra_state={"buffers": sparseps.torch.ModuleBuffers(model)})
    print("start", w.step, int(w.rejoined), flush=True)
    for t in range(w.step, steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * rank + t))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        print("step", t + 1, flush=True)
        time.sleep(sleep)
    opt.synchronize()
    w.finish()
    torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tofile(out)


if __name__ == "__main__":
    main()
