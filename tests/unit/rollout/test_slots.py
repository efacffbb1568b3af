"""Rolling updates across a reload: never more than ``update.max_unavailable`` servers paused at
once, also while a reload changes it (the daemon's slots, as every supervisor takes them)."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.config import Config
from rolloutd.node.daemon import Daemon
from rolloutd.rollout.slots import RolloutSlots

pytestmark = pytest.mark.timeout(30)


def rolling(max_unavailable: int) -> Config:
    return Config.model_validate({
        "registry": {"url": "http://trainer:8700"},
        "update": {"strategy": "rolling", "max_unavailable": max_unavailable},
        "servers": [{"name": f"s{i}", "model": "/m", "public_port": 9001 + i} for i in range(4)]})


class Updates:
    """Servers that each hold a rollout slot, as ``Supervisor._update`` does, until let go; every
    entry records how many held a slot then and the limit of the configuration running then."""

    def __init__(self, daemon: Daemon):
        self.daemon, self.entries, self.inside = daemon, [], set()
        self.go = {name: asyncio.Event() for name in ("A", "B", "C", "D")}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str) -> None:
        self.tasks[name] = asyncio.ensure_future(self._update(name))

    async def _update(self, name: str) -> None:
        async with self.daemon._rollout_slots():
            self.inside.add(name)
            self.entries.append((name, len(self.inside), self.daemon.cfg.update.max_unavailable))
            await self.go[name].wait()
            self.inside.discard(name)

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (3, 1)])
async def test_a_reload_of_max_unavailable_never_lets_more_servers_update_at_once(before, after):
    daemon = Daemon(rolling(before))
    updates = Updates(daemon)
    for name in "ABCD"[:before]:  # as many as the old limit lets in, mid-update at the reload
        updates.start(name)
    await updates.settle()
    assert len(updates.inside) == before
    daemon.cfg = rolling(after)  # the reload (Daemon._reload_now swaps the config so)
    for name in "ABCD"[before:]:
        updates.start(name)
    await updates.settle()
    assert len(updates.inside) == max(before, min(after, 4)), updates.entries
    for name in "ABCD":  # let them finish one by one: each entry must fit the limit of its time
        updates.go[name].set()
        await updates.settle()
    await asyncio.gather(*updates.tasks.values())
    assert [n for n, _, _ in updates.entries] == list("ABCD")
    for name, inside, limit in updates.entries:
        assert inside <= limit, f"{name} entered with {inside} servers updating; the limit was {limit}"


async def test_a_larger_limit_lets_a_waiting_server_in_at_once():
    slots = RolloutSlots(1)
    await slots.acquire()
    waiting = asyncio.ensure_future(slots.acquire())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    slots.resize(2)
    await asyncio.wait_for(waiting, 1)
    assert slots.held == 2


async def test_a_waiter_cancelled_after_its_turn_came_passes_it_on():
    slots = RolloutSlots(1)
    await slots.acquire()
    first, second = asyncio.ensure_future(slots.acquire()), asyncio.ensure_future(slots.acquire())
    await asyncio.sleep(0.01)
    slots.release()  # first's turn ...
    first.cancel()  # ... but it is cancelled before it runs
    await asyncio.wait_for(second, 1)
    assert slots.held == 1 and first.cancelled()
