"""deploy/summarize.py on synthetic run directories: one Markdown row per run with the numbers
of its summary.json, the method named for PS and allreduce runs, a clear error for a directory
without a summary. Run by ctest with Debian's python3 -m pytest."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "deploy", "summarize.py")

PS = {"job_name": "quickstart", "status": "ok", "num_workers": 2, "num_servers": 2,
      "aggregation": "ps", "collective": "", "encoding": "topk", "density": 0.01,
      "num_params": 235146, "final_test_accuracy": 0.87656, "wall_clock_s": 11.24,
      "train_s": 9.87, "steps": 2808, "bytes_sent_per_worker_per_step": 19089.4,
      "bytes_received_per_worker_per_step": 37685.2, "cluster_samples_per_s": 36437.2,
      "workers": [], "servers": [{"rank": 0, "rejected": 3}, {"rank": 1, "rejected": 4}]}


def run(*dirs):
    return subprocess.run([sys.executable, SCRIPT, *dirs], capture_output=True, text=True)


def write(tmp_path, name, summary):
    d = tmp_path / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(summary))
    return str(d)


def test_one_row_per_run_with_its_numbers(tmp_path):
    ps = write(tmp_path, "quickstart-1", PS)
    ar = write(tmp_path, "spardl-1", dict(PS, aggregation="allreduce", collective="spardl",
                                          encoding="", num_servers=0, servers=[],
                                          final_test_accuracy=0.8466,
                                          cluster_samples_per_s=1234.6))
    r = run(ps, ar)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().split("\n")
    assert lines[0].startswith("| run | method | density | W | S | status | test acc |")
    assert lines[1] == "|" + "---|" * 14
    assert lines[2] == ("| quickstart-1 | ps/topk | 0.01 | 2 | 2 | ok | 87.66% | 11.2 | 9.9 "
                        "| 2808 | 19089 | 37685 | 36437 | 7 |")
    assert lines[3].startswith("| spardl-1 | allreduce/spardl | 0.01 | 2 | 0 | ok | 84.66% |")
    assert lines[3].endswith("| 1235 | - |")


def test_a_directory_without_a_summary_is_an_error_naming_it(tmp_path):
    ok = write(tmp_path, "ok", PS)
    r = run(ok, str(tmp_path / "missing"))
    assert r.returncode == 1
    assert os.path.join(str(tmp_path / "missing"), "summary.json") in r.stderr
    assert r.stdout == ""


def test_help_and_no_arguments():
    assert run("--help").returncode == 0
    assert "summary.json" in run("--help").stdout
    assert run().returncode == 2
