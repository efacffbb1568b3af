"""The schemathesis command the fuzz tests run (installed with the test extras)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def schemathesis() -> str:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(exe).exists():
        pytest.fail("schemathesis is not installed: scripts/bootstrap installs it with the test extras")
    return exe
