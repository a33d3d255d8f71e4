"""sparseps.torch.DistributedOptimizer across checkpoints: a job stopped and resumed, or rolled back
when a server is replaced, goes on with the optimizer's own state of the checkpoint's step (Adam's
moments, its own copy of the model, local_view's shift, the frozen denominators), so that it ends
with the models of a job never interrupted, bitwise; the checkpoint's model file holds the model
the optimizer trained."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import sparseps
import sparseps.torch
from sparseps import capi
from conftest import (BUILD, DATA, DDP_HOOK_SETS, PS_HOOK_SETS, ROOT, example_env,
                      launch_example, run_ddp_workers, run_threads)
from test_model_file import read_safetensors

CONFIG = "train: {lr: 0.1, momentum: 0}\ncompression: {encoding: topk, density: 0.5}\n"
SETS = ["checkpoint.every_steps=5", "checkpoint.keep=0"]
TOTAL = 15
# aggregate, freeze_variance_step, local_view
CASES = {"adam_gradient": ("gradient", None, False),
         "adam_gradient_frozen_view": ("gradient", 3, True),
         "adam_update": ("update", None, False)}


_SEEDED = threading.Lock()  # torch's global generator, shared by the workers' threads


def make_model():
    with _SEEDED:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3),
                                   torch.nn.ReLU(), torch.nn.Linear(3, 2))


def flat(model):
    """The model's parameters, then its buffers (BatchNorm's running statistics), flat."""
    return torch.cat([t.detach().reshape(-1).float() for t in
                      [*model.parameters(), *model.buffers()]]).numpy().copy()


def wait_for_log(c, name, text, timeout_s=60):
    """Waits until the log of daemon `name` holds `text` (AssertionError with the log after
    timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while text not in c.log(name):
        assert time.monotonic() < deadline, f"no {text!r} in {name}'s log:\n{c.log(name)}"
        time.sleep(0.05)


def train(c, case, backend, sets=(), stop_after=None, kill_at=None, keep_scheduler=True,
          scaled=False, metric=False):
    """Two workers train `case` for TOTAL steps (each step's batch fixed by rank and step; the
    learning rate halved every 4 steps by a StepLR stepped after each step; the StepLR and the
    BatchNorm's running statistics kept in the checkpoints as extra_state unless keep_scheduler
    is False; scaled: the loss scaled by a sparseps.torch.GradScaler, in extra_state too, whose
    scale grows every 3 steps; metric: the loop averages each step's loss over the workers
    itself, worker.allreduce_values at the step's end); returns per worker (first step, {step:
    model and buffers after it}, final residual, the steps it rolled back from and to). With
    kill_at, worker 0 replaces server 0 after that step and goes on once the scheduler sent the
    workers back to a checkpoint: worker 1 waits for worker 0 in its next call that meets the
    others (the metric's, GradScaler.unscale_'s allreduce_values, or the push) when the job
    pauses, and worker 0 meets the rollback in that call."""
    aggregate, freeze, view = CASES[case]

    def worker(rank):
        model = make_model()
        w = backend(str(c.job), rank=rank, overrides=c.overrides + SETS + list(sets))
        adam = torch.optim.Adam(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=4, gamma=0.5)
        scaler = sparseps.torch.GradScaler(init_scale=2.0 ** 4, growth_interval=3,
                                           enabled=scaled)
        opt = sparseps.torch.DistributedOptimizer(
            adam, w, aggregate=aggregate, freeze_variance_step=freeze, local_view=view,
            names=[n for n, _ in model.named_parameters()],
            extra_state={"scheduler": scheduler, "buffers": sparseps.torch.ModuleBuffers(model),
                         "scaler": scaler} if keep_scheduler else None)
        start = t = w.step
        models, rolled = {}, []
        while t < TOTAL:
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * rank + t))
            if t < 3:  # the last input's weights have no gradient before the variance freezes
                x[:, 4] = 0
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            try:
                scaler.step(opt)
            except (sparseps.RolledBack, capi.RolledBack):
                rolled.append((t, w.step))
                t = w.step  # the loop's own position; the optimizer restored itself
                continue
            scaler.update()
            scheduler.step()
            t += 1
            models[t] = flat(model)
            if stop_after == t:
                return start, models, None, rolled  # the process "dies": no finish
            if rank == 0 and kill_at == t and not rolled:
                c.kill("server-0")
                c.start_server(0, ["--rejoin"])
                wait_for_log(c, "scheduler", "the workers go back to it")
            if metric:
                try:
                    w.allreduce_values([float(loss)])
                except (sparseps.RolledBack, capi.RolledBack):
                    rolled.append((t, w.step))
                    t = w.step  # as after step(): the optimizer restored itself
        out = (start, models, w.residual(), rolled, scaler.get_scale())
        opt.synchronize()
        w.finish()
        return out
    return run_threads([lambda r=r: worker(r) for r in range(2)], timeout_s=240)


