"""Byte counts, shares, ages and versions for people: ``1.8 MiB``, ``512 B``, ``2.1%``, ``3m05s``, ``v7``."""

from __future__ import annotations


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def percent(ratio: float) -> str:
    """0.021 -> ``2.1%``: whole percents from 10 %, one decimal below, two below 0.1 %, and
    ``<0.01%`` for less but not nothing (a delta's share of its version's size is often under 1 %)."""
    p = 100 * ratio
    if 0 < p < 0.005:
        return "<0.01%"
    return f"{p:.0f}%" if p >= 10 or p == 0 else f"{p:.1f}%" if p >= 0.1 else f"{p:.2f}%"


def age(seconds: float) -> str:
    s = int(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def version_label(version: int | None) -> str:
    return "-" if version is None else f"v{version}"
