"""The Debian package (deploy/package.sh, CPack) of this build: it unpacks (dpkg -x) into a
temporary root; every daemon and tool runs --version and --help from there; its Depends name every
Debian package whose libraries the binaries link (dpkg-shlibdeps); the systemd unit templates pass
systemd-analyze verify; the installed launcher runs; and a consumer project outside sparseps
(tests/install/consumer) builds against the unpacked tree with find_package(sparseps) and trains
through the client library against daemons from the package, checking the parameters exactly.
Run by ctest with Debian's python3 -m pytest."""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import BUILD, ROOT, VERSION, cannot_run, run

TOOLS = ("sparseps-scheduler", "sparseps-server", "sparseps-worker", "sparseps-keygen",
         "sparseps-eval")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("package")
    r = run([str(ROOT / "deploy" / "package.sh"), str(BUILD), str(out)], timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    debs = list(out.glob(f"sparseps_{VERSION}_*.deb"))
    assert len(debs) == 1, list(out.iterdir())
    root = out / "root"
    r = run(["dpkg", "-x", str(debs[0]), str(root)])
    assert r.returncode == 0, r.stderr
    return debs[0], root


def control(deb):
    r = run(["dpkg-deb", "-f", str(deb)])
    assert r.returncode == 0, r.stderr
    fields = {}
    for line in r.stdout.splitlines():
        if ":" in line and not line.startswith(" "):
            k, v = line.split(":", 1)
            fields[k] = v.strip()
    return fields


def test_every_tool_runs_from_the_unpacked_tree(package):
    _, root = package
    for tool in TOOLS:
        exe = root / "usr" / "bin" / tool
        r = run([str(exe), "--version"])
        assert r.returncode == 0 and r.stdout.strip() == f"{tool} {VERSION}", (tool, r)
        r = run([str(exe), "--help"])
        assert r.returncode == 0 and "Usage" in r.stdout and "--version" in r.stdout, (tool, r)
    # The launcher on PATH (a link into share/sparseps) finds its own part of the tree.
    r = run([str(root / "usr" / "bin" / "sparseps-launch"), "--help"])
    assert r.returncode == 0 and "--hosts FILE" in r.stdout, r
    share = root / "usr" / "share" / "sparseps"
    for f in ("configs/quickstart.yaml", "deploy/slurm/sparseps.sbatch", "deploy/lib/remote.sh",
              "deploy/grafana/sparseps-dashboard.json", "deploy/systemd/sparseps.default"):
        assert (share / f).is_file(), f
    doc = root / "usr" / "share" / "doc" / "sparseps"
    assert (doc / "README.md").is_file() and (doc / "user-guide.md").is_file()
    assert (root / "usr" / "lib" / "python3" / "dist-packages" / "sparseps" / "__init__.py").is_file()


def test_depends_names_every_library_the_binaries_link(package):
    deb, root = package
    fields = control(deb)
    assert fields["Package"] == "sparseps" and fields["Version"] == VERSION, fields
    depends = {d.strip().split()[0] for d in fields["Depends"].split(",")}
    elves = [root / "usr" / "bin" / t for t in TOOLS]
    elves += list((root / "usr" / "lib").rglob("*.so*"))
    elves = [e for e in elves if e.is_file() and not e.is_symlink()]
    # dpkg-shlibdeps wants a debian/control next to it.
    work = root.parent / "shlibdeps"
    (work / "debian").mkdir(parents=True, exist_ok=True)
    (work / "debian" / "control").write_text("Source: sparseps\n\nPackage: sparseps\n"
                                             "Architecture: any\n")
    # The package's own libraries (the Python module links libsparseps_client) are found in it.
    own = sorted({f"-l{e.parent}" for e in elves if e.name.startswith("libsparseps")})
    r = run(["dpkg-shlibdeps", "--ignore-missing-info", *own, "-O", *map(str, elves)], cwd=work)
    assert r.returncode == 0, r.stderr
    needed = {d.strip().split()[0]
              for d in r.stdout.split("=", 1)[1].split(",") if d.strip()}
    assert needed, r.stdout
    assert needed <= depends, f"missing from Depends: {sorted(needed - depends)}"


def test_nothing_in_the_package_needs_an_nvidia_library(package):
    """A CUDA build links the CUDA runtime statically and loads cuBLAS at run time: no binary or
    library of the package names one of NVIDIA's libraries (it would not start without CUDA)."""
    _, root = package
    elves = [root / "usr" / "bin" / t for t in TOOLS]
    elves += [e for e in (root / "usr" / "lib").rglob("*.so*") if not e.is_symlink()]
    for elf in elves:
        r = run(["readelf", "-d", str(elf)])
        assert r.returncode == 0, r.stderr
        nvidia = re.findall(r"NEEDED.*\[(lib(?:cuda|cudart|cublas|cublasLt)\.so[.0-9]*)\]",
                            r.stdout)
        assert not nvidia, f"{elf.relative_to(root)} needs {nvidia}"


def test_systemd_unit_templates_verify(package):
    _, root = package
    units = root / "usr" / "lib" / "systemd" / "system"
    names = ["sparseps-scheduler.service", "sparseps-server@.service", "sparseps-worker@.service"]
    for name in names:
        text = (units / name).read_text()
        daemon = "sparseps-" + name.split("-")[1].split("@")[0].split(".")[0]
        assert f"ExecStart=/usr/bin/{daemon} --config ${{SPARSEPS_CONFIG}}" in text, text
    assert "Environment=SPARSEPS_RANK=%i" in (units / "sparseps-server@.service").read_text()
    if shutil.which("systemd-analyze") is None:
        # deploy/install-deps.sh installs it (systemd): in CI its absence is a failure.
        cannot_run("systemd-analyze not installed: the units' syntax was not verified")
    # Instances of the templates, with the package's daemons where the units expect them.
    check = root.parent / "units"
    check.mkdir(exist_ok=True)
    paths = []
    for name in names:
        text = (units / name).read_text().replace("/usr/bin/", str(root / "usr" / "bin") + "/")
        inst = name.replace("@.", "@0.")
        (check / inst).write_text(text)
        paths.append(str(check / inst))
    r = run(["systemd-analyze", "verify", "--man=no", *paths])
    assert r.returncode == 0, r.stdout + r.stderr
    problems = [l for l in r.stderr.splitlines() if "sparseps" in l]
    assert not problems, r.stderr


def test_a_consumer_project_builds_with_find_package_and_trains(package, tmp_path):
    _, root = package
    prefix = root / "usr"
    build = tmp_path / "consumer"
    r = run(["cmake", "-S", str(ROOT / "tests" / "install" / "consumer"), "-B", str(build),
             f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert str(prefix / "lib") in (build / "CMakeCache.txt").read_text()  # sparseps_DIR there
    r = run(["cmake", "--build", str(build)], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # A job of 1 server and 1 worker (the consumer), the daemons from the package.
    cfg = tmp_path / "job.yaml"
    cfg.write_text("cluster: {num_servers: 1, num_workers: 1, scheduler_port: 0,"
                   " register_timeout_s: 60, request_timeout_s: 60}\n"
                   "train: {lr: 1, momentum: 0}\ncompression: {encoding: dense}\n"
                   f"run: {{name: consumer, dir: {tmp_path / 'run'}}}\n")
    (tmp_path / "run").mkdir()
    bin_dir = prefix / "bin"
    procs = []
    try:
        procs.append(subprocess.Popen([str(bin_dir / "sparseps-scheduler"), "--config", str(cfg)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        port_file = tmp_path / "run" / "scheduler.port"
        end = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.time() < end and procs[0].poll() is None, "the scheduler did not start"
            time.sleep(0.1)
        port = f"cluster.scheduler_port={port_file.read_text().strip()}"
        procs.append(subprocess.Popen([str(bin_dir / "sparseps-server"), "--config", str(cfg),
                                       "--set", port],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        r = run([str(build / "consumer"), str(cfg), port], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"consumer: ok, sparseps {VERSION}, 7 steps" in r.stdout, r.stdout
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert summary["workers"][0]["steps"] == 7 and summary["servers"][0]["pushes"] == 7, summary


OWN_MODEL = '''"""A user's own PyTorch model and data on the loop of the package's examples (torch_job), so
that sparseps-compare runs it under torch DDP and under sparseps alike."""
import sys

import torch

sys.path.insert(0, "{examples}")  # /usr/share/sparseps/examples once installed
import torch_job  # noqa: E402


def build_model(name, get):
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def load_data(args, get):
    """Seeded points labelled by a fixed linear map: 4000 to train on, 500 to test."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(20, 4, generator=g)
    x = torch.randn(4500, 20, generator=g)
    y = (x @ w).argmax(1)
    return x[:4000], y[:4000], x[4000:], y[4000:], "points labelled by a linear map"


args = torch_job.parser(__doc__, models=["mine"]).parse_args()
torch_job.run(args, build_model, load_data)
'''


def test_the_packaged_comparison_runs_a_users_own_model_against_ddp(package, tmp_path):
    """A user's own model (a script outside the tree on the package's torch_job loop) compared
    by the package's sparseps-compare, run from the user's folder with no build around: torch DDP
    over Gloo against PS top-k through sparseps.torch. Both train to the accuracy the data allow,
    the time to DDP's accuracy target is computed, and the results land in ./runs (before, the
    comparison looked for its worker in <share>/build and died with a traceback, and the
    package had no examples for the configs' PyTorch settings)."""
    _, root = package
    share = root / "usr" / "share" / "sparseps"
    assert (share / "examples" / "torch_job.py").is_file()
    assert (share / "examples" / "torch_ddp.py").is_file()  # torch_job.py's --ddp
    assert (share / "examples" / "fashion_mnist.py").is_file()
    script = tmp_path / "my_train.py"
    script.write_text(OWN_MODEL.replace("{examples}", str(share / "examples")))
    (tmp_path / "job.yaml").write_text(
        "cluster: {register_timeout_s: 60}\n"
        "train: {lr: 0.1, momentum: 0, batch_size: 32, epochs: 2, seed: 42}\n"
        "compression: {density: 0.1}\n")
    (tmp_path / "compare.yaml").write_text(
        "name: own_model\njob: job.yaml\nworkers: 2\nservers: 1\n"
        "target: {baseline: ddp, minus: 0.05}\nsettings:\n"
        "  - {name: ddp, set: [aggregation=allreduce, collective.algorithm=ring],\n"
        f"     worker: 'env GLOO_SOCKET_IFNAME=lo /usr/bin/python3 {script} --ddp'}}\n"
        "  - {name: ps_topk, set: [aggregation=ps, compression.encoding=topk],\n"
        f"     worker: '/usr/bin/python3 {script}'}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEPS_")}
    env.update(PATH=f"{root / 'usr' / 'bin'}:{env['PATH']}",
               PYTHONPATH=str(root / "usr" / "lib" / "python3" / "dist-packages"),
               # The package's libraries are not where its RPATH says (/usr/lib/...) until installed.
               LD_LIBRARY_PATH=str(root / "usr" / "lib" / "x86_64-linux-gnu"))
    r = run([str(root / "usr" / "bin" / "sparseps-compare"), "--config", "compare.yaml",
             "--no-netns"], cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    results = list(tmp_path.glob("runs/own_model-*/results.csv"))
    assert len(results) == 1, r.stdout[-3000:]
    rows = {row["setting"]: row for row in csv.DictReader(results[0].open())}
    assert set(rows) == {"ddp", "ps_topk"}, rows
    for name, row in rows.items():
        assert int(row["steps"]) == 2 * 62, row  # 2 epochs of 2000 samples a worker, 32 a step
        assert float(row["final_accuracy"]) >= 0.8, (name, row)
    assert float(rows["ddp"]["time_to_target_s"]) > 0, rows["ddp"]
    assert "model: torch mine" in (results[0].parent / "runs" / "ps_topk" /
                                   "worker-0.log").read_text()
    # DDP's bytes, Gloo's ring counted (2 (P - 1) / P of the 1,604 floats each way), so that the
    # advisor charges DDP's step for the network it names: here 10 Mbit/s.
    assert float(rows["ddp"]["sent_bytes_per_step"]) == 4 * 1604, rows["ddp"]
    r = run([str(root / "usr" / "bin" / "sparseps-advise"), "--config", "compare.yaml",
             "--calibration", str(results[0].parent), "--link", "1.25e6,0.0001"],
            cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    advice = json.loads(next(tmp_path.glob("runs/advise-own_model-*/advice.json")).read_text())
    ddp = next(s for s in advice["settings"] if s["setting"] == "ddp")
    assert ddp["sent_bytes_per_step"] == 4 * 1604, ddp
    # 5.1 ms on the link (less what the same bytes took on loopback); with no bytes counted, the
    # round trips' 0.05 ms alone
    assert ddp["network_ms"] > 0.9 * 1000 * 4 * 1604 / 1.25e6, ddp
