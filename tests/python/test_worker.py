"""sparseps.Worker against a real job (scheduler and servers as daemons, workers as threads):
push_pull equals the C++ worker's (tests/python/replay_worker.cc) bitwise for every kind of
aggregation; nothing is lost between what was applied and the residuals; bad input is a clear
Python exception that leaves the job running."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sparseps
from sparseps import capi
from conftest import BUILD, run_threads

N = 1000  # parameters
STEPS = 12

BASE = """
train: {lr: 0.5, momentum: 0.9}
compression: {encoding: topk, density: 0.05}
cluster: {register_timeout_s: 60, request_timeout_s: 60}
"""


def initial():
    return ((np.arange(N) % 13) - 6).astype(np.float32) / 8


def gradient(rank, t):
    i = np.arange(N, dtype=np.int64)
    return (((i * 7919 + t * 104729 + rank * 1299709) % 41) - 20).astype(np.float32)


SETTINGS = {
    "ps_topk": [],
    "ps_topk_sampled_fp16": ["compression.selection=sampled_threshold",
                             "compression.fp16_values=true", "compression.varint_indices=true"],
    "ps_topk_server_topk": ["compression.server_topk=true"],
    "ps_dense": ["compression.encoding=dense"],
    "ps_sbc_local2": ["compression.encoding=sbc", "compression.local_iterations=2"],
    "ps_sketch_second_round": ["compression.encoding=sketch", "compression.sketch.second_round=true"],
    "allreduce_gtopk": ["aggregation=allreduce", "collective.algorithm=gtopk"],
    "allreduce_spardl": ["aggregation=allreduce", "collective.algorithm=spardl"],
    "allreduce_exdyna": ["aggregation=allreduce", "collective.algorithm=exdyna"],
    "allreduce_powersgd": ["aggregation=allreduce", "collective.algorithm=powersgd",
                           "collective.momentum=aggregated"],
    "allreduce_ring_aggregated": ["aggregation=allreduce", "collective.algorithm=ring",
                                  "collective.momentum=aggregated"],
}


def servers_for(sets):
    return 0 if "aggregation=allreduce" in sets else 2


def replay(c, sets, steps, final=False):
    """Runs two C++ workers (tests/python/replay_worker.cc) on job c: the job's parameters after
    each step per worker, and with final, each worker's parameters and residual once synchronized."""
    outs = [c.dir / f"cpp-{r}.bin" for r in range(2)]
    finals = [c.dir / f"cpp-final-{r}.bin" for r in range(2)]
    procs = [subprocess.Popen(
        [str(BUILD / "tests" / "replay_worker"), "--config", str(c.job), "--num-params", str(N),
         "--steps", str(steps), "--out", str(outs[r])] +
        (["--final-out", str(finals[r])] if final else []) +
        sum((["--set", s] for s in c.overrides + sets + [f"node.rank={r}"]), []),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    assert c.wait() == {k: 0 for k in c.wait()}
    steps_out = [np.fromfile(o, dtype=np.float32).reshape(steps, N) for o in outs]
    if not final:
        return steps_out
    return steps_out, [np.fromfile(f, dtype=np.float32).reshape(2, N) for f in finals]


def record_steps(w, rank, sets=()):
    """Trains w (any worker with sparseps.Worker's interface, initialised) for STEPS steps of
    gradient(rank, t), the sparse form at odd steps: (params before, update, params after) each.
    Where every step changes every key (ring, PowerSGD, SBC's local copy; PS dense pulls per key
    range, which the recorder takes as sparse) sparseps.Worker's sparse keys are one read-only
    array 0..N-1, every such step the same."""
    before = w.params()
    got = []
    every_key = []  # the keys of the dense steps' sparse results
    out = np.empty(N, dtype=np.float32)
    params_out = np.empty(N, dtype=np.float32)
    for t in range(STEPS):
        if t % 2:
            # The sparse form: the changed keys, the update and the new parameters there; with
            # `out` (t = 3, 7, 11) or `params_out` (t = 5, 9), where a dense step writes its update
            # or its new parameters instead (and returns None for the other).
            out.fill(np.nan)
            params_out.fill(np.nan)
            given = {3: {"out": out}, 1: {"params_out": params_out}}.get(t % 4, {}) if t > 1 else {}
            keys, values, now = w.push_pull(gradient(rank, t), sparse=True, **given)
            after = w.params()
            assert keys.dtype == np.int64 and np.all(np.diff(keys) > 0)
            if values is out or now is params_out:  # a dense step, into the caller's array
                assert len(keys) == N
                assert (values is out) == ("out" in given) and (values is None) != ("out" in given)
                assert (now is params_out) == ("params_out" in given)
                assert (now is None) != ("params_out" in given)
                if now is params_out:
                    np.testing.assert_array_equal(params_out, after)
            else:
                assert np.isnan(out).all() and np.isnan(params_out).all()  # left alone
                np.testing.assert_array_equal(now, after[keys])
                # sparseps.Worker: a dense method's step (its keys the read-only 0..N-1) takes them
                assert not given or keys.flags.writeable
            if not keys.flags.writeable:
                every_key.append(keys)
            update = None  # params_out alone: no update returned (after is checked)
            if values is not None:
                update = np.zeros(N, dtype=np.float32)
                update[keys] = values
        else:
            update = w.push_pull(gradient(rank, t), loss=1.0)
            after = w.params()
        got.append((before, update, after))
        before = after
    # sparseps.Worker after a dense method's steps: their keys are one read-only 0..N-1.
    assert all(k is every_key[0] for k in every_key) and all(len(k) == N for k in every_key)
    dense = any(s.endswith(("=powersgd", "=ring", "local_iterations=2")) for s in sets)
    assert bool(every_key) == (dense and not isinstance(w, capi.Worker)), (len(every_key), dense)
    return got


def assert_equals_cpp(name, sets, got, cpp):
    """Each worker's parameters after each step are the C++ worker's, bitwise, and the update is
    exactly what they moved by (but with SBC's local copy)."""
    sbc = "compression.encoding=sbc" in sets
    for r in range(2):
        for t, (before, update, after) in enumerate(got[r]):
            np.testing.assert_array_equal(after, cpp[r][t], err_msg=f"{name} worker {r} step {t}")
            if not sbc and update is not None:
                np.testing.assert_array_equal(update, before - after, err_msg=f"step {t}")


def equals_the_cpp_worker(cluster, name, make, check=lambda w, rank: None):
    """Two workers made by make(job, rank, overrides) (sparseps.Worker or capi.Worker) train as
    record_steps does; their parameters after every step are the C++ workers' on the same job,
    bitwise. check(w, rank) looks at a worker after its steps."""
    sets = SETTINGS[name]
    cpp = replay(cluster(BASE, servers=servers_for(sets), sets=sets), sets, STEPS)
    p = cluster(BASE, servers=servers_for(sets), sets=sets)

    def worker(rank):
        w = make(str(p.job), rank=rank, overrides=p.overrides + sets)
        w.init(initial())
        got = record_steps(w, rank, sets)
        check(w, rank)
        w.finish()
        return got

    got = run_threads([lambda r=r: worker(r) for r in range(2)])
    assert p.wait() == {k: 0 for k in p.wait()}
    assert_equals_cpp(name, sets, got, cpp)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_push_pull_equals_the_cpp_worker_bitwise(cluster, name):
    equals_the_cpp_worker(cluster, name, sparseps.Worker)


@pytest.mark.parametrize("name", ["ps_topk", "ps_topk_server_topk", "ps_dense",
                                  "ps_sketch_second_round", "ps_topk_abort", "ps_topk_warmup3"])
def test_delay_is_the_same_iterations_one_step_later(cluster, name):
    """train.overlap: delay with gradients that do not depend on the parameters: the servers apply
    the same iterations as without it, each one step later. After step t a delayed worker holds
    the parameters a worker without the delay held after step t - 1 (bitwise); once synchronized,
    its parameters and residual are those of the run without it (nothing lost or added).
    ps_topk_abort: cluster.on_worker_failure: abort, where the pulls leave with the pushes.
    ps_topk_warmup3: train.delay_warmup_steps 3, the first 3 steps as without the delay."""
    warmup = 3 if name == "ps_topk_warmup3" else 0
    sets = (["cluster.on_worker_failure=abort"] if name == "ps_topk_abort"
            else [] if name == "ps_topk_warmup3" else SETTINGS[name])
    plain, plain_final = replay(cluster(BASE, servers=2, sets=sets), sets, STEPS, final=True)
    delayed_sets = sets + ["train.overlap=delay", f"train.delay_warmup_steps={warmup}"]
    delayed, delayed_final = replay(cluster(BASE, servers=2, sets=delayed_sets), delayed_sets,
                                    STEPS, final=True)
    for r in range(2):
        if warmup == 0:
            np.testing.assert_array_equal(delayed[r][0], initial(), err_msg=f"worker {r} step 0")
        for t in range(warmup):
            np.testing.assert_array_equal(delayed[r][t], plain[r][t],
                                          err_msg=f"worker {r} step {t} (warm-up)")
        for t in range(max(warmup, 1), STEPS):
            np.testing.assert_array_equal(delayed[r][t], plain[r][t - 1],
                                          err_msg=f"worker {r} step {t}")
        np.testing.assert_array_equal(delayed_final[r][0], plain[r][STEPS - 1])
        np.testing.assert_array_equal(delayed_final[r][0], plain_final[r][0])
        np.testing.assert_array_equal(delayed_final[r][1], plain_final[r][1],
                                      err_msg=f"worker {r}'s residual")


def test_delay_is_refused_in_a_python_loop(cluster):
    """push_pull returns the update of the gradient it was given: the one-step delay is the C++
    worker's loop's, and the Python module says so."""
    c = cluster(BASE, servers=2)
    with pytest.raises(ValueError, match="train.overlap: delay is for the C\\+\\+ worker"):
        sparseps.Worker(str(c.job), rank=0, overrides=c.overrides + ["train.overlap=delay"])


def test_sbc_update_moves_the_local_copy(cluster):
    """SBC trains a local copy between pushes: the update takes the model from one local copy to
    the next (lr * velocity between pushes), and to the job's parameters at a push."""
    sets = SETTINGS["ps_sbc_local2"]
    c = cluster(BASE, sets=sets)

    def worker(rank):
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets)
        model = initial()
        w.init(model)
        assert w.live_workers == [0, 1]
        assert w.is_leader == (rank == 0)
        pushes = 0
        for t in range(4):
            model = model - w.push_pull(gradient(rank, t))
            if t % 2 == 1:  # a push: the model holds the job's parameters again (to rounding)
                np.testing.assert_allclose(model, w.params(), rtol=0, atol=1e-5)
                pushes += 1
        w.finish()
        return pushes

    # Both workers ran their loop to the end, every check included.
    assert run_threads([lambda r=r: worker(r) for r in range(2)]) == [2, 2]


@pytest.mark.parametrize("aggregation", ["ps", "ps_overlap", "allreduce", "ring_overlap"])
def test_conservation_with_integer_gradients(cluster, aggregation):
    """momentum 0, lr = W: init - params + the workers' residuals == every gradient pushed, exactly
    (integers in float), and entries were applied every step. ps_overlap: train.overlap: backward,
    a compressor per server key range (each selects density * its size) pushing range by range."""
    sets = ["train.momentum=0", "train.lr=2"]
    if aggregation == "ps_overlap":
        sets += ["train.overlap=backward"]
    if aggregation == "ring_overlap":  # dense: nothing held back, every key applied
        sets += ["train.overlap=backward", "aggregation=allreduce", "collective.algorithm=ring"]
    if aggregation == "allreduce":
        sets += ["aggregation=allreduce", "collective.algorithm=topk_allgather"]
    c = cluster(BASE, servers=servers_for(sets), sets=sets)
    pushed = np.zeros(N, dtype=np.float64)

    def worker(rank):
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets)
        w.init(np.zeros(N, dtype=np.float32))
        applied = []
        for t in range(10):
            update = w.push_pull(gradient(rank, t))
            applied.append(int(np.count_nonzero(update)))
        residual = w.residual().astype(np.float64)
        params = w.params().astype(np.float64)
        w.finish()
        return residual, params, applied

    out = run_threads([lambda r=r: worker(r) for r in range(2)])
    for r in range(2):
        for t in range(10):
            pushed[:] += gradient(r, t)
    params = out[0][1]
    np.testing.assert_array_equal(out[1][1], params)  # every worker holds the same parameters
    np.testing.assert_array_equal(-params + out[0][0] + out[1][0], pushed)
    for r in range(2):
        # k = 50 per worker: the union of two selections, 50 to 100 keys per step; dense: all
        # keys whose summed gradient is not zero.
        lo, hi = (50, 100) if aggregation != "ring_overlap" else (N // 2, N)
        assert all(lo <= a <= hi for a in out[r][2]), out[r][2]


@pytest.mark.parametrize("consistency", ["ssp", "async", "ssp_overlap"])
def test_stale_workers_conserve_and_synchronize_to_one_model(cluster, consistency):
    """train.consistency ssp (staleness 1) / async with worker 1 slower: each push is applied on
    its own, so until synchronize the workers hold different parameters; after it both hold the
    same, and init - params + the residuals == every gradient pushed, exactly. ssp_overlap: with
    train.overlap: backward (a compressor and a push per key range)."""
    overlap = consistency.endswith("_overlap")
    consistency = consistency.removesuffix("_overlap")
    sets = ["train.momentum=0", "train.lr=2", f"train.consistency={consistency}",
            "train.staleness=1", f"train.overlap={'backward' if overlap else 'none'}"]
    c = cluster(BASE, servers=2, sets=sets)
    fast_done = threading.Event()

    def worker(rank):
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets)
        w.init(np.zeros(N, dtype=np.float32))
        for t in range(10):
            if rank == 1:
                time.sleep(0.02)
                if t == 9:  # worker 0 ends first (it may, its last pull waits for push 8 only)
                    assert fast_done.wait(60)
            w.push_pull(gradient(rank, t))
        if rank == 0:
            fast_done.set()
        before = w.params().astype(np.float64)
        params = w.synchronize().astype(np.float64)
        residual = w.residual().astype(np.float64)
        w.finish()
        return residual, params, before

    out = run_threads([lambda r=r: worker(r) for r in range(2)])
    pushed = sum(gradient(r, t).astype(np.float64) for r in range(2) for t in range(10))
    np.testing.assert_array_equal(out[1][1], out[0][1])
    np.testing.assert_array_equal(-out[0][1] + out[0][0] + out[1][0], pushed)
    # The slow worker pushed last: it held the final parameters before synchronize already.
    np.testing.assert_array_equal(out[1][2], out[1][1])
    # Worker 0 ended without worker 1's last push: synchronize brought it.
    assert not np.array_equal(out[0][2], out[0][1])
    assert c.wait() == {name: 0 for name, _ in c.procs}


