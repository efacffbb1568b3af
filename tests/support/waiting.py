"""Waiting for the thing a test checks, instead of sleeping: one helper for async tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 20 ms until it is true; fail the test naming ``what`` after
    ``timeout_s`` (wall clock, whatever clock the loop runs on)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        await asyncio.sleep(0.02)
