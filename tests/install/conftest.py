"""What the install tests share: the tree, the build, the project's version, whether a missing
part skips a test or fails it, and a subprocess run that captures its output."""
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
VERSION = re.search(r"project\(sparseps VERSION ([0-9.]+)",
                    (ROOT / "CMakeLists.txt").read_text()).group(1)

# In CI (CI=true: root, deploy/install-deps.sh ran) every part of a test runs as written: a
# missing part fails it instead of narrowing it.
STRICT = os.environ.get("CI", "").lower() not in ("", "0", "false")


def cannot_run(why):
    """Skips the test where a part it needs is missing; fails it in CI."""
    if STRICT:
        pytest.fail(why + " (in CI, where deploy/install-deps.sh ran as root, this is a failure)")
    pytest.skip(why)


def run(cmd, **kw):
    """subprocess.run with the output captured as text and a 300 s timeout unless given."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 300)
    return subprocess.run(cmd, **kw)