def test_bad_input_is_a_clear_exception_and_the_job_goes_on(cluster):
    c = cluster(BASE)
    good = {}

    def worker(rank):
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides)
        with pytest.raises(sparseps.Error, match="call init"):
            w.push_pull(np.zeros(N, dtype=np.float32))
        w.init(initial())
        if rank == 0:
            with pytest.raises(ValueError, match="float32"):
                w.push_pull(np.zeros(N, dtype=np.float64))
            with pytest.raises(ValueError, match="1001 elements; init's params had 1000"):
                w.push_pull(np.zeros(N + 1, dtype=np.float32))
            with pytest.raises(ValueError, match="not contiguous"):
                w.push_pull(np.zeros(2 * N, dtype=np.float32)[::2])
            with pytest.raises(ValueError, match="not laid out as init's params"):
                w.push_pull([np.zeros(N - 1, dtype=np.float32), np.zeros(1, dtype=np.float32)])
            with pytest.raises(ValueError, match="expected a float32 tensor or array"):
                w.push_pull("gradient")
            nan = gradient(0, 0)
            nan[17] = np.nan
            with pytest.raises(ValueError, match="NaN or Inf"):
                w.push_pull(nan)
            with pytest.raises(sparseps.Error, match="init was called already"):
                w.init(initial())
            g = gradient(0, 0)
            with pytest.raises(ValueError, match="out is for sparse=True"):
                w.push_pull(g, out=np.empty(N, dtype=np.float32))
            with pytest.raises(ValueError, match="params_out has 1001 elements; it takes"):
                w.push_pull(g, sparse=True, params_out=np.empty(N + 1, dtype=np.float32))
            with pytest.raises(ValueError, match="out shares memory with grads"):
                w.push_pull(g, sparse=True, out=g)
            same = np.empty(N, dtype=np.float32)
            with pytest.raises(ValueError, match="out and params_out are the same array"):
                w.push_pull(g, sparse=True, out=same, params_out=same)
            with pytest.raises(ValueError, match="out has 999 elements; it takes the model's 1000"):
                w.push_pull(g, sparse=True, out=np.empty(N - 1, dtype=np.float32))
            frozen = np.empty(N, dtype=np.float32)
            frozen.setflags(write=False)
            with pytest.raises(ValueError, match="out is read-only"):
                w.push_pull(g, sparse=True, out=frozen)
        # The job goes on: a good push_pull on both workers.
        good[rank] = w.push_pull(gradient(rank, 0))
        w.finish()

    run_threads([lambda r=r: worker(r) for r in range(2)])
    assert np.count_nonzero(good[0]) > 0
    np.testing.assert_array_equal(good[0], good[1])
    assert c.wait() == {k: 0 for k in c.wait()}


