"""bench/delta.py: its entropy bound is the one it states, and a tiny run rebuilds every step
exactly with every encoding and ends with the JSON the README and the issue read."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.delta import entropy_bound

REPO = Path(__file__).resolve().parents[2]


def test_the_entropy_bound_counts_which_elements_changed_and_by_how_many_steps():
    import torch  # here: collecting this file on every worker of the fast tier would import it there
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
