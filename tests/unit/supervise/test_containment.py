"""What every way of holding a server's processes shares (:mod:`rolloutd.supervise.containment`)."""

from __future__ import annotations

import asyncio
import time

from rolloutd.supervise.containment import Scope


class SlowScope(Scope):
    """A FAKE scope whose look at its processes takes 0.2 s, as a scan of /proc does on a busy
    host; it is empty from its third look on."""

    def __init__(self):
        self.looks = 0

    def __str__(self) -> str:
        return "a slow fake scope"

    def place(self, pid: int) -> None:
        pass

    def pids(self) -> list[int]:
        self.looks += 1
        time.sleep(0.2)
        return [] if self.looks >= 3 else [4242]

    def signal(self, sig: int) -> None:
        pass

    def release(self) -> None:
        pass


async def test_waiting_for_a_scope_to_empty_never_blocks_the_event_loop():
    scope = SlowScope()
    lateness: list[float] = []

    async def ticker() -> None:  # how late a 10 ms timer fires while the wait goes on
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            lateness.append(time.monotonic() - t0 - 0.01)
    tick = asyncio.create_task(ticker())
    try:
        assert await scope.wait_empty(5.0)
    finally:
        tick.cancel()
    assert scope.looks == 3
    assert max(lateness) < 0.1, f"the loop stalled {max(lateness):.3f} s while a scope was looked at"


class FailingScope(SlowScope):
    """A FAKE scope whose first ``failures`` looks fail as a read of /proc can (a descriptor
    closed under the read), then it is empty."""

    def __init__(self, failures: int):
        super().__init__()
        self.failures = failures

    def pids(self) -> list[int]:
        self.looks += 1
        if self.looks <= self.failures:
            raise OSError(9, "Bad file descriptor")
        return []


async def test_a_look_that_fails_counts_as_not_empty_and_the_next_one_decides():
    scope = FailingScope(failures=2)
    assert await scope.wait_empty(5.0)
    assert scope.looks == 3


async def test_looks_that_keep_failing_end_at_the_deadline_without_raising():
    scope = FailingScope(failures=10**6)
    t0 = time.monotonic()
    assert await scope.wait_empty(0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 3 and scope.looks >= 2
