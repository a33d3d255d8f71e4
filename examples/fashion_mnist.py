#!/usr/bin/python3
"""Train a PyTorch model on Fashion-MNIST as one worker of a sparseps job.

The gradients go through sparseps (sparseps.torch.DistributedOptimizer: the job's encoding or
collective, error feedback inside sparseps), the model and the optimizer are plain PyTorch.
Started like the C++ worker, with the job's config and --set overrides, so deploy/launch.sh can
start it in place of sparseps-worker (examples/train_torch.sh does):

    examples/fashion_mnist.py --config examples/torch_cnn.yaml --set node.rank=0 \\
        [--set key=value ...] [--model cnn|resnet18|mlp] [--device cuda]

The config's train.* keys (epochs, batch_size, lr, seed, max_steps, eval_every_epochs,
eval_every_steps), data.* (dir, max_train_samples, max_test_samples), run.dir and
run.progress_interval_s mean what they mean for the C++ worker. The data: torchvision's
FashionMNIST reader over the IDX files of data.dir (Debian's dataset-fashion-mnist), unpacked
once into ~/.cache/sparseps (SPARSEPS_CACHE). Each worker trains on its own shard (a seeded
permutation dealt by rank). In run.dir it writes metrics-worker-R.csv and (worker 0)
eval-worker-0.csv with the C++ worker's columns, so deploy/summarize.py and bench/sparseps-compare
read its runs too.

--ddp trains with torch's DistributedDataParallel over Gloo instead (the baseline that
torch.distributed users get on CPU; GLOO_SOCKET_IFNAME picks the interface, eth0 on deploy/netns.sh
hosts): the worker still joins the sparseps job, for its rank and so that the scheduler sees the
job end, but no gradient goes through sparseps; the optimizer is torch's SGD with momentum
train.momentum. --ddp-hook fp16 adds DDP's fp16_compress_hook (the gradients cast to half for the
allreduce), --ddp-hook powersgd its powerSGD_hook at rank --powersgd-rank (Debian's torch 1.13
aborts it with more than 2 Gloo ranks: sparseps's own, collective.algorithm: powersgd, is the
PowerSGD that runs there). bench/sparseps-compare runs them all (configs/compare_torch_1gbit.yaml).

Models: cnn (two 5x5 conv layers of 16 and 32 filters with 2x2 pooling, a 128-unit head: the C++
worker's configs/cnn.yaml, 215,370 parameters), resnet18 and resnet50 (torchvision's, CIFAR-style:
a 3x3 stride-1 stem without max pooling, on Fashion-MNIST padded to 32x32: 11,172,810 and
23,519,690 parameters), mlp (model.hidden of the config, ReLU, initialised as the C++ worker's
MLP). --synthetic trains on random 1x32x32 data instead (a large model's step time and bytes
where its data set is absent; the accuracy means nothing).

--device cuda (default: the config's train.device) trains on the GPU: the model, the data set and
the gradients stay on the device, and a CUDA build of sparseps compresses them there (PS top-k,
SBC, sketches, the sparse collectives). The worker is sparseps.Worker, the pybind11 module, when it
is built for this Python, else (or with --capi) sparseps.capi.Worker, the same worker through the
client library's C interface: the way to run under a Python or PyTorch the module was not built
for, e.g. a GPU machine's own.
"""
import argparse
import csv
import gzip
import os
import shutil
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import sparseps
import sparseps.torch
from sparseps import capi

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's, as the C++ reader normalises
ERRORS = [ValueError, TimeoutError, capi.Error]  # a clear message and exit code 1 or 2


def log(rank, level, text):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    stream = sys.stderr if level in ("warning", "error") else sys.stdout
    print(f"[{stamp}] [worker-{rank}] [{level}] {text}", file=stream, flush=True)


