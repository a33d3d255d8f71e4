#!/usr/bin/python3
"""Train a PyTorch model on Fashion-MNIST as one worker of a sparseps job.

The gradients go through sparseps (sparseps.torch.DistributedOptimizer: the job's encoding or
collective, error feedback inside sparseps), the model and the optimizer are plain PyTorch.
Started like the C++ worker, with the job's config and --set overrides, so deploy/launch.sh can
start it in place of sparseps-worker (examples/train_torch.sh does):

    examples/fashion_mnist.py --config examples/torch_cnn.yaml --set node.rank=0 \\
        [--set key=value ...] [--model cnn|resnet18|mlp] [--device cuda]

The loop is examples/torch_job.py's (its docstring has the options: --ddp with --ddp-hook fp16 or
powersgd for torch DDP over Gloo, the baseline, or sparseps for DDP with sparseps's hook;
--optimizer adam|adamw with --aggregate update;
--device cuda; --capi). The data: torchvision's FashionMNIST reader over the IDX files of
data.dir (Debian's dataset-fashion-mnist), unpacked once into ~/.cache/sparseps (SPARSEPS_CACHE).
bench/sparseps-compare runs its settings side by side (configs/compare_torch_1gbit.yaml).

Models: cnn (two 5x5 conv layers of 16 and 32 filters with 2x2 pooling, a 128-unit head: the C++
worker's configs/cnn.yaml, 215,370 parameters), resnet18 and resnet50 (torchvision's, CIFAR-style:
a 3x3 stride-1 stem without max pooling, on Fashion-MNIST padded to 32x32: 11,172,810 and
23,519,690 parameters), mlp (model.hidden of the config, ReLU, initialised as the C++ worker's
MLP). --synthetic trains on random 1x32x32 data instead (a large model's step time and bytes
where its data set is absent; the accuracy means nothing).

--device cuda (default: the config's train.device) trains on the GPU: the model, the data set and
the gradients stay on the device, and a CUDA build of sparseps compresses them there. The worker is
sparseps.Worker (the pybind11 module) where it is built for this Python, else sparseps.capi.Worker.
"""
import gzip
import os
import shutil

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import torch_job

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's, as the C++ reader normalises


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


def build_model(name, get):
    return {"cnn": Cnn, "resnet18": resnet18, "resnet50": resnet50,
            "mlp": lambda: mlp(get("model.hidden"))}[name]()


def load_data(args, get):
    """Fashion-MNIST (padded to 32x32 for the ResNets), or --synthetic 1x32x32 noise."""
    if args.synthetic:
        seed = get("train.seed")
        x, y = synthetic(60000, seed)
        xt, yt = synthetic(10000, seed + 1)
        return x, y, xt, yt, "synthetic 1x32x32 data"
    x, y = fashion_mnist(get("data.dir"), train=True)
    xt, yt = fashion_mnist(get("data.dir"), train=False)
    if args.model.startswith("resnet"):
        x, xt = pad32(x), pad32(xt)
    return x, y, xt, yt, "Fashion-MNIST"


def main():
    args = torch_job.parser(__doc__, ["cnn", "resnet18", "resnet50", "mlp"]).parse_args()
    torch_job.run(args, build_model, load_data)


if __name__ == "__main__":
    torch_job.main(main, "fashion_mnist.py")
