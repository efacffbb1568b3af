"""bench/delta.py: its entropy bound is the one it states, and a tiny run rebuilds every step
exactly with every encoding and ends with the JSON the README and the issue read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.delta import entropy_bound
from rolloutd.wire import delta

REPO = Path(__file__).resolve().parents[2]


def test_the_entropy_bound_counts_which_elements_changed_and_by_how_many_steps():
    base = torch.full((1000,), 1.0, dtype=torch.bfloat16)
    target = base.clone()
    target.view(torch.int16)[::2] += 1  # half move one bf16 step up
    changed, bound = entropy_bound({"w": base}, {"w": target})
    assert changed == 0.5
    assert bound == pytest.approx(1 / 16)  # 1 bit of 16 per element: which; no bits for the step (always +1)
    target[1::4] = (base[1::4].float() - 0.5).bfloat16()  # a quarter more move many steps down
    changed, bound = entropy_bound({"w": base}, {"w": target})
    assert changed == 0.75
    h_which = -(0.75 * torch.log2(torch.tensor(0.75)) + 0.25 * torch.log2(torch.tensor(0.25)))
    assert bound == pytest.approx((h_which.item() + 0.75 * 0.918296) / 16, rel=1e-4)  # steps: 2/3 vs 1/3
    assert entropy_bound({"w": base}, {"w": base.clone()}) == (0.0, 0.0)


@pytest.mark.slow
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
