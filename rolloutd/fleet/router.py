"""Routing: which replica takes a request.

Among the usable replicas that meet the request's version (:meth:`Directory.usable`), and
that this request has not failed on yet:

- a request with a ``session`` key goes where its session went last (multi-turn rollouts
  reuse the server's prefix cache), as long as that replica qualifies;
- otherwise to the replica with the fewest requests in flight from this client, ties taken in
  turn, so equal replicas share the load evenly from the first request on.

A replica that failed is avoided for a while (``avoid_s``, or the server's ``Retry-After``):
:meth:`Replica.usable` leaves it out until then. Sessions are remembered up to
``max_sessions``, the least recently used forgotten first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from rolloutd.fleet.directory import Directory, Replica


class Router:
    def __init__(self, directory: Directory, max_sessions: int = 100_000):
        self.directory = directory
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._turn = itertools.count()

    def pick(self, min_version: int | None, session: str | None = None,
             exclude: frozenset[str] = frozenset()) -> Replica | None:
        """The replica for the next attempt, or None when none qualifies now."""
        usable = self.directory.usable(min_version)
        fresh = [r for r in usable if r.replica_id not in exclude]
        candidates = fresh or usable  # every qualifying one failed this request once: try them again
        if not candidates:
            return None
        if session is not None:
            rid = self._sessions.get(session)
            for r in candidates:
                if r.replica_id == rid:
                    self._sessions.move_to_end(session)
                    return r
        least = min(r.in_flight for r in candidates)
        tied = [r for r in candidates if r.in_flight == least]
        return tied[next(self._turn) % len(tied)]

    def stick(self, session: str | None, replica: Replica) -> None:
        """Remember where ``session`` was answered."""
        if session is None:
            return
        self._sessions[session] = replica.replica_id
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