@pytest.mark.parametrize("case,backend", [(case, sparseps.Worker) for case in CASES] +
                         [("adam_gradient", capi.Worker)],
                         ids=[*CASES, "adam_gradient-capi"])
def test_a_resumed_job_goes_on_with_the_optimizers_state(cluster, case, backend):
    """Stopped after 13 steps and resumed from the newest complete checkpoint (step 10, or 5): every
    later model and the final residuals are those of the job never stopped, and the checkpoint's
    model file is worker 0's model at that step (its own copy, or local_view's view, where the
    job's parameters are not the model), its BatchNorm's running statistics (ModuleBuffers)
    beside the parameters as that step left them."""
    whole = train(cluster(CONFIG, sets=SETS), case, backend)
    cut = cluster(CONFIG, sets=SETS)
    train(cut, case, backend, stop_after=13)
    cut.stop()
    manifests = sorted((cut.run_dir / "checkpoints").glob("iter-*/MANIFEST.json"))
    assert manifests, "no complete checkpoint after 13 steps"
    newest = int(manifests[-1].parent.name[5:])
    tensors, _ = read_safetensors(manifests[-1].parent / "model.safetensors")
    saved = np.concatenate([tensors[n].reshape(-1) for n, _ in make_model().named_parameters()])
    np.testing.assert_array_equal(saved, whole[0][1][newest][:saved.size])  # the parameters
    buffers = np.concatenate([tensors[n].reshape(-1) for n, _ in make_model().named_buffers()])
    np.testing.assert_array_equal(buffers, whole[0][1][newest][saved.size:])
    assert float(tensors["1.num_batches_tracked"]) == newest
    resume = [f"checkpoint.dir={cut.run_dir / 'checkpoints'}", "checkpoint.resume=true"]
    again = train(cluster(CONFIG, sets=SETS + resume), case, backend, sets=resume)
    for r in range(2):
        assert again[r][0] == newest, newest
        for t in range(newest + 1, TOTAL + 1):
            np.testing.assert_array_equal(again[r][1][t], whole[r][1][t], err_msg=f"step {t}")
        np.testing.assert_array_equal(again[r][2], whole[r][2])


@pytest.mark.parametrize("scaled,metric,backend,kill_at",
                         [(False, False, sparseps.Worker, 12), (True, False, sparseps.Worker, 12),
                          (False, True, capi.Worker, 12), (False, True, capi.Worker, 10)],
                         ids=["fp32", "grad_scaler", "metric-capi", "metric-capi-at-checkpoint"])
def test_a_rolled_back_job_goes_on_with_the_optimizers_state(cluster, scaled, metric, backend,
                                                             kill_at):
    """Server 0 killed with kill -9 after step `kill_at` and replaced: step() raises RolledBack
    with the optimizer back at the checkpoint's step, the loop goes on from worker.step, and every
    worker ends with the models of the job never interrupted (Adam over the aggregated gradient,
    the variance frozen, local_view). With a sparseps.torch.GradScaler (scaler.step(opt) raises it,
    from the overflow check's allreduce_values: before, that worker stayed where it was and the
    job hung) the scaler is back at the checkpoint's scale too and its next iteration starts
    afresh (before, unscale_ refused it: "already been called"). The loop's own
    allreduce_values raises it after the same restore (the optimizer listens to its worker), also
    right after a checkpoint's step (10), before the loop handed that checkpoint its state."""
    case = "adam_gradient_frozen_view"
    whole = train(cluster(CONFIG, sets=SETS), case, backend, scaled=scaled, metric=metric)
    cut = cluster(CONFIG, sets=SETS)
    again = train(cut, case, backend, kill_at=kill_at, scaled=scaled, metric=metric)
    codes = cut.wait()
    assert codes.pop("server-0") == -9 and codes == {k: 0 for k in codes}, codes
    for r in range(2):
        assert again[r][3] and all(to % 5 == 0 and 0 < to <= at for at, to in again[r][3])
        np.testing.assert_array_equal(again[r][1][TOTAL], whole[r][1][TOTAL])
        np.testing.assert_array_equal(again[r][2], whole[r][2])
        assert again[r][4] == whole[r][4] == (2.0 ** 9 if scaled else 1.0)


