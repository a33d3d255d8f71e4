"""The training loop that the PyTorch examples share (examples/fashion_mnist.py,
examples/language_model.py): one worker of a sparseps job through sparseps.torch, or of torch DDP
over Gloo (the baseline users run today; examples/torch_ddp.py, with torch's hooks or sparseps's
own, --ddp-hook sparseps), started like the C++ worker with the job's config and
--set overrides, writing the C++ worker's metrics and eval CSVs (so deploy/summarize.py and
bench/sparseps-compare read its runs).

An example supplies its models and its data; everything else is here:

    import torch_job
    args = torch_job.parser(__doc__, models=["cnn", "mlp"]).parse_args()
    torch_job.run(args, build_model, load_data)   # build_model(name, get); load_data(args, get)

The config's train.* keys (epochs, batch_size, lr, momentum, seed, max_steps, eval_every_epochs,
eval_every_steps, device), data.max_train_samples, data.max_test_samples, run.dir and
run.progress_interval_s mean what they mean for the C++ worker. Each worker trains on its own
shard (a seeded permutation of the training samples dealt by rank); when a worker is lost
(cluster.on_worker_failure: continue) or a replacement joins, the live workers share the data
anew from the next epoch on (sparseps.torch.ElasticSampler and its sparseps.EpochPlan), and the
leader, not worker 0, evaluates, prints the progress and writes eval-worker-<rank>.csv, as the
C++ worker does.

--evaluate FILE trains nothing: it scores a model file that a job of --model wrote
(<run.dir>/model.safetensors, or a checkpoint folder's) on the test set of --config and --set (the
run's config.yaml and overrides.txt), as sparseps-eval does for the C++ worker's models.

Optimizers (--optimizer): sgd (default) is torch's SGD at train.lr, with DGC's momentum
correction (train.momentum) inside sparseps; adam and adamw are torch's at --opt-lr. With
`--aggregate gradient` (default) sparseps aggregates the gradients and the optimizer steps with the
aggregated one; with `--aggregate update` each worker's optimizer steps on its own gradient and
sparseps aggregates those steps, error feedback keeping what the compression leaves out
(sparseps.torch.DistributedOptimizer's aggregate="update": what Adam needs at low density).
--amp bf16 computes the forward pass under torch.autocast in bfloat16; --amp fp16 (a GPU) in
float16 with loss scaling (sparseps.torch.GradScaler, torch's under --ddp).
"""
import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import sparseps
import sparseps.torch
import torch_ddp
from sparseps import capi

ERRORS = [ValueError, TimeoutError, capi.Error]  # a clear message and exit code 1, 2 or 3


def log(rank, level, text):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    stream = sys.stderr if level in ("warning", "error") else sys.stdout
    print(f"[{stamp}] [worker-{rank}] [{level}] {text}", file=stream, flush=True)


class MemcpyCount:
    """--profile-memcpy N: torch.profiler over steps 11 to 10 + N (after the first steps' warm-up),
    its trace's device copies (CUPTI's, so the library's own cudaMemcpy calls count as PyTorch's
    do) summed by direction and written, per step, as memcpy-worker-<rank>.json in run_dir:
    {"steps": N, "h2d_bytes_per_step": .., "d2h_bytes_per_step": .., "d2d_bytes_per_step": ..}.
    Without a CUDA device the counts are 0."""

    FIRST = 10  # steps before the window

    def __init__(self, steps, run_dir, rank, cuda):
        self.steps, self.rank, self.cuda = steps, rank, cuda
        self.path = os.path.join(run_dir or ".", f"memcpy-worker-{rank}.json")
        self.prof = None

    def before(self, step):
        """Called before step `step` (0-based) runs."""
        if self.steps and step == self.FIRST:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()

    def after(self, step):
        """Called after step `step` (1-based: the steps done) ended."""
        if self.prof is None or step != self.FIRST + self.steps:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        trace = self.path + ".trace.json"
        self.prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        total = {"HtoD": 0, "DtoH": 0, "DtoD": 0}
        for e in events:
            if e.get("cat") != "gpu_memcpy":
                continue
            for d in total:
                if d in e.get("name", ""):
                    total[d] += int(e.get("args", {}).get("bytes", 0))
        os.remove(trace)
        with open(self.path, "w") as f:
            json.dump({"steps": self.steps,
                       "h2d_bytes_per_step": total["HtoD"] / self.steps,
                       "d2h_bytes_per_step": total["DtoH"] / self.steps,
                       "d2d_bytes_per_step": total["DtoD"] / self.steps}, f)
            f.write("\n")
        self.prof = None


