"""bench/plot_timeline.py on synthetic traces (the columns of worker/step_trace.h): the step it
picks, the PNG it writes, and clear errors for an empty trace or a step it lacks. Also that
bench/sparseps-compare draws timeline.png from the runs that traced their steps. Run by ctest
with Debian's python3 -m pytest."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
import plot_timeline  # noqa: E402

from test_sparseps_compare import driver  # noqa: E402

HEADER = "step,lane,event,start_ms,end_ms\n"


def write_trace(path, lengths):
    """A trace whose step s (1-based) lasts lengths[s - 1] ms: two layers, two ranges."""
    rows = []
    for s, length in enumerate(lengths, start=1):
        half = length / 2
        rows += [f"{s},compute,forward + backward fc1,0,{half / 2}",
                 f"{s},compute,backward fc0,{half / 2},{half}",
                 f"{s},range0,encode,{half},{half + 1}",
                 f"{s},range0,push,{half + 1},{half + 2}",
                 f"{s},range0,pull,{half + 1},{length - 1}",
                 f"{s},range1,encode,{half / 2},{half / 2 + 1}",
                 f"{s},range1,push,{half / 2 + 1},{half}",
                 f"{s},range1,pull,{half / 2 + 1},{length - 2}",
                 f"{s},step,wait,{half},{length}"]
    with open(path, "w") as f:
        f.write(HEADER + "\n".join(rows) + "\n")


def test_the_median_step_after_the_warm_up_is_drawn(tmp_path):
    # Steps 1-5 are the warm-up (long); of steps 6-10 (lengths 30, 10, 50, 20, 40) the median is
    # step 6 (30 ms).
    write_trace(tmp_path / "a.csv", [500, 400, 300, 200, 100, 30, 10, 50, 20, 40])
    write_trace(tmp_path / "b.csv", [60] * 10)
    out = tmp_path / "timeline.png"
    summary = plot_timeline.plot([("a", tmp_path / "a.csv"), ("b", tmp_path / "b.csv")], out)
    assert summary["a"] == (6, 30.0)
    assert summary["b"][1] == 60.0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_timeline.plot([("a", tmp_path / "a.csv")], out, step=8) == {"a": (8, 50.0)}


def test_an_empty_trace_or_a_missing_step_is_a_clear_error(tmp_path):
    (tmp_path / "empty.csv").write_text(HEADER)
    with pytest.raises(ValueError, match="no traced steps"):
        plot_timeline.plot([("e", tmp_path / "empty.csv")], tmp_path / "x.png")
    write_trace(tmp_path / "a.csv", [10, 20])
    with pytest.raises(ValueError, match="step 7 is not in the trace"):
        plot_timeline.plot([("a", tmp_path / "a.csv")], tmp_path / "x.png", step=7)


def test_the_comparison_draws_the_settings_that_traced(tmp_path):
    os.makedirs(tmp_path / "runs" / "traced")
    os.makedirs(tmp_path / "runs" / "untraced")
    write_trace(tmp_path / "runs" / "traced" / "trace-worker-0.csv", [20] * 8)
    driver.draw_timeline(str(tmp_path), [{"setting": "traced"}, {"setting": "untraced"}])
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    os.remove(tmp_path / "timeline.png")
    driver.draw_timeline(str(tmp_path), [{"setting": "untraced"}])
    assert not (tmp_path / "timeline.png").exists()
