"""The trained model file as a PyTorch user meets it: <run.dir>/model.safetensors read with json
and numpy alone (no sparseps, no safetensors package), its tensors named by layer with the
model's shapes, and the MLP it holds, run in numpy on the Fashion-MNIST test set, scoring what
the job reported and what sparseps-eval says."""
import gzip
import json
import os
import pathlib
import struct
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
DATA = pathlib.Path("/usr/share/datasets/fashion-mnist")
DTYPES = {"F32": np.float32, "F64": np.float64, "U8": np.uint8, "U32": np.uint32,
          "I64": np.int64, "U64": np.uint64}


def read_safetensors(path):
    """(tensors by name, metadata) of a safetensors file, by the format's definition."""
    raw = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype=DTYPES[t["dtype"]]).reshape(
            t["shape"])
    return tensors, meta


def read_idx(path):
    with gzip.open(path) as f:
        raw = f.read()
    dims = raw[3]
    shape = struct.unpack(">" + "I" * dims, raw[4:4 + 4 * dims])
    return np.frombuffer(raw[4 + 4 * dims:], dtype=np.uint8).reshape(shape)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not (DATA / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST not installed")
    run_dir = tmp_path_factory.mktemp("model") / "run"
    cmd = ["/bin/bash", str(ROOT / "deploy" / "launch.sh"), "--quiet", "--build-dir", str(BUILD),
           "--run-dir", str(run_dir), "--set", "model.hidden=[64,32]",
           "--set", "data.max_train_samples=12800", "--set", "train.max_steps=200",
           "--set", "checkpoint.every_steps=100"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


def test_layers_shapes_and_metadata(run):
    tensors, meta = read_safetensors(run / "model.safetensors")
    assert list(tensors) == ["fc0.bias", "fc0.weight", "fc1.bias", "fc1.weight", "fc2.bias",
                             "fc2.weight"]
    assert tensors["fc0.weight"].shape == (784, 64)
    assert tensors["fc1.weight"].shape == (64, 32)
    assert tensors["fc2.weight"].shape == (32, 10)
    assert tensors["fc2.bias"].shape == (10,)
    assert meta["format"] == "sparseps-model"
    assert meta["iteration"] == "200"
    assert all(np.isfinite(t).all() for t in tensors.values())
    # The checkpoint of iteration 200 holds the same model; that of 100 another one.
    same, _ = read_safetensors(run / "checkpoints" / "iter-0000000200" / "model.safetensors")
    older, _ = read_safetensors(run / "checkpoints" / "iter-0000000100" / "model.safetensors")
    for name, t in tensors.items():
        np.testing.assert_array_equal(same[name], t)
    assert any((older[name] != t).any() for name, t in tensors.items())


def test_numpy_forward_pass_scores_what_the_job_reported(run):
    tensors, meta = read_safetensors(run / "model.safetensors")
    # The input normalisation the model was trained with is in the file.
    x = read_idx(DATA / "t10k-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255.0
    x = (x - float(meta["input_mean"])) / float(meta["input_std"])
    y = read_idx(DATA / "t10k-labels-idx1-ubyte.gz")
    h = x
    for layer in range(3):
        h = h @ tensors[f"fc{layer}.weight"] + tensors[f"fc{layer}.bias"]
        if layer < 2:
            h = np.maximum(h, 0.0)
    accuracy = float((h.argmax(axis=1) == y).mean())
    reported = json.loads((run / "summary.json").read_text())["final_test_accuracy"]
    assert reported > 0.7
    # The same network in another summation order: a test sample or two may tie differently.
    assert abs(accuracy - reported) <= 0.002, (accuracy, reported)

    out = subprocess.run([str(BUILD / "worker" / "sparseps-eval"), "--model",
                          str(run / "model.safetensors"), "--config", str(run / "config.yaml"),
                          "--set", "model.hidden=[64,32]", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["test_accuracy"] == pytest.approx(reported, abs=1e-6)
    assert result["iteration"] == "200"


def test_eval_refuses_a_model_of_another_config(run):
    out = subprocess.run([str(BUILD / "worker" / "sparseps-eval"), "--model",
                          str(run / "model.safetensors"), "--config", str(run / "config.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "fc0.weight" in out.stderr and "another shape" in out.stderr
