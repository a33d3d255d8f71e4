"""The Debian package as a user meets it, in a brand-new minbase Debian 12 container without CUDA:
its Dockerfile image (deploy/docker) installs the package with apt-get, and in it the quickstart
trains one epoch from an empty directory, `import sparseps` works, a find_package(sparseps)
consumer builds and trains, and train.device=cuda is refused naming what is missing; the compose
file (deploy/docker/compose.yaml) trains the quickstart as five containers.

Real parts: Debian's docker.io dockerd, started here on a private socket, data root and exec root,
with --iptables=false --ip-masq=false --bridge=none so that the host's firewall is left as it was
(checked; a dockerd with its defaults sets the FORWARD policy to DROP and cuts deploy/netns.sh's
hosts); the base image from `mmdebstrap --variant=minbase bookworm` and `docker import` (no
registry is reachable). Containers that need the Debian mirror (apt-get) use the host's network;
the compose cluster runs on a user-defined network. Needs root; skips naming why elsewhere, fails
in CI. Run by ctest (plain build only) with Debian's python3 -m pytest."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time

import pytest

from conftest import BUILD, ROOT, VERSION, cannot_run, run

DOCKER = "/usr/bin/docker"  # Debian's client (docker.io), not another one earlier on PATH
BASE = "sparseps-test/debian:bookworm"
IMAGE = "sparseps-test/sparseps:test"
PROJECT = "sparsepstest"  # the compose project: its containers, network and volume


def firewall():
    """The host's iptables rules (filter and nat), to check that dockerd left them alone."""
    return [run(["iptables", "-t", t, "-S"]).stdout for t in ("filter", "nat")]


