#!/usr/bin/env bash
# PyTorch models trained through sparseps in one command: installs the dependencies (Debian's
# python3-torch and python3-torchvision among them), builds (the daemons and the Python module),
# and runs a local cluster of 1 scheduler, 2 servers and 2 PyTorch workers
# (examples/fashion_mnist.py, sparseps.torch.DistributedOptimizer) on Fashion-MNIST with
# examples/torch_cnn.yaml. Arguments:
#
#   examples/train_torch.sh                      # the small CNN, 2 epochs
#   examples/train_torch.sh --model resnet18     # torchvision's ResNet-18, CIFAR-style (32x32)
#   examples/train_torch.sh --model mlp --set train.epochs=6
#   examples/train_torch.sh --config F ...       # another job config; other arguments go to
#                                                # deploy/launch.sh (--set, --run-dir, --quiet)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model=cnn
config="$here/examples/torch_cnn.yaml"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
# deploy/quickstart.sh installs, builds and passes the rest on to deploy/launch.sh.
exec "$here/deploy/quickstart.sh" --config "$config" --set "run.name=torch_$model" \
  --worker-command "/usr/bin/python3 $here/examples/fashion_mnist.py --model $model" \
  "${args[@]}"
