#!/usr/bin/env python3
"""torch.topk baseline for the GPU top-k benchmark (issue 5), on the same problem as
build/bench/sparseps_gpu_bench's BM_TopK: N float32 normal values on the GPU (default 100M),
k = N / 1000 largest magnitudes.

    python3 bench/torch_topk_baseline.py [--n N] [--reps R]

Prints one line per variant with the median time over R timed runs (CUDA events, after warm-up):
  torch.topk(|x|)        topk over a precomputed |x| (the selection alone; the fair baseline)
  torch.topk(x.abs())    what a user writes: abs then topk (one more pass over x)
  read (x.sum())         one read of x, for the ratio against sparseps' own one-read baseline
  copy (D2D clone)       x.clone(): 8N bytes moved, the practical bandwidth ceiling
Needs PyTorch with CUDA; exits 0 with a message when either is missing (nothing to compare).
"""
import argparse
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_topk_baseline: no PyTorch here, nothing to compare")
        return 0
    if not torch.cuda.is_available():
        print("torch_topk_baseline: PyTorch sees no CUDA device, nothing to compare")
        return 0
    torch.manual_seed(1)
    n, k = args.n, args.n // 1000
    x = torch.randn(n, device="cuda", dtype=torch.float32)
    ax = x.abs()

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    name = torch.cuda.get_device_name()
    print(f"torch {torch.__version__} on {name}: n={n} k={k}, median of {args.reps}")
    rows = [
        ("torch.topk(|x|)", timed(lambda: torch.topk(ax, k, sorted=False)), 4 * n),
        ("torch.topk(x.abs())", timed(lambda: torch.topk(x.abs(), k, sorted=False)), 4 * n),
        ("read (x.sum())", timed(lambda: x.sum()), 4 * n),
        ("copy (D2D clone)", timed(lambda: x.clone()), 8 * n),
    ]
    for label, sec, nbytes in rows:
        print(f"{label:22s} {sec * 1e6:10.1f} us  {nbytes / sec / 1e9:8.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
