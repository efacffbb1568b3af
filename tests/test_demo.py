"""The README's main command: ``rolloutd demo`` runs the whole job with a real CPU vLLM server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .vllm_server import ROOT, VLLM, require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_demo_serves_three_versions_of_a_tied_model_exactly_and_leaves_nothing(tmp_path):
    require_vllm()
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "demo", "--vllm", str(VLLM),
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-4000:]
    assert "with tied embeddings" in out
    for v in (1, 2, 3):
        assert f"trainer: published version {v}" in out
        assert re.search(rf"status: cpu0 SERVING version {v} \(incarnation 1, pid \d+\)", out), out
        assert f'"version": "{v}"' in out  # the tokens are labelled with the version
    gens = re.findall(r"generate at http://127.0.0.1:\d+ \(the gateway\) \[.*?\] -> (\[.*?\])", out)
    refs = re.findall(r"transformers on the published weights  -> (\[.*?\]): equal", out)
    assert len(gens) == 3 and len(set(gens)) == 3, out  # three versions, three different answers...
    assert refs == gens, out  # ... each equal to transformers' on that version's weights
    # Version 3 was pulled into version 1's file, removed once the server moved on (mirror.recycle):
    # transformers' answer on version 3 above shows that no stale byte of version 1 was served.
    assert re.search(r"begin version 3 in .* \(1 files, (\d+) bytes, \1 of them in recycled pages\)", run.stderr), \
        run.stderr[-4000:]
    assert len(re.findall(r"gate: the version's canary scored on the server: max \|dlogprob\| \S+", out)) == 3
    assert "demo: done" in out
    assert "stop rolloutd: every server stopped" in run.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert left == "", f"processes left behind: {left}"