def curve_keys(folder, names):
    """A keypair per name (sparseps-keygen) under `folder`, each public key authorized in
    folder/authorized. Returns the config's security section for a job whose nodes all use the
    first name's keys, and {name: key_dir}."""
    authorized = folder / "authorized"
    authorized.mkdir(parents=True)
    dirs = {}
    for n in names:
        dirs[n] = folder / f"keys-{n}"
        subprocess.run([str(BUILD / "security" / "sparseps-keygen"), str(dirs[n])], check=True,
                       capture_output=True)
        (authorized / f"{n}.key").write_text((dirs[n] / "public.key").read_text())
    return ("security: {curve: true, " f"key_dir: '{dirs[names[0]]}', "
            f"authorized_keys_dir: '{authorized}', "
            f"scheduler_public_key: '{authorized / (names[0] + '.key')}'}}\n"), dirs


# The module's case runs under CURVE, the C API's without: the hand-over is the same either way,
# and CI's time has no room for a third case.
@pytest.mark.parametrize("backend,curve", [("module", True), ("capi", False)],
                         ids=["module-curve", "capi"])
def test_a_replacement_takes_the_leaders_model_and_optimizer_state(cluster, tmp_path, backend,
                                                                   curve):
    """Adam over the aggregated gradient keeps each worker's own model. Worker 1 killed with
    kill -9 after step 10 and replaced (node.rejoin=true) computes its first step at the job's
    parameters, then takes worker 0's model, Adam's moments and extra_state as they are after
    that step (worker 0's hand-over, through the scheduler), so both workers end with the same
    model, bit for bit. Without the hand-over the replacement trained a model of its own: the
    job's parameters moved by a fresh Adam. Under CURVE (module-curve) the replacement comes with
    a key of its own, authorized beforehand, and the hand-over's chunks go over CURVE sockets."""
    steps = 120
    security, key_dirs = curve_keys(tmp_path / "keys", ["job", "replacement"]) if curve \
        else ("", {})
    c = cluster(CONFIG + "cluster: {register_timeout_s: 60, request_timeout_s: 60}\n" + security)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"),
                                                      str(ROOT / "tests" / "python")]))

    def start(rank, sleep, out, extra=()):
        return subprocess.Popen([sys.executable, str(ROOT / "tests" / "python" / "adam_worker.py"),
                                 str(c.job), str(rank), str(steps), str(sleep),
                                 str(c.dir / out), backend] + c.overrides + list(extra),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)

    # Worker 0 is the slower: the replacement joins long before the end.
    leader = start(0, 0.05, "leader.bin")
    victim = start(1, 0.0, "lost.bin")
    lines = []
    for line in victim.stdout:
        lines.append(line)
        if line.strip() == "step 10":
            break
    victim.kill()
    victim.wait()
    assert lines and lines[-1].strip() == "step 10", "".join(lines)
    replacement = start(1, 0.0, "replacement.bin", ["node.rejoin=true"] + (
        [f"security.key_dir={key_dirs['replacement']}"] if curve else []))
    out, _ = replacement.communicate(timeout=180)
    leader_out, _ = leader.communicate(timeout=180)
    assert replacement.returncode == 0, out
    assert leader.returncode == 0, leader_out
    first = next(line for line in out.splitlines() if line.startswith("start ")).split()
    assert first[2] == "1", out  # rejoined
    joined = int(first[1])
    assert 10 <= joined < steps - 1, out
    assert "handed this loop's state" in leader_out and \
        f"which joined at iteration {joined}" in leader_out, leader_out
    assert c.wait() == {k: 0 for k in c.wait()}
    handed = re.search(f"worker 0 handed its loop's state of iteration {joined} "
                       r"\((\d+) bytes\) to worker 1", c.log("scheduler"))
    assert handed and int(handed.group(1)) > 0, c.log("scheduler")
    np.testing.assert_array_equal(np.fromfile(c.dir / "replacement.bin", dtype=np.float32),
                                  np.fromfile(c.dir / "leader.bin", dtype=np.float32))
    if curve:
        assert "CURVE on" in out and "CURVE on" in c.log("scheduler"), out
        assert "refused" not in c.log("scheduler") + c.log("server-0") + c.log("server-1")


