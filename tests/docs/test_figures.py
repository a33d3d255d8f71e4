"""Every figure that README.md and docs/user-guide.md state (a percentage, a ratio such as 0.29x
or 23x, a time in seconds with decimals) must appear, with the same number and unit, in
docs/results.md, where each has the command that produced it, the machine, the date and the
commit (docs/render_results.py renders that page; tests/docs/test_results_page.py checks it).
Run by ctest with Debian's python3 -m pytest."""
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
NUMBER = r"(\d+(?:\.\d+)?)"
# A number, or a range of two such as 85-89 or 12.2–13.4 (both ends count), then the unit.
NUMBERS = NUMBER + r"(?:\s?[-–]\s?" + NUMBER + r")?\s?"
# x or ×, but not a product such as "5 × 10k" or "4 x 8".
UNIT = r"(%|x(?!\w)(?!\s?\d)|×(?!\s?\d)|(?<=\d) s\b)"
FIGURE = re.compile(r"(?<![\w.\-–])" + NUMBERS + UNIT)
# Percentages that are settings, not measurements (densities and the like).
SETTINGS = {"1%", "0.1%"}


def figures(text):
    """(figure, line) of every figure in the text, outside fenced code blocks (examples of
    output and commands are not claims)."""
    out = []
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in FIGURE.finditer(line):
            unit = m.group(3).strip()
            unit = "x" if unit in ("x", "×") else unit
            for number in filter(None, (m.group(1), m.group(2))):
                if unit == "s" and "." not in number:
                    continue  # whole seconds are settings (timeouts, intervals)
                out.append((number + unit, line.strip()))
    return out


def benchmarks():
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        return known_figures(f.read())


def known_figures(text):
    """Every figure a page of results states, as figures() spells them."""
    text = text.replace("×", "x")
    found = set()
    # As FIGURE: "5 x 10k" is no ratio, and both ends of a range count.
    for low, high, unit in re.findall(r"(?<![\w.])" + NUMBERS + r"(%|x(?!\w)(?!\s?\d)|s\b)",
                                      text):
        found.update(number + unit for number in (low, high) if number)
    return found


@pytest.mark.parametrize("page", ["README.md", os.path.join("docs", "user-guide.md")])
def test_every_figure_comes_from_benchmarks(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    known = benchmarks()
    missing = [(fig, line) for fig, line in figures(text)
               if fig not in SETTINGS and fig not in known]
    assert not missing, f"{page}: figures not in docs/results.md:\n" + "\n".join(
        f"  {fig}: {line}" for fig, line in missing)


def test_the_check_catches_a_figure_that_is_not_there():
    made_up = "The CNN reaches 89.2% in 41.5 s, 3.1x faster.\n```\nloss 0.4 acc 12.5%\n```\n"
    assert [f for f, _ in figures(made_up)] == ["89.2%", "41.5s", "3.1x"]
    assert "89.2%" not in benchmarks()
    # Both ends of a range, with a hyphen or an en dash; a product is no ratio.
    ranges = "between 85-89% and 0.77–0.83x, in 12.2–13.4 s; 5 × 10k steps, 4 x86 hosts\n"
    assert [f for f, _ in figures(ranges)] == ["85%", "89%", "0.77x", "0.83x", "12.2s", "13.4s"]
    assert known_figures("5 × 10k steps at 85-89% and 0.77–0.83x, 3x") == {
        "85%", "89%", "0.77x", "0.83x", "3x"}
