"""Heartbeats: one task per server, on its own timer, reporting to the registry.

Each beat is a ``PUT /v1/replicas/<node>.<server>`` with the server's state, loaded version,
target, incarnation, endpoint, last update's phase durations and gate, the node's last pull (its
time, whether it came whole or as a delta and on which base, the bytes it fetched against the
version's size), the versions the node refused, and the server's last error (the registry's fleet
view shows them). The task only reads the supervisor's fields, so a pull or an update never delays
it. A change of the server's state (SERVING on a new version above all) is beaten at once rather
than at the next tick, so that a trainer waiting for replicas on a version learns it as soon as it
is served. The reply's newest version and demand go to the updater. A failed beat is counted and logged
when the registry is lost and when it is back, not on every beat; beats go on at the same
interval. Cancelling the task deregisters the replica (bounded by ``shutdown.deregister_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from rolloutd.config import Config
from rolloutd.rollout.puller import PullProgress, PullState
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.updater import Updater
from rolloutd.supervise.supervisor import Supervisor
from rolloutd.wire import errors
from rolloutd.wire.messages import (
    MAX_ERROR_CHARS,
    OPTIONAL_HEARTBEAT_FIELDS,
    GateReport,
    Heartbeat,
    PullReport,
)

log = logging.getLogger("rolloutd.rollout.heartbeat")


class Heartbeater:
    def __init__(self, server: Supervisor, conf: Callable[[], Config], client: RegistryClient, updater: Updater):
        self.server, self._conf, self._client, self._updater = server, conf, client, updater
        cfg = conf()
        self.replica_id = f"{cfg.node_name}.{server.name}"
        self.last_ok: float | None = None
        self._failing = False
        self._refused: set[str] = set()  # newer fields a registry from before them refuses: left out
        self._last_pull: PullReport | None = None  # kept while the next pull runs
        self._changed = asyncio.Event()  # the server's state changed since the last beat began

    def age_s(self) -> float | None:
        return None if self.last_ok is None else time.monotonic() - self.last_ok

    def heartbeat(self) -> Heartbeat:
        cfg, snap = self._conf(), self.server.snapshot()
        last = snap.last_update
        timings = dict(last.phases_s) if last else {}
        pull = self._updater.progress
        if pull is not None and pull.state is PullState.DONE:
            timings["pull"] = round(pull.seconds, 4)  # the node's last pull, for the fleet view
            self._last_pull = pull_report(pull)
        refused = self.server.refusals.for_heartbeat()
        optional = {"gate": GateReport(**last.gate.model_dump()) if last and last.gate else None,
                    "last_error": _clip(snap.last_error),
                    "refused": refused or None,
                    "last_pull": self._last_pull}
        return Heartbeat(node=cfg.node_name, server=self.server.name, state=snap.state, endpoint=snap.endpoint,
                         version=snap.version, target=snap.target, incarnation=snap.incarnation,
                         registry_instance=self._updater.registry.instance, timings=timings,
                         **{k: v for k, v in optional.items() if k not in self._refused})

    def state_changed(self) -> None:
        """The server's state changed: beat now, not at the next tick."""
        self._changed.set()

    async def run(self) -> None:
        try:
            while True:
                started = time.monotonic()
                self._changed.clear()  # a change while beating is beaten next
                await self.beat()
                interval = self._conf().heartbeat.interval_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.0, interval - (time.monotonic() - started)))
        except asyncio.CancelledError:
            await asyncio.shield(self.deregister())
            raise

    async def beat(self) -> bool:
        cfg = self._conf()
        try:
            hb = self.heartbeat()
            try:
                reply = await self._client.heartbeat(self.replica_id, hb, timeout_s=cfg.heartbeat.timeout_s)
            except errors.InvalidRequest as e:
                refused = [f for f in OPTIONAL_HEARTBEAT_FIELDS if getattr(hb, f) is not None and f in e.fields]
                if not refused:
                    raise
                log.warning("heartbeat %s: the registry does not take %s (%s); sending heartbeats without",
                            self.replica_id, " and ".join(refused), e)
                self._refused.update(refused)
                reply = await self._client.heartbeat(self.replica_id, self.heartbeat(),
                                                     timeout_s=cfg.heartbeat.timeout_s)
        except (errors.RegistryError, errors.RegistryUnavailable) as e:
            self.server.metrics.heartbeat_failures.labels(server=self.server.name).inc()
            if not self._failing:
                log.warning("heartbeat %s: failed: %s (retrying every %g s)", self.replica_id, e,
                            cfg.heartbeat.interval_s)
                self._failing = True
            if isinstance(e, errors.RegistryUnavailable):
                self._updater.note_unreachable(str(e))
            return False
        if self._failing:
            log.info("heartbeat %s: delivered again", self.replica_id)
            self._failing = False
        self.last_ok = time.monotonic()
        self._updater.note_reply(reply)
        return True

    async def deregister(self) -> None:
        with contextlib.suppress(errors.RegistryError, errors.RegistryUnavailable, TimeoutError):
            async with asyncio.timeout(self._conf().shutdown.deregister_timeout_s):
                await self._client.deregister(self.replica_id)
                log.info("deregister %s", self.replica_id)


def pull_report(p: PullProgress) -> PullReport | None:
    """What the heartbeat says of a pull that ended with its version in the mirror."""
    if p.version is None:
        return None
    return PullReport(version=p.version, kind=p.kind, base=p.base, bytes_fetched=p.bytes_fetched,
                      version_bytes=p.version_bytes, seconds=round(p.seconds, 4),
                      reconstruct_s=None if p.reconstruct_s is None else round(p.reconstruct_s, 4),
                      delta_error=_clip(p.delta_error))


def _clip(error: str | None) -> str | None:
    if error is None or len(error) <= MAX_ERROR_CHARS:
        return error
    return error[:MAX_ERROR_CHARS - 1] + "…"
