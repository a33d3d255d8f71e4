"""A Python training loop as a process of its own, for tests that kill one (test_worker.py):
joins the job as worker RANK, trains to STEPS steps of test_worker.gradient from where init puts
it (0, a checkpoint's step, or a replacement's join iteration), printing "start STEP REJOINED"
and then "step N" after each step (a replacement, "handoff FROM STATE_BYTES NO_MODEL MISSING"
before its second), and writes the final parameters to OUT (float32).

    loop_worker.py JOB RANK STEPS OUT [key=value ...]
"""
import sys


import sparseps
from test_worker import gradient, initial


def main():
    job, rank, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    w = sparseps.Worker(job, rank=rank, overrides=sys.argv[5:])
    params = initial()
    w.init(params)
    print("start", w.step, int(w.rejoined), flush=True)
    for t in range(w.step, steps):
        if w.handoff_expected:  # a replacement, after its first step: its donor's loop state
            got = w.receive_handoff()
            print("handoff", got["from"], len(got["state"]), got["model"] is None,
                  repr(got["missing"]), flush=True)
        params -= w.push_pull(gradient(rank, t))
        print("step", t + 1, flush=True)
    final = w.params()
    w.finish()
    final.tofile(out)


if __name__ == "__main__":
    main()
