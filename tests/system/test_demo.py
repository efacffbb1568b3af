"""The README's main command: ``rolloutd demo`` runs the whole job with a real CPU vLLM server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.vllm_server import ROOT, VLLM, require_vllm

pytestmark = [pytest.mark.timeout(420)]


def test_demo_serves_three_versions_of_a_tied_model_exactly_the_third_as_a_delta_and_leaves_nothing(tmp_path):
    require_vllm()
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "demo", "--vllm", str(VLLM),
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    out = run.stdout
    log = (tmp_path / "demo.log").read_text()
    assert run.returncode == 0, (out + run.stderr + log)[-4000:]
    # The terminal holds the story and the status table; the daemon's and vLLM's lines go to
    # the file it names, and neither the run nor the stop it asked for made the daemon log an
    # ERROR or a WARNING there. (vLLM's own lines, relayed under rolloutd.server.<name>, have
    # warnings of their own, and may hold its shutdown race: "AsyncLLM output_handler failed"
    # when its engine exits before the handler is cancelled.)
    assert f"demo: the daemon's and vLLM's logs: {tmp_path / 'demo.log'}" in out
    assert run.stderr == "", run.stderr[-4000:]
    assert "rolloutd.server.cpu0" not in out and "rolloutd.server.cpu0" in log
    assert not re.findall(r"^\S+ \S+ (?:ERROR|WARNING) (?!rolloutd\.server\.).*", log, re.M), log[-4000:]
    assert "with tied embeddings" in out
    for v in (1, 2, 3):
        assert f"trainer: published version {v}" in out
        if v < 3:  # new seeds: every weight differs, so the registry sends them whole
            assert re.search(rf"trainer: published version {v} .*; the registry sends it whole", out), out
            assert f"node: pulled version {v} whole" in out, out
        assert re.search(rf"status: cpu0 SERVING version {v} \(incarnation 1, pid \d+\)", out), out
        assert f'"version": "{v}"' in out  # the tokens are labelled with the version
    gens = re.findall(r"generate at http://127.0.0.1:\d+ \(the gateway\) \[.*?\] -> (\[.*?\])", out)
    refs = re.findall(r"transformers on the published weights  -> (\[.*?\]): equal", out)
    assert len(gens) == 3 and len(set(gens)) == 3, out  # three versions, three different answers...
    assert refs == gens, out  # ... each equal to transformers' on that version's weights
    # Version 3 was pulled into version 1's file, removed once the server moved on (mirror.recycle):
    # transformers' answer on version 3 above shows that no stale byte of version 1 was served.
    assert re.search(r"begin version 3 in .* \(1 files, (\d+) bytes, \1 of them in recycled pages\)", log), \
        log[-4000:]
    assert len(re.findall(r"gate: the version's canary scored on the server: max \|dlogprob\| \S+", out)) == 3
    # Version 3 is one RL-like step after version 2: a delta, and the node says (from its /status)
    # that it fetched a small share of the version's bytes; its outputs above equal transformers'.
    assert re.search(r"trainer: published version 3 .*; the registry sends it as a delta on version 2: ", out), out
    fetched = re.search(r"node: pulled version 3 as a delta on version 2: fetched (\d+) bytes of its (\d+) "
                        r"\(\S+%\), rebuilt and checked chunk by chunk in \d+ ms", out)
    assert fetched, out
    assert 0 < int(fetched[1]) < 0.15 * int(fetched[2]), fetched[0]
    assert "demo: done" in out
    assert "stop rolloutd: every server stopped" in log
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert left == "", f"processes left behind: {left}"
