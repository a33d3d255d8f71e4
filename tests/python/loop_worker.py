"""A Python training loop as a process of its own, for tests that kill one (test_worker.py):
joins the job as worker RANK, trains to STEPS steps of test_worker.gradient from where init puts
it (0, a checkpoint's step, or a replacement's join iteration), printing "start STEP REJOINED"
and then "step N" after each step (a replacement, "handoff FROM STATE MODEL_SUM MISSING" before
its second: the donor's state as text, the sum of its model or None), and writes the final
parameters to OUT (float32). --capi: through sparseps.capi instead of the pybind11 module.

    loop_worker.py JOB RANK STEPS OUT [--capi] [key=value ...]
"""
import sys


import sparseps
from sparseps import capi
from test_worker import gradient, initial


def main():
    job, rank, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    sets = sys.argv[5:]
    make = sparseps.Worker
    if sets[:1] == ["--capi"]:
        make, sets = capi.Worker, sets[1:]
    w = make(job, rank=rank, overrides=sets)
    params = initial()
    w.init(params)
    print("start", w.step, int(w.rejoined), flush=True)
    for t in range(w.step, steps):
        if w.handoff_expected:  # a replacement, after its first step: its donor's loop state
            got = w.receive_handoff()
            model = None if got["model"] is None else float(got["model"].astype("float64").sum())
            print("handoff", got["from"], repr(got["state"].decode()), model,
                  repr(got["missing"]), flush=True)
        params -= w.push_pull(gradient(rank, t))
        print("step", t + 1, flush=True)
    final = w.params()
    w.finish()
    final.tofile(out)


if __name__ == "__main__":
    main()
