"""Where a server's processes live, and how every one of them is found and stopped: one interface
for the two ways the daemon holds a process tree.

- A **delegated cgroup** (cgroups.py), when the daemon runs in a cgroup v2 subtree that is its
  own to manage (systemd's ``Delegate=yes``): each server in ``<unit cgroup>/server-<name>``,
  the daemon itself in ``<unit cgroup>/daemon``. Nothing a server starts leaves its cgroup,
  whatever it forks and whichever session it makes; SIGKILL is one write to ``cgroup.kill``;
  "gone" is ``populated 0``; what a crashed daemon left is every populated cgroup under the
  unit's, with no record needed.
- **Process groups** (leftovers.py), everywhere else (the demo, a daemon started by hand or by
  a test): each server in its own session, its processes found by process group with psutil,
  and what a crashed daemon left known from the records it wrote (pid, group, start time).

:class:`Containment` is the node's side (which scope a server gets, what an earlier run left);
:class:`Scope` is one server's processes (child.py drives it: place, signal, wait until empty).
:func:`rolloutd.supervise.cgroups.contain` picks one at the daemon's start.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from abc import ABC, abstractmethod
from typing import Protocol

log = logging.getLogger("rolloutd.supervise.leftovers")

_POLL_S = (0.02, 0.2)           # while waiting for a scope to empty: first interval, longest


class Scope(ABC):
    """The processes of one server: its leader and everything it starts."""

    @abstractmethod
    def __str__(self) -> str:
        """What it is, for log lines: ``process group 1234``, ``cgroup /system.slice/...``."""

    @abstractmethod
    def place(self, pid: int) -> None:
        """Take in the leader just spawned (in a session of its own); OSError if it cannot be."""

    @abstractmethod
    def pids(self) -> list[int]:
        """Its live processes (zombies are gone), sorted."""

    @abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process in it (never to the daemon)."""

    def empty(self) -> bool:
        return not self.pids()

    def _looks_empty(self) -> bool:
        """:meth:`empty`, where a look that failed (a read of /proc that errs) counts as not
        empty: the next look, or the deadline, decides."""
        try:
            return self.empty()
        except OSError as e:
            log.warning("look at %s: %s; looking again", self, e)
            return False

    @abstractmethod
    def release(self) -> None:
        """It is empty: give back what it held (its cgroup). Harmless if called again."""

    async def wait_empty(self, timeout_s: float, *, hurry: asyncio.Event | None = None) -> bool:
        """Wait until no live process is left; False if some outlived ``timeout_s`` (or ``hurry``
        was set meanwhile). Each look runs in a thread: a process group's is a scan of /proc,
        which must not hold up the loop that relays every token."""
        deadline = time.monotonic() + timeout_s
        pause = _POLL_S[0]
        while not await asyncio.to_thread(self._looks_empty):
            left = deadline - time.monotonic()
            if left <= 0 or (hurry is not None and hurry.is_set()):
                return False
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_S[1])
        return True


class Containment(ABC):
    """How this daemon holds its servers' processes; one for the daemon's life."""

    @abstractmethod
    def __str__(self) -> str:
        """One line for the daemon's start: how servers are held, and why this way."""

    @abstractmethod
    def scope(self, name: str) -> Scope:
        """A new scope for server ``name``'s next process, before it is spawned."""

    @abstractmethod
    async def start(self, grace_s: float, kill_wait_s: float) -> list[str]:
        """At the daemon's start, before any server is spawned: stop what an earlier run of the
        daemon left (all at once: SIGTERM, ``grace_s``, SIGKILL, ``kill_wait_s``), and take the
        daemon's own place. One line per leftover stopped."""

    @abstractmethod
    def record(self, child: Spawned) -> None:
        """``child`` was spawned: remember it for a daemon that starts after a crash of this one."""

    @abstractmethod
    def forget(self, child: Spawned) -> None:
        """``child``'s processes are all gone."""


class Spawned(Protocol):
    """What a containment reads of a spawned child (:class:`rolloutd.supervise.child.Child`): the
    child uses its containment, so the containment names only these, not the child's module."""

    name: str
    argv: list[str]
    pid: int | None
    pgid: int | None


async def stop_leftover(scope: Scope, head: str, grace_s: float, kill_wait_s: float) -> str:
    """Stop what an earlier run left in ``scope`` (``head`` names it): SIGTERM, ``grace_s``, SIGKILL,
    ``kill_wait_s``. Lines start with ``clean``; returns ``<head>: <how it ended>``."""
    log.warning("clean %s: SIGTERM, grace %.1f s", head, grace_s)
    scope.signal(signal.SIGTERM)
    how = "stopped with SIGTERM"
    if not await scope.wait_empty(grace_s):
        scope.signal(signal.SIGKILL)
        how = "killed with SIGKILL"
        if not await scope.wait_empty(kill_wait_s):
            how = f"pids {scope.pids()} outlived SIGKILL"
    log.info("clean %s: %s", head, how)
    return f"{head}: {how}"
