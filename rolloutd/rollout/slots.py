"""Rollout slots: how many of the node's servers may be out of traffic for an update at once.

A server holds a slot from pausing to resuming (``async with slots:``). The limit is
``update.max_unavailable`` when rolling, every server otherwise, and a reload may change it:
:meth:`RolloutSlots.resize` changes the limit of the one object every server shares, so the
servers updating across a reload keep counting against the new limit. (Replacing the semaphore
would let the holders of the old one and those of the new one add up past the limit.) A smaller
limit lets no one in until enough holders left; a larger one lets waiters in at once.
"""

from __future__ import annotations

import asyncio
import collections


class RolloutSlots:
    def __init__(self, limit: int):
        self._limit = max(1, limit)
        self._held = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # in arrival order

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def held(self) -> int:
        """Slots taken now (at most ``limit``, unless the limit was lowered meanwhile)."""
        return self._held

    def resize(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._wake()

    async def acquire(self) -> None:
        while self._held >= self._limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: the turn goes to the next waiter
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._held += 1

    def release(self) -> None:
        if self._held <= 0:
            raise RuntimeError("release of a rollout slot nobody holds")
        self._held -= 1
        self._wake()

    def _wake(self) -> None:
        """Wake as many waiters, first come first, as there are free slots (each checks again)."""
        free = self._limit - self._held
        for waiter in self._waiters:
            if free <= 0:
                break
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    async def __aenter__(self) -> RolloutSlots:
        await self.acquire()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
