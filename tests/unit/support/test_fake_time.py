"""The fake clock of tests/support/fake_time.py: timers take no real time and fire in order, executor work
runs inline, a scenario that can never go on fails instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.support.fake_time import Stuck, run


def test_sleeps_and_timeouts_take_fake_time_only():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        loop.call_later(30, seen.append, "later")
        await asyncio.sleep(3600)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(60):
                await asyncio.Event().wait()
        return loop.time(), seen

    t0 = time.perf_counter()
    assert run(main()) == (3660.0, ["later"])
    assert time.perf_counter() - t0 < 1.0


def test_executor_work_runs_inline_at_one_fake_instant():
    async def main():
        loop = asyncio.get_running_loop()
        before = loop.time()
        name = await asyncio.to_thread(lambda: threading.current_thread().name)
        with pytest.raises(ZeroDivisionError):
            await asyncio.to_thread(lambda: 1 / 0)
        return name, loop.time() - before

    assert run(main()) == (threading.current_thread().name, 0.0)


def test_a_scenario_waiting_for_nothing_is_stuck_and_a_task_left_pending_fails():
    with pytest.raises(Stuck):
        run(asyncio.Event().wait())

    async def leaves_a_task():
        asyncio.ensure_future(asyncio.sleep(10))

    with pytest.raises(AssertionError, match="tasks left pending"):
        run(leaves_a_task())
