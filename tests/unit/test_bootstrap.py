"""scripts/bootstrap: each command installs what it needs. The demo's bootstrap asks apt for
nothing; the tests' asks for the machine tools they use that are missing.

Run with a PATH that holds only the shell tools the script uses and a FAKE ``apt-get`` that
records its arguments; the environments are already current (the stamps match), so no pip runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_TOOLS = ["bash", "cat", "sha256sum", "cut", "grep", "sort", "id", "mkdir", "dirname", "printf", "env"]
FAKE_APT = """#!/bin/sh
echo "$@" >> "{record}"
[ "$1" = update ] || exit 100  # the install fails, as on a machine without the packages
"""


def bootstrap(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    if os.geteuid() != 0:
        pytest.fail("the bootstrap installs machine tools as root only: run the tests as root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in SHELL_TOOLS:
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").unlink(missing_ok=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    record = tmp_path / "apt-get.calls"
    record.unlink(missing_ok=True)
    apt = bin_dir / "apt-get"
    apt.write_text(FAKE_APT.format(record=record))
    apt.chmod(0o755)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap"), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    return run, record.read_text() if record.exists() else ""


def test_the_demos_bootstrap_installs_no_machine_tool(tmp_path):
    run, apt = bootstrap(tmp_path, "demo")
    assert run.returncode == 0, run.stderr
    assert apt == "", apt


def test_the_tests_bootstrap_asks_apt_for_the_tools_they_use(tmp_path):
    run, apt = bootstrap(tmp_path)
    assert run.returncode == 1 and "bootstrap: apt-get could not install" in run.stderr, run.stderr
    install = next(line for line in apt.splitlines() if line.startswith("install"))
    for package in ("systemd-container", "debootstrap", "chromium", "chromium-driver", "iproute2", "strace"):
        assert package in install.split(), install


def test_an_unknown_purpose_is_refused(tmp_path):
    run, apt = bootstrap(tmp_path, "everything")
    assert run.returncode == 2 and "usage: scripts/bootstrap [demo|test]" in run.stderr and apt == ""