class Dockerd:
    """Debian's dockerd on a private socket, data root and exec root (under a short temporary
    directory: the socket's path is limited to 107 bytes); stop() ends it by its pid."""

    def __init__(self):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="spdock-"))
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.dir}/docker.sock")
        self.log = open(self.dir / "dockerd.log", "w")
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", str(self.dir / "root"), "--exec-root",
             str(self.dir / "exec"), "-H", self.env["DOCKER_HOST"], "--pidfile",
             str(self.dir / "dockerd.pid"), "--iptables=false", "--ip-masq=false",
             "--bridge=none"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.time() + 60
        while run([DOCKER, "version"], env=self.env, timeout=30).returncode != 0:
            if self.proc.poll() is not None or time.time() > end:
                why = (self.dir / "dockerd.log").read_text()[-2000:]
                self.stop()
                raise RuntimeError(f"dockerd did not start within 60 s: {why}")
            time.sleep(0.5)

    def __call__(self, *args, timeout=300):
        return run([DOCKER, *args], env=self.env, timeout=timeout)

    def compose(self, *args, timeout=300, image=IMAGE, override=None):
        """docker-compose on deploy/docker/compose.yaml, and on `override` after it if given."""
        files = ["-f", str(ROOT / "deploy" / "docker" / "compose.yaml")]
        if override is not None:
            files += ["-f", str(override)]
        return run(["docker-compose", "-p", PROJECT, *files, *args],
                   env=dict(self.env, SPARSEPS_IMAGE=image), timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            ids = self("ps", "-aq").stdout.split()
            if ids:
                self("rm", "-f", *ids)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        # dockerd unmounted its layers on the way out; whatever is still mounted stays rather
        # than being deleted through.
        mounted = [line.split()[1] for line in open("/proc/mounts")
                   if line.split()[1].startswith(str(self.dir))]
        for m in sorted(mounted, reverse=True):
            run(["umount", "-l", m])
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def docker():
    if os.geteuid() != 0:
        cannot_run("needs root to start dockerd")
    for tool in ("dockerd", "mmdebstrap", "docker-compose", "iptables"):
        if shutil.which(tool) is None:
            cannot_run(f"{tool} is not installed (deploy/install-deps.sh installs it)")
    if not os.path.exists(DOCKER):
        cannot_run(f"{DOCKER} (Debian's docker.io) is not installed")
    before = firewall()
    try:
        d = Dockerd()
    except RuntimeError as e:
        cannot_run(str(e))
    try:
        yield d
    finally:
        d.stop()
        assert firewall() == before, "the test's dockerd changed the host's iptables rules"


@pytest.fixture(scope="module")
def image(docker, tmp_path_factory):
    """The Dockerfile's image on a minbase Debian 12 made here, with this build's package."""
    work = tmp_path_factory.mktemp("image")
    r = run(["sh", "-c", f"mmdebstrap --quiet --variant=minbase bookworm - | "
             f"{DOCKER} import - {BASE}"], timeout=600, env=docker.env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([str(ROOT / "deploy" / "package.sh"), str(BUILD), str(work)], timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([str(ROOT / "deploy" / "docker" / "build-image.sh"), r.stdout.split()[-1],
             "--network", "host", "--build-arg", f"BASE={BASE}", "-t", IMAGE],
            timeout=900, env=docker.env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return IMAGE


def in_container(docker, image, script, *opts, timeout=600):
    """Runs a shell script (dedented) in a fresh container of `image` (removed after)."""
    return docker("run", "--rm", *opts, image, "bash", "-euo", "pipefail", "-c",
                  textwrap.dedent(script), timeout=timeout)


def test_the_package_trains_imports_and_names_what_cuda_needs(docker, image, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Nothing of NVIDIA's in the image, and no binary misses a library.
    r = in_container(docker, image, """
        ! ls /usr/local/cuda 2>/dev/null
        ! ldconfig -p | grep -E 'libcuda|libcudart|libcublas'
        for f in /usr/bin/sparseps-* /usr/lib/x86_64-linux-gnu/libsparseps_client.so.*; do
          [ -L "$f" ] || ! ldd "$f" | grep 'not found'
        done
        python3 -c 'import sparseps, sparseps.capi; print("import ok", sparseps.__file__)'
        sparseps-advise --help >/dev/null
        sparseps-compare --help >/dev/null
        mkdir /tmp/empty && cd /tmp/empty
        sparseps-launch --set train.epochs=1 --run-dir /out/quickstart
        """, "--network", "none", "-v", f"{run_dir}:/out")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "import ok" in r.stdout, r.stdout
    summary = json.loads((run_dir / "quickstart" / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert summary["final_test_accuracy"] >= 0.83, summary

    r = in_container(docker, image, "cd /tmp && sparseps-launch --set train.epochs=1 "
                     "--set train.device=cuda --run-dir /tmp/cuda", "--network", "none")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "train.device: cuda, but no NVIDIA driver on this machine" in out, out[-3000:]


def test_a_consumer_project_builds_and_trains_in_the_container(docker, image):
    """tests/install/consumer against the installed package, with the compilers apt-get adds."""
    r = in_container(docker, image, """
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
          g++ cmake make >/dev/null
        cmake -S /src/consumer -B /tmp/b -DCMAKE_BUILD_TYPE=Release >/dev/null
        cmake --build /tmp/b >/dev/null
        mkdir /tmp/run
        cat > /tmp/job.yaml <<EOF
        cluster: {num_servers: 1, num_workers: 1, scheduler_port: 0, register_timeout_s: 60,
                  request_timeout_s: 60}
        train: {lr: 1, momentum: 0}
        compression: {encoding: dense}
        run: {name: consumer, dir: /tmp/run}
        EOF
        sparseps-scheduler --config /tmp/job.yaml > /tmp/run/s.log 2>&1 &
        for i in $(seq 600); do [ -s /tmp/run/scheduler.port ] && break; sleep 0.1; done
        port=cluster.scheduler_port=$(cat /tmp/run/scheduler.port)
        sparseps-server --config /tmp/job.yaml --set "$port" > /tmp/run/server.log 2>&1 &
        /tmp/b/consumer /tmp/job.yaml "$port"
        wait
        cat /tmp/run/summary.json
        """, "--network", "host", "-v", f"{ROOT / 'tests' / 'install' / 'consumer'}:/src/consumer:ro",
                     timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"consumer: ok, sparseps {VERSION}, 7 steps" in r.stdout, r.stdout[-3000:]
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["status"] == "ok" and summary["workers"][0]["steps"] == 7, summary


def test_compose_trains_the_quickstart_as_five_containers(docker, image, tmp_path):
    """The compose file as the user guide runs it, with an override file that gives each service
    its own command plus --set train.epochs=3: 3 of the quickstart's 6 epochs (87.3% with both
    workers when measured), which halves the test's training."""
    commands = {"scheduler": [], "server-0": ["node.rank=0"], "server-1": ["node.rank=1"],
                "worker-0": ["node.rank=0"], "worker-1": ["node.rank=1"]}
    override = tmp_path / "epochs.yaml"  # JSON is YAML
    override.write_text(json.dumps({"version": "3.7", "services": {
        s: {"command": sum((["--set", kv] for kv in [f"node.host={s}", *sets, "train.epochs=3"]),
                           [])}
        for s, sets in commands.items()}}))
    docker.compose("down", "-v")
    try:
        r = docker.compose("up", "-d", override=override)
        assert r.returncode == 0, r.stdout + r.stderr
        names = {s: f"{PROJECT}_{s}_1" for s in
                 ("scheduler", "server-0", "server-1", "worker-0", "worker-1")}
        codes = {}
        for service, name in names.items():
            w = docker("wait", name, timeout=600)
            assert w.returncode == 0, f"{name}: {w.stderr}"
            codes[service] = int(w.stdout.strip())
        logs = docker.compose("logs", "--no-color").stdout
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{logs[-4000:]}"
        # the user guide's command for the job's summary
        r = docker.compose("run", "--rm", "--entrypoint", "cat", "scheduler",
                           "/run/sparseps/summary.json")
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert summary["status"] == "ok", summary
        assert summary["steps"] == 3 * 468, summary  # 60,000 / 2 workers / 64 a batch, 3 epochs
        assert summary["final_test_accuracy"] >= 0.85, summary
        # Every daemon announced its container's name and bound every address.
        assert "worker-1" in logs and "0.0.0.0" in logs, logs[-4000:]
    finally:
        docker.compose("down", "-v")
