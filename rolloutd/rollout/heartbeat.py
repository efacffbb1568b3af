"""Heartbeats: one task per server, on its own timer, reporting to the registry.

Each beat is a ``PUT /v1/replicas/<node>.<server>`` with the server's state, loaded version,
target, incarnation, endpoint and last update's phase durations. The task only reads the
supervisor's fields, so a pull or an update never delays it. The reply's newest version and
demand go to the updater. A failed beat is counted and logged when the registry is lost and
when it is back, not on every beat; beats go on at the same interval. Cancelling the task
deregisters the replica (bounded by ``shutdown.deregister_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from rolloutd.config import Config
from rolloutd.registry.client import RegistryClient
from rolloutd.rollout.updater import Updater
from rolloutd.supervise.supervisor import Supervisor
from rolloutd.wire import errors
from rolloutd.wire.messages import GateReport, Heartbeat

log = logging.getLogger("rolloutd.rollout.heartbeat")


class Heartbeater:
    def __init__(self, server: Supervisor, conf: Callable[[], Config], client: RegistryClient, updater: Updater):
        self.server, self._conf, self._client, self._updater = server, conf, client, updater
        cfg = conf()
        self.replica_id = f"{cfg.node_name}.{server.name}"
        self.last_ok: float | None = None
        self._failing = False
        self._gate_refused = False  # a registry from before the "gate" field refuses it: leave it out

    def age_s(self) -> float | None:
        return None if self.last_ok is None else time.monotonic() - self.last_ok

    def heartbeat(self) -> Heartbeat:
        cfg, snap = self._conf(), self.server.snapshot()
        last = snap["last_update"]
        timings = last["phases_s"] if last else {}
        gate = GateReport(**last["gate"]) if last and last.get("gate") and not self._gate_refused else None
        return Heartbeat(node=cfg.node_name, server=self.server.name, state=snap["state"],
                         endpoint=snap["endpoint"],
                         version=snap["version"], target=snap["target"], incarnation=snap["incarnation"],
                         registry_instance=self._updater.registry.instance, timings=timings, gate=gate)

    async def run(self) -> None:
        try:
            while True:
                started = time.monotonic()
                await self.beat()
                interval = self._conf().heartbeat.interval_s
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
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
                if hb.gate is None or "gate" not in str(e):
                    raise
                log.warning("heartbeat %s: the registry does not take the gate's figure (%s); sending "
                            "heartbeats without it", self.replica_id, e)
                self._gate_refused = True
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