def worker_backend(force_capi):
    """(Worker class, its Error class): the pybind11 module's when it loads in this Python (and
    not force_capi), else sparseps.capi's."""
    if not force_capi:
        try:
            return sparseps.Worker, sparseps.Error
        except ImportError:
            pass
    return capi.Worker, capi.Error


class StepCsv:
    """A CSV file of rows by step (its "step" column), written a line at a time. Opened on a
    resumed job (keep_to: the checkpoint's step) it keeps the rows up to that step; keep_to()
    after a rollback drops the rows past it, which are done again (as sparseps-worker's CSVs)."""

    def __init__(self, path, header, keep_to=0):
        self.path, self.header, self.file = path, header, None
        self.keep_to(keep_to)

    def keep_to(self, step):
        if self.file:
            self.file.close()
        rows = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as f:
                old = list(csv.reader(f))
            if old and old[0] == self.header:
                column = self.header.index("step")
                rows = [r for r in old[1:] if int(r[column]) <= step]
        self.file = open(self.path, "w", newline="", buffering=1)
        self.writer = csv.writer(self.file)
        self.writer.writerows([self.header] + rows)

    def writerow(self, row):
        self.writer.writerow(row)


def resume_overrides(resume_dir):
    """--resume DIR as the daemons take it: checkpoint.resume=true with checkpoint.dir=DIR when
    DIR holds iter-* checkpoints, else run.dir=DIR (a run directory); before --set, which wins."""
    if not resume_dir:
        return []
    if not os.path.isdir(resume_dir):
        raise ValueError(f"--resume {resume_dir}: no such directory")
    holds = any(e.startswith("iter-") for e in os.listdir(resume_dir))
    return ["checkpoint.resume=true", ("checkpoint.dir=" if holds else "run.dir=") + resume_dir]


def evaluate(model, x, y, batch=1000):
    """(mean cross-entropy, accuracy) over (x, y): per sample for a classifier (outputs N x C),
    per token for a language model (outputs N x T x V against N x T targets)."""
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch])
            target = y[i:i + batch]
            loss += F.cross_entropy(out.flatten(0, -2), target.flatten(), reduction="sum").item()
            correct += (out.argmax(-1) == target).sum().item()
    model.train()
    return loss / y.numel(), correct / y.numel()