def test_run_threads_fails_on_a_thread_still_running_or_raising():
    """The helper every multi-worker test here uses: a hung thread is a failure, not a None."""
    assert run_threads([lambda: 1, lambda: 2]) == [1, 2]
    with pytest.raises(AssertionError, match=r"threads \[1\] of 2 still running after 0.5 s"):
        run_threads([lambda: 1, lambda: time.sleep(3)], timeout_s=0.5)

    def fails():
        raise KeyError("in a thread")

    with pytest.raises(KeyError, match="in a thread"):
        run_threads([lambda: 1, fails])


def test_bad_config_is_a_value_error_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: fast\n")
    with pytest.raises(ValueError, match=r"bad.yaml:2:.*train.lr"):
        sparseps.Worker(str(bad))
    with pytest.raises(ValueError, match="weight_decay"):
        sparseps.Worker("", overrides=["train.weight_decay=0.1"])


def test_a_missing_scheduler_is_a_timeout_naming_it():
    w = sparseps.Worker("", overrides=["cluster.scheduler_port=1", "cluster.register_timeout_s=0.5"])
    with pytest.raises(TimeoutError, match="membership"):
        w.init(initial())


def test_a_stopped_worker_is_told_it_is_out_of_the_job_and_the_job_goes_on(cluster):
    """A Python loop (through sparseps.capi) stopped with SIGSTOP for longer than
    cluster.heartbeat_timeout_s: the scheduler removes it; continued, its next call raises
    capi.Lost (code LOST, a capi.Error) saying it was removed and why, not that the scheduler
    died (the time it was stopped is not the scheduler's silence); worker 0 trains on alone to
    the end and the job ends well, listing worker 1 as lost. The module's sparseps.Lost, and the
    exit code 3 that launch.sh lets go: tests/python/test_torch_checkpoint.py."""
    steps = 120
    c = cluster(BASE, sets=["cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=3"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"),
                                                      str(pathlib.Path(__file__).parent)]))
    script = pathlib.Path(__file__).parent / "loop_worker.py"
    victim = subprocess.Popen([sys.executable, str(script), str(c.job), "1", str(steps),
                               str(c.dir / "victim.bin"), "--capi"] + c.overrides,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def worker0():
        w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides)
        params = initial()
        w.init(params)
        for t in range(steps):
            params -= w.push_pull(gradient(0, t))
            time.sleep(0.05)  # still training when worker 1 runs again
        w.finish()
        return w.step

    done = {}
    thread = threading.Thread(target=lambda: done.update(step=worker0()))
    thread.start()
    try:
        lines = []
        for line in victim.stdout:
            lines.append(line)
            if line.strip() == "step 5":
                break
        assert lines and lines[-1].strip() == "step 5", "".join(lines)
        victim.send_signal(signal.SIGSTOP)
        time.sleep(5)
        victim.send_signal(signal.SIGCONT)
        out, _ = victim.communicate(timeout=60)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    thread.join(timeout=120)
    assert victim.returncode != 0, out
    assert "sparseps.capi.Lost: removed from the job: worker 1 (" in out, out
    assert "sent no heartbeat for" in out and "the others went on without it" in out, out
    assert done.get("step") == steps, "worker 0 failed (its exception is above)"
    assert c.wait() == {"scheduler": 0, "server-0": 0, "server-1": 0}
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [w["rank"] for w in summary["lost_workers"]] == [1], summary


