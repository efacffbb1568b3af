"""The registry's state: versions, leases, the replica directory and demand.

Pure logic with an injected clock. Every method is synchronous and is called from the
server's event loop only, so each is atomic with respect to the others: leasing "latest"
resolves and leases in one step, and no publish can slip in between.

Version lifecycle (one place changes it, :meth:`Store._set_state`)::

    LIVE --retire--> RETIRED --last lease ends--> RECLAIMED

A RETIRED version takes no new leases but keeps its bytes for the leases it has.
"""

from __future__ import annotations

import enum
import heapq
import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutd.registry.blobs import Blob
from rolloutd.registry.rollouts import RolloutLog
from rolloutd.wire import errors
from rolloutd.wire.manifest import FileEntry, Manifest
from rolloutd.wire.messages import REPLICA_ID_RE, Heartbeat
from rolloutd.wire.states import ServerState

log = logging.getLogger("rolloutd.registry")

_EXPIRED_MEMORY = 10_000  # how many expired lease ids are remembered, to say "expired" not "unknown"


class VersionState(enum.Enum):
    LIVE = "live"
    RETIRED = "retired"
    RECLAIMED = "reclaimed"


_ARROWS = {
    VersionState.LIVE: {VersionState.RETIRED},
    VersionState.RETIRED: {VersionState.RECLAIMED},
    VersionState.RECLAIMED: set(),
}


@dataclass
class Version:
    manifest: Manifest
    blobs: dict[str, Blob]
    published_at: float
    state: VersionState = VersionState.LIVE
    leases: set[str] = field(default_factory=set)

    @property
    def number(self) -> int:
        return self.manifest.version

    def summary(self) -> dict:
        return {"version": self.number, "state": self.state.value, "digest": self.manifest.digest,
                "total_bytes": self.manifest.total_bytes, "files": len(self.manifest.files),
                "leases": len(self.leases), "delta": self.delta_summary()}

    def delta_summary(self) -> dict | None:
        """``{"base_version", "bytes"}`` of a delta version; None for a full one."""
        d = self.manifest.delta
        return None if d is None else {"base_version": d.base_version, "bytes": d.total_bytes}

    def entry(self, name: str) -> FileEntry | None:
        """The file ``name`` of the version: one of the target's, or a delta file."""
        if (f := self.manifest.file(name)) is not None or self.manifest.delta is None:
            return f
        return next((d for d in self.manifest.delta.files if d.name == name), None)


@dataclass
class Lease:
    id: str
    holder: str
    version: int
    ttl_s: float
    expires_at: float

    def to_json(self, now: float) -> dict:
        return {"lease_id": self.id, "holder": self.holder, "version": self.version,
                "ttl_s": self.ttl_s, "expires_in_s": round(max(0.0, self.expires_at - now), 3)}


@dataclass
class Replica:
    heartbeat: Heartbeat
    first_seen: float
    last_seen: float
    state_since: float  # when the registry first saw it in its current state
    reached: int = 0    # newest version it was seen SERVING (each version is timed once)


