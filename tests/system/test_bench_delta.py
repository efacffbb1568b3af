"""The tests of test_bench_delta.py that run one at a time in the slow tier (slow by this folder);
the rest, and the helpers and fixtures they share, are in tests/integration/test_bench_delta.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rolloutd.wire import delta

REPO = Path(__file__).resolve().parents[2]


def test_a_tiny_run_rebuilds_every_step_exactly_and_ends_with_its_summary(tmp_path):
    out = tmp_path / "delta.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "delta.py"), "--hidden", "64", "--layers", "2",
                           "--vocab", "256", "--steps", "2", "--threads", "2", "--tmp-dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("params", "lr", "steps", "delta_ratio_last", "best_encoding_ratio_last", "entropy_bound_last",
                "encode_vs_full_publish", "reconstruct_vs_memcpy", "encodings"):
        assert key in summary, key
    assert summary["lr"] == 1e-6 and summary["steps"] == 2 and summary["all_exact"] is True
    assert set(summary["encodings"]) == set(delta.ENCODINGS)
    assert summary["delta_ratio_last"] == summary["encodings"][delta.DEFAULT_ENCODING]["ratio_last"]
    assert summary["best_encoding_ratio_last"] == min(e["ratio_last"] for e in summary["encodings"].values())
    assert 0 < summary["entropy_bound_last"] < 1
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lr"], r["step"]) for r in rows] == [(1e-6, 1), (1e-6, 2), (1e-5, 1), (1e-5, 2)]
    for r in rows:  # a real optimizer step changed something, and every encoding rebuilt it exactly
        assert 0 < r["changed"] < 1
        assert {e: v["exact"] for e, v in r["enc"].items()} == dict.fromkeys(delta.ENCODINGS, True)