@pytest.mark.parametrize("backend", ["module", "capi"])
def test_a_killed_python_worker_is_replaced_by_one_that_rejoins(cluster, backend):
    """A Python loop killed with kill -9 mid-job is replaced by another (node.rejoin=true, its
    rank): init gives it the join iteration J as its step and the job's parameters there; it
    trains from J to the end, the other worker never stops, and both end with the same
    parameters; summary.json lists the replacement. Worker 0, the leader, is the replacement's
    donor after iteration J: through the module its loop hands nothing over (the replacement is
    told so at worker 0's next push_pull and goes on at once); through sparseps.capi it hands
    over a state and its parameters, which the replacement gets as they were sent. Worker 0's
    data_split follows the membership: alone from the loss, both again from the join."""
    steps = 120
    c = cluster(BASE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"),
                                                      str(pathlib.Path(__file__).parent)]))
    script = pathlib.Path(__file__).parent / "loop_worker.py"

    def start(rank, out, extra=()):
        binding = ["--capi"] if backend == "capi" else []
        return subprocess.Popen([sys.executable, str(script), str(c.job), str(rank), str(steps),
                                 str(out)] + binding + c.overrides + list(extra),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)

    def worker0():
        w = (sparseps.Worker if backend == "module" else capi.Worker)(
            str(c.job), rank=0, overrides=c.overrides)
        params = initial()
        w.init(params)
        for t in range(steps):
            params -= w.push_pull(gradient(0, t))
            if w.handoff_due:
                done.setdefault("handoff_due", []).append(w.step)
                if backend == "capi":  # the module's loop hands nothing over
                    try:  # a model of another size is refused, and the hand-over stays due
                        w.send_handoff(b"x", model=np.zeros(3, dtype=np.float32))
                    except ValueError as e:
                        done["refused"] = str(e)
                    assert w.handoff_due
                    w.send_handoff(f"state of step {w.step}".encode(), model=w.params())
                    done["sent_sum"] = float(w.params().astype(np.float64).sum())
            time.sleep(0.05)  # slower than worker 1: the replacement joins long before the end
        final = w.params()
        done["splits"] = [w.data_split(t) for t in range(steps + 1)]
        w.finish()
        return final

    done = {}
    thread = threading.Thread(target=lambda: done.update(params=worker0()))
    thread.start()
    victim = start(1, c.dir / "lost.bin")
    lines = []
    for line in victim.stdout:
        lines.append(line)
        if line.strip() == "step 10":  # (the log lines come first)
            break
    victim.kill()
    victim.wait()
    assert lines and lines[-1].strip() == "step 10", "".join(lines)
    replacement = start(1, c.dir / "replacement.bin", ["node.rejoin=true"])
    out, _ = replacement.communicate(timeout=120)
    thread.join(timeout=120)
    assert replacement.returncode == 0, out
    assert "params" in done, "worker 0 failed (its exception is above)"
    first = next(line for line in out.splitlines() if line.startswith("start ")).split()
    assert first[2] == "1", out  # rejoined
    joined = int(first[1])
    assert 10 <= joined < steps, out
    assert out.splitlines()[-1] == f"step {steps}", out
    # Worker 0, the leader, was to hand its loop's state over after the join iteration.
    assert done["handoff_due"] == [joined + 1], done["handoff_due"]
    if backend == "module":  # none sent: its next push_pull told the replacement
        assert "handoff 0 '' None ''" in out.splitlines(), out
    else:
        assert "the hand-over's model has 3 elements; the job has 1000" in done["refused"]
        assert f"handoff 0 'state of step {joined + 1}' {done['sent_sum']!r} ''" in \
            out.splitlines(), out
    assert c.wait() == {k: 0 for k in c.wait()}
    np.testing.assert_array_equal(np.fromfile(c.dir / "replacement.bin", dtype=np.float32),
                                  done["params"])
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [(j["rank"], int(j["iteration"])) for j in summary["joined_workers"]] == [(1, joined)]
    # data_split: worker 0 alone (index 0 of 1) in epochs that begin after the loss, both again
    # in those that begin after the join iteration.
    lost = int(summary["lost_workers"][0]["iteration"])
    assert done["splits"] == [(0, 2)] * (lost + 1) + [(0, 1)] * (joined - lost) + \
        [(0, 2)] * (steps - joined), (lost, joined, done["splits"])