def fashion_mnist(data_dir, train):
    """torchvision's FashionMNIST over data_dir's IDX files (.gz unpacked once into the cache)."""
    cache = os.environ.get("SPARSEPS_CACHE", os.path.expanduser("~/.cache/sparseps"))
    raw = os.path.join(cache, "FashionMNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        dst = os.path.join(raw, name)
        if os.path.exists(dst):
            continue
        src = os.path.join(data_dir, name)
        tmp = f"{dst}.{os.getpid()}.tmp"
        if os.path.exists(src + ".gz"):
            with gzip.open(src + ".gz", "rb") as f, open(tmp, "wb") as out:
                shutil.copyfileobj(f, out)
        elif os.path.exists(src):
            shutil.copyfile(src, tmp)
        else:
            raise SystemExit(f"fashion_mnist.py: {src}[.gz] not found (data.dir; "
                             "deploy/install-deps.sh installs Debian's dataset-fashion-mnist)")
        os.replace(tmp, dst)  # atomic: workers sharing the cache never see half a file
    ds = torchvision.datasets.FashionMNIST(cache, train=train, download=False)
    x = (ds.data.float().div_(255.0).sub_(MEAN).div_(STD)).unsqueeze(1)  # N x 1 x 28 x 28
    return x, ds.targets.clone()


class Cnn(nn.Module):
    """configs/cnn.yaml's CNN: conv5x5-16, pool, conv5x5-32, pool, 1568-128-10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def cifar_style(m):
    """A torchvision ResNet as CIFAR models are: a 3x3 stride-1 stem of one channel, no max
    pooling (for 1x32x32 images: Fashion-MNIST padded, as no other image set is packaged)."""
    m.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def resnet18():
    return cifar_style(torchvision.models.resnet18(num_classes=10))


def resnet50():
    return cifar_style(torchvision.models.resnet50(num_classes=10))


def pad32(x):
    """N x 1 x 28 x 28 normalised images, padded to 32 x 32 with the background's value."""
    return F.pad(x, (2, 2, 2, 2), value=-MEAN / STD)


def synthetic(n, seed):
    """n random 1 x 32 x 32 images and labels (--synthetic: step time and bytes of a large model
    where its data set is absent; the accuracy means nothing)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def mlp(hidden):
    """The C++ worker's MLP (worker/mlp.h), initialised as it is: He-uniform weights (bound
    sqrt(6 / fan_in)) and zero biases, not torch's default (bound 1 / sqrt(fan_in))."""
    layers, width = [nn.Flatten()], 28 * 28
    for h in hidden + [10]:
        linear = nn.Linear(width, h)
        nn.init.kaiming_uniform_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
        width = h
    return nn.Sequential(*layers[:-1])


def worker_backend(force_capi):
    """(Worker class, its Error class): the pybind11 module's when it loads in this Python (and
    not force_capi), else sparseps.capi's."""
    if not force_capi:
        try:
            return sparseps.Worker, sparseps.Error
        except ImportError:
            pass
    return capi.Worker, capi.Error