def launch_and_kill(tmp_path, command, sets, victim, after_steps, launch_args=(), stop_s=None):
    """deploy/launch.sh of examples/torch_cnn.yaml with `sets` and workers started as COMMAND (a
    run directory tmp_path/run); worker VICTIM killed with kill -9 (its pid from its log) once
    it logged more than `after_steps` steps, or with stop_s, stopped (SIGSTOP) for that many
    seconds and continued. Returns (run directory, the launcher's exit code and output); the
    launcher is stopped when the test fails."""
    run = tmp_path / "run"
    args = ["bash", str(ROOT / "deploy" / "launch.sh"), "--build-dir", str(BUILD), "--config",
            str(ROOT / "examples" / "torch_cnn.yaml"), "--run-dir", str(run), "--quiet",
            "--worker-command", command, *launch_args]
    for s in sets:
        args += ["--set", s]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=example_env())
    try:
        metrics = run / f"metrics-worker-{victim}.csv"
        deadline = time.time() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > after_steps):
            assert time.time() < deadline and launcher.poll() is None, \
                f"no step {after_steps} of worker {victim}"
            time.sleep(0.02)
        pid = re.search(r"\(pid (\d+)\)", (run / f"worker-{victim}.log").read_text())
        assert pid, (run / f"worker-{victim}.log").read_text()
        if stop_s is None:
            os.kill(int(pid.group(1)), signal.SIGKILL)
        else:
            os.kill(int(pid.group(1)), signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(int(pid.group(1)), signal.SIGCONT)
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return run, launcher.returncode, out


@pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (deploy/install-deps.sh)")
def test_the_launchers_replacement_of_a_python_worker_takes_the_leaders_state(tmp_path):
    """deploy/launch.sh --max-restarts 1 with examples/fashion_mnist.py (the MLP, Adam over the
    aggregated gradient): worker 1 stopped (SIGSTOP, as a swapped-out or frozen process) after
    step 20 for longer than cluster.heartbeat_timeout_s, then continued: the scheduler removed it
    meanwhile and tells it so; the example exits with code 3 (sparseps.Lost: out of the job, not
    failed), so launch.sh starts it again with --rejoin, which the example passes on
    (node.rejoin); the replacement joins, takes worker 0's model and optimizer state after its
    first step (the scheduler's log: the hand-over's bytes) and trains to the job's last step;
    the job ends well. (A worker killed with kill -9 takes the same way through launch.sh: the
    next test.)"""
    # Worker 0 trains on alone while the replacement starts and joins: room for it to join before
    # the end (at 900 steps, under a loaded CI, worker 0 once ended the job first, and the
    # replacement had nothing to join).
    steps = 2000
    command = f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model mlp " \
        "--optimizer adam"
    run, code, out = launch_and_kill(
        tmp_path, command, ["train.momentum=0", f"train.max_steps={steps}",
                            "train.epochs=10", "data.max_test_samples=200",
                            "cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=5"],
        victim=1, after_steps=20, launch_args=["--max-restarts", "1"], stop_s=8)
    assert code == 0, out
    assert "restart 1 of 1: worker-1 exited with code 3" in (run / "restarts.log").read_text()
    log1 = (run / "worker-1.log").read_text()
    assert re.search(r"fashion_mnist.py: removed from the job: worker 1 \(.*\) sent no heartbeat "
                     r"for .*; the others went on without it", log1), log1
    joined = re.search(r"a replacement from step (\d+)\)", (run / "worker-1.log").read_text())
    assert joined, (run / "worker-1.log").read_text()
    handed = re.search(f"worker 0 handed its loop's state of iteration {joined.group(1)} "
                       r"\((\d+) bytes\) to worker 1", (run / "scheduler.log").read_text())
    assert handed and int(handed.group(1)) > 0, (run / "scheduler.log").read_text()
    last = (run / "metrics-worker-1.csv").read_text().splitlines()[-1]
    assert last.split(",")[0] == str(steps), last
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [w["rank"] for w in summary["lost_workers"]] == [1], summary
    assert [(j["rank"], int(j["iteration"])) for j in summary["joined_workers"]] == \
        [(1, int(joined.group(1)))], summary


@pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (deploy/install-deps.sh)")
def test_a_ddp_job_that_loses_a_worker_ends_naming_why(tmp_path):
    """The example under torch DDP (2 workers, plain DDP over Gloo), worker 1 killed with kill -9
    after step 10: worker 0's next allreduce fails, and instead of Gloo's traceback it says that
    DDP needs every rank, even under cluster.on_worker_failure: continue, and names
    DistributedOptimizer; the job ends with exit code 1 (the same message when a hook job loses a
    worker at DDP's broadcast of the buffers: docs/log/benchmarks-2026-11.md)."""
    command = f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model cnn --ddp"
    run, code, out = launch_and_kill(
        tmp_path, command, ["aggregation=allreduce", "train.max_steps=2000",
                            "data.max_test_samples=100", "cluster.on_worker_failure=continue"],
        victim=1, after_steps=10)
    assert code == 1, out
    log0 = (run / "worker-0.log").read_text()
    assert "fashion_mnist.py: a collective of torch DDP's process group failed (" in log0, log0
    assert "DistributedOptimizer goes on without it" in log0 and "Traceback" not in log0, log0


@pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (deploy/install-deps.sh)")
def test_a_python_job_that_loses_worker_0_goes_on_as_the_cpp_workers_do(tmp_path):
    """deploy/launch.sh with 3 examples/fashion_mnist.py workers (the MLP; 24576 samples, batch
    64: 128 steps an epoch each, 3 epochs), cluster.on_worker_failure: continue, no restarts:
    worker 0 killed with kill -9 early in its first epoch. Workers 1 and 2 go on; from the epoch
    after the loss they share the whole training set (192 steps an epoch: nothing of it left
    untrained) and end at the same step; worker 1, the new leader, evaluates after each epoch,
    writes eval-worker-1.csv and the model, and the job ends well with its accuracy."""
    command = f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model mlp"
    run, code, out = launch_and_kill(
        tmp_path, command, ["cluster.num_workers=3", "train.epochs=3",
                            "data.max_train_samples=24576", "data.max_test_samples=1000",
                            "train.eval_every_epochs=1", "cluster.heartbeat_interval_s=0.25",
                            "cluster.heartbeat_timeout_s=5"], victim=0, after_steps=3)
    assert code == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert [w["rank"] for w in summary["lost_workers"]] == [0], summary
    killed_at = len((run / "metrics-worker-0.csv").read_text().splitlines()) - 1
    if killed_at >= 120:  # the test was held up so long that the kill missed epoch 1's start
        pytest.skip(f"worker 0 was killed after step {killed_at}, not early in epoch 1")
    logs = {w: (run / f"worker-{w}.log").read_text() for w in (1, 2)}
    last = {}
    for w in (1, 2):
        assert "epoch 2: the data is re-split among the 2 live workers (192 steps per epoch)" \
            in logs[w], logs[w]
        rows = (run / f"metrics-worker-{w}.csv").read_text().splitlines()
        last[w] = int(rows[-1].split(",")[0])
    assert last == {1: 128 + 2 * 192, 2: 128 + 2 * 192}, last
    assert "this worker evaluates from now on" in logs[1], logs[1]
    assert "final test accuracy" in logs[1] and "final test accuracy" not in logs[2]
    evals = (run / "eval-worker-1.csv").read_text().splitlines()
    assert [int(r.split(",")[1]) for r in evals[1:]] == [128, 320, 512], evals
    accuracy = float(evals[-1].split(",")[4])
    assert summary["final_test_accuracy"] == pytest.approx(accuracy)
    assert accuracy > 0.75, evals  # 0.85 when measured
    assert (run / "model.safetensors").exists()


def test_the_loops_scheduler_goes_on_from_the_checkpoint_only_as_extra_state(cluster):
    """The StepLR kept as extra_state is restored with the optimizer (the test above: the models
    of the job never stopped). From a checkpoint taken without it the job warns that the
    scheduler starts again, and its models then differ from the job never stopped (the learning
    rate halves at other steps). An extra_state without state_dict(), or whose state_dict holds
    what a checkpoint cannot keep, is a TypeError at construction."""
    case = "adam_update"
    whole = train(cluster(CONFIG, sets=SETS), case, sparseps.Worker)
    cut = cluster(CONFIG, sets=SETS)
    train(cut, case, sparseps.Worker, stop_after=13, keep_scheduler=False)
    cut.stop()
    resume = [f"checkpoint.dir={cut.run_dir / 'checkpoints'}", "checkpoint.resume=true"]
    with pytest.warns(UserWarning, match=r"holds no state of extra_state\['scheduler'\]"):
        again = train(cluster(CONFIG, sets=SETS + resume), case, sparseps.Worker, sets=resume)
    assert again[0][0] in (5, 10)  # the newest complete checkpoint when the job stopped
    assert not np.array_equal(again[0][1][TOTAL], whole[0][1][TOTAL])
    model = make_model()
    with pytest.raises(TypeError, match=r"extra_state\['epoch'\] \(a int\) has no state_dict"):
        sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), None,
                                            extra_state={"epoch": 3})

    class Holder:  # a state_dict that _state cannot keep
        def state_dict(self):
            return {"f": len}

        def load_state_dict(self, state):
            pass
    with pytest.raises(TypeError, match=r"extra_state\['h'\]'s state_dict\(\): sparseps: a "
                                        "builtin_function_or_method in the state"):
        sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), None,
                                            extra_state={"h": Holder()})


