"""Every figure that README.md and docs/user-guide.md state (a percentage, a ratio such as 0.29x
or 23x, a time in seconds with decimals) must appear, with the same number and unit, in
docs/BENCHMARKS.md, where each has the command that produced it and the machine it ran on.
Run by ctest with Debian's python3 -m pytest."""
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
FIGURE = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?)\s?(%|x(?![\w])|×|(?<=\d) s\b)")
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
            number, unit = m.group(1), m.group(2).strip()
            unit = "x" if unit in ("x", "×") else unit
            if unit == "s" and "." not in number:
                continue  # whole seconds are settings (timeouts, intervals)
            out.append((number + unit, line.strip()))
    return out


def benchmarks():
    with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as f:
        text = f.read().replace("×", "x")
    found = set()
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s?(%|x|s\b)", text):
        found.add(number + unit)
    return found


@pytest.mark.parametrize("page", ["README.md", os.path.join("docs", "user-guide.md")])
def test_every_figure_comes_from_benchmarks(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    known = benchmarks()
    missing = [(fig, line) for fig, line in figures(text)
               if fig not in SETTINGS and fig not in known]
    assert not missing, f"{page}: figures not in docs/BENCHMARKS.md:\n" + "\n".join(
        f"  {fig}: {line}" for fig, line in missing)


def test_the_check_catches_a_figure_that_is_not_there():
    made_up = "The CNN reaches 89.2% in 41.5 s, 3.1x faster.\n```\nloss 0.4 acc 12.5%\n```\n"
    assert [f for f, _ in figures(made_up)] == ["89.2%", "41.5s", "3.1x"]
    assert "89.2%" not in benchmarks()