class Store:
    def __init__(self, *, keep_versions: int = 3, clock: Callable[[], float] = time.monotonic,
                 max_lease_ttl_s: float = 3600.0, replica_forget_after_s: float = 3600.0,
                 reclaim: Callable[[int, dict], None] = lambda v, blobs: None):
        if keep_versions < 2:
            raise ValueError("keep_versions must be at least 2")
        self.instance = secrets.token_hex(8)
        self.keep_versions = keep_versions
        self.max_lease_ttl_s = max_lease_ttl_s
        self.replica_forget_after_s = replica_forget_after_s
        self._clock = clock
        self._reclaim_bytes = reclaim
        self._versions: dict[int, Version] = {}
        self._highest = 0  # highest number ever published, retired or not
        self._reclaimed: set[int] = set()  # to answer "retired" rather than "unknown" for them
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale entries skipped on pop
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._replicas: dict[str, Replica] = {}
        self._latest: Version | None = None
        self.demand: int | None = None
        self.rollouts = RolloutLog()  # publish-to-serving times and lag, for the fleet view
        self.listeners: list[Callable[[], None]] = []  # called after every change of "latest"

    def now(self) -> float:
        return self._clock()

    # -- versions ---------------------------------------------------------------------------
    @property
    def latest(self) -> Version | None:
        """The newest LIVE version (kept up to date by :meth:`_changed`: heartbeats read it)."""
        return self._latest

    def versions(self) -> list[Version]:
        return sorted(self._versions.values(), key=lambda v: v.number)

    def check_publishable(self, manifest: Manifest) -> bool:
        """True if ``manifest`` is already published identically (nothing to do); raise if it
        can never be published; False if it may be."""
        existing = self._versions.get(manifest.version)
        if existing is not None:
            if existing.manifest.digest == manifest.digest:
                return True
            raise errors.VersionConflict(f"version {manifest.version} exists with digest "
                                         f"{existing.manifest.digest}, not {manifest.digest}")
        if manifest.version <= self._highest:
            raise errors.VersionNotNewer(f"version {manifest.version} is not newer than "
                                         f"{self._highest}, the newest published here")
        return False

    def check_new_number(self, number: int) -> None:
        """Raise unless ``number`` could still be published."""
        if number in self._versions:
            raise errors.VersionConflict(f"version {number} is already published")
        if number <= self._highest:
            raise errors.VersionNotNewer(f"version {number} is not newer than {self._highest}, "
                                         "the newest published here")

    def publish(self, manifest: Manifest, blobs: dict[str, Blob], how: str | None = None) -> Version:
        """Make a version visible (its bytes are already committed and verified); ``how`` it is
        published, for the log (a delta on which version, or full and why)."""
        if self.check_publishable(manifest):
            return self._versions[manifest.version]
        version = Version(manifest, blobs, self.now())
        self._versions[manifest.version] = version
        self._highest = manifest.version
        self.rollouts.published(manifest.version, version.published_at)
        log.info("publish version %d %s (%d files, digest %s)", manifest.version,
                 how or f"of {manifest.total_bytes} bytes", len(manifest.files), manifest.digest)
        live = [v for v in self.versions() if v.state is VersionState.LIVE]
        for old in live[:-self.keep_versions]:
            self._retire(old, f"older than the newest {self.keep_versions} live")
        self._changed()
        return version

    def get(self, number: int) -> Version:
        """A version whose bytes still exist (LIVE or RETIRED)."""
        self._expire_leases()
        version = self._versions.get(number)
        if version is None:
            if number in self._reclaimed:
                raise errors.VersionRetired(f"version {number} was retired and its bytes reclaimed")
            raise errors.VersionUnknown(f"version {number} was never published here")
        return version

    def retire(self, number: int) -> Version:
        version = self.get(number)
        if version.state is VersionState.LIVE:
            self._retire(version, "asked")
            self._changed()
        return version

    def _retire(self, version: Version, why: str) -> None:
        self._set_state(version, VersionState.RETIRED, why)
        if not version.leases:
            self._reclaim(version)

    def _reclaim(self, version: Version) -> None:
        self._set_state(version, VersionState.RECLAIMED, "no lease left")
        del self._versions[version.number]
        self._reclaimed.add(version.number)
        blobs, version.blobs = version.blobs, {}
        self._reclaim_bytes(version.number, blobs)  # the byte store lets go of them

    def _set_state(self, version: Version, new: VersionState, why: str) -> None:
        if new not in _ARROWS[version.state]:
            raise AssertionError(f"version {version.number}: {version.state.name} -> {new.name}")
        log.info("version %d %s -> %s (%s)", version.number, version.state.name, new.name, why)
        version.state = new

    def _changed(self) -> None:
        live = [v for v in self._versions.values() if v.state is VersionState.LIVE]
        self._latest = max(live, key=lambda v: v.number, default=None)
        for fn in self.listeners:
            fn()

    # -- leases -----------------------------------------------------------------------------
    def lease(self, holder: str, version: int | str, ttl_s: float) -> Lease:
        """Lease a version, or the newest LIVE one when ``version == "latest"`` (atomically)."""
        ttl_s = self._grant_ttl(ttl_s)
        self._expire_leases()
        if version == "latest":
            target = self.latest
            if target is None:
                raise errors.NoVersions("nothing has been published yet")
        else:
            target = self.get(int(version))
            if target.state is not VersionState.LIVE:
                raise errors.VersionRetired(f"version {target.number} is retired: no new leases")
        lease = Lease(secrets.token_urlsafe(12), holder, target.number, ttl_s, self.now() + ttl_s)
        self._leases[lease.id] = lease
        target.leases.add(lease.id)
        heapq.heappush(self._expiry, (lease.expires_at, lease.id))
        return lease

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        self._expire_leases()
        lease = self._live_lease(lease_id)
        if ttl_s is not None:
            lease.ttl_s = self._grant_ttl(ttl_s)
        lease.expires_at = self.now() + lease.ttl_s
        heapq.heappush(self._expiry, (lease.expires_at, lease.id))
        return lease

    def release(self, lease_id: str) -> None:
        self._expire_leases()
        self._end_lease(self._live_lease(lease_id))

    def _live_lease(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            if lease_id in self._expired:
                raise errors.LeaseExpired(f"lease {lease_id} expired before it was renewed")
            raise errors.LeaseUnknown(f"no lease {lease_id!r} (never granted, or released)")
        return lease

    def _grant_ttl(self, ttl_s: float) -> float:
        """The TTL granted: as asked, capped at ``max_lease_ttl_s`` (the reply says which)."""
        if not (0 < ttl_s < math.inf):
            raise errors.InvalidRequest(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        return min(ttl_s, self.max_lease_ttl_s)

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.id]
        version = self._versions.get(lease.version)
        if version is not None:
            version.leases.discard(lease.id)
            if version.state is VersionState.RETIRED and not version.leases:
                self._reclaim(version)

    def sweep(self) -> None:
        """Periodic upkeep: end expired leases and forget replicas silent for too long."""
        self._expire_leases()
        now = self.now()
        for rid in [r for r, rep in self._replicas.items() if now - rep.last_seen > self.replica_forget_after_s]:
            log.info("forget replica %s (silent for %.0f s)", rid, now - self._replicas[rid].last_seen)
            del self._replicas[rid]

    def _expire_leases(self) -> None:
        """End expired leases, reclaiming retired versions they held. Cheap (a heap), so every
        version and lease call runs it first: expiry never waits for the periodic sweep."""
        now = self.now()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires_at != expires_at:
                continue  # released, or renewed since this entry was pushed
            log.info("expire lease %s of %s on version %d", lease.id, lease.holder, lease.version)
            self._end_lease(lease)
            self._expired[lease.id] = None
            if len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)

    def lease_count(self) -> int:
        return len(self._leases)

    # -- replicas and demand ------------------------------------------------------------------
    def heartbeat(self, replica_id: str, hb: Heartbeat) -> dict:
        if not REPLICA_ID_RE.fullmatch(replica_id):
            raise errors.InvalidRequest(f"invalid replica id {replica_id[:140]!r}")
        now = self.now()
        rep = self._replicas.get(replica_id)
        if rep is None:
            log.info("register replica %s (node %s, server %s)", replica_id, hb.node, hb.server)
            rep = self._replicas[replica_id] = Replica(hb, now, now, now)
        else:
            if hb.state != rep.heartbeat.state:
                rep.state_since = now
            rep.heartbeat, rep.last_seen = hb, now
        if hb.state is ServerState.SERVING and hb.version is not None and hb.version > rep.reached:
            rep.reached = hb.version
            self.rollouts.serving(hb.version, rep.first_seen, now)
        return self.heartbeat_reply()

    def heartbeat_reply(self) -> dict:
        latest = self.latest
        return {"instance": self.instance, "latest": latest.number if latest else None,
                "demand": {"min_version": self.demand}}

    def deregister(self, replica_id: str) -> bool:
        rep = self._replicas.pop(replica_id, None)
        if rep is not None:
            log.info("deregister replica %s", replica_id)
        return rep is not None

    def replicas(self) -> list[dict]:
        now = self.now()
        return [{"replica_id": rid, **rep.heartbeat.model_dump(mode="json"),
                 "age_s": round(now - rep.last_seen, 3)}
                for rid, rep in sorted(self._replicas.items())]

    def directory(self) -> dict[str, Replica]:
        """The replica directory itself, for read-only views (the fleet page): no copy at any size."""
        return self._replicas

    def replica_count(self) -> int:
        return len(self._replicas)

    def replica_counts(self, max_age_s: float | None = None) -> list[dict]:
        """How many replicas are in each (state, version), counting only those heard from
        within ``max_age_s``: cheap to poll at any fleet size, unlike the full directory."""
        now = self.now()
        counts = Counter((r.heartbeat.state, r.heartbeat.version) for r in self._replicas.values()
                         if max_age_s is None or now - r.last_seen <= max_age_s)
        return [{"state": state, "version": version, "count": n}
                for (state, version), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))]

    def refusals(self, min_version: int, max_age_s: float | None = None) -> dict | None:
        """Replicas heard from within ``max_age_s``, below ``min_version``, whose node refused the
        newest version (these bytes; at ``min_version`` or above): none of them reaches
        ``min_version`` before a newer version is published. ``{"version", "replicas",
        "reasons": [{"reason", "count"}]}`` (the five most common), or None when there are none."""
        latest = self.latest
        if latest is None or latest.number < min_version:
            return None
        now, key = self.now(), (latest.number, latest.manifest.digest)
        reasons: Counter[str] = Counter()
        for r in self._replicas.values():
            hb = r.heartbeat
            if not hb.refused or (hb.version or 0) >= min_version or (max_age_s is not None
                                                                      and now - r.last_seen > max_age_s):
                continue
            reasons.update(x.reason for x in hb.refused if (x.version, x.digest) == key)
        if not reasons:
            return None
        return {"version": latest.number, "replicas": sum(reasons.values()),
                "reasons": [{"reason": why, "count": n} for why, n in reasons.most_common(5)]}

    def set_demand(self, min_version: int | None) -> None:
        if min_version is not None and min_version > self._highest:
            raise errors.DemandAhead(f"min_version {min_version} is newer than the newest "
                                     f"published version ({self._highest or 'none'})")
        log.info("demand min_version %s", min_version)
        self.demand = min_version
