"""The code passes the project's linter (ruff, settings in pyproject.toml), so that a change
that breaks the style or leaves an unused import fails the suite, not a later reader."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "rolloutd", "tests", "bench",
                          "scripts", "vllm_plugin"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