def parser(doc, models, default_model=None):
    """The examples' command line: --config, --set, --model (one of `models`) and the options of
    the loop (devices, DDP and its hooks, optimizers, the Python backend)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--config", default="", help="the job's YAML config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, as the daemons take it")
    ap.add_argument("--resume", default="", metavar="DIR",
                    help="resume from DIR, a run directory or a folder of iter-* checkpoints, as "
                    "the daemons' --resume (deploy/launch.sh --resume passes it)")
    ap.add_argument("--rejoin", action="store_true",
                    help="a replacement of a lost worker (node.rejoin, as the daemons' --rejoin; "
                    "deploy/launch.sh --max-restarts passes it): it joins the running job, and "
                    "with sparseps's DistributedOptimizer takes the leader's model and optimizer "
                    "state after its first step")
    ap.add_argument("--model", choices=models, default=default_model or models[0])
    ap.add_argument("--synthetic", action="store_true",
                    help="random data instead of the data set (step time and bytes only)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the workers of a machine share its cores)")
    ap.add_argument("--ddp", action="store_true",
                    help="torch DDP over Gloo instead of sparseps (the baseline)")
    ap.add_argument("--ddp-hook", choices=["none", "fp16", "powersgd", "sparseps"],
                    default="none", help="with --ddp: DDP's communication hook (torch's "
                    "fp16_compress_hook, powerSGD_hook; sparseps's sparse_allreduce_hook: the "
                    "job's collective or servers)")
    ap.add_argument("--powersgd-rank", type=int, default=4,
                    help="with --ddp-hook powersgd: its matrix_approximation_rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="with --ddp: DDP's bucket_cap_mb (the gradient bucket's size)")
    ap.add_argument("--bucket-view", action=argparse.BooleanOptionalAction, default=None,
                    help="with --ddp: DDP's gradient_as_bucket_view=True (no copy of the "
                    "gradients into DDP's buckets; the default with --ddp-hook sparseps, which "
                    "then writes the update into them: docs/results.md)")
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd",
                    help="sgd at train.lr (momentum: train.momentum), or adam / adamw at --opt-lr")
    ap.add_argument("--opt-lr", type=float, default=1e-3, help="adam's and adamw's learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="adam's and adamw's")
    ap.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                    help="adam's and adamw's (any optimizer's under --ddp) learning rate over the "
                    "run: constant, or linear from 0 over --warmup-steps and then a cosine decay "
                    "to 0 at train.epochs' last step (train.max_steps only cuts it short); kept "
                    "in sparseps's checkpoints")
    ap.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                    help="with --lr-schedule cosine: the warm-up's steps")
    ap.add_argument("--aggregate", choices=["gradient", "update"], default="gradient",
                    help="what sparseps aggregates: the gradients, or each worker's optimizer "
                    "step (error feedback on the update)")
    ap.add_argument("--freeze-variance-step", type=int, default=None, metavar="N",
                    help="adam / adamw through sparseps: freeze the second moment after N "
                    "steps (1-bit Adam's compression stage; DistributedOptimizer's "
                    "freeze_variance_step)")
    ap.add_argument("--local-view", action="store_true",
                    help="each worker computes at the job's parameters moved by its own residual "
                    "(DistributedOptimizer's local_view; with --aggregate update or "
                    "--freeze-variance-step)")
    ap.add_argument("--average-views", action="store_true",
                    help="with --local-view: at the end every worker's model becomes the "
                    "average of the workers' views (DistributedOptimizer.average_views)")
    ap.add_argument("--overlap", action="store_true",
                    help="push each server's key range during the backward pass "
                    "(DistributedOptimizer's overlap; the job needs train.overlap=backward)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where the model trains (default: the config's train.device)")
    ap.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                    help="mixed precision: the forward pass under torch.autocast in bfloat16 "
                    "(CPU or GPU), or float16 with loss scaling (GPU; sparseps.torch.GradScaler, "
                    "under --ddp torch's)")
    ap.add_argument("--capi", action="store_true",
                    help="sparseps.capi's worker even where the pybind11 module loads")
    ap.add_argument("--profile-memcpy", type=int, default=0, metavar="N",
                    help="count the host-device copies of steps 11 to 10 + N (torch.profiler: "
                    "PyTorch's and sparseps's alike) into memcpy-worker-R.json in run.dir")
    ap.add_argument("--evaluate", default="", metavar="FILE",
                    help="no training: score a model file that a job of --model wrote "
                    "(<run.dir>/model.safetensors, a checkpoint's) on the test set of --config "
                    "(the run's config.yaml), as sparseps-eval does for the C++ models")
    ap.add_argument("--json", action="store_true",
                    help="with --evaluate: one JSON object (sparseps-eval --json's keys) instead "
                    "of a line")
    return ap


def describe(names, what, shown=3):
    """["N tensors WHAT: a, b, c, ..."] for a nonempty list of names (the first `shown`), else
    []."""
    if not names:
        return []
    more = ", ..." if len(names) > shown else ""
    return [f"{len(names)} tensor{'s' if len(names) > 1 else ''} {what}: "
            f"{', '.join(names[:shown])}{more}"]


def evaluate_file(args, build_model, load_data, get, device, perplexity):
    """--evaluate FILE: the model of args.model loaded from FILE (sparseps.read_model_file, the
    file read once for its tensors and its metadata; strict: its parameters and buffers), scored
    on the config's test set (data.max_test_samples) as the job's own evaluation scores it;
    prints sparseps-eval's line (--json: its object). ValueError when FILE does not hold that
    model (another --model, or the file of a --ddp run, whose names are not the module's)."""
    model = build_model(args.model, get).to(device)
    try:
        arrays, meta = sparseps.read_model_file(args.evaluate)
    except OSError as e:
        raise ValueError(f"--evaluate {args.evaluate}: {e.strerror or e}") from None
    tensors = {name: torch.from_numpy(a).to(device) for name, a in arrays.items()}
    want = model.state_dict()
    faults = describe([n for n in want if n not in tensors], "missing")
    faults += describe([n for n in tensors if n not in want], "not the model's")
    faults += describe([f"{n} (the file's {list(t.shape)}, the model's {list(want[n].shape)})"
                        for n, t in tensors.items() if n in want and t.shape != want[n].shape],
                       "of another shape")
    if faults:
        raise ValueError(f"--evaluate {args.evaluate}: not a model of --model {args.model}: "
                         + "; ".join(faults))
    model.load_state_dict(tensors, strict=True)
    _, _, xt, yt, _ = load_data(args, get)
    if get("data.max_test_samples"):
        xt, yt = xt[:get("data.max_test_samples")], yt[:get("data.max_test_samples")]
    loss, accuracy = evaluate(model, xt.to(device), yt.to(device))
    if args.json:
        result = {"test_loss": loss, "test_accuracy": accuracy, "samples": len(yt),
                  "iteration": meta.get("iteration", "")}
        if perplexity:
            result["test_perplexity"] = math.exp(min(loss, 50.0))
        print(json.dumps(result))
        return
    ppl = f", test perplexity {math.exp(min(loss, 50.0)):.2f}" if perplexity else ""
    print(f"test loss {loss:.4f}, test accuracy {100 * accuracy:.2f}%{ppl} ({len(yt)} samples, "
          f"iteration {meta.get('iteration', '?')})")


def make_optimizer(args, params, get, ddp):
    """The torch optimizer of --optimizer: SGD at train.lr (with train.momentum under DDP; inside
    sparseps otherwise), Adam / AdamW at --opt-lr."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=get("train.lr"),
                               momentum=get("train.momentum") if ddp else 0.0)
    cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=args.opt_lr, weight_decay=args.weight_decay)


def lr_schedule(args, optimizer, horizon):
    """--lr-schedule's scheduler over the torch optimizer (None: constant): a LambdaLR whose
    factor rises linearly over --warmup-steps and then follows a cosine to 0 at
    horizon["steps"] (set once the data are loaded; the factor of step 0 needs none). Stepped
    after each optimizer step, as torch orders it."""
    if args.lr_schedule == "constant":
        return None
    warm = args.warmup_steps

    def factor(step):
        if step < warm:
            return (step + 1) / warm
        decay = max(horizon.get("steps", step + 1) - warm, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warm, decay) / decay))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pick_device(name, cuda_device, rank):
    """The torch.device of train.device `name` (cpu, cuda, auto: cuda where this PyTorch sees a
    GPU) and train.cuda_device (-1: the local rank's GPU, sparseps.local_rank() modulo the GPUs,
    as sparseps-worker takes it), made the current CUDA device. ValueError for cuda without a GPU
    or an ordinal it does not see."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: this PyTorch sees no CUDA device")
    count = torch.cuda.device_count()
    if cuda_device >= count:
        raise ValueError(f"train.cuda_device: {cuda_device}, but this PyTorch sees {count} CUDA "
                         "device(s): use -1 for the local rank's")
    index = cuda_device if cuda_device >= 0 else sparseps.local_rank() % count
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)  # PyTorch's own allocations and kernels (DDP, hooks) too
    if count > 1:
        log(rank, "info", f"GPU {index} of {count}: {torch.cuda.get_device_name(index)}")
    return device


