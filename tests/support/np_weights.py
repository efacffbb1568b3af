"""numpy state dicts, and steps on them that change a few elements as an optimizer step does."""

from __future__ import annotations

import numpy as np


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.mlp.weight": rng.standard_normal((256, 256)).astype(np.float32) for i in range(8)}


def step(sd: dict[str, np.ndarray], seed: int, fraction: float = 0.01) -> dict[str, np.ndarray]:
    """A copy of ``sd`` with about ``fraction`` of its elements nudged, as an optimizer step does."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in sd.items():
        t = t.copy()
        flat = t.reshape(-1)
        idx = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
        flat[idx] += np.float32(1e-3)
        out[name] = t
    return out
