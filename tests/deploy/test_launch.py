"""deploy/launch.sh with a run directory used before (--run-dir of an earlier job, as
bench/sparseps-compare --resume does for a setting that did not finish): the stale
scheduler.port of the last job must not send the workers to a dead scheduler. Run by ctest with
Debian's python3 -m pytest."""
import json
import os
import subprocess

from conftest import ROOT, cannot_run

BUILD = os.environ.get("SPARSEPS_BUILD_DIR", str(ROOT / "build"))


def test_a_reused_run_directory_starts_a_fresh_job(tmp_path):
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        cannot_run("Fashion-MNIST not installed (dataset-fashion-mnist)")
    run = tmp_path / "run"
    run.mkdir()
    # What a finished (or killed) job leaves: the port its scheduler had, and its summary.
    (run / "scheduler.port").write_text("1\n")
    (run / "summary.json").write_text('{"status": "an old job"}\n')
    cmd = [str(ROOT / "deploy" / "launch.sh"), "--build-dir", BUILD, "--run-dir", str(run),
           "--quiet", "--config", str(ROOT / "configs" / "quickstart.yaml"),
           "--set", "model.hidden=[32]", "--set", "data.max_train_samples=2048",
           "--set", "data.max_test_samples=500", "--set", "train.max_steps=20",
           "--set", "cluster.register_timeout_s=20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (run / "scheduler.port").read_text().strip() != "1"
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
