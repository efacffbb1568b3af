"""Three minutes of the soak (bench/soak.py): the real daemon with two real ``vllm serve``, a
version every few seconds, every kind of fault at least once, and every answer checked.

Three minutes, not more: one round of every fault kind fits in them (a fault every 18 s; the
round is finished past the three minutes on a slow machine), and a longer run repeats the round.
Longer runs are bench/soak.py's (bench/README.md).

The soak's own goals are asserted from its last line (a JSON object): no wrong output, no torn
load, nothing left behind, the servers on the last version at the end, each fault kind seen.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.soak_faults import KINDS
from tests.support.vllm_server import ROOT, require_vllm

pytestmark = [pytest.mark.timeout(2700)]


def test_three_minutes_of_chaos_serve_no_wrong_output_and_leave_nothing_behind(tmp_path):
    require_vllm()  # a machine without vLLM fails here, it does not skip
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "3", "--seed", "1",
                          "--workdir", str(tmp_path / "soak")], cwd=ROOT, capture_output=True, text=True,
                         timeout=2600)
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-5000:]
    print("\n".join(lines[-40:]))
    result = json.loads(lines[-1])
    context = f"{lines[-1]}\n{run.stderr[-3000:]}\ndaemon log: {tmp_path / 'soak' / 'rolloutd.log'}"
    assert result.get("error") is None, context
    assert result["wrong_outputs"] == 0 and result["torn_loads"] == 0, context
    assert result["claim_mismatches"] == 0, context
    assert result["orphans"] == 0 and result["daemon_exit"] == 0, context
    assert result["converged"] is True, context
    assert {k: n for k, n in result["faults"].items() if n < 1} == {}, context
    assert set(result["faults"]) == set(KINDS), context
    # it did something (how much depends on how long the servers take to come back on this host)
    assert result["checks_ok"] >= 20 and result["versions_published"] >= 20 and result["updates"] >= 5, context
    assert result["goals_missed"] == [] and run.returncode == 0, context
