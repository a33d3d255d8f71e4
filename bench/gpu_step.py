#!/usr/bin/env python3
"""The GPU step, measured (issue 41): sparseps's step on the GPU split into compute / encode /
communication, next to PyTorch's own training step of the same model and batch on the same GPU.

    bench/gpu_step.py [--runs DIR ...] [--models cnn,resnet18,mlp] [--batch 64] [--steps 100]
                      [--out FILE.json]

PyTorch's step: examples/fashion_mnist.py's model (cnn, resnet18 CIFAR-style on 1x32x32, mlp
784-2048-2048-10: the 5.8M-parameter MLP of configs/compare_job.yaml), forward + backward +
torch.optim.SGD step (momentum 0.9) on random data of the model's input shape, timed with CUDA
events around each step: the median of --steps steps after 20 warm-up steps.

--runs: run directories of sparseps jobs trained on the GPU (deploy/launch.sh's; the C++ worker
with train.device=cuda or the example with --device cuda), each named MODEL-METHOD (cnn-ps_topk,
resnet18-spardl, ...): worker 0's metrics, the median per step of compute_ms, encode_ms, comm_ms
and bytes sent, after the first 10 steps, and the host-device bytes per step where the run counted
them (memcpy-worker-0.json: the C++ worker writes it on the GPU, the example with
--profile-memcpy). Prints one table: each run's split,
PyTorch's step of its model, and (compute + encode) / PyTorch's step, the issue's goal being at
most 1.2.
"""
import argparse
import csv
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import fashion_mnist as example  # noqa: E402  (the example's models)


def model_of(name):
    """The example's model `name` and its input's shape (the mlp: 784-2048-2048-10)."""
    if name not in ("cnn", "resnet18", "mlp"):
        raise SystemExit(f"gpu_step.py: unknown model {name!r} (cnn, resnet18, mlp)")
    model = example.build_model(name, {"model.hidden": [2048, 2048]}.get)
    return model, (1, 32, 32) if name.startswith("resnet") else (1, 28, 28)


def torch_step_ms(name, batch, steps, device):
    """Median ms of PyTorch's forward + backward + SGD step of model `name` at `batch`."""
    torch.manual_seed(0)
    model, shape = model_of(name)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs = [torch.randn(batch, *shape, device=device) for _ in range(4)]  # rotated: not one buffer
    ys = [torch.randint(0, 10, (batch,), device=device) for _ in range(4)]
    times = []
    for i in range(20 + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad()
        F.cross_entropy(model(xs[i % 4]), ys[i % 4]).backward()
        opt.step()
        end.record()
        end.synchronize()
        if i >= 20:
            times.append(start.elapsed_time(end))
    return statistics.median(times), sum(p.numel() for p in model.parameters())


def run_split(run_dir):
    """Worker 0's median compute / encode / comm ms and bytes sent per step, after 10 steps."""
    with open(os.path.join(run_dir, "metrics-worker-0.csv")) as f:
        rows = list(csv.DictReader(f))[10:]
    if not rows:
        raise SystemExit(f"gpu_step.py: {run_dir}: fewer than 11 steps in metrics-worker-0.csv")

    def med(column):
        return statistics.median(float(r[column]) for r in rows)

    split = {"steps": len(rows) + 10, "compute_ms": med("compute_ms"),
             "encode_ms": med("encode_ms"), "comm_ms": med("comm_ms"),
             "bytes_sent": med("bytes_sent")}
    # Host-device copies per step: the C++ worker's own count on the GPU, or the example's
    # --profile-memcpy (PyTorch's and sparseps's copies); "steps" stays the run's.
    copies = os.path.join(run_dir, "memcpy-worker-0.json")
    if os.path.exists(copies):
        with open(copies) as f:
            split.update({k: v for k, v in json.load(f).items() if k != "steps"})
    return split


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="*", default=[])
    ap.add_argument("--models", default="cnn,resnet18,mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py: this PyTorch sees no CUDA device")
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "batch": args.batch, "torch_step_ms": {}, "runs": {}}
    for name in args.models.split(","):
        ms, n = torch_step_ms(name, args.batch, args.steps, device)
        result["torch_step_ms"][name] = ms
        print(f"PyTorch's own step, {name} ({n} parameters, batch {args.batch}): {ms:.3f} ms")
    for run in args.runs:
        result["runs"][os.path.basename(run.rstrip("/"))] = run_split(run)
    print(f"\n{result['device']}, torch {result['torch']} (CUDA {result['cuda']}), batch "
          f"{args.batch} per worker; medians per step of worker 0\n")
    print("| run | compute ms | encode ms | comm ms | bytes sent | host to device bytes | "
          "device to host bytes | PyTorch step ms | (compute+encode)/PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in result["runs"].items():
        base = result["torch_step_ms"].get(name.split("-")[0])
        ratio = "" if base is None else f"{(r['compute_ms'] + r['encode_ms']) / base:.2f}x"
        h2d = f"{r['h2d_bytes_per_step']:.0f}" if "h2d_bytes_per_step" in r else "not counted"
        d2h = f"{r['d2h_bytes_per_step']:.0f}" if "d2h_bytes_per_step" in r else "not counted"
        print(f"| {name} | {r['compute_ms']:.2f} | {r['encode_ms']:.2f} | {r['comm_ms']:.2f} | "
              f"{r['bytes_sent']:.0f} | {h2d} | {d2h} | {'' if base is None else f'{base:.2f}'} | "
              f"{ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
