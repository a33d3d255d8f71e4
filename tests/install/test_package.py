"""The Debian package (deploy/package.sh, CPack) of this build: it unpacks (dpkg -x) into a
temporary root; every daemon and tool runs --version and --help from there; its Depends name every
Debian package whose libraries the binaries link (dpkg-shlibdeps); the systemd unit templates pass
systemd-analyze verify; the installed launcher runs; and a consumer project outside sparseps
(tests/install/consumer) builds against the unpacked tree with find_package(sparseps) and trains
through the client library against daemons from the package, checking the parameters exactly.
Run by ctest with Debian's python3 -m pytest."""
import json
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