def test_resuming_without_the_optimizers_state_is_refused(cluster):
    """A checkpoint taken by a loop without DistributedOptimizer has no state of it: resuming
    Adam over the aggregated gradient from it (whose model is not the job's parameters) is a
    RuntimeError naming the step; set_checkpoint_state with no checkpoint waiting is refused."""
    c = cluster(CONFIG, workers=1, sets=SETS)
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides + SETS)
    w.init(np.zeros(32, dtype=np.float32))
    for t in range(6):
        w.push_pull(np.full(32, t + 1.0, dtype=np.float32))
    with pytest.raises(sparseps.Error, match="no checkpoint is waiting for the loop's state"):
        w.set_checkpoint_state(b"state")
    w.finish()
    resume = [f"checkpoint.dir={c.run_dir / 'checkpoints'}", "checkpoint.resume=true"]
    again = cluster(CONFIG, workers=1, sets=SETS + resume)
    model = make_model()
    w = sparseps.Worker(str(again.job), rank=0, overrides=again.overrides + SETS + resume)
    with pytest.raises(RuntimeError, match="the checkpoint of step 5 the job resumed from holds "
                                           "no state of this optimizer"):
        sparseps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), w)


# The example's job of the two tests below: the CNN, Adam with its rate warmed up over 40 steps,
# PS top-k 1%, a checkpoint every 10 steps, 60 steps; through DistributedOptimizer with the
# variance frozen at step 20, or under DDP with sparseps's hook.
EXAMPLE_LOOPS = {"distributed_optimizer": "--freeze-variance-step 20",
                 "ddp_hook": "--ddp --ddp-hook sparseps"}
