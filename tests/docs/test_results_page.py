"""docs/results.md is what docs/render_results.py renders from the committed result files
(docs/results/*.json, the comparisons' results.csv and results.md): a re-run that changed a result
file without rendering, or a hand edit of the page, fails here. Run by ctest with Debian's
python3 -m pytest."""
import importlib.util
import json
import os

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def renderer():
    spec = importlib.util.spec_from_file_location(
        "render_results", os.path.join(ROOT, "docs", "render_results.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rendering_reproduces_the_committed_page():
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        committed = f.read()
    assert renderer().render() == committed, (
        "docs/results.md differs from what docs/render_results.py renders: run it and commit")


def test_every_entered_figure_names_its_command_machine_date_and_commit():
    with open(os.path.join(ROOT, "docs", "results", "entered.json")) as f:
        sections = json.load(f)["sections"]
    for name, entries in sections.items():
        for e in entries:
            for key in ("title", "text", "command", "machine", "date", "commit", "log"):
                assert e.get(key), f"entered.json, {name}, {e.get('title')}: no {key}"


def test_every_written_up_section_is_in_the_log():
    with open(os.path.join(ROOT, "docs", "log", "benchmarks-2026-11.md")) as f:
        headings = {line.lstrip("#").strip() for line in f if line.startswith("#")}
    with open(os.path.join(ROOT, "docs", "results", "entered.json")) as f:
        sections = json.load(f)["sections"]
    for entries in sections.values():
        for e in entries:
            assert e["log"] in headings, f"{e['title']}: no section '{e['log']}' in the log"


def test_a_changed_result_changes_the_page(monkeypatch):
    module = renderer()
    page = module.render()
    original = module.load

    def load(name):
        data = original(name)
        if name == "quickstart.json":
            data["jobs"][0]["runs"][0]["final_test_accuracy"] = 0.1234
        return data

    monkeypatch.setattr(module, "load", load)
    changed = module.render()
    assert changed != page and "12.34%" in changed


def test_settings_run_with_several_seeds_get_their_spread():
    """NAME and NAME_seedN rows are one setting run with several seeds: the median and range
    of the time to the target and of the final accuracy; a seed that missed the target is
    counted, not averaged in. The page takes the table from bench/sparseps-compare (its
    seed_table, which the comparisons' own results.md hold too), fed results.csv's text."""
    seed_table = renderer().load_driver().seed_table

    def row(name, t, acc):
        return {"setting": name, "time_to_target_s": t, "final_accuracy": str(acc)}

    rows = [row("ddp", "10.0", 0.88), row("ps", "4.0", 0.87), row("gloo", "nan", 0.5),
            row("ddp_seed43", "14.0", 0.9), row("ps_seed43", "nan", 0.86),
            row("ddp_seed44", "12.0", 0.89), row("ps_seed44", "5.0", 0.875)]
    lines = seed_table(rows, False)
    assert "| ddp | 3 | 12.0 (10.0–14.0) | 89.00% (88.00%–90.00%) |" in lines
    assert "| ps | 3 | reached by 2 of 3 (4.0–5.0) | 87.00% (86.00%–87.50%) |" in lines
    assert not any(line.startswith("| gloo |") for line in lines)
    assert seed_table([row("ddp", "1.0", 0.8)], False) == []
