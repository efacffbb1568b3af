"""Discovery: the replicas a trainer can send generation requests to, from the registry.

The registry's replica directory (``GET /v1/replicas``) lists every server that heartbeats
to it: its ``endpoint`` (the server's gateway), ``state``, loaded ``version``,
``incarnation`` and ``age_s`` (seconds since its last heartbeat, on the registry's clock).
:class:`Directory` keeps one :class:`Replica` per listed server, with what the client itself
learns between listings (requests in flight, failures, the version a server proved or
refused with, its ``max_model_len``). A replica is **usable** while the last listing shows it
``SERVING`` and heard from within ``max_age_s``; nodes that come and go appear and disappear
with the listings, so a trainer never restarts for them.

A replica's version is known from three sources, and the freshest wins: the listing (up to
one heartbeat old), an answer (its tokens' ``weight_versions`` say what it holds now), and a
gateway's refusal (``version_behind`` says what it holds). Versions only grow while a server
lives; a new ``incarnation`` (a restart) forgets what was learnt about the old process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.wire.states import ServerState


@dataclass
class Replica:
    replica_id: str
    endpoint: str
    state: str = ""
    listed_version: int | None = None  # what its last heartbeat said
    incarnation: int = 0
    age_s: float = 0.0  # of its last heartbeat, when listed
    listed: bool = True  # in the last listing
    proven: int | None = None  # the newest version an answer of this process came from
    refused: int | None = None  # the version it held when its gateway refused a request as too old
    refused_listed: int | None = None  # what the listing said then (a newer listing ends the refusal)
    in_flight: int = 0
    failures: int = 0  # in a row
    avoid_until: float = 0.0
    max_model_len: int | None = None
    declined: dict[tuple[int, str], str] = field(default_factory=dict)  # versions its node refused -> why
    stats: dict[str, int] = field(default_factory=lambda: {"answered": 0, "failed": 0})

    @property
    def version(self) -> int | None:
        """The version it holds, as far as the client knows."""
        if self.refused is not None:
            return self.refused
        known = [v for v in (self.listed_version, self.proven) if v is not None]
        return max(known) if known else None

    def usable(self, now: float, max_age_s: float) -> bool:
        return (self.listed and self.state == ServerState.SERVING and self.age_s <= max_age_s
                and now >= self.avoid_until)

    def meets(self, min_version: int | None) -> bool:
        if min_version is None:
            return True
        v = self.version
        return v is not None and v >= min_version

    def restarted(self, endpoint: str, incarnation: int) -> None:
        """A new server process (or a new address) under the same id: what was learnt about the
        old one no longer holds. Requests in flight keep this record, so their counts stay right."""
        self.endpoint, self.incarnation = endpoint, incarnation
        self.proven = self.refused = self.refused_listed = self.max_model_len = None
        self.failures, self.avoid_until = 0, 0.0

    # -- what an exchange taught -----------------------------------------------------------------
    def answered(self, version: int | None) -> None:
        self.failures = 0
        self.avoid_until = 0.0
        self.stats["answered"] += 1
        if version is not None:
            self.proven = max(self.proven or 0, version)
            if self.refused is not None and version > self.refused:
                self.refused = None

    def refused_at(self, held: int | None) -> None:
        """Its gateway said it holds ``held``, below what a request wanted."""
        self.refused, self.refused_listed = held or 0, self.listed_version
        if self.proven is not None and self.proven > self.refused:
            self.proven = None

    def failed(self, now: float, avoid_s: float) -> None:
        self.failures += 1
        self.stats["failed"] += 1
        self.avoid_until = max(self.avoid_until, now + avoid_s)

    def view(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "endpoint": self.endpoint, "state": self.state,
                "version": self.version, "age_s": self.age_s, "in_flight": self.in_flight, "failures": self.failures,
                "max_model_len": self.max_model_len, **self.stats}


class Directory:
    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_age_s, self.clock = max_age_s, clock
        self.replicas: dict[str, Replica] = {}
        self.newest: int | None = None  # the registry's newest version
        self.newest_digest: str | None = None  # its manifest digest
        self.instance: str | None = None
        self.listed_at: float | None = None  # when the last listing arrived

    def apply(self, listing: list[dict], newest: int | None = None, instance: str | None = None,
              newest_digest: str | None = None) -> None:
        """Take a listing of the registry's directory (the ``replicas`` of ``GET /v1/replicas``)."""
        if instance is not None and self.instance is not None and instance != self.instance:
            self.replicas.clear()  # a restarted registry: its versions are new numbers
        self.instance = instance or self.instance
        if newest is not None:
            self.newest, self.newest_digest = newest, newest_digest
        seen = set()
        for entry in listing:
            rid, endpoint = entry.get("replica_id"), entry.get("endpoint")
            if not isinstance(rid, str) or not isinstance(endpoint, str) or not endpoint:
                continue  # a server that names no endpoint takes no generation requests
            seen.add(rid)
            rep = self.replicas.get(rid)
            incarnation = entry.get("incarnation") or 0
            if rep is None:
                rep = self.replicas[rid] = Replica(rid, endpoint.rstrip("/"), incarnation=incarnation)
            elif rep.endpoint != endpoint.rstrip("/") or rep.incarnation != incarnation:
                rep.restarted(endpoint.rstrip("/"), incarnation)
            rep.state = str(entry.get("state") or "")
            rep.listed_version = entry.get("version")
            rep.age_s = float(entry.get("age_s") or 0.0)
            rep.listed = True
            rep.declined = {(r["version"], r["digest"]): str(r.get("reason", "")) for r in entry.get("refused") or ()
                            if isinstance(r, dict) and "version" in r and "digest" in r}
            if rep.refused is not None and (rep.listed_version or 0) > (rep.refused_listed or 0):
                rep.refused = None  # its heartbeat reports a newer load since
        for rid, rep in list(self.replicas.items()):
            if rid not in seen:
                if rep.in_flight:
                    rep.listed = False  # kept until its requests end
                else:
                    del self.replicas[rid]
        self.listed_at = self.clock()

    def usable(self, min_version: int | None = None) -> list[Replica]:
        now = self.clock()
        return [r for r in self.replicas.values() if r.usable(now, self.max_age_s) and r.meets(min_version)]

    def refusing(self, min_version: int) -> list[Replica]:
        """Listed replicas below ``min_version`` whose node refused the registry's newest version
        (those bytes): none of them gets there before a newer version is published."""
        newest = (self.newest, self.newest_digest)
        if self.newest is None or self.newest < min_version:
            return []
        return [r for r in self.replicas.values() if r.listed and not r.meets(min_version) and newest in r.declined]

    def describe(self) -> str:
        """One line on what the directory holds, for errors."""
        if not self.replicas:
            return "no replica listed"
        return ", ".join(f"{r.replica_id} {r.state}@{r.version}" + (" (avoided)" if r.avoid_until > self.clock()
                                                                   else "")
                         for r in sorted(self.replicas.values(), key=lambda r: r.replica_id))

