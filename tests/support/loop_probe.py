"""Where a blocking call runs: on an event loop's thread, or off it."""

from __future__ import annotations

import asyncio
import shutil


def where_rmtree_runs(monkeypatch) -> list[str]:
    """Record, for every shutil.rmtree, whether it ran on an event loop's thread."""
    where: list[str] = []
    real = shutil.rmtree

    def rmtree(path, *args, **kw):
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:
            where.append("thread")
        return real(path, *args, **kw)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return where