@pytest.mark.parametrize("backend", ["module", "capi"])
def test_a_replacement_that_comes_as_the_job_ends_has_nothing_to_join(cluster, backend, capfd):
    """A replacement (node.rejoin=true) that registers once worker 0 is done, while worker 1 is
    still at its last step: init raises sparseps.JobEnded (nothing to join, nothing failed: a
    SystemExit with code 0, so an uncaught one ends the script with exit code 0, as launch.sh's
    replacement needs), not an error; the job then ends well. One that comes after the
    scheduler exited raises Lost (exit code 3, which launch.sh lets go after the end) once the
    port refused it for cluster.heartbeat_timeout_s, not a registration timeout after 70 s.
    (The scheduler's side: tests/scheduler/scheduler_test.cc.)"""
    c = cluster(BASE, sets=["cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=2"])
    make = sparseps.Worker if backend == "module" else capi.Worker
    module = sparseps if backend == "module" else capi
    replacement_tried = threading.Event()

    def worker(rank):
        w = make(str(c.job), rank=rank, overrides=c.overrides)
        params = initial()
        w.init(params)
        for t in range(5):
            params -= w.push_pull(gradient(rank, t))
        if rank == 1:  # still at its last step while the replacement comes
            assert replacement_tried.wait(120)
        w.finish()
        return w.step

    def replacement():
        time.sleep(1)  # worker 0's DONE first (else it waits for worker 1 and is told as well)
        w = make(str(c.job), rank=1, overrides=c.overrides + ["node.rejoin=true"])
        try:
            with pytest.raises(sparseps.JobEnded, match="ended before this replacement worker") \
                    as ended:
                w.init(initial())
        finally:
            replacement_tried.set()
        assert isinstance(ended.value, SystemExit) and ended.value.code == 0
        assert module.JobEnded is sparseps.JobEnded  # one class, through both bindings
        return "told"

    assert run_threads([lambda: worker(0), lambda: worker(1), replacement]) == [5, 5, "told"]
    assert c.wait() == {"scheduler": 0, "server-0": 0, "server-1": 0}
    # The client's log says why (the scheduler's SHUTDOWN).
    assert "could join (nothing to join: the job's workers are finishing (worker 0" in \
        capfd.readouterr().out
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and not summary.get("joined_workers"), summary
    # After the end: no scheduler listens any more.
    late = make(str(c.job), rank=1, overrides=c.overrides + ["node.rejoin=true",
                                                             "cluster.heartbeat_timeout_s=2"])
    started = time.monotonic()
    with pytest.raises(module.Lost, match=r"no scheduler at .* refused this replacement's "
                                          r"connections.*has the job ended"):
        late.init(initial())
    assert time.monotonic() - started < 30  # not the 70 s registration deadline
    # Uncaught, JobEnded ends a script with exit code 0 and nothing on stderr.
    env = dict(os.environ, PYTHONPATH=str(BUILD / "python"))
    p = subprocess.run([sys.executable, "-c", "import sparseps; raise sparseps.JobEnded('x')"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr


def test_local_rank_reads_the_launchers_variables_in_order():
    """sparseps.local_rank (one function through both bindings): the first of
    SPARSEPS_LOCAL_RANK, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID that is set (an
    empty one is unset), 0 without any, as sparseps-worker reads them (PickCudaDevice); a value
    that is not a non-negative integer is refused naming it."""
    assert capi.local_rank is sparseps.local_rank
    assert sparseps.local_rank({}) == 0
    env = {"SLURM_LOCALID": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "LOCAL_RANK": ""}
    assert sparseps.local_rank(env) == 3
    env["LOCAL_RANK"] = "2"
    assert sparseps.local_rank(env) == 2
    env["SPARSEPS_LOCAL_RANK"] = "1"
    assert sparseps.local_rank(env) == 1
    for bad in ("-1", "one", " 1", "\u0661"):  # the last: an Arabic-Indic digit one
        with pytest.raises(ValueError, match=r"env SPARSEPS_LOCAL_RANK="):
            sparseps.local_rank({"SPARSEPS_LOCAL_RANK": bad, "LOCAL_RANK": "0"})


@pytest.mark.parametrize("kind", ["module", "capi"])
def test_ctrl_c_ends_a_blocking_call_at_once(kind):
    """SIGINT during a wait (here for a scheduler that never answers, 70 s deadline) ends it at
    once as KeyboardInterrupt, as it would any Python call; through the module or sparseps.capi."""
    make = sparseps.Worker if kind == "module" else capi.Worker
    w = make("", overrides=["cluster.scheduler_port=1", "cluster.register_timeout_s=60"])
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="stopped by a signal"):
        w.init(initial())
    assert time.monotonic() - start < 20
    timer.join()


@pytest.mark.parametrize("aggregation", ["ps", "allreduce"])
def test_a_python_loop_resumes_from_a_checkpoint_bitwise(cluster, aggregation):
    """Three workers with integer-valued gradients (sums exact in any order): a job stopped after
    9 steps and resumed from its newest complete checkpoint ends with the parameters and residuals
    of a job never stopped; worker 0 writes the model file with the tensors' names."""
    _resume_case(cluster, aggregation)


def _resume_case(cluster, aggregation):
    # momentum 0 and lr = W: every value an integer in float, exact whatever the order of the sums.
    sets = ["train.momentum=0", "train.lr=3", "checkpoint.every_steps=4", "checkpoint.keep=0"]
    if aggregation == "allreduce":
        sets += ["aggregation=allreduce", "collective.algorithm=topk_allgather"]
    servers = servers_for(sets)
    total = 12

    def run(c, extra, stop_after=None):
        def worker(rank):
            w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets + extra)
            w.init([np.zeros(N - 10, dtype=np.float32), np.zeros(10, dtype=np.float32)],
                   names=["layer.weight", "layer.bias"])
            start = w.step
            for t in range(start, total):
                w.push_pull([gradient(rank, t)[:N - 10], gradient(rank, t)[N - 10:]])
                if stop_after is not None and t + 1 == stop_after:
                    return start, None, None  # the process "dies": no finish
            out = (start, w.params(), w.residual())
            w.finish()
            return out
        return run_threads([lambda r=r: worker(r) for r in range(3)])

    whole = cluster(BASE, servers=servers, workers=3, sets=sets)
    a = run(whole, [])
    cut = cluster(BASE, servers=servers, workers=3, sets=sets)
    run(cut, [], stop_after=9)
    cut.stop()
    manifests = sorted((cut.run_dir / "checkpoints").glob("iter-*/MANIFEST.json"))
    assert manifests, "no complete checkpoint after 9 steps"
    newest = int(manifests[-1].parent.name[5:])
    resume = [f"checkpoint.dir={cut.run_dir / 'checkpoints'}", "checkpoint.resume=true"]
    again = cluster(BASE, servers=servers, workers=3, sets=sets + resume)
    b = run(again, resume)
    for r in range(3):
        assert b[r][0] == newest  # w.step after init: the checkpoint's
        np.testing.assert_array_equal(b[r][1], a[r][1])
        np.testing.assert_array_equal(b[r][2], a[r][2])
    model = again.run_dir / "model.safetensors"
    raw = model.read_bytes()
    header = __import__("json").loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["layer.weight"]["shape"] == [N - 10]
    assert header["layer.bias"]["shape"] == [10]
    assert header["__metadata__"]["iteration"] == str(total)