def loss_scaler(args, device):
    """--amp fp16's loss scaler (None otherwise): torch's under --ddp (DDP's allreduce takes an
    overflow to every rank), else sparseps.torch.GradScaler (the workers skip an overflow
    together). ValueError for fp16 off a GPU or with --overlap."""
    if args.amp != "fp16":
        return None
    if device.type != "cuda":
        raise ValueError("--amp fp16: CUDA's (autocast and loss scaling); --amp bf16 needs no "
                         "scaling and runs on the CPU too")
    if args.overlap:
        raise ValueError("--amp fp16 with --overlap: the gradients would leave during the "
                         "backward pass, before they are unscaled")
    if not args.ddp:
        return sparseps.torch.GradScaler()
    return torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else \
        torch.cuda.amp.GradScaler()


def loop_state(model, scheduler, scaler):
    """What sparseps keeps in its checkpoints beside the optimizer (extra_state): the schedule,
    BatchNorm's running statistics (ResNet's), which sparseps does not aggregate (synchronize()
    also puts them into the trained model file), and the loss scaler."""
    extra = {"lr_schedule": scheduler} if scheduler else {}
    if any(True for _ in model.buffers()):
        extra["buffers"] = sparseps.torch.ModuleBuffers(model)
    if scaler:
        extra["scaler"] = scaler
    return extra


