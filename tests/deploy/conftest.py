"""What the deploy tests share: whether a missing part skips a test or fails it, and whether
this machine can make the network namespaces that give each emulated host its own address."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# In CI (CI=true: root, deploy/install-deps.sh ran) every part of a test runs as written: a
# missing part fails it instead of narrowing it.
STRICT = os.environ.get("CI", "").lower() not in ("", "0", "false")


def cannot_run(why):
    """Skips the test where a part it needs is missing; fails it in CI."""
    if STRICT:
        pytest.fail(why + " (in CI, where deploy/install-deps.sh ran as root, this is a failure)")
    pytest.skip(why)


def distinct_hosts():
    """True when deploy/netns.sh can make network namespaces here (one address per host).
    Outside CI a machine that cannot falls back to one host; in CI that is a failure."""
    check = subprocess.run([str(ROOT / "deploy" / "netns.sh"), "check"],
                           capture_output=True, text=True)
    if check.returncode != 0 and STRICT:
        pytest.fail("deploy/netns.sh check failed, so the hosts would not be distinct: "
                    + check.stderr.strip())
    return check.returncode == 0