def test_a_python_loop_rolls_back_when_a_server_is_replaced(cluster):
    """Server 0 killed with kill -9 mid-job and replaced (--rejoin): every Python worker's
    push_pull raises sparseps.RolledBack once it is back at the newest complete checkpoint (step
    and params() are its); each loop goes on from step and the job ends with the parameters and
    residuals of a job never interrupted, bitwise (integer gradients, exact sums)."""
    sets = ["train.momentum=0", "train.lr=2", "checkpoint.every_steps=4", "checkpoint.keep=0"]
    total = 24

    def run(c, kill_at=None):
        rolled = {}

        def worker(rank):
            w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets)
            w.init(np.zeros(N, dtype=np.float32))
            t = w.step
            while t < total:
                try:
                    w.push_pull(gradient(rank, t))
                    t += 1
                except sparseps.RolledBack:
                    rolled[rank] = (t, w.step)
                    t = w.step  # the loop's own state of that step: here, only its position
                if rank == 0 and kill_at is not None and t == kill_at:
                    c.kill("server-0")
                    c.start_server(0, ["--rejoin"])
                time.sleep(0.02)
            out = (w.params(), w.residual())
            w.finish()
            return out
        return run_threads([lambda r=r: worker(r) for r in range(2)], timeout_s=240), rolled

    whole, _ = run(cluster(BASE, sets=sets))
    cut = cluster(BASE, sets=sets)
    again, rolled = run(cut, kill_at=10)
    codes = cut.wait()
    assert codes.pop("server-0") == -9 and codes == {k: 0 for k in codes}, codes
    assert sorted(rolled) == [0, 1], rolled
    for rank, (at, back_to) in rolled.items():
        assert back_to % 4 == 0 and 0 < back_to <= at, rolled  # a checkpoint's step
    for r in range(2):
        np.testing.assert_array_equal(again[r][0], whole[r][0])
        np.testing.assert_array_equal(again[r][1], whole[r][1])
    summary = json.loads((cut.run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [s["rank"] for s in summary["replaced_servers"]] == [0], summary


def test_python_workers_serve_live_metrics(cluster):
    """metrics.port: each sparseps.Worker serves /metrics at port + 1 + num_servers + rank, as
    sparseps-worker does: after 5 push_pull calls the step counter, iteration, the loss given, the
    selected density (k = 50 of 1000), the compute time between calls (the loop sleeps 20 ms) and
    the bytes sent. Scraped over HTTP while the workers are still in the job."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "deploy"))
    import test_metrics as live  # free_base, scrape, value (the daemons' metrics test)

    base = live.free_base(5)
    c = cluster(BASE)
    scraped = [None, None]
    barrier = threading.Barrier(2)

    def worker(rank):
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + [
            f"metrics.port={base}", "metrics.host=127.0.0.1"])
        w.init(np.zeros(N, dtype=np.float32))
        w.set_epoch(1)
        for t in range(5):
            time.sleep(0.02)
            w.push_pull(gradient(rank, t), loss=1.5 + t)
        scraped[rank] = live.scrape(base + 3 + rank)
        barrier.wait(60)  # both scraped before either leaves the job
        w.finish()

    run_threads([lambda r=r: worker(r) for r in range(2)])
    for rank in range(2):
        s = scraped[rank]
        labels = {"role": "worker", "rank": rank}
        assert live.value(s, "sparseps_worker_steps_total", **labels) == 5
        assert live.value(s, "sparseps_worker_iteration", **labels) == 5
        assert live.value(s, "sparseps_worker_epoch", **labels) == 2
        assert live.value(s, "sparseps_worker_loss", **labels) == 5.5
        assert live.value(s, "sparseps_worker_selected_density", **labels) == 0.05
        assert live.value(s, "sparseps_worker_compute_seconds_count", **labels) == 5
        # The first call has no loop time before it; the other 4 follow a 20 ms sleep.
        assert live.value(s, "sparseps_worker_compute_seconds_sum", **labels) >= 4 * 0.02
        assert live.value(s, "sparseps_worker_sent_bytes_total", type="push", **labels) > 0


@pytest.mark.parametrize("backend", ["module", "capi"])
def test_report_evaluation_sets_the_live_test_accuracy_and_finishs_default(cluster, backend):
    """A loop's report_evaluation(accuracy): the live metrics' sparseps_worker_test_accuracy
    gauge (scraped over HTTP, as the Grafana dashboard reads it; -1 before any), and the final
    accuracy in summary.json when finish() is given none; an accuracy outside [0, 1] is a
    ValueError that changes nothing; a report before init is the binding's Error."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "deploy"))
    import test_metrics as live  # free_base, scrape, value (the daemons' metrics test)

    base = live.free_base(5)
    c = cluster(BASE)
    make = sparseps.Worker if backend == "module" else capi.Worker
    sets = c.overrides + [f"metrics.port={base}", "metrics.host=127.0.0.1"]
    scraped = {}

    def worker(rank):
        w = make(str(c.job), rank=rank, overrides=sets)
        if rank == 0:
            error = sparseps.Error if backend == "module" else capi.Error
            with pytest.raises(error, match="call init"):
                w.report_evaluation(0.5)
        w.init(initial())
        w.push_pull(gradient(rank, 0))
        if rank == 0:
            port = base + 3  # after the scheduler's and the 2 servers'
            scraped["before"] = live.value(live.scrape(port), "sparseps_worker_test_accuracy")
            w.report_evaluation(0.8125)
            with pytest.raises(ValueError, match="test accuracy 1.5.*a fraction in \\[0, 1\\]"):
                w.report_evaluation(1.5)
            scraped["after"] = live.value(live.scrape(port), "sparseps_worker_test_accuracy")
        w.finish()
    run_threads([lambda r=r: worker(r) for r in range(2)])
    assert scraped == {"before": -1, "after": 0.8125}
    assert c.wait() == {k: 0 for k in c.wait()}  # the scheduler wrote summary.json and left
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert summary["final_test_accuracy"] == 0.8125, summary


@pytest.mark.parametrize("backend", ["module", "capi"])
def test_a_worker_closed_by_its_with_block_leaves_the_job(cluster, backend):
    """`with Worker(...) as w:` closes the worker at the block's end, here an exception after 3
    steps: the worker leaves the job, the other goes on without it (cluster.on_worker_failure:
    continue) and ends well; a call on the closed worker is a ValueError saying so, and closing
    again does nothing."""
    c = cluster(BASE)
    make = sparseps.Worker if backend == "module" else capi.Worker
    closed = {}

    def leaver():
        try:
            with make(str(c.job), rank=1, overrides=c.overrides) as w:
                w.init(initial())
                for t in range(3):
                    w.push_pull(gradient(1, t))
                raise RuntimeError("the loop failed")
        except RuntimeError as e:
            closed["error"] = str(e)
        with pytest.raises(ValueError, match="closed"):
            w.push_pull(gradient(1, 3))
        with pytest.raises(ValueError, match="closed"):
            w.step
        w.close()

    def stayer():
        w = make(str(c.job), rank=0, overrides=c.overrides)
        w.init(initial())
        for t in range(10):
            w.push_pull(gradient(0, t))
        closed["live"] = w.live_workers
        w.finish()

    run_threads([stayer, leaver])
    assert closed == {"error": "the loop failed", "live": [0]}
    assert c.wait() == {k: 0 for k in c.wait()}  # the scheduler wrote summary.json and left
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [w["rank"] for w in summary["lost_workers"]] == [1], summary


def three_steps_then(c, sets, before_finish):
    """Workers 0 and 1 of job c (with the overrides `sets`) each take 3 steps, then call
    before_finish(rank) and finish(); returns {rank: (the error finish raised or None, when finish
    returned: time.monotonic())}."""
    ends = {}

    def worker(rank):
        w = sparseps.Worker(str(c.job), rank=rank, overrides=c.overrides + sets)
        w.init(initial())
        for t in range(3):
            w.push_pull(gradient(rank, t))
        before_finish(rank)
        error = None
        try:
            w.finish()
        except (sparseps.Error, TimeoutError) as e:
            error = str(e)
        ends[rank] = (error, time.monotonic())

    run_threads([lambda r=r: worker(r) for r in range(2)])
    return ends


def test_a_leader_working_past_the_request_timeout_after_its_last_step_ends_well(cluster):
    """The leader's work after its last step (a final evaluation, saving the model) takes longer
    than cluster.request_timeout_s: the worker that finished first waits for the SHUTDOWN as long
    as the end of a BSP job may take (cluster.barrier_timeout_s), not request_timeout_s, and the
    job ends well for both."""
    sets = ["cluster.request_timeout_s=3"]
    c = cluster(BASE, sets=sets)
    leader_finishing = []

    def before_finish(rank):
        if rank == 0:
            time.sleep(8)  # the final evaluation
            leader_finishing.append(time.monotonic())

    ends = three_steps_then(c, sets, before_finish)
    assert ends[0][0] is None and ends[1][0] is None, ends
    assert ends[1][1] >= leader_finishing[0], ends  # worker 1 waited for the leader's DONE
    assert c.wait() == {k: 0 for k in c.wait()}
    summary = json.loads((c.run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and not summary.get("lost_workers"), summary


def test_a_worker_that_does_not_finish_within_the_barrier_timeout_is_named(cluster):
    """In BSP the end of training is a barrier: once a worker sent DONE, the others have
    cluster.barrier_timeout_s for theirs, and then the scheduler ends the job naming who did not
    finish, which the waiting worker's error says too."""
    sets = ["cluster.barrier_timeout_s=6"]
    c = cluster(BASE, sets=sets)
    waited = []

    def before_finish(rank):
        if rank == 0:  # until the job has ended without it
            deadline = time.monotonic() + 60
            while c.procs[0][1].poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            waited.append(c.procs[0][1].poll() is not None)

    errors = {rank: error for rank, (error, _) in three_steps_then(c, sets, before_finish).items()}
    assert waited == [True], "the scheduler did not end the job"
    assert "end of training" in (errors[1] or "") and "worker 0" in errors[1], errors
    assert errors[0] is not None, errors  # the job had ended when the leader got to its finish
    codes = c.wait()
    assert codes["scheduler"] != 0, codes
    assert "worker 0" in c.log("scheduler")