def run(args, build_model, load_data, perplexity=False):
    """Trains one worker: build_model(name, get) -> torch module; load_data(args, get) ->
    (x, y, xt, yt, what) training and test tensors on the CPU and a description for the log.
    perplexity: the log reports exp(test loss) beside the accuracy (a language model)."""
    torch.set_num_threads(args.threads)
    if args.bucket_view is None:
        args.bucket_view = args.ddp and args.ddp_hook == "sparseps"
    Worker, error = worker_backend(args.capi)
    ERRORS.append(error)
    rejoin = ["node.rejoin=true"] if args.rejoin else []
    worker = Worker(args.config, overrides=resume_overrides(args.resume) + rejoin + args.set)
    get = worker.get
    device = pick_device(args.device or get("train.device"), get("train.cuda_device"),
                         worker.rank)
    if args.evaluate:
        return evaluate_file(args, build_model, load_data, get, device, perplexity)
    if args.rejoin and args.ddp:
        raise ValueError("--rejoin: torch DDP's process group takes no replacement (sparseps's "
                         "DistributedOptimizer does)")
    if args.aggregate == "update" and args.ddp:
        raise ValueError("--aggregate update: sparseps's, not DDP's")
    if args.overlap and args.ddp:
        raise ValueError("--overlap: sparseps's DistributedOptimizer's (DDP overlaps its own)")
    if args.freeze_variance_step is not None and args.ddp:
        raise ValueError("--freeze-variance-step: sparseps's DistributedOptimizer's, not DDP's")
    if args.local_view and args.ddp:
        raise ValueError("--local-view: sparseps's DistributedOptimizer's, not DDP's")
    if args.average_views and not args.local_view:
        raise ValueError("--average-views needs --local-view")
    scaler = loss_scaler(args, device)
    amp = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp else contextlib.nullcontext
    if args.lr_schedule != "constant" and args.optimizer == "sgd" and not args.ddp:
        raise ValueError("--lr-schedule: with --optimizer adam or adamw (SGD's rate inside "
                         "sparseps is the job's train.lr)")
    seed, batch = get("train.seed"), get("train.batch_size")
    torch.manual_seed(seed)  # the same initial model everywhere (worker 0's is used anyway)
    model = build_model(args.model, get).to(device)
    n = sum(p.numel() for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]  # what DDP allreduces
    horizon = {}  # --lr-schedule's last step, once the data are loaded
    hook_state = None  # --ddp-hook sparseps: the hook's SparseAllreduceState
    if args.ddp and args.ddp_hook == "sparseps":
        # SGD at train.lr over the aggregated gradient (the job's momentum inside sparseps), as
        # DistributedOptimizer's; the state restores a resumed job's model before DDP starts.
        opt = make_optimizer(args, model.parameters(), get, ddp=False)
        scheduler = lr_schedule(args, opt, horizon)
        hook_state = sparseps.torch.SparseAllreduceState(
            worker, model, optimizer=opt, extra_state=loop_state(model, scheduler, scaler),
            grad_scaler=scaler)
        model = torch_ddp.ddp_model(args, model, worker, get, hook_state)
    elif args.ddp:
        # sparseps only for the rank and the job's end; DDP broadcasts worker 0's parameters.
        with torch.no_grad():
            worker.init([p.detach() for p in model.parameters()])
        model = torch_ddp.ddp_model(args, model, worker, get)
        opt = make_optimizer(args, model.parameters(), get, ddp=True)
        scheduler = lr_schedule(args, opt, horizon)
    else:
        inner = make_optimizer(args, model.parameters(), get, ddp=False)
        scheduler = lr_schedule(args, inner, horizon)
        opt = sparseps.torch.DistributedOptimizer(
            inner, worker, aggregate=args.aggregate, freeze_variance_step=args.freeze_variance_step,
            overlap=args.overlap, names=[n for n, _ in model.named_parameters()],
            local_view=args.local_view, extra_state=loop_state(model, scheduler, scaler))
    native = args.ddp and hook_state is None  # torch's communication: its bytes counted
    rank = worker.rank

    x, y, xt, yt, what = load_data(args, get)
    if get("data.max_train_samples"):
        x, y = x[:get("data.max_train_samples")], y[:get("data.max_train_samples")]
    if get("data.max_test_samples"):
        xt, yt = xt[:get("data.max_test_samples")], yt[:get("data.max_test_samples")]
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    # The epochs and each one's share of the data as the membership says (sparseps-worker's):
    # the sampler's plan, which the loop steps through.
    sampler = sparseps.torch.ElasticSampler(len(x), worker, batch, seed=seed,
                                            epochs=get("train.epochs"),
                                            max_steps=get("train.max_steps"))
    plan = sampler.plan
    horizon["steps"] = plan.horizon
    optimizer = args.optimizer + (f" (lr {args.opt_lr})" if args.optimizer != "sgd" else "")
    if scheduler:
        optimizer += f", its rate warmed up over {args.warmup_steps} steps and cosine-decayed " \
            f"over {horizon['steps']}"
    sparse = f"{worker.aggregation} " + (
        get("compression.encoding") if worker.aggregation == "ps" else get("collective.algorithm"))
    method = (f"torch DDP (gloo) with sparseps's hook: {sparse}" if hook_state else
              f"torch DDP (gloo, {args.ddp_hook} hook)" if args.ddp else
              f"{sparse}, aggregating the {args.aggregate}") + \
        (", gradients as views of DDP's buckets" if args.ddp and args.bucket_view else "") + \
        ("" if amp is None else f"; {args.amp} autocast")
    log(rank, "info", f"model: torch {args.model}, {n} parameters on {device}; {what}; "
        f"{len(x) // plan.count} training samples on this worker, {plan.steps} steps per epoch; "
        f"{method}; optimizer {optimizer}; through "
        f"{'sparseps.capi' if Worker is capi.Worker else 'the pybind11 module'} "
        f"(pid {os.getpid()}" + (f", a replacement from step {worker.step})" if worker.rejoined
                                 else ")"))

    run_dir = get("run.dir")
    # A resumed job (deploy/launch.sh --resume) goes on from its checkpoint's step, where
    # DistributedOptimizer restored the model and the optimizer's state.
    step = 0 if native else worker.step
    plan.seek(step)
    horizon["steps"] = plan.horizon
    metrics = evals = None
    if run_dir:
        metrics = StepCsv(os.path.join(run_dir, f"metrics-worker-{rank}.csv"),
                          ["step", "epoch", "loss", "bytes_sent", "bytes_received", "selected",
                           "compute_ms", "encode_ms", "comm_ms", "wall_s", "applied",
                           "topk_mass", "binding_ms"], step)
    leader = False  # the membership's leader: worker 0, or who took over when it was lost

    def lead():
        """Whether this worker evaluates and prints the progress; the one that becomes the
        leader opens its eval CSV."""
        nonlocal leader, evals
        if not leader and worker.is_leader:
            leader = True
            if steps_run > 0:
                log(rank, "warning", "the workers before this one were lost: this worker "
                    "evaluates from now on")
            if run_dir:
                evals = StepCsv(os.path.join(run_dir, f"eval-worker-{rank}.csv"),
                                ["epoch", "step", "wall_s", "test_loss", "test_accuracy",
                                 "train_s"], step)
        return leader

    memcpy = MemcpyCount(args.profile_memcpy, run_dir, rank, device.type == "cuda")
    start = last = time.monotonic()
    steps_run = 0  # in this process (a resumed job's start at its checkpoint's step)
    ddp_bytes = 0  # --ddp: the bytes counted so far (each way)
    # --ddp: a step's bytes before and after PowerSGD's vanilla steps, counted once.
    ddp_step = [torch_ddp.ddp_step_bytes(trained, worker.num_workers, args.ddp_hook,
                                         args.powersgd_rank, s)
                for s in (1, torch_ddp.POWERSGD_START + 1)] if native else None
    rollback_error = capi.RolledBack if Worker is capi.Worker else sparseps.RolledBack
    eval_s, accuracy, epoch_loss, epoch_steps = 0.0, -1.0, 0.0, 0
    progress_loss, progress_steps = 0.0, 0

    def run_eval(epoch):
        nonlocal eval_s, accuracy
        t = time.monotonic()
        test_loss, accuracy = evaluate(getattr(model, "module", model), xt, yt)
        worker.report_evaluation(accuracy)  # the live metrics' test accuracy gauge
        took = time.monotonic() - t
        wall = t + took - start
        if evals:
            evals.writerow([epoch, step, wall, test_loss, accuracy, wall - eval_s - took])
        eval_s += took
        ppl = f", test perplexity {math.exp(min(test_loss, 50.0)):.2f}" if perplexity else ""
        log(rank, "info", f"eval epoch {epoch} step {step}: test loss {test_loss:.4f}, "
            f"test accuracy {100 * accuracy:.2f}%{ppl}")

    lead()
    while step < plan.total:
        epoch = plan.epoch
        sampler.set_epoch(epoch)
        order = sampler.order().to(device)
        worker.set_epoch(epoch)
        epoch_loss, epoch_steps = 0.0, 0
        rolled_back = False
        for s in range(step - plan.begin, plan.steps):
            if step >= plan.total:
                break
            memcpy.before(step)
            t0 = time.monotonic()
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            with autocast():
                out = model(x[idx])
                loss = F.cross_entropy(out.flatten(0, -2).float(), y[idx].flatten())
            (scaler.scale(loss) if scaler else loss).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # compute_ms: the forward and backward, finished
            t1 = time.monotonic()
            pushed = worker.step if scaler else None  # --amp fp16: a skipped step pushes nothing
            rollback = None
            if args.ddp and scaler:
                scaler.step(opt)
            elif args.ddp:
                opt.step()
            else:
                try:
                    # loss: the live metrics' loss gauge. --amp fp16: an overflow on any worker
                    # skips the step on every one (nothing pushed; the batch is spent).
                    if scaler:
                        scaler.step(opt, loss=loss)
                    else:
                        opt.step(loss=loss)
                except rollback_error as e:
                    rollback = str(e)
            if hook_state and hook_state.rolled_back:  # its state comes back at the next forward
                rollback = f"rolled back to the checkpoint of step {worker.step}"
            if rollback is not None:
                # A lost server was replaced: the job, the model and the optimizer are back at
                # the newest complete checkpoint; so goes the data position.
                log(rank, "warning", f"{rollback}; going on from step {worker.step}")
                step, rolled_back = worker.step, True
                for f in (metrics, evals):
                    if f:
                        f.keep_to(step)  # the steps after it are done again
                break
            if scaler:
                scaler.update()
            if scheduler:
                scheduler.step()
            t2 = time.monotonic()
            step += 1
            steps_run += 1
            loss = loss.item()
            memcpy.after(step)
            epoch_loss, epoch_steps = epoch_loss + loss, epoch_steps + 1
            if native:  # Gloo's ring's bytes, counted (ddp_step_bytes)
                sent = ddp_step[step > torch_ddp.POWERSGD_START]
                ddp_bytes += sent
            if metrics and native:
                # DDP's allreduce runs inside backward (compute_ms); comm_ms is the optimizer step.
                metrics.writerow([step, epoch + 1, loss, sent, sent, n, 1000 * (t1 - t0), 0,
                                  1000 * (t2 - t1), t2 - start, n, -1, 0])
            elif metrics:
                skipped = scaler is not None and worker.step == pushed
                last_step = dict.fromkeys(worker.last_step, 0) if skipped else worker.last_step
                # comm_ms: push_pull and the optimizer's step less the aggregation's encoding;
                # binding_ms: push_pull's time outside the C++ aggregation (tensor intake, the
                # update's array, the GIL), the cost of being called from Python. The hook's
                # push_pull runs inside the backward pass: out of compute_ms, into comm_ms.
                push = (hook_state or opt).last_push_pull_ms
                inside = push if hook_state else 0.0
                comm = 1000 * (t2 - t1) + inside - last_step["encode_ms"]
                binding = 0 if skipped else push - last_step["encode_ms"] - last_step["comm_ms"]
                metrics.writerow([step, epoch + 1, loss, last_step["bytes_sent"],
                                  last_step["bytes_received"], last_step["selected"],
                                  1000 * (t1 - t0) - inside, last_step["encode_ms"], comm,
                                  t2 - start,
                                  last_step["applied"], -1, binding])
            progress_loss, progress_steps = progress_loss + loss, progress_steps + 1
            if lead() and t2 - last >= get("run.progress_interval_s"):
                acc = "n/a" if accuracy < 0 else f"{100 * accuracy:.2f}%"
                log(rank, "info",
                    f"progress epoch {epoch + 1}/{plan.epochs} step {step}/{plan.total} loss "
                    f"{progress_loss / progress_steps:.4f} test_acc {acc} cluster "
                    f"{rate(progress_steps * batch * plan.count / (t2 - last))} samples/s, this "
                    f"worker "
                    f"sent {(ddp_bytes if native else worker.bytes_sent) / 1e6:.2f} MB and "
                    f"received {(ddp_bytes if native else worker.bytes_received) / 1e6:.2f} "
                    f"MB in all{' (counted)' if native else ''}")
                last, progress_loss, progress_steps = t2, 0.0, 0
            every = get("train.eval_every_steps")
            if every and step % every == 0 and step < plan.total and lead():
                run_eval(epoch + 1)
        if rolled_back:
            plan.seek(step)
            horizon["steps"] = plan.horizon
            continue
        every = get("train.eval_every_epochs")
        if every and (epoch + 1) % every == 0 and step < plan.total and lead():
            run_eval(epoch + 1)
        if step < plan.total and plan.next():
            horizon["steps"] = plan.horizon
            log(rank, "info", f"epoch {plan.epoch + 1}: the data is re-split among the "
                f"{plan.count} live workers ({plan.steps} steps per epoch)")
    if args.average_views:
        opt.average_views()  # every worker, at the same step
    train_s = time.monotonic() - start
    if hook_state:
        hook_state.synchronize()  # the model file and a last checkpoint: the DDP model
    elif not args.ddp:
        # ssp / async: every push in; the model file: this model; a checkpoint of the last
        # step: the learning-rate schedule's state (extra_state).
        opt.synchronize()
    if lead():
        run_eval(plan.epochs)
    log(rank, "info", f"training done: {step} steps ({steps_run} run here) in {train_s:.1f} s, "
        f"{rate(steps_run * batch / train_s)} samples/s on this worker"
        + (f", final test accuracy {100 * accuracy:.2f}%" if leader else ""))
    worker.finish(test_accuracy=accuracy, train_loss=epoch_loss / max(epoch_steps, 1),
                  samples_per_s=steps_run * batch / train_s, train_s=train_s)