def evaluate(model, x, y, batch=1000):
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch])
            loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return loss / len(x), correct / len(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="the job's YAML config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, as the daemons take it")
    ap.add_argument("--model", choices=["cnn", "resnet18", "resnet50", "mlp"], default="cnn")
    ap.add_argument("--synthetic", action="store_true",
                    help="random 1x32x32 data instead of Fashion-MNIST (step time and bytes only)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the workers of a machine share its cores)")
    ap.add_argument("--ddp", action="store_true",
                    help="torch DDP over Gloo instead of sparseps (the baseline)")
    ap.add_argument("--ddp-hook", choices=["none", "fp16", "powersgd"], default="none",
                    help="with --ddp: DDP's communication hook (fp16_compress_hook, powerSGD_hook)")
    ap.add_argument("--powersgd-rank", type=int, default=4,
                    help="with --ddp-hook powersgd: its matrix_approximation_rank")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where the model trains (default: the config's train.device)")
    ap.add_argument("--capi", action="store_true",
                    help="sparseps.capi's worker even where the pybind11 module loads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Worker, error = worker_backend(args.capi)
    ERRORS.append(error)
    worker = Worker(args.config, overrides=args.set)
    get = worker.get
    device = torch.device(args.device or get("train.device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this PyTorch sees no CUDA device")
    seed, batch = get("train.seed"), get("train.batch_size")
    torch.manual_seed(seed)  # the same initial model everywhere (worker 0's is used anyway)
    model = {"cnn": Cnn, "resnet18": resnet18, "resnet50": resnet50,
             "mlp": lambda: mlp(get("model.hidden"))}[args.model]().to(device)
    n = sum(p.numel() for p in model.parameters())
    if args.ddp:
        # sparseps only for the rank and the job's end; DDP broadcasts worker 0's parameters.
        with torch.no_grad():
            worker.init([p.detach() for p in model.parameters()])
        import torch.distributed as dist
        run_dir = get("run.dir") or "."
        dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(run_dir)}/ddp.init",
                                rank=worker.rank, world_size=worker.num_workers)
        model = torch.nn.parallel.DistributedDataParallel(model)  # Gloo takes CUDA tensors too
        if args.ddp_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.ddp_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=args.powersgd_rank,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=get("train.lr"),
                              momentum=get("train.momentum"))
    else:
        opt = sparseps.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=get("train.lr")), worker)
    rank, workers = worker.rank, worker.num_workers

    if args.synthetic:
        x, y = synthetic(60000, seed)
        xt, yt = synthetic(10000, seed + 1)
    else:
        x, y = fashion_mnist(get("data.dir"), train=True)
        xt, yt = fashion_mnist(get("data.dir"), train=False)
        if args.model.startswith("resnet"):
            x, xt = pad32(x), pad32(xt)
    if get("data.max_train_samples"):
        x, y = x[:get("data.max_train_samples")], y[:get("data.max_train_samples")]
    if get("data.max_test_samples"):
        xt, yt = xt[:get("data.max_test_samples")], yt[:get("data.max_test_samples")]
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    shard = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[rank::workers]
    shard = shard.to(device)
    steps_per_epoch = len(shard) // batch
    total = get("train.epochs") * steps_per_epoch
    if get("train.max_steps"):
        total = min(total, get("train.max_steps"))
    epochs = (total + steps_per_epoch - 1) // steps_per_epoch
    method = (f"torch DDP (gloo, {args.ddp_hook} hook)" if args.ddp else f"{worker.aggregation} " + (
        get("compression.encoding") if worker.aggregation == "ps" else get("collective.algorithm")))
    log(rank, "info", f"model: torch {args.model}, {n} parameters on {device}; {len(shard)} training "
        f"samples on this worker, {steps_per_epoch} steps per epoch; {method}")

    run_dir = get("run.dir")
    metrics = evals = None
    if run_dir:
        metrics = csv.writer(open(os.path.join(run_dir, f"metrics-worker-{rank}.csv"), "w", newline="",
                                  buffering=1))
        metrics.writerow(["step", "epoch", "loss", "bytes_sent", "bytes_received", "selected",
                          "compute_ms", "encode_ms", "comm_ms", "wall_s", "applied", "topk_mass",
                          "binding_ms"])
        if rank == 0:
            evals = csv.writer(open(os.path.join(run_dir, "eval-worker-0.csv"), "w", newline="",
                                    buffering=1))
            evals.writerow(["epoch", "step", "wall_s", "test_loss", "test_accuracy", "train_s"])
    start = last = time.monotonic()
    eval_s, accuracy, step, epoch_loss, epoch_steps = 0.0, -1.0, 0, 0.0, 0
    progress_loss, progress_steps = 0.0, 0

    def run_eval(epoch):
        nonlocal eval_s, accuracy
        t = time.monotonic()
        test_loss, accuracy = evaluate(getattr(model, "module", model), xt, yt)
        took = time.monotonic() - t
        wall = t + took - start
        if evals:
            evals.writerow([epoch, step, wall, test_loss, accuracy, wall - eval_s - took])
        eval_s += took
        log(rank, "info", f"eval epoch {epoch} step {step}: test loss {test_loss:.4f}, "
            f"test accuracy {100 * accuracy:.2f}%")

    for epoch in range(epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(
            seed ^ (epoch + 1) * 0x9E3779B9 ^ rank)).to(device)]
        worker.set_epoch(epoch)
        epoch_loss, epoch_steps = 0.0, 0
        for s in range(steps_per_epoch):
            if step >= total:
                break
            t0 = time.monotonic()
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # compute_ms: the forward and backward, finished
            t1 = time.monotonic()
            if args.ddp:
                opt.step()
            else:
                opt.step(loss=loss)  # the live metrics' loss gauge
            t2 = time.monotonic()
            step += 1
            loss = loss.item()
            epoch_loss, epoch_steps = epoch_loss + loss, epoch_steps + 1
            if metrics and args.ddp:
                # DDP's allreduce runs inside backward (compute_ms); comm_ms is the SGD step.
                metrics.writerow([step, epoch + 1, loss, 0, 0, n, 1000 * (t1 - t0), 0,
                                  1000 * (t2 - t1), t2 - start, n, -1, 0])
            elif metrics:
                last_step = worker.last_step
                # comm_ms: push_pull and the optimizer's step less the aggregation's encoding;
                # binding_ms: push_pull's time outside the C++ aggregation (tensor intake, the
                # update's array, the GIL), the cost of being called from Python.
                comm = 1000 * (t2 - t1) - last_step["encode_ms"]
                binding = opt.last_push_pull_ms - last_step["encode_ms"] - last_step["comm_ms"]
                metrics.writerow([step, epoch + 1, loss, last_step["bytes_sent"],
                                  last_step["bytes_received"], last_step["selected"],
                                  1000 * (t1 - t0), last_step["encode_ms"], comm, t2 - start,
                                  last_step["applied"], -1, binding])
            progress_loss, progress_steps = progress_loss + loss, progress_steps + 1
            if rank == 0 and t2 - last >= get("run.progress_interval_s"):
                acc = "n/a" if accuracy < 0 else f"{100 * accuracy:.2f}%"
                log(rank, "info",
                    f"progress epoch {epoch + 1}/{epochs} step {step}/{total} loss "
                    f"{progress_loss / progress_steps:.4f} test_acc {acc} cluster "
                    f"{progress_steps * batch * workers / (t2 - last):.0f} samples/s, this worker "
                    f"sent {worker.bytes_sent / 1e6:.2f} MB and received "
                    f"{worker.bytes_received / 1e6:.2f} MB in all")
                last, progress_loss, progress_steps = t2, 0.0, 0
            every = get("train.eval_every_steps")
            if rank == 0 and every and step % every == 0 and step < total:
                run_eval(epoch + 1)
        every = get("train.eval_every_epochs")
        if rank == 0 and every and (epoch + 1) % every == 0 and step < total:
            run_eval(epoch + 1)
    train_s = time.monotonic() - start
    if rank == 0:
        if not args.ddp:
            opt.synchronize()  # ssp / async: the model with every worker's every push
        run_eval(epochs)
    log(rank, "info", f"training done: {step} steps in {train_s:.1f} s, "
        f"{step * batch / train_s:.0f} samples/s on this worker"
        + (f", final test accuracy {100 * accuracy:.2f}%" if rank == 0 else ""))
    worker.finish(test_accuracy=accuracy, train_loss=epoch_loss / max(epoch_steps, 1),
                  samples_per_s=step * batch / train_s, train_s=train_s)


if __name__ == "__main__":
    try:
        main()
    except tuple(ERRORS) as e:
        print(f"fashion_mnist.py: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ValueError) else 1)
