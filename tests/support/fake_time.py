"""A fake clock for the event loop: time moves only when every task waits for a timer.

:class:`FakeTimeLoop` is an asyncio loop whose ``time()`` starts at 0 and jumps straight to the
next timer whenever nothing else is ready, so ``asyncio.sleep``, ``asyncio.timeout`` and every
``call_later`` of the code under test take no real time, and a scenario of minutes (backoff
delays, health probes, grace periods) runs in milliseconds with exact, repeatable timings.
Executor work (``asyncio.to_thread``) runs inline: no thread can race the jumps.

Only for code whose peers are all fakes in the same loop: real I/O gets no time to happen
between two jumps. A scenario where every task waits for something no timer will ever bring
raises :class:`Stuck` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Stuck(RuntimeError):
    """Every task waits and no timer is set: nothing can ever happen again."""


class _JumpWhenIdle:
    """The loop's selector: real events first (the loop's own wake-up pipe); when there are none,
    the fake clock jumps to the timer the loop would have slept until."""

    def __init__(self, loop: FakeTimeLoop):
        self._loop, self._real = loop, selectors.DefaultSelector()

    def select(self, timeout: float | None = None):
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Stuck("every task waits and no timer is set")
        self._loop.now += timeout
        return []

    def __getattr__(self, name: str):
        return getattr(self._real, name)


class FakeTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpWhenIdle(self))

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor, func, *args) -> asyncio.Future:
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except Exception as e:  # noqa: BLE001 - the awaiting caller gets it, as from a thread
            future.set_exception(e)
        return future


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a fresh :class:`FakeTimeLoop`; fail if it leaves a task pending. Whatever
    is left (a failed test's tasks) is cancelled and awaited before the loop closes."""
    loop = FakeTimeLoop()
    try:
        result = loop.run_until_complete(main)
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        assert left == [], f"tasks left pending: {left}"
        return result
    finally:
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
