"""The registry service: the store, the bytes, publishing and long-poll, on one event loop.

``RegistryService`` is what the HTTP routes call. It owns the only :class:`Store`, so all
state changes happen on one loop; slow work (hashing uploaded bytes) runs in threads and
its result is applied back on the loop under the publish lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rolloutd.registry.blobs import DiskStore, MemoryStore, Staged, StagingDropped, Upload
from rolloutd.registry.canary_check import canary_problems, version_tensors
from rolloutd.registry.deltas import (
    Chain,
    chain_after,
    describe,
    encode_delta,
    why_full_after,
    why_full_before,
)
from rolloutd.registry.rollouts import BEHIND_BUCKETS, behind_bucket
from rolloutd.registry.settings import RegistrySettings
from rolloutd.registry.store import Store, Version, VersionState
from rolloutd.registry.tracker import Tracker
from rolloutd.wire import errors
from rolloutd.wire.manifest import MAX_VERSION, Manifest, ManifestError, duplicate_tensors, safetensors_names
from rolloutd.wire.messages import REPLICA_ID_RE, Announce, Heartbeat

log = logging.getLogger("rolloutd.registry")

# Seconds to minutes on a small fleet and model; up to an hour for a large one over a slow link.
PUBLISH_TO_SERVING_BUCKETS = (.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("rolloutd_registry_requests", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("rolloutd_registry_request_seconds", "HTTP request latency", ["route"],
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .5, 1, 5, 30, 120),
                                 registry=r)
        self.bytes_served = Counter("rolloutd_registry_served_bytes", "File bytes sent", registry=r)
        self.sendfile_responses = Counter("rolloutd_registry_sendfile_responses", "File responses whose bytes "
                                          "the kernel sent from a disk store (sendfile)", registry=r)
        self.bytes_uploaded = Counter("rolloutd_registry_uploaded_bytes", "File bytes received", registry=r)
        self.direct_uploads = Counter("rolloutd_registry_direct_uploads", "Upload bodies read straight from the "
                                      "socket into the store, past the HTTP server's buffers", registry=r)
        self.publishes = Counter("rolloutd_registry_publishes", "Versions published", registry=r)
        self.delta_publishes = Counter("rolloutd_registry_delta_publishes", "Versions published as a delta on "
                                       "an earlier one", registry=r)
        self.delta_bytes = Counter("rolloutd_registry_delta_bytes", "Bytes of the delta files of the versions "
                                   "published as deltas", registry=r)
        self.delta_target_bytes = Counter("rolloutd_registry_delta_target_bytes", "Full size of the versions "
                                          "published as deltas (against delta_bytes: the saving)", registry=r)
        self.delta_encode = Histogram("rolloutd_registry_delta_encode_seconds", "Time to encode a version's "
                                      "delta at publish", buckets=(.01, .05, .1, .5, 1, 2, 5, 10, 30, 60, 120, 300),
                                      registry=r)
        self.heartbeats = Counter("rolloutd_registry_heartbeats", "Heartbeats received", registry=r)
        self.latest = Gauge("rolloutd_registry_latest_version", "Newest live version (0: none)", registry=r)
        self.versions = Gauge("rolloutd_registry_versions", "Versions holding bytes", ["state"], registry=r)
        self.leases = Gauge("rolloutd_registry_leases", "Live leases", registry=r)
        self.replicas = Gauge("rolloutd_registry_replicas", "Replicas in the directory", registry=r)
        self.replica_states = Gauge("rolloutd_registry_replica_states", "Replicas in the directory by the state "
                                    "they reported last", ["state"], registry=r)
        self.replicas_behind = Gauge("rolloutd_registry_replicas_behind", "Replicas by how many versions "
                                     "were published after the one they hold (start model: none loaded)",
                                     ["behind"], registry=r)
        self.publish_to_serving = Histogram("rolloutd_registry_publish_to_serving_seconds", "From a version's "
                                            "publish to each replica's first SERVING report of it (replicas "
                                            "that were in the directory at the publish)",
                                            buckets=PUBLISH_TO_SERVING_BUCKETS, registry=r)
        for bucket in BEHIND_BUCKETS:
            self.replicas_behind.labels(bucket)

    def refresh(self, store: Store) -> None:
        latest = store.latest
        self.latest.set(latest.number if latest else 0)
        for state in (VersionState.LIVE, VersionState.RETIRED):
            self.versions.labels(state.value).set(sum(v.state is state for v in store.versions()))
        self.leases.set(store.lease_count())
        self.replicas.set(store.replica_count())
        states, behind = Tally(), Tally()
        newest = latest.number if latest else None
        for c in store.replica_counts():
            states[c["state"]] += c["count"]
            behind[behind_bucket(c["version"], store.rollouts.lag(c["version"], newest, store.now())[0])] += c["count"]
        self.replica_states.clear()  # a state no replica reports any more is dropped, not left at its last count
        for state, n in states.items():
            self.replica_states.labels(state).set(n)
        for bucket in BEHIND_BUCKETS:
            self.replicas_behind.labels(bucket).set(behind[bucket])


@dataclass(frozen=True)
class Staging:
    """One version's files staged in-process (the trainer's own process publishing), before
    :meth:`RegistryService.publish_staged`: written in place or copied, from any thread."""

    blobs: DiskStore | MemoryStore
    version: int

    def view(self, name: str, size: int) -> Staged:
        """File ``name`` of ``size`` bytes, to be written in place (then ``finish`` or ``abort``)."""
        return self.blobs.stage_view(self.version, name, size)

    def copy(self, path: Path) -> None:
        """A copy of the file at ``path``, named as it is."""
        self.blobs.stage_file(self.version, path)


class RegistryService:
    def __init__(self, settings: RegistrySettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.blobs = DiskStore(Path(settings.data_dir)) if settings.data_dir else MemoryStore()
        self.tracker = Tracker(clock=clock, holder_ttl_s=settings.holder_ttl_s, assign_ttl_s=settings.assign_ttl_s,
                               max_peers=settings.max_peers)
        self.store = Store(keep_versions=settings.keep_versions, clock=clock,
                           max_lease_ttl_s=settings.max_lease_ttl_s,
                           replica_forget_after_s=settings.replica_forget_after_s,
                           reclaim=self._reclaim)
        self.metrics = Metrics()
        self.store.rollouts.on_delay = self.metrics.publish_to_serving.observe
        self.token = settings.read_token()
        self._publish_lock: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None
        self._closing = False
        self._publishing: set[int] = set()  # versions between "verify" and "commit": no uploads
        self._chains: dict[int, Chain | None] = {}  # per version holding bytes: where since the last full one
        self._encoder: ThreadPoolExecutor | None = None  # the delta encoder's threads, made on first use
        self.store.listeners.append(self._wake_pollers)
        for manifest, blobs in self.blobs.load_committed():
            self._publish_committed(manifest, blobs, loaded=True)

    # Events are made on first use so they belong to the loop that serves.
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _wake_pollers(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _reclaim(self, version: int, blobs: dict) -> None:
        self.blobs.reclaim(version, blobs)
        self._chains.pop(version, None)  # only a live version is ever a base
        self.tracker.forget_version(version)  # no puller is sent to a peer for bytes nobody may keep

    def announce(self, node: str, body: bytes) -> dict:
        """A node's peer listener and what it holds -> where it should take what it lacks."""
        if not REPLICA_ID_RE.fullmatch(node):
            raise errors.InvalidRequest(f"invalid node name {node[:140]!r}")
        views = self.tracker.announce(node, errors.parse(Announce, body), self._manifest_of)
        return {"instance": self.store.instance, "versions": views}

    def _manifest_of(self, version: int) -> Manifest | None:
        try:
            return self.store.get(version).manifest
        except (errors.VersionUnknown, errors.VersionRetired):
            return None

    def heartbeat(self, replica_id: str, body: bytes) -> dict:
        """One replica's heartbeat (raw JSON body) -> the reply with latest and demand."""
        reply = self.store.heartbeat(replica_id, errors.parse(Heartbeat, body))
        self.metrics.heartbeats.inc()
        return reply

    def close(self) -> None:
        """Release every long-poll at once (the server is stopping)."""
        self._closing = True
        self._wake_pollers()
        if self._encoder is not None:
            self._encoder.shutdown(wait=False)
            self._encoder = None

    # -- long-poll -------------------------------------------------------------------------------
    async def wait_latest(self, after: int, instance: str | None, wait_s: float) -> dict:
        """The newest version; waits up to ``wait_s`` for one newer than ``after`` unless the
        caller knew another registry instance (then its numbers mean nothing here)."""
        deadline = time.monotonic() + min(wait_s, self.settings.max_wait_s)
        while True:
            latest = self.store.latest
            newer = latest is not None and latest.number > after
            remaining = deadline - time.monotonic()
            if newer or remaining <= 0 or self._closing or (instance and instance != self.store.instance):
                return self.latest_json(latest)
            try:
                await asyncio.wait_for(self._event().wait(), remaining)
            except TimeoutError:
                pass

    def latest_json(self, latest: Version | None) -> dict:
        return {"instance": self.store.instance,
                "version": latest.number if latest else None,
                "digest": latest.manifest.digest if latest else None,
                "total_bytes": latest.manifest.total_bytes if latest else None}

    # -- publishing ------------------------------------------------------------------------------
    def _lock(self) -> asyncio.Lock:
        if self._publish_lock is None:
            self._publish_lock = asyncio.Lock()
        return self._publish_lock

    def check_upload(self, version: int) -> None:
        """Refuse uploads for a version that can never be published (fail fast, not after GBs),
        or whose bytes are being checked and committed right now."""
        self.store.check_new_number(version)
        if version in self._publishing:
            raise errors.VersionConflict(f"version {version} is being published; its files are final")

    def finish_upload(self, version: int, name: str, up: Upload) -> int:
        """Put an uploaded (and synced) file in place, unless its version was published, or began
        to be, while the bytes arrived. On the loop, in one step with the check: no publish can
        verify or commit the version's files in between."""
        self.check_upload(version)
        try:
            return up.finish()
        except StagingDropped:
            raise errors.UploadIncomplete(f"the uploads of version {version} were dropped while {name} "
                                          "arrived (DELETE /v1/uploads); upload it again") from None

    async def publish(self, manifest: Manifest, verify: bool = True, delta: bool = True) -> tuple[Version, bool]:
        """Publish the staged bytes of ``manifest``; returns (version, created). It is published as
        a delta on the newest live version when that is worth it (docs/deltas.md); ``delta=False``:
        full. A manifest published already is answered as it is, whatever delta section either has."""
        try:
            manifest = manifest.sealed()
        except ManifestError as e:
            raise errors.ManifestDigestMismatch(str(e)) from None
        async with self._lock():
            if self.store.check_publishable(manifest):
                return self.store.get(manifest.version), False
            if manifest.source is not None:  # the bytes are in an object store: the manifest only
                self._check_canary(manifest, staged=False)
                manifest, why_full = self._sent_delta(manifest, delta)
                blobs = await asyncio.to_thread(self.blobs.commit, manifest)
                return self._publish_committed(manifest, blobs, why_full=why_full), True
            if manifest.delta is not None:  # only a delta section the registry encoded itself is served
                log.info("drop the delta section sent with version %d: the registry encodes its own",
                         manifest.version)
                manifest = manifest.target()
            self._check_staged(manifest)
            await asyncio.to_thread(self._check_canary, manifest, staged=True)
            self._publishing.add(manifest.version)
            try:
                if verify:
                    bad = await asyncio.to_thread(self.blobs.verify_staged, manifest)
                    if bad:
                        detail = "; ".join(f"{n}: chunks {c[:8]}" for n, c in sorted(bad.items()))
                        raise errors.DigestMismatch(f"uploaded bytes differ from the manifest ({detail}); "
                                                    "upload those files again")
                if dups := await asyncio.to_thread(self._duplicate_tensors, manifest):
                    raise errors.DuplicateTensor(f"version {manifest.version} gives a tensor name more than "
                                                 f"once: {'; '.join(dups[:5])}{'; ...' if len(dups) > 5 else ''}")
                manifest, why_full = await self._encode(manifest, delta)
                blobs = await asyncio.to_thread(self.blobs.commit, manifest)
            except StagingDropped as e:  # dropped in-process (an embedded publish cancelled): never an empty version
                raise errors.UploadIncomplete(f"{e}; upload the version's files again") from None
            finally:
                self._publishing.discard(manifest.version)
            return self._publish_committed(manifest, blobs, why_full=why_full), True

    def _publish_committed(self, manifest: Manifest, blobs: dict, *, why_full: str | None = None,
                           loaded: bool = False) -> Version:
        base = self._chains.get(manifest.delta.base_version) if manifest.delta is not None else None
        chain = chain_after(base, manifest.delta)  # before the publish: it may reclaim the base
        version = self.store.publish(manifest, blobs, "loaded from disk" if loaded else describe(manifest, why_full))
        self._chains[manifest.version] = chain
        if loaded:
            return version
        self.metrics.publishes.inc()
        if manifest.delta is not None:
            self.metrics.delta_publishes.inc()
            self.metrics.delta_bytes.inc(manifest.delta.total_bytes)
            self.metrics.delta_target_bytes.inc(manifest.total_bytes)
        return version

    async def _encode(self, manifest: Manifest, asked: bool) -> tuple[Manifest, str | None]:
        """``manifest`` with the delta section it is published with, encoded against the newest
        live version (its delta files staged beside its own), or as it is and why it goes full."""
        base = self.store.latest
        chain = self._chains.get(base.number) if base is not None else None
        if why := why_full_before(self.settings, manifest, asked, base, chain):
            return manifest, why
        began = time.perf_counter()
        try:
            section = await asyncio.to_thread(encode_delta, self.blobs, manifest, base,
                                              encoding=self.settings.delta_encoding, pool=self._pool())
            if why := why_full_after(self.settings, manifest.total_bytes, section.total_bytes, chain):
                return manifest, why
            with_delta = manifest.with_delta(section)
        except StagingDropped:
            raise
        except Exception as e:  # a full version is always right: a failed encode costs bytes, never the publish
            log.warning("encode version %d against version %d failed: %s", manifest.version, base.number, e,
                        exc_info=True)
            return manifest, f"its delta could not be encoded: {type(e).__name__}"
        finally:
            self.metrics.delta_encode.observe(time.perf_counter() - began)
        return with_delta, None

    def _sent_delta(self, manifest: Manifest, asked: bool) -> tuple[Manifest, str | None]:
        """An object-store version (its publisher encoded any delta section it has) as published:
        with its section when the rules of the registry's own deltas allow it on the LIVE version
        it names, else full; and why full. The registry holds none of the delta files' bytes to
        check: nodes check every chunk of them and every rebuilt chunk of the target."""
        why = self.why_full_sent(manifest, asked)
        if why is not None and manifest.delta is not None:
            log.info("drop the delta section sent with version %d: %s", manifest.version, why)
            return manifest.target(), why
        return manifest, why

    def why_full_sent(self, manifest: Manifest, asked: bool) -> str | None:
        """Why an object-store version ``manifest`` would be published full, whatever delta section
        it has; None: with its section. On the loop (an embedded publisher asks before it uploads)."""
        base = None
        if manifest.delta is not None:
            with contextlib.suppress(errors.VersionUnknown, errors.VersionRetired):
                base = self.store.get(manifest.delta.base_version)
            if base is not None and base.state is not VersionState.LIVE:
                base = None
        chain = self._chains.get(base.number) if base is not None else None
        why = why_full_before(self.settings, manifest, asked, base, chain)
        if why is None:
            why = why_full_after(self.settings, manifest.total_bytes, manifest.delta.total_bytes, chain)
        return why

    def _pool(self) -> ThreadPoolExecutor:
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="registry-delta")
        return self._encoder

    def _check_staged(self, manifest: Manifest) -> None:
        sizes = self.blobs.staged_sizes(manifest.version)
        problems = []
        for f in manifest.files:
            if f.name not in sizes:
                problems.append(f"{f.name} not uploaded")
            elif sizes[f.name] != f.size:
                problems.append(f"{f.name} has {sizes[f.name]} bytes, manifest says {f.size}")
        if problems:
            raise errors.UploadIncomplete("; ".join(problems[:20]))

    def _check_canary(self, manifest: Manifest, *, staged: bool) -> None:
        """A canary that can never pass would have every node load the version and refuse it."""
        if manifest.canary is None:
            return
        tensors = version_tensors(manifest.files, lambda name, o, n: self.blobs.read_staged(
            manifest.version, name, o, n)) if staged else ()
        if problems := canary_problems(manifest.canary, tensors):
            raise errors.BadCanary(f"version {manifest.version}: its canary can never pass: {'; '.join(problems)}")

    def _duplicate_tensors(self, manifest: Manifest) -> list[str]:
        """Tensor names given twice across the safetensors headers of the staged files (files
        that are not safetensors are not looked into: the registry stores any bytes)."""
        def names(f) -> list[str] | None:
            return safetensors_names(lambda o, n: self.blobs.read_staged(manifest.version, f.name, o, n), f.size)
        return duplicate_tensors((f.name, names(f)) for f in manifest.files)

    # -- the staged publish: the trainer's embedded registry, in-process --------------------------------
    @contextlib.contextmanager
    def staging(self, version: int) -> Iterator[Staging]:
        """Stage ``version``'s files in-process, then :meth:`publish_staged` them on the loop.
        Fails before any work for a number that can never be published (one published already may
        still be the same bytes again, a no-op decided at publish); on any failure nothing of it is
        left behind."""
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
            raise errors.InvalidRequest(f"version must be an integer from 1 to {MAX_VERSION}, got {version!r:.100}")
        with contextlib.suppress(errors.VersionConflict):
            self.store.check_new_number(version)
        try:
            yield Staging(self.blobs, version)
        except BaseException:
            self.blobs.discard_staging(version)
            raise

    async def publish_staged(self, manifest: Manifest, *, verify: bool, delta: bool) -> tuple[Version, bool]:
        """:meth:`publish` what :meth:`staging` staged for ``manifest``; when the same bytes are
        published already (the check is :meth:`publish`'s), their staged copy is thrown away."""
        version, created = await self.publish(manifest, verify=verify, delta=delta)
        if not created:
            self.blobs.discard_staging(manifest.version)
        return version, created

    def abort_upload(self, version: int) -> None:
        """Drop a version's staged files, unless it is being published: its files are final then
        (dropped mid-publish, the commit would find them gone)."""
        if version in self._publishing:
            raise errors.VersionConflict(f"version {version} is being published; its uploads cannot be "
                                         "dropped now")
        self.blobs.discard_staging(version)
