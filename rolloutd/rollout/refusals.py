"""The node's verdicts on versions: those it refused (the trainer's bad versions, kept apart from
the node's failures), and its last good one.

A version a server could not be made to serve correctly (its gate failed after the re-applies
and, when the failure could be the server's, after one restart; or its canary cannot be scored
at all) is **refused** on the node: no server of the node loads it again, each one serves its
last good version (rollout/supervise: ``Supervisor.good``) and takes the next version as usual.
A refusal names the version by number and manifest digest (a registry that restarted may give
the number to other bytes) and says why; ``/status``, every heartbeat (so the registry's
directory, its fleet view and ``wait_for_replicas``) and the metrics show them.

The node's **last good version** is the last one any of its servers served with its gate passed.
A server with no good version of its own (restarted since, or started after the refusal) goes
back to it rather than to its start model, so that one node never serves two policies because
one of its servers restarted at the wrong moment; the mirror keeps its copy.

Kept in memory: a daemon that restarts tries the registry's newest version again, and refuses it
again if it is still bad.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rolloutd.metrics import Metrics
from rolloutd.rollout.updater import Target
from rolloutd.wire.messages import MAX_ERROR_CHARS, MAX_REFUSED, RefusedVersion
from rolloutd.wire.status import RefusedStatus

log = logging.getLogger("rolloutd.rollout.refusals")


@dataclass(frozen=True)
class Refusal:
    version: int
    digest: str
    reason: str
    server: str     # the server whose failures refused it
    at_unix: float

    def status(self) -> RefusedStatus:
        return RefusedStatus(version=self.version, digest=self.digest, reason=self.reason, server=self.server,
                             at_unix=self.at_unix)


class Refusals:
    """The node's refused versions, newest refusal last (at most ``MAX_REFUSED``: the oldest go),
    and its last good version (:attr:`last_good`).

    ``discard``: called (awaited) once a server no longer holds a refused version, to free its
    room in the mirror (the daemon's: removed unless another server still holds it)."""

    def __init__(self, metrics: Metrics | None = None, *,
                 discard: Callable[[Target], Awaitable[None]] | None = None):
        self._metrics, self._discard = metrics, discard
        self._refused: OrderedDict[tuple[int, str], Refusal] = OrderedDict()
        self.last_good: Target | None = None  # the node's (module docstring); one owner, the servers report

    def served(self, target: Target) -> None:
        """A server of the node holds ``target``, its gate passed."""
        self.last_good = target

    def refuse(self, target: Target, reason: str, server: str) -> Refusal:
        """Refuse ``target`` on this node (the first refusal stands; a later one returns it)."""
        key = (target.version, target.digest)
        if (known := self._refused.get(key)) is not None:
            return known
        refusal = Refusal(target.version, target.digest, _clip(reason), server, time.time())
        self._refused[key] = refusal
        last = self.last_good  # any copy of these bytes: a server that passed its gate on it keeps it, none goes back
        if last is not None and (last.version, last.digest) == key:
            self.last_good = None
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)
        log.error("refuse version %d on this node (%s): %s; every server keeps its last good version",
                  target.version, server, refusal.reason)
        if self._metrics is not None:
            self._metrics.versions_refused.inc()
            self._metrics.refused_version.set(target.version)
        return refusal

    def refused(self, target: Target | None) -> Refusal | None:
        """The refusal of ``target`` (these bytes under that number), if it was refused."""
        return None if target is None else self._refused.get((target.version, target.digest))

    async def discard(self, target: Target) -> None:
        if self._discard is not None:
            await self._discard(target)

    def status(self) -> list[RefusedStatus]:
        """Oldest first, as /status shows them."""
        return [r.status() for r in self._refused.values()]

    def for_heartbeat(self) -> list[RefusedVersion]:
        return [RefusedVersion(version=r.version, digest=r.digest, reason=r.reason) for r in self._refused.values()]


def _clip(reason: str) -> str:
    return reason if len(reason) <= MAX_ERROR_CHARS else reason[:MAX_ERROR_CHARS - 1] + "…"
