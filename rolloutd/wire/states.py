"""Each supervised server's lifecycle: the states and the arrows allowed between them.

::

    STOPPED -> STARTING -> SYNCING -> SERVING <-> UPDATING
                  |           |          |           |
                  +-----------+----------+-----------+--> BACKOFF -> STARTING | FATAL
    any running state -> STOPPING -> STOPPED;  FATAL -> STARTING (restart asked by a person)

A server is SERVING only once ``/health`` passed **and** it holds the node's target version:
the first sync after every (re)start happens in SYNCING, before it is reported as serving.
``Lifecycle.set`` is the one place a state changes: it refuses an arrow not in the table,
logs ``old -> new``, and tells the listeners (status line, metrics).

The states are words both ends speak: a heartbeat carries one (:class:`rolloutd.wire.messages.Heartbeat`),
the registry and the fleet client read it. So they sit at the bottom and import nothing of rolloutd;
each is a string equal to its name (``ServerState.SERVING == "SERVING"``), as it is on the wire.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable


class ServerState(enum.StrEnum):
    STOPPED = "STOPPED"      # no process (initial, and after a stop)
    STARTING = "STARTING"    # spawned; waiting for /health
    SYNCING = "SYNCING"      # healthy; loading the node's target version before serving
    SERVING = "SERVING"      # healthy and on the target version
    UPDATING = "UPDATING"    # paused for a weight update
    BACKOFF = "BACKOFF"      # failed; waiting before the next start
    FATAL = "FATAL"          # gave up after too many failed starts (a person must act)
    STOPPING = "STOPPING"    # process group being terminated

    @property
    def running(self) -> bool:
        """A process of this server may be alive."""
        return self in _RUNNING


S = ServerState
_RUNNING = {S.STARTING, S.SYNCING, S.SERVING, S.UPDATING, S.STOPPING}

ARROWS: dict[ServerState, frozenset[ServerState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.SYNCING, S.BACKOFF, S.STOPPING}),
    S.SYNCING: frozenset({S.SERVING, S.BACKOFF, S.STOPPING}),
    S.SERVING: frozenset({S.UPDATING, S.BACKOFF, S.STOPPING}),
    S.UPDATING: frozenset({S.SERVING, S.BACKOFF, S.STOPPING}),
    S.BACKOFF: frozenset({S.STARTING, S.FATAL, S.STOPPING}),
    S.FATAL: frozenset({S.STARTING, S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED}),
}


class BadTransition(RuntimeError):
    pass


class Lifecycle:
    """The state of one server, with the time it entered it."""

    def __init__(self, name: str, *, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, ServerState, ServerState], None] | None = None,
                 log: logging.Logger | None = None):
        self.name = name
        self.state = ServerState.STOPPED
        self._clock = clock
        self.since = clock()
        self._on_change = on_change
        self._log = log or logging.getLogger("rolloutd.server")

    def set(self, new: ServerState, why: str = "") -> None:
        old = self.state
        if new not in ARROWS[old]:
            raise BadTransition(f"{self.name}: {old.name} -> {new.name} is not allowed")
        self.state, self.since = new, self._clock()
        self._log.info("state %s: %s -> %s%s", self.name, old.name, new.name, f" ({why})" if why else "")
        if self._on_change is not None:
            self._on_change(self.name, old, new)

    def age_s(self) -> float:
        return self._clock() - self.since
