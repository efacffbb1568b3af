"""A blocking façade of :class:`~rolloutd.fleet.client.Fleet`, for a trainer that is not asyncio.

The client runs on an event loop of its own in a thread; each call hands its work to that loop
and waits. ``submit`` returns a :class:`concurrent.futures.Future` at once: many requests can
be in flight from one thread, and ``future.cancel()`` aborts a request on its server.

>>> with FleetSync("http://trainer:8700") as fleet:
...     outs = fleet.generate_many(prompts, Sampling(max_tokens=64, seed=1), max_lag=2)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rolloutd.fleet.client import Fleet
from rolloutd.fleet.result import Generation
from rolloutd.fleet.sampling import Sampling


class FleetSync:
    def __init__(self, registry_url: str, **options: Any):
        """``options`` are :class:`Fleet`'s."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rolloutd-fleet", daemon=True)
        self._thread.start()
        self.fleet = Fleet(registry_url, **options)
        try:
            self._call(self.fleet.start())
        except BaseException:
            self._end_loop()
            raise

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, prompt_ids: Sequence[int], sampling: Sampling | None = None,
               **contract_kw: Any) -> concurrent.futures.Future[Generation]:
        """Start a request; its Future's ``cancel()`` aborts it."""
        return asyncio.run_coroutine_threadsafe(self.fleet.generate(prompt_ids, sampling, **contract_kw), self._loop)

    def generate(self, prompt_ids: Sequence[int], sampling: Sampling | None = None, **contract_kw: Any) -> Generation:
        """:meth:`Fleet.generate`, blocking: ``min_version``, ``max_lag``, ``session``, ``timeout_s``."""
        return self._call(self.fleet.generate(prompt_ids, sampling, **contract_kw))

    def generate_many(self, prompts: Sequence[Sequence[int]], sampling: Sampling | None = None,
                      **contract_kw: Any) -> list[Generation]:
        return self._call(self.fleet.generate_many(prompts, sampling, **contract_kw))

    def refresh(self) -> None:
        self._call(self.fleet.refresh())

    def wait_for(self, min_version: int, n: int = 1, timeout_s: float = 600.0) -> list[dict]:
        return self._call(self.fleet.wait_for(min_version, n, timeout_s))

    def replicas(self) -> list[dict]:
        return self._call(_now(self.fleet.replicas))

    @property
    def newest(self) -> int | None:
        return self.fleet.newest

    @property
    def stats(self) -> Counter[str]:
        """A copy of :attr:`Fleet.stats` (requests, answers, retries by reason, continuations)."""
        return self._call(_now(lambda: Counter(self.fleet.stats)))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.fleet.close())
        finally:
            self._end_loop()

    def _end_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> FleetSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _now(fn):
    """``fn()`` on the client's loop (its state is that loop's alone)."""
    return fn()