def rate(x):
    """A rate for the log: whole numbers from 10 up, two significant digits below (a large
    model on the CPU trains under one sample a second)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def main(fn, name):
    """Runs fn() and turns the loop's errors into a message and exit code 2 (bad arguments or
    config), 3 (this worker is out of the job: sparseps.Lost, as the daemons exit when cut off or
    removed; launch.sh lets the job go on without it) or 1 (the job failed). A replacement that
    came as the job ended gets sparseps.JobEnded, a SystemExit with code 0: nothing to do. A
    failed collective of torch DDP's process group (Gloo: a rank lost) is a message and 1 too."""
    try:
        fn()
    except tuple(ERRORS) as e:
        print(f"{name}: {e}", file=sys.stderr)
        lost = type(e).__name__ == "Lost"  # sparseps.Lost or sparseps.capi's
        sys.exit(2 if isinstance(e, ValueError) else 3 if lost else 1)
    except RuntimeError as e:
        if "gloo" not in str(e).lower():
            raise
        print(f"{name}: a collective of torch DDP's process group failed ({e}): DDP needs every "
              "rank to the end (its allreduce, or with a communication hook the broadcast of the "
              "model's buffers at every forward pass), so a lost worker ends a DDP job even under "
              "cluster.on_worker_failure: continue; sparseps.torch.DistributedOptimizer goes on "
              "without it", file=sys.stderr)
        sys.exit(1)