EXAMPLE_SETS = ["train.momentum=0", "checkpoint.every_steps=10", "data.max_test_samples=500"]


@pytest.fixture(scope="module", params=list(EXAMPLE_LOOPS))
def example_job(request, tmp_path_factory):
    """(the loop, the worker command, the run directory of its job of 60 steps never
    interrupted): run once per loop for both tests below."""
    if not (DATA / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST not installed (deploy/install-deps.sh)")
    command = (f"{sys.executable} {ROOT / 'examples' / 'fashion_mnist.py'} --model cnn "
               "--optimizer adam --lr-schedule cosine --warmup-steps 40 " +
               EXAMPLE_LOOPS[request.param])
    whole = launch_example(tmp_path_factory.mktemp(request.param), "torch_cnn.yaml", command,
                           EXAMPLE_SETS + ["train.max_steps=60"], name="whole")
    return request.param, command, whole


def test_the_example_resumed_ends_with_the_model_of_a_job_never_stopped(tmp_path, example_job):
    """examples/fashion_mnist.py (example_job's) through deploy/launch.sh: 45 steps, then
    `launch.sh --resume RUN --set train.max_steps=60` (from the checkpoint of step 40, the worker
    command given --resume), writes the same model file, byte for byte, as 60 steps never
    stopped (the schedule's state went with the checkpoint). The example's --evaluate (checked
    once, on DistributedOptimizer's file) scores that file as the job's own final evaluation did,
    and refuses it for another --model, naming the faults."""
    loop, command, whole = example_job
    cut = launch_example(tmp_path, "torch_cnn.yaml", command,
                         EXAMPLE_SETS + ["train.max_steps=45"], name="cut")
    env = example_env()
    p = subprocess.run(["bash", str(ROOT / "deploy" / "launch.sh"), "--build-dir", str(BUILD),
                        "--resume", str(cut), "--quiet", "--worker-command", command,
                        "--set", "train.max_steps=60"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resumed from" in (cut / "worker-0.log").read_text()
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    if loop != "distributed_optimizer":
        return
    example = [sys.executable, str(ROOT / "examples" / "fashion_mnist.py"), "--evaluate",
               str(whole / "model.safetensors"), "--config", str(whole / "config.yaml"),
               *(whole / "overrides.txt").read_text().split()]
    p = subprocess.run(example + ["--model", "cnn"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    last = (whole / "eval-worker-0.csv").read_text().splitlines()[-1].split(",")
    assert p.stdout.strip() == (f"test loss {float(last[3]):.4f}, test accuracy "
                                f"{100 * float(last[4]):.2f}% (500 samples, iteration 60)")
    p = subprocess.run(example + ["--model", "cnn", "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout) == {"test_loss": pytest.approx(float(last[3]), rel=1e-6),
                                    "test_accuracy": float(last[4]), "samples": 500,
                                    "iteration": "60"}
    p = subprocess.run(example + ["--model", "resnet18"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and "not a model of --model resnet18: 121 tensors missing: " \
        "bn1.weight" in p.stderr and "conv1.weight (the file's [16, 1, 5, 5], the model's " \
        "[64, 1, 3, 3])" in p.stderr, p.stderr


def test_the_example_goes_on_after_a_lost_server_is_replaced(tmp_path, example_job):
    """examples/fashion_mnist.py (example_job's) through `deploy/launch.sh --max-restarts 1`:
    server 0 killed with kill -9 once worker 0 has done 25 steps. launch.sh starts a
    replacement, the job rolls back to a checkpoint, the example's loop goes back there in its
    data (DistributedOptimizer's RolledBack; the hook's state.rolled_back) with the optimizer's
    and the schedule's state of that step, and the model file is byte for byte that of the job
    never interrupted."""
    _, command, whole = example_job
    run = tmp_path / "cut"
    cmd = ["bash", str(ROOT / "deploy" / "launch.sh"), "--build-dir", str(BUILD), "--config",
           str(ROOT / "examples" / "torch_cnn.yaml"), "--run-dir", str(run), "--quiet",
           "--max-restarts", "1", "--worker-command", command] + \
        sum((["--set", s] for s in EXAMPLE_SETS + ["train.max_steps=60"]), [])
    env = example_env()
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
    try:
        metrics, deadline = run / "metrics-worker-0.csv", time.time() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > 25):
            assert time.time() < deadline and launcher.poll() is None, "no step 25"
            time.sleep(0.02)
        log = (run / "server-0.log").read_text()
        os.kill(int(log.split("starting (pid ", 1)[1].split(")", 1)[0]), signal.SIGKILL)
        out, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["replaced_servers"], summary
    assert re.search(r"going on from step [1-9]0\b", (run / "worker-0.log").read_text())
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


def test_a_ddp_hook_job_resumes_with_its_model_and_saves_it(cluster, tmp_path):
    """DDP with sparse_allreduce_hook (TopK-AllGather 10%), torch SGD with momentum 0.9 and a
    StepLR, 40 steps, a checkpoint every 10: the trained model file holds the DDP model (not the
    job's parameters); stopped after 25 steps and resumed from its checkpoint of step 20, both
    workers end with the model of the job never stopped, bit for bit (the model, the momentum
    and the scheduler came back), and so does the model file (the refusal without that state:
    the next test)."""
    sets = ["checkpoint.every_steps=10", "checkpoint.keep=0"]
    head = "cluster: {register_timeout_s: 60}\n"
    args = ["--momentum", "0.9"]
    c = cluster(head, servers=0, sets=DDP_HOOK_SETS + sets)
    whole = run_ddp_workers(c, tmp_path, "cpu", args, sets, name="whole")
    c.wait()
    tensors, _ = read_safetensors(c.run_dir / "model.safetensors")
    saved = np.concatenate([tensors[n].reshape(-1) for n in ("0.weight", "0.bias", "2.weight",
                                                               "2.bias")])
    np.testing.assert_array_equal(saved, whole[0]["params"].numpy())
    cut = cluster(head, servers=0, sets=DDP_HOOK_SETS + sets)
    run_ddp_workers(cut, tmp_path, "cpu", args + ["--stop-after", "25"], sets, name="cut")
    cut.stop()
    resume = [f"checkpoint.dir={cut.run_dir / 'checkpoints'}", "checkpoint.resume=true"]
    again_c = cluster(head, servers=0, sets=DDP_HOOK_SETS + sets + resume)
    again = run_ddp_workers(again_c, tmp_path, "cpu", args, sets + resume, name="again")
    again_c.wait()
    for r in range(2):
        assert again[r]["first"] in (10, 20)  # the newest complete checkpoint at the stop
        assert torch.equal(again[r]["params"], whole[r]["params"])
    tensors, _ = read_safetensors(again_c.run_dir / "model.safetensors")
    again_saved = np.concatenate([tensors[n].reshape(-1) for n in ("0.weight", "0.bias",
                                                                     "2.weight", "2.bias")])
    np.testing.assert_array_equal(again_saved, saved)


def test_a_ddp_hook_job_through_the_servers_rolls_back_to_the_model_of_a_job_never_stopped(
        cluster, tmp_path):
    """DDP with sparse_allreduce_hook on a PS job (top-k 10%, 2 servers), torch SGD with
    momentum 0.9 and a StepLR, 40 steps, a checkpoint every 5: server 0 killed with kill -9
    after step 22 and replaced. The hook hands DDP zero buckets and says rolled_back, the loop
    goes back to worker.step (a checkpoint's), the model, the momentum, the scheduler and the
    loss scaler (--amp: each step's overflow check waits for the others, so the pause may come
    there or in the push) come back before the next forward pass, and both workers end with the
    model of the job never interrupted, bit for bit."""
    sets = ["checkpoint.every_steps=5", "checkpoint.keep=0"]
    head = "cluster: {register_timeout_s: 60}\n"
    args = ["--momentum", "0.9", "--amp"]
    whole_c = cluster(head, sets=PS_HOOK_SETS + sets)
    whole = run_ddp_workers(whole_c, tmp_path, "cpu", args, sets, name="whole",
                            hook_sets=PS_HOOK_SETS)
    assert whole_c.wait() == {k: 0 for k in ("scheduler", "server-0", "server-1")}
    c = cluster(head, sets=PS_HOOK_SETS + sets)
    server = dict(c.procs)["server-0"]

    def replace_server_0():
        server.wait(timeout=240)  # killed by worker 0 after step 22
        c.start_server(0, ["--rejoin"])
    cut = run_ddp_workers(c, tmp_path, "cpu",
                          args + ["--kill-at", "22", "--kill-pid", str(server.pid)], sets,
                          name="cut", hook_sets=PS_HOOK_SETS, during=replace_server_0)
    codes = c.wait()
    assert codes.pop("server-0") == -9 and codes == {k: 0 for k in codes}, codes
    for r in range(2):
        assert cut[r]["rolled"] and all(to % 5 == 0 and 0 < to <= at
                                        for at, to in cut[r]["rolled"]), cut[r]["rolled"]
        assert torch.equal(cut[r]["params"], whole[r]["params"])
    assert torch.equal(whole[0]["params"], whole[1]["params"])


def test_a_ddp_hook_job_does_not_resume_without_its_model(cluster):
    """From a checkpoint taken without the hook's state (a loop of push_pull calls) the hook's
    resume is a RuntimeError naming the step: the job's parameters there are not the DDP
    model."""
    sets = DDP_HOOK_SETS + SETS
    c = cluster("", servers=0, workers=1, sets=sets)
    w = sparseps.Worker(str(c.job), rank=0, overrides=c.overrides + sets)
    w.init(np.zeros(18, dtype=np.float32))
    for t in range(6):
        w.push_pull(np.full(18, t + 1.0, dtype=np.float32))
    w.finish()
    resume = [f"checkpoint.dir={c.run_dir / 'checkpoints'}", "checkpoint.resume=true"]
    again = cluster("", servers=0, workers=1, sets=sets + resume)
    w = sparseps.Worker(str(again.job), rank=0, overrides=again.overrides + sets + resume)
    with pytest.raises(RuntimeError, match="the checkpoint of step 5 the job resumed from holds "
                                           "no model of this DDP hook"):
        sparseps.torch.SparseAllreduceState(w, torch.nn.Linear(5, 3))
