#!/usr/bin/env python3
"""sparseps-advise's gTop-k network time against the gTop-k paper's measured communication.

Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low
Bandwidth Networks", ICDCS 2019. Their plotting scripts (github.com/hclhkbu/gtopkssgd,
scripts/icdcs2019/communication.py) hold what the paper's figures show, with the inputs:
- the link: alpha = 0.436 ms a message and beta = 9e-6 ms a byte (their point-to-point fit on the
  cluster's 1 Gbit/s Ethernet, plot_allreduce_comparison);
- density 0.001 (gtopk_mpi.sh's default), P = 32 workers;
- each model's computation, compression and communication seconds an iteration of gTop-k S-SGD at
  P = 32 (plot_breakdown): VGG-16 on CIFAR-10, ResNet-20, AlexNet and ResNet-50 on ImageNet
  (exp_configs/), whose sizes are the standard ones.
Prints a Markdown table: measured communication, the discrete-event simulation
(deploy/advise/simulate.py, SimGrid) and the closed-form cost model (cost_model.py) of a step's
gTop-k with those inputs, the paper's own alpha-beta formula, and the measured time per
parameter. Needs python3-simgrid. Usage: bench/advise_gtopk_paper.py
"""
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy",
                                "advise"))
import cost_model  # noqa: E402
import simulate  # noqa: E402

ALPHA_S = 0.436e-3          # one message's latency (one way)
BANDWIDTH_BPS = 1 / 9e-9    # 9e-6 ms a byte
DENSITY = 0.001
P = 32
# name: (parameters, measured communication seconds an iteration at P = 32)
MODELS = {
    "VGG-16 (CIFAR-10)": (14.73e6, 0.811753),
    "ResNet-20 (CIFAR-10)": (0.27e6, 0.024686),
    "AlexNet (ImageNet)": (61.10e6, 3.36298),
    "ResNet-50 (ImageNet)": (25.56e6, 1.424253),
}


def main():
    rounds = math.ceil(math.log2(P))
    print("| model | parameters | measured (ms) | simulated (ms) | cost model (ms) | "
          "paper's formula (ms) | measured / simulated | measured ns per parameter |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (n, measured) in MODELS.items():
        k = DENSITY * n
        # worker 0, the tree's root: k (key, value) pairs of 8 bytes a round, log2 P rounds up
        # (received) and log2 P down (sent)
        sent = received = 8 * k * rounds
        sim = simulate.network_step_s("allreduce", "gtopk", P, 0, sent, received,
                                      BANDWIDTH_BPS, 2 * ALPHA_S)
        model = cost_model.network_s("allreduce", "gtopk", P, 0, sent, received, BANDWIDTH_BPS,
                                     2 * ALPHA_S)
        # _gtopkallreduce_model's intent: 2 log2 P messages, 4 log2 P rho m elements of 4 bytes
        paper = 2 * rounds * ALPHA_S + 4 * rounds * k * 4 * 9e-9
        print(f"| {name} | {n / 1e6:.2f}M | {1e3 * measured:.1f} | {1e3 * sim:.1f} | "
              f"{1e3 * model:.1f} | {1e3 * paper:.1f} | {measured / sim:.0f}x | "
              f"{1e9 * measured / n:.0f} |")


if __name__ == "__main__":
    main()
