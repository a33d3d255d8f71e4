"""torch DDP for examples/torch_job.py's --ddp: Gloo's process group, the DDP model and its
communication hook (--ddp-hook): none (Gloo's dense allreduce, the baseline users run today),
torch's fp16_compress_hook or powerSGD_hook, or sparseps's own sparse_allreduce_hook (the job's
collective or servers, as a DDP user adopts sparseps without changing the loop), and the bytes
of torch's settings, counted.
"""
import datetime
import os

import torch

import sparseps.torch

POWERSGD_START = 2  # the PowerSGD hook's start_powerSGD_iter: its first steps allreduce vanilla


def ddp_step_bytes(params, workers, hook, rank, step):
    """The bytes one worker sends (and as many it receives) in step `step` (1-based) of torch
    DDP over Gloo, counted, not measured: Gloo's ring allreduce moves 2 (P - 1) / P of every
    allreduced tensor's bytes each way. The fp16 hook allreduces half-floats; torch's PowerSGD
    hook (after POWERSGD_START vanilla steps) allreduces, for each gradient viewed as n x m
    (its first dimension by the rest), the factors P (n x r) and Q (m x r), r = min(n, m, rank),
    where they hold under half of its n m elements (its min_compression_rate 2), else the whole
    gradient (powerSGD_hook.py's _should_compress)."""
    if workers < 2:
        return 0
    elements = 0
    for p in params:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // n
        r = min(n, m, rank)
        compress = hook == "powersgd" and step > POWERSGD_START and (n + m) * r * 2 < n * m
        elements += (n + m) * r if compress else n * m
    width = 2 if hook == "fp16" else 4
    return round(2 * (workers - 1) / workers * width * elements)


def ddp_model(args, model, worker, get, state=None):
    """Gloo's process group (worker.rank of worker.num_workers; a file store in run.dir) and the
    DDP model of `model` with --ddp-hook's hook registered: `state` (a SparseAllreduceState made
    on the plain model before, so that a resumed job's model is in it before DDP broadcasts rank
    0's) for sparseps."""
    import torch.distributed as dist
    run_dir = get("run.dir") or "."
    # Gloo's collectives fail after cluster.request_timeout_s instead of hanging (DDP's
    # PowerSGD hook deadlocked at 4 Gloo ranks in Debian's torch 1.13).
    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(run_dir)}/ddp.init",
                            rank=worker.rank, world_size=worker.num_workers,
                            timeout=datetime.timedelta(seconds=get("cluster.request_timeout_s")))
    ddp = torch.nn.parallel.DistributedDataParallel(  # Gloo takes CUDA tensors too
        model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.bucket_view)
    if args.ddp_hook == "sparseps":
        ddp.register_comm_hook(state, sparseps.torch.sparse_allreduce_hook)
    elif args.ddp_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.ddp_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        psgd = powerSGD_hook.PowerSGDState(process_group=None,
                                           matrix_approximation_rank=args.powersgd_rank,
                                           start_powerSGD_iter=POWERSGD_START)

        # Gloo completes a bucket's allreduce on a thread of its own, where the hook starts the
        # next of its chain (P, then Q): two buckets' chains then interleave differently on each
        # rank and Gloo pairs tensors of different sizes ("op.preamble.length <= op.nbytes", an
        # abort: Debian's torch 1.13 at 4 ranks on the CPU, torch 2.11 on an H100). One
        # bucket's chain ends before the next bucket's starts.
        def hook(state, bucket):
            fut = powerSGD_hook.powerSGD_hook(state, bucket)
            fut.wait()
            return fut
        ddp.register_comm_hook(psgd, hook)
    return ddp
