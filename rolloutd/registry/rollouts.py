"""How far each version got through the fleet, on the registry's clock.

The store tells the log when a version is published and when a replica first reports SERVING a
version; the log answers, per version, how long the fleet took from publish to serving
(``stats``), and, per replica, how far behind the trainer it is (``lag``).

What counts: a replica's first SERVING report of a version, and only if the replica was in the
directory when the version was published. A replica that registered later (a node that joined,
or every node after a registry restart) would measure when it joined, not how fast the fleet
moved. The heartbeat interval bounds the precision: a replica is seen serving at its next beat.

Bounded: the delays of the newest ``history`` versions, and the publish times of the newest
``PUBLISHED_MEMORY`` versions (the lag of a replica older than those reads as "at least").
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

HISTORY = 32              # versions whose publish-to-serving delays are kept
PUBLISHED_MEMORY = 10_000  # versions whose publish time is kept (for lag)


@dataclass
class Rollout:
    """One version's way through the fleet."""

    version: int
    published_at: float
    delays: array = field(default_factory=lambda: array("d"))  # seconds, publish -> first SERVING
    _stats: dict | None = None  # cached until the next delay arrives

    def add(self, delay_s: float) -> None:
        self.delays.append(delay_s)
        self._stats = None

    def stats(self) -> dict:
        """``reached``: replicas counted; min, p50, p90 and max of their delays (null: none yet)."""
        if self._stats is None:
            d = sorted(self.delays)
            self._stats = {"reached": len(d), "min_s": _round(d[0]) if d else None,
                           "p50_s": _pick(d, 0.5), "p90_s": _pick(d, 0.9),
                           "max_s": _round(d[-1]) if d else None}
        return self._stats


def _pick(values: list[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank (a value that was measured, not an interpolation)."""
    if not values:
        return None
    return _round(values[min(len(values) - 1, max(0, math.ceil(len(values) * q) - 1))])


def _round(x: float) -> float:
    return round(x, 3)


class RolloutLog:
    def __init__(self, history: int = HISTORY, published_memory: int = PUBLISHED_MEMORY):
        self.history = history
        self._rollouts: OrderedDict[int, Rollout] = OrderedDict()
        self._numbers = array("q")  # published versions, ascending (numbers only grow)
        self._times = array("d")    # their publish times, same order
        self._memory = published_memory
        self.on_delay: Callable[[float], None] = lambda seconds: None  # each delay as it is recorded (metrics)

    def published(self, version: int, at: float) -> None:
        self._rollouts[version] = Rollout(version, at)
        while len(self._rollouts) > self.history:
            self._rollouts.popitem(last=False)
        self._numbers.append(version)
        self._times.append(at)
        if len(self._numbers) > self._memory:
            drop = len(self._numbers) - self._memory
            del self._numbers[:drop], self._times[:drop]

    def serving(self, version: int, replica_first_seen: float, now: float) -> None:
        """A replica reported SERVING ``version`` for the first time."""
        rollout = self._rollouts.get(version)
        if rollout is not None and replica_first_seen <= rollout.published_at:
            delay = max(0.0, now - rollout.published_at)
            rollout.add(delay)
            self.on_delay(delay)

    def published_at(self, version: int) -> float | None:
        i = bisect.bisect_left(self._numbers, version)
        return self._times[i] if i < len(self._numbers) and self._numbers[i] == version else None

    def lag(self, version: int | None, newest: int | None, now: float) -> tuple[int | None, float | None]:
        """(versions published after ``version`` up to ``newest``, seconds since the first of them
        was published); (0, 0.0) when it holds the newest; (None, None) when it holds no version
        from this registry (the start model)."""
        if version is None or newest is None:
            return None, None
        if version >= newest:
            return 0, 0.0
        i = bisect.bisect_right(self._numbers, version)
        j = bisect.bisect_right(self._numbers, newest)
        if i >= len(self._numbers):
            return None, None
        return max(1, j - i), round(now - self._times[i], 3)

    def stats(self, now: float) -> list[dict]:
        """Every remembered version, oldest first: publish age and its publish-to-serving figures."""
        return [{"version": r.version, "published_age_s": round(now - r.published_at, 3), **r.stats()}
                for r in self._rollouts.values()]


BEHIND_BUCKETS = ("0", "1", "2", "3+", "start model")


def behind_bucket(version: int | None, lag: int | None) -> str:
    """How far behind the newest a replica is, in the buckets the fleet view and the metrics use."""
    if version is None:
        return "start model"
    if lag is None or lag >= 3:
        return "3+"
    return str(lag)
