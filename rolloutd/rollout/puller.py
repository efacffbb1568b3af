"""The puller: brings one version from the registry into the node mirror, once per node.

Contract:

- ``await Puller.pull(version or "latest")`` leases the version, fetches its manifest (its
  digest checked), and returns at once if the mirror already holds it with that digest.
  Otherwise it makes room (``Mirror.ensure_room``), writes every chunk into a hidden partial
  directory with ``streams`` concurrent workers (each chunk in ``Range`` requests of at most
  ``request_bytes``), checks every chunk against the manifest as it completes, and commits
  the directory into place. It returns a :class:`PullResult`, or raises :class:`PullError`
  naming what failed.
- Where each chunk comes from is the pull's :class:`~rolloutd.rollout.swarm.ChunkPlan`: the
  version's origin (the registry, or the object store its manifest names) and, with peers on,
  other nodes. A chunk from the origin that arrives corrupt or whose transfer fails is fetched
  again, up to ``max_chunk_retries`` times per chunk; then the pull fails. A peer that fails
  (an error, bad bytes, slower than ``peer_chunk_timeout_s`` for a chunk) is dropped for the
  rest of the pull and its chunk fetched elsewhere, without counting against that limit.
- A **delta version** (its manifest has a ``delta`` section, docs/deltas.md) whose base the
  mirror holds complete, with the section's ``base_digest`` and sound (``Mirror.damage``), is
  pulled as its delta: room is made for the version and its delta files, the base is pinned
  (no gc or ``ensure_room`` removes it meanwhile; it is only ever read), the delta files are
  fetched from the origin (and, with peers on, from nodes pulling the same delta, docs/peers.md)
  into the partial directory (``Mirror.stage``), checked chunk by chunk as any file, then the
  pull workers rebuild every file of the version from the base and them
  (:func:`rolloutd.wire.delta.apply_and_verify`), each chunk checked against the version's
  digests as it is written; the delta files are removed (with peers on, kept for peers in
  ``.<v>.delta`` until the mirror commits another version: docs/peers.md) and the version
  committed with the section dropped (``Manifest.target()``: the same digest), so the mirror holds an ordinary
  full version. Any failure of that path (a delta chunk that fails ``max_chunk_retries`` + 1
  times, a delta that cannot be applied, a rebuilt chunk that differs, a damaged base, no room
  for the delta files) is logged at WARNING naming the version and file, kept in
  ``progress.delta_error``, and the same ``pull()`` goes on with the whole version in a fresh
  partial directory: a version rebuilt wrong is never committed. Without the base (or with
  another copy of it) the whole version is pulled at once (logged at INFO). A delta pull's
  partial directory is never kept for a next try; a full pull's kept one is resumed whole.
- The lease is renewed every ``renew_every_s`` while pulling. A lease that expired anyway is
  taken again on the same version if the registry still has it (a retired version keeps its
  bytes only while leased: if they are gone, the pull fails).
- On any failure or cancellation the lease is released (best effort) and nothing is ever
  visible under the version's name unless complete. A pull that ends while fetching, with
  chunks already checked, leaves its partial directory for the next try (a transfer that
  failed once too often, a ``pull.timeout_s``): the next pull of the same version and digest
  takes it up and fetches only the chunks it lacks. Any other pull first discards it, and
  :meth:`Puller.discard_kept` does so at shutdown; the mirror counts it in its usage meanwhile.
- ``Puller.progress`` describes the current (or last) pull at any time, for status and metrics.
  One pull at a time per ``Puller``.
- The pull workers of a pull that succeeded are kept ``keep_workers_s`` for the next one (0:
  stopped as each pull ends), so a node that pulls every RL step starts them once: a start
  is a noticeable share of a pull (bench/README.md, "Workers kept between steps"). A pull that fails or is cancelled
  stops them (the next starts fresh ones); a kept worker that dies is started again as during a
  pull. ``await Puller.close()`` stops them at once, and must be called before the loop ends.
- Once ``stopping`` is set (the daemon stops), a pull ends cancelled whatever it met: a failure
  while it is cancelled (its workers' stop, say) is logged, never raised in place of the
  cancellation, so a stop is never taken for a failed pull to be tried again. (A flag, not the
  task's ``cancelling()``: on Python 3.11 a task group whose task fails leaves that count raised
  for good.) ``close()`` stops every worker this puller started, a running pull's included.

Who does what: this object, on the daemon's loop, takes the lease, reads the manifest, makes
room, has the mirror create the partial directory, asks the plan where each chunk comes from
and hands it, with that source, to a pull worker
(:mod:`~rolloutd.rollout.fetch_pool`: ``workers`` child processes with ``streams`` transfers
in all), retries what failed, renews the lease and has the mirror commit. The workers only
move bytes: network reads, digests, rebuilds from a delta and writes into the partial
directory's files, so no pull work ever runs on the daemon's event loop or under its
interpreter lock. The mirror stays the
one owner of its directories, in this process: the workers never create, rename or remove
anything, so gc, ``ensure_room`` and commits decide on one view under one lock. Requests start
on chunk boundaries, so every write but a file's last covers whole pages (tmpfs zero-fills the
rest of a page a write covers only partly). No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rolloutd.config import Config
from rolloutd.rollout.fetch_pool import (
    ApplyJob,
    ChunkCorrupt,
    ChunkJob,
    DeltaRejected,
    FetchPool,
    TargetDiffers,
    WorkerCrashed,
)
from rolloutd.rollout.mirror import Mirror, MirrorFull, Partial
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.swarm import ChunkPlan, Pick, Swarm, SwarmSettings
from rolloutd.wire import errors
from rolloutd.wire.chunkmap import chunk_index, ones
from rolloutd.wire.manifest import FileEntry, Manifest, ManifestError
from rolloutd.wire.messages import LeaseInfo
from rolloutd.wire.status import PullState, PullStatus

log = logging.getLogger("rolloutd.rollout.puller")

MiB = 1 << 20
RATE_WINDOW_S = 5.0      # progress rate: bytes over this recent window
RATE_SAMPLE_S = 0.1      # at most one rate sample this often
PIECE_BYTES = 1 * MiB     # a worker reads, hashes and writes a body in pieces of this size
RELEASE_TIMEOUT_S = 5.0  # a release is best effort: never hold a failing pull for long

# A version that is gone, a file it lacks, a bad token: fetching again cannot help.
_FATAL = (errors.VersionRetired, errors.VersionUnknown, errors.FileUnknown, errors.Unauthorized,
          errors.RangeNotSatisfiable, errors.InvalidRequest, errors.RouteNotFound)


class PullError(Exception):
    """A pull failed; the message says which version, and which file and chunk if one."""


class VersionGone(PullError):
    """The version cannot be fetched any more (retired and its bytes reclaimed, or unknown to
    the registry): the chunks a failed pull checked are worth nothing to a next try."""


_ARROWS = {
    PullState.LEASING: {PullState.PULLING, PullState.DONE, PullState.FAILED, PullState.CANCELLED},
    PullState.PULLING: {PullState.COMMITTING, PullState.FAILED, PullState.CANCELLED},
    PullState.COMMITTING: {PullState.DONE, PullState.FAILED, PullState.CANCELLED},
    PullState.DONE: set(), PullState.FAILED: set(), PullState.CANCELLED: set(),
}


@dataclass
class PullProgress:
    """One pull as it goes; read it at any time (all fields are plain values)."""

    target: int | str
    version: int | None = None  # None until "latest" is resolved
    bytes_total: int = 0
    bytes_done: int = 0         # bytes written for chunks not (yet) failed
    retries: int = 0
    worker_pids: list[int] = field(default_factory=list)  # the pull workers while they run
    worker_restarts: int = 0
    state: PullState = PullState.LEASING
    error: str | None = None
    bytes_resumed: int = 0      # of bytes_done: checked by an earlier try, not fetched again
    kind: str = "full"          # "full" or "delta" (the base's bytes plus the delta files)
    base: int | None = None     # a delta pull's base version
    bytes_fetched: int = 0      # bytes received over the network and kept (a failed attempt's: once)
    version_bytes: int = 0      # the version's full size
    reconstruct_s: float | None = None  # a delta pull's rebuild so far, or in all once it ended
    delta_error: str | None = None      # why this pull fell back from the delta to the full version
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    started_at: float = 0.0
    ended_at: float | None = None
    # (time, bytes moved): the rate's samples. Bytes moved only grow: a failed chunk's bytes
    # leave bytes_done but were moved all the same, so the rate never reads negative.
    _samples: deque[tuple[float, int]] = field(default_factory=deque, repr=False)
    _moved: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.started_at = self.clock()
        self._samples.append((self.started_at, 0))

    @property
    def seconds(self) -> float:
        return (self.ended_at if self.ended_at is not None else self.clock()) - self.started_at

    @property
    def rate_bytes_per_s(self) -> float:
        """Over the last ``RATE_WINDOW_S`` while pulling; the average once it ended."""
        if self.ended_at is not None:
            return (self.bytes_done - self.bytes_resumed) / self.seconds if self.seconds > 0 else 0.0
        now = self.clock()
        t0, b0 = self._samples[0]
        return (self._moved - b0) / (now - t0) if now > t0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.state is not PullState.PULLING:
            return 0.0 if self.state is PullState.DONE else None
        rate = self.rate_bytes_per_s
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None

    def resume(self, n: int) -> None:
        """Start from ``n`` bytes an earlier try left checked: done, but not in the rate."""
        self.bytes_done = self.bytes_resumed = n
        self._samples.clear()
        self._samples.append((self.clock(), self._moved))

    def add(self, n: int) -> None:
        self.bytes_done += n
        self._moved += n
        now = self.clock()
        if now - self._samples[-1][0] >= RATE_SAMPLE_S:
            self._samples.append((now, self._moved))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()

    def take_back(self, n: int) -> None:
        """A failed attempt's ``n`` bytes: not done (they are fetched again), but they were moved."""
        self.bytes_done -= n

    def start_delta(self, base: int, delta_bytes: int) -> None:
        """A delta pull: its work is the delta files' bytes fetched, then the version's rebuilt."""
        self.kind, self.base = "delta", base
        self.bytes_total = delta_bytes + self.version_bytes

    def start_full(self, why: str | None) -> None:
        """The whole version from now on; ``why``: the delta pull that failed, if one did."""
        self.kind, self.base, self.reconstruct_s, self.delta_error = "full", None, None, why
        self.bytes_total, self.bytes_done, self.bytes_resumed = self.version_bytes, 0, 0
        self._samples.clear()
        self._samples.append((self.clock(), self._moved))

    def status(self) -> PullStatus:
        """The pull as the node's status shows it (figures rounded)."""
        eta = self.eta_s
        return PullStatus(target=self.target, version=self.version, state=self.state, bytes_done=self.bytes_done,
                          bytes_total=self.bytes_total, bytes_resumed=self.bytes_resumed,
                          rate_bytes_per_s=round(self.rate_bytes_per_s, 1),
                          eta_s=None if eta is None else round(eta, 2), retries=self.retries,
                          workers=list(self.worker_pids), worker_restarts=self.worker_restarts,
                          seconds=round(self.seconds, 3), error=self.error, kind=self.kind, base=self.base,
                          bytes_fetched=self.bytes_fetched, version_bytes=self.version_bytes,
                          reconstruct_s=None if self.reconstruct_s is None else round(self.reconstruct_s, 3),
                          delta_error=self.delta_error)

    def as_dict(self) -> dict:
        """:meth:`status` as the JSON the admin API serves."""
        return self.status().model_dump(mode="json")


@dataclass(frozen=True)
class PullResult:
    version: int
    path: Path
    digest: str
    bytes: int       # bytes fetched (0 when the mirror already had the version; not those resumed)
    seconds: float
    retries: int
    reused: bool = False
    kind: str = "full"   # "delta": rebuilt from the base and the delta files
    base: int | None = None
    bytes_fetched: int = 0   # the same as ``bytes``, under the name the status uses
    version_bytes: int = 0   # the version's full size
    reconstruct_s: float | None = None  # a delta pull's rebuild


@dataclass(frozen=True)
class Kept:
    """A pull that ended while fetching, kept for the next try: its partial directory and the
    chunks (bits in :func:`~rolloutd.wire.chunkmap.chunk_index` order) checked in it."""

    partial: Partial
    done_bits: int
    bytes: int


class PullSettings(BaseModel):
    """How a node pulls: from the ``pull`` section of its config (:meth:`from_config`), or given
    whole in a test. The puller's collaborators (the registry client, the mirror, the swarm) are
    passed beside it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    holder: str = Field(description="the lease holder's name: the node's")
    streams: int = Field(4, ge=1, description="chunk transfers at once")
    workers: int = Field(1, ge=1, description="pull worker processes (at most one per stream)")
    priority: str = Field("normal", description="the workers' CPU priority: idle, low or normal")
    request_bytes: int = Field(16 * MiB, ge=1, description="largest Range request")
    max_chunk_retries: int = Field(3, ge=0, description="tries of a chunk from the origin after the first")
    lease_ttl_s: float = Field(60.0, gt=0, description="the lease's time to live")
    renew_every_s: float | None = Field(None, gt=0, description="lease renewal period (None: a third of the ttl)")
    piece_bytes: int = Field(PIECE_BYTES, ge=1, description="a worker reads, hashes and writes in pieces this size")
    retry_delay_s: float = Field(0.1, ge=0, description="first delay before a chunk is fetched again (doubling)")
    keep_workers_s: float = Field(0.0, ge=0, description="idle time the workers are kept for a next pull")
    worker_silence_s: float = Field(10.0, gt=0, description="a worker silent this long, and not runnable, is hung")

    @classmethod
    def from_config(cls, cfg: Config) -> PullSettings:
        p = cfg.pull
        return cls(holder=cfg.node_name, streams=p.stream_count(), workers=p.worker_count(), priority=p.cpu_priority,
                   request_bytes=int(p.request_bytes), max_chunk_retries=p.max_chunk_retries,
                   lease_ttl_s=p.lease_ttl_s, keep_workers_s=p.keep_workers_s, worker_silence_s=p.worker_silence_s)


class Puller:
    def __init__(self, client: RegistryClient, mirror: Mirror, settings: PullSettings, *, swarm: Swarm | None = None,
                 in_use: Callable[[], set[int]] = set, on_worker_restart: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        holder, streams, workers = settings.holder, settings.streams, settings.workers
        self.client, self.mirror, self.holder = client, mirror, holder
        self.streams, self.request_bytes = streams, settings.request_bytes
        self.workers = min(workers, streams)  # a worker without a stream would do nothing
        self.priority = settings.priority  # the workers' CPU priority: idle, low or normal
        self.keep_workers_s = settings.keep_workers_s
        self._pool: FetchPool | None = None        # the last pull's workers, kept for the next
        self._idle: asyncio.Task | None = None     # stops them once they idled keep_workers_s
        self._pools: set[FetchPool] = set()        # every pool started and not yet closed
        self.worker_silence_s = settings.worker_silence_s
        self.stopping = False  # set when the daemon stops: every pull ends cancelled from then on
        # The last pull failed for lack of room on the mirror's filesystem, like the one before
        # it: said once (and by the daemon at start), not at every retry.
        self.no_room_again = False
        self._no_room = False
        self.on_worker_restart = on_worker_restart
        self.max_chunk_retries = settings.max_chunk_retries
        self.lease_ttl_s = settings.lease_ttl_s
        self.renew_every_s = settings.renew_every_s if settings.renew_every_s is not None else self.lease_ttl_s / 3
        self.piece_bytes = settings.piece_bytes
        self.retry_delay_s = settings.retry_delay_s
        self.in_use = in_use  # versions the node's servers hold: never removed to make room
        self.clock = clock
        self.progress: PullProgress | None = None
        self.kept: Kept | None = None  # owned here: only pull() and discard_kept() change it
        self._lease: LeaseInfo | None = None
        # Where chunks come from: the origin (registry or object store) and, with peers on, other
        # nodes; the default is the registry alone.
        self.swarm = swarm or Swarm(SwarmSettings(), client, mirror, node=holder)
        self.peer_chunk_timeout_s = self.swarm.settings.peer_chunk_timeout_s
        self.last_plan: ChunkPlan | None = None

    @property
    def kept_worker_pids(self) -> list[int]:
        """The pull workers kept idle for the next pull (none while a pull runs)."""
        return self._pool.pids if self._pool is not None else []

    async def close(self) -> None:
        """Stop every pull worker (at the daemon's stop): those kept, and those of a pull that
        did not end (its chunks fail; the pull should have been cancelled first)."""
        await self._stop_idle()
        self._pool = None
        await asyncio.gather(*(self._close_pool(pool) for pool in list(self._pools)))

    async def _close_pool(self, pool: FetchPool) -> None:
        self._pools.discard(pool)
        await pool.close()

    @property
    def lease(self) -> LeaseInfo | None:
        """The lease held for the pull in progress, if any."""
        return self._lease

    # -- the pull ---------------------------------------------------------------------------------
    async def pull(self, version: int | str = "latest") -> PullResult:
        if self.progress is not None and self.progress.ended_at is None:
            raise RuntimeError(f"a pull of {self.progress.target} is in progress: one at a time")
        if self.stopping:
            raise asyncio.CancelledError()  # rolloutd stops: no pull starts
        progress = self.progress = PullProgress(target=version, clock=self.clock)
        self.last_plan = None
        no_room_before, self._no_room, self.no_room_again = self._no_room, False, False
        try:
            async with self._leased(version) as lease:
                return await self._pull_leased(lease, version, no_room_before)
        except BaseException as e:
            if progress.ended_at is not None:  # said and recorded under the lease already
                raise
            raised = self._abandon(e, version, no_room_before)  # the lease could not be taken
            if raised is e:
                raise
            raise raised from e
        finally:
            if progress.ended_at is None:  # only if something stranger than an Exception ended it
                progress.ended_at = self.clock()

    async def _pull_leased(self, lease: LeaseInfo, version: int | str, no_room_before: bool) -> PullResult:
        """The pull under its lease: what it leaves (a partial directory kept for the next try,
        or discarded; its chunks no longer served to peers) is settled before the lease goes."""
        progress = self.progress
        partial: Partial | None = None
        done_bits = 0
        keepable = True  # until the commit starts, checked chunks are worth keeping for a next try
        try:
            progress.version = lease.version
            manifest = await self._manifest(lease)
            progress.bytes_total = progress.version_bytes = manifest.total_bytes
            kept = await self._take_kept(manifest)
            if kept is not None:
                partial, done_bits = kept.partial, kept.done_bits
            if self.mirror.has(manifest.version, manifest.digest):
                damage = await asyncio.to_thread(self.mirror.damage, manifest.version, manifest.digest)
                if not damage:
                    log.info("have version %d already in %s", manifest.version, self.mirror.path(manifest.version))
                    self._set_state(PullState.DONE)
                    return self._result(manifest, reused=True)
                log.warning("verify version %d: the mirror copy is damaged (%s); pulling it again",
                            manifest.version, "; ".join(damage)[:300])
                await asyncio.to_thread(self.mirror.remove, manifest.version, "damaged")
            if manifest.delta is not None:
                if kept is None and (result := await self._try_delta(manifest)) is not None:
                    return result
                if kept is not None:
                    log.info("pull version %d whole, not from its delta: the last try left %d bytes of it checked",
                             manifest.version, kept.bytes)
                manifest = manifest.target()  # what the mirror keeps: the same digest, no delta section
            # A kept partial is in the mirror's usage at its full size already.
            await asyncio.to_thread(self.mirror.ensure_room, 0 if kept else manifest.total_bytes, self.in_use())
            if kept is not None:
                progress.resume(kept.bytes)
            else:
                partial = await _settle(asyncio.to_thread(self.mirror.begin, manifest), self.mirror.discard)
            if progress.state is not PullState.PULLING:  # it is already after a delta pull that failed
                self._set_state(PullState.PULLING)
            chunks = sum(len(f.chunks) for f in manifest.files) - done_bits.bit_count()
            workers, streams = self._plan(chunks)
            log.info("pull version %d: %d files, %d bytes, %d workers, %d streams of %d-byte requests%s",
                     manifest.version, len(manifest.files), manifest.total_bytes, workers, streams,
                     self.request_bytes, f"; {done_bits.bit_count()} chunks ({kept.bytes} bytes) checked by the "
                     f"last try, {chunks} to fetch" if kept else "")
            await self._fetch_all(manifest, partial, done_bits)
            keepable = False
            self._set_state(PullState.COMMITTING)
            await _settle(asyncio.to_thread(self.mirror.commit, partial))
            partial = None
            self._set_state(PullState.DONE)
            result = self._result(manifest)
            log.info("pulled version %d: %d bytes in %.2f s (%.0f MB/s), %d retries%s", result.version,
                     result.bytes, result.seconds, result.bytes / max(result.seconds, 1e-9) / 1e6, result.retries,
                     f"; whole after its delta failed ({progress.delta_error})" if progress.delta_error else "")
            return result
        except BaseException as e:
            if isinstance(e, VersionGone) and not self.stopping:
                keepable = False  # its checked chunks are worth nothing to a next try
            raised = self._abandon(e, version, no_room_before)
            if raised is e:
                raise
            raise raised from e
        finally:
            if partial is not None:
                checked = self.last_plan.done_bits if self.last_plan is not None else done_bits
                if keepable and checked:
                    self._keep(partial, checked)
                else:
                    await _settle(asyncio.to_thread(self.mirror.discard, partial))
            if self.last_plan is not None:  # after the commit: peers are served the partial until then
                self.swarm.finish(self.last_plan)

    def _abandon(self, e: BaseException, version: int | str, no_room_before: bool) -> BaseException:
        """Record in the progress how the pull ended, and say so; the exception to raise for ``e``."""
        progress = self.progress
        if isinstance(e, asyncio.CancelledError):
            self._end(PullState.CANCELLED, "cancelled")
            return e
        if not isinstance(e, Exception):
            return e
        if self.stopping:  # the stop wins: whoever cancelled must see it
            log.warning("pull of %s: %s while rolloutd stops", progress.version or version, _describe(e))
            self._end(PullState.CANCELLED, "cancelled")
            return asyncio.CancelledError()
        if isinstance(e, PullError):
            self._end(PullState.FAILED, str(e))
            return e
        what = f"pull of version {progress.version or version} failed: {_describe(e)}"
        self._no_room = isinstance(e, OSError) and e.errno == errno.ENOSPC
        self.no_room_again = self._no_room and no_room_before
        self._end(PullState.FAILED, what, quiet=self.no_room_again)
        return PullError(what)

    def _result(self, manifest: Manifest, reused: bool = False) -> PullResult:
        p = self.progress
        fetched = 0 if reused else p.bytes_fetched
        return PullResult(version=manifest.version, path=self.mirror.path(manifest.version),
                          digest=manifest.digest, bytes=fetched, seconds=p.seconds, retries=p.retries, reused=reused,
                          kind=p.kind, base=p.base, bytes_fetched=fetched, version_bytes=manifest.total_bytes,
                          reconstruct_s=p.reconstruct_s)

    # -- delta pulls ------------------------------------------------------------------------------------
    async def _try_delta(self, manifest: Manifest) -> PullResult | None:
        """Pull ``manifest`` (which has a delta section) from its delta if the mirror holds the
        base complete, with the delta's base digest, and sound: the result; or None, and the
        full version is to be pulled: said at INFO when the base is not here, at WARNING (and
        in ``progress.delta_error``) when the delta pull failed. The base is pinned meanwhile:
        no gc or ``ensure_room`` removes what the rebuild reads."""
        delta, v = manifest.delta, manifest.version
        await _settle(asyncio.to_thread(self.mirror.pin, delta.base_version),
                      lambda _: self.mirror.unpin(delta.base_version))
        try:
            base = await asyncio.to_thread(self.mirror.manifest, delta.base_version)
            if base is not None and base.digest != delta.base_digest and await asyncio.to_thread(
                    self._from_this_registry, delta.base_version):
                # The registry that gave us this copy now names another base: its delta cannot be ours.
                self._fall_back(v, f"version {v}: its delta names base version {delta.base_version} with digest "
                                   f"{delta.base_digest[:12]}..., but this registry's version {delta.base_version} "
                                   f"in the mirror has digest {base.digest[:12]}...")
                return None
            if base is None or base.digest != delta.base_digest:
                held = "not" if base is None else (f"with digest {base.digest[:12]}... (pulled from another "
                                                   f"registry instance), not {delta.base_digest[:12]}...")
                log.info("pull version %d whole, not from its delta: the mirror holds its base, version %d, %s",
                         v, delta.base_version, held)
                return None
            if problems := await asyncio.to_thread(self.mirror.damage, base.version, base.digest):
                self._fall_back(v, f"version {v}: its base, version {base.version}, is damaged in the mirror "
                                   f"({'; '.join(problems)[:300]})")
                return None
            try:
                return await self._pull_delta(manifest, base)
            except VersionGone:
                raise
            except PullError as e:
                if self.stopping:
                    raise
                self._fall_back(v, str(e))
                return None
        finally:
            await _settle(asyncio.to_thread(self.mirror.unpin, delta.base_version))

    def _from_this_registry(self, version: int) -> bool:
        """Whether the mirror's copy of ``version`` was pulled for the registry instance the node follows."""
        following = self.mirror.following
        return following is not None and self.mirror.record(version).instance == following

    def _fall_back(self, version: int, why: str) -> None:
        log.warning("pull version %d whole: its delta pull failed: %s", version, why)
        self.progress.start_full(why)

    async def _pull_delta(self, manifest: Manifest, base: Manifest) -> PullResult:
        """Fetch the delta files into the partial directory, rebuild every target file from the
        base and them in the pull workers (each chunk checked against the target's digest as it
        is written), drop the delta files (or keep them for peers) and commit the target. PullError names the version
        and file of a failure; the partial directory is discarded on every path but success."""
        target, files = manifest.target(), _delta_files(manifest)
        self.progress.start_delta(base.version, files.total_bytes)
        try:
            await asyncio.to_thread(self.mirror.ensure_room, files.total_bytes + target.total_bytes, self.in_use())
        except MirrorFull as e:
            raise PullError(f"version {manifest.version}: no room for its delta files beside it: {e}") from None
        partial = await _settle(asyncio.to_thread(self.mirror.begin, target), self.mirror.discard)
        plan: ChunkPlan | None = None
        try:
            try:
                staged = await asyncio.to_thread(self.mirror.stage, partial, files)
            except OSError as e:
                raise PullError(f"version {manifest.version}: cannot stage its delta files: {e}") from None
            self._set_state(PullState.PULLING)
            log.info("pull version %d from its delta on version %d: %d delta files, %d bytes for %d bytes of "
                     "version", manifest.version, base.version, len(files.files), files.total_bytes,
                     target.total_bytes)
            plan = self.swarm.plan_delta(manifest, staged.manifest, staged.dir)
            await self._fetch_and_rebuild(manifest, base, partial, staged, plan)
            # Peers may still be fetching the delta: with peers on, its files stay served from
            # beside the version until the mirror commits another one (docs/peers.md).
            keep = plan.peers_on
            if not keep:
                await asyncio.to_thread(self.mirror.unstage, partial)
            self._set_state(PullState.COMMITTING)
            await _settle(asyncio.to_thread(self.mirror.commit, partial, keep_delta=keep))
            partial = None
            if keep and self.swarm.keep_delta(plan, manifest, self.mirror.delta_dir(manifest.version)):
                log.info("keep the delta files of version %d (%d bytes) for peers until another version is "
                         "committed", manifest.version, files.total_bytes)
            self._set_state(PullState.DONE)
        finally:
            if plan is not None:  # served until here on every path; kept beyond only by keep_delta
                self.swarm.finish(plan)
            if partial is not None:
                await _settle(asyncio.to_thread(self.mirror.discard, partial))
        result = self._result(target)
        log.info("pulled version %d from its delta on version %d: %d bytes fetched for %d (%.1f%%), rebuilt in "
                 "%.2f s, %.2f s in all, %d retries", result.version, base.version, result.bytes_fetched,
                 result.version_bytes, 100 * result.bytes_fetched / max(1, result.version_bytes),
                 result.reconstruct_s or 0.0, result.seconds, result.retries)
        return result

    async def _fetch_and_rebuild(self, manifest: Manifest, base: Manifest, partial: Partial, staged: Partial,
                                 plan: ChunkPlan) -> None:
        """The delta files' chunks (``plan``: from the origin and, with peers on, from the nodes
        that hold the same delta; this node serves its checked delta chunks meanwhile), then one
        rebuild job per target file, on the same workers."""
        jobs = _rebuild_jobs(manifest, self.mirror.path(base.version), base, partial, staged)
        workers, streams = self._plan(max(plan.count, len(jobs)))

        async def work(pool: FetchPool) -> None:
            if plan.count:
                await self._chunks(plan, staged.manifest, staged, pool, min(streams, plan.count))
            await self._rebuild(jobs, pool, streams)
        await self._with_pool(manifest.version, workers, streams, work)

    async def _rebuild(self, jobs: list[ApplyJob], pool: FetchPool, streams: int) -> None:
        started, left = time.monotonic(), deque(jobs)
        self.progress.reconstruct_s = 0.0

        async def one_stream() -> None:
            while left:
                await self._rebuild_file(left.popleft(), pool, started)
        try:
            async with asyncio.TaskGroup() as tasks:
                for _ in range(min(streams, len(jobs))):
                    tasks.create_task(one_stream())
        finally:
            self.progress.reconstruct_s = time.monotonic() - started

    async def _rebuild_file(self, job: ApplyJob, pool: FetchPool, started: float) -> None:
        """One target file, rebuilt by a worker. Any failure is the delta's: PullError naming
        the version and files (the pull goes on with the full version)."""
        added = 0

        def progress(n: int) -> None:
            nonlocal added
            added += n
            self.progress.add(n)
            self.progress.reconstruct_s = time.monotonic() - started
        where = f"version {job.version} file {job.name} (from delta file {job.delta.name})"
        try:
            await pool.apply(job, progress)
        except BaseException as e:
            self.progress.take_back(added)
            if isinstance(e, TargetDiffers):
                raise PullError(f"{where}: the rebuilt bytes differ from the version's digests: {e}") from None
            if isinstance(e, (DeltaRejected, OSError, WorkerCrashed)):
                raise PullError(f"{where}: {_describe(e)}") from None
            raise

    # -- what a pull that did not finish left -----------------------------------------------------------
    async def _take_kept(self, manifest: Manifest) -> Kept | None:
        """The kept partial if it is this version's, with this digest, whole and not yet in the
        mirror; otherwise it is discarded (a pull of another version needs its room)."""
        kept, self.kept = self.kept, None
        if kept is None:
            return None
        same = (kept.partial.manifest.version == manifest.version and kept.partial.manifest.digest == manifest.digest
                and not self.mirror.has(manifest.version, manifest.digest))
        if same and await asyncio.to_thread(_intact, kept.partial):
            return kept
        log.info("discard the partial version %d the last try left (%s)", kept.partial.manifest.version,
                 "not the version pulled now" if not same else "its files changed")
        await _settle(asyncio.to_thread(self.mirror.discard, kept.partial))
        return None

    def _keep(self, partial: Partial, checked: int) -> None:
        self.kept = Kept(partial, checked, _bytes_of(partial.manifest, checked))
        log.info("keep %d checked chunks (%d bytes) of version %d in %s for the next try",
                 checked.bit_count(), self.kept.bytes, partial.manifest.version, partial.dir)

    def discard_kept(self) -> None:
        """Remove what a pull that did not finish kept (at shutdown: the next start would
        remove it anyway, as it removes every leftover). Not while a pull runs."""
        kept, self.kept = self.kept, None
        if kept is not None:
            self.mirror.discard(kept.partial)

    def _set_state(self, new: PullState) -> None:
        p = self.progress
        if new not in _ARROWS[p.state]:
            raise AssertionError(f"pull {p.target}: {p.state.name} -> {new.name}")
        log.debug("pull %s: %s -> %s", p.version or p.target, p.state.name, new.name)
        p.state = new
        if new in (PullState.DONE, PullState.FAILED, PullState.CANCELLED):
            p.ended_at = self.clock()

    def _end(self, state: PullState, error: str, *, quiet: bool = False) -> None:
        self.progress.error = error
        if self.progress.state not in (PullState.DONE, PullState.FAILED, PullState.CANCELLED):
            self._set_state(state)
        log.log(logging.DEBUG if quiet else logging.WARNING, "abandon pull of %s: %s",
                self.progress.version or self.progress.target, error)

    async def _manifest(self, lease: LeaseInfo) -> Manifest:
        try:
            manifest = await self.client.manifest(lease.version)
        except ValidationError as e:  # one line, as every pull error: it goes to /status and the log
            problems = "; ".join(f"{'.'.join(str(x) for x in p['loc']) or 'manifest'}: {p['msg']}"
                                 for p in e.errors()[:5])
            raise PullError(f"version {lease.version}: the manifest served is not valid: "
                            f"{' '.join(problems.split())[:1000]}") from None
        try:
            manifest = manifest.sealed()  # checks the digest it came with
        except ManifestError as e:
            raise PullError(f"version {lease.version}: {e}") from None
        if manifest.version != lease.version or (lease.digest and lease.digest != manifest.digest):
            raise PullError(f"version {lease.version}: manifest (version {manifest.version}, digest "
                            f"{manifest.digest}) is not the one leased (digest {lease.digest})")
        return manifest

    # -- chunks -----------------------------------------------------------------------------------
    async def _fetch_all(self, manifest: Manifest, partial: Partial, done_bits: int) -> None:
        """``streams`` tasks take chunks from the pull's plan (:class:`ChunkPlan`: in file order
        from the origin alone, or from peers and the origin as the tracker says) and hand each
        to a worker; the lease is renewed meanwhile. The first failure cancels the rest.
        ``done_bits``: chunks an earlier try checked, not fetched again."""
        plan = self.last_plan = self.swarm.plan(manifest, partial.dir, done_bits)
        workers, streams = self._plan(plan.count - done_bits.bit_count())
        if not streams:
            return  # only empty files: they exist at their size already
        await self._with_pool(manifest.version, workers, streams,
                              lambda pool: self._chunks(plan, manifest, partial, pool, streams))

    async def _chunks(self, plan: ChunkPlan, manifest: Manifest, partial: Partial, pool: FetchPool,
                      streams: int) -> None:
        failures: dict[int, int] = {}  # chunk -> failed attempts from the origin
        async with asyncio.TaskGroup() as tasks:
            for _ in range(streams):
                tasks.create_task(self._stream(plan, manifest, partial, pool, failures))

    async def _with_pool(self, version: int, workers: int, streams: int,
                         work: Callable[[FetchPool], Awaitable[None]]) -> None:
        """Run ``work`` with the pull's workers (kept ones, or started), the lease renewed
        meanwhile; the first failure cancels the rest and is raised."""
        task, cancels = asyncio.current_task(), asyncio.current_task().cancelling()
        try:
            async with asyncio.TaskGroup() as tg:
                keeper = tg.create_task(self._keep_lease(version))  # also while workers start
                pool = await self._take_pool(workers, streams)
                done = False
                try:
                    self.progress.worker_pids = pool.pids
                    await work(pool)
                    done = True
                finally:
                    self.progress.worker_pids = []
                    await self._put_back(pool, keep=done)  # or stopped and reaped, on every other path
                keeper.cancel()
        except BaseExceptionGroup as group:
            # Python 3.11: a task group whose task fails while the group waits for it cancels
            # the group's own task and never takes that back (fixed in 3.12). Left so, the
            # updater's task would read as cancelled for good after one failed pull, and the
            # daemon's crash policy would take a later crash of it for a stop.
            while task.cancelling() > cancels:
                task.uncancel()
            raise _first(group) from None

    async def _take_pool(self, workers: int, streams: int) -> FetchPool:
        """The workers kept from the last pull if there are enough of them, else new ones."""
        await self._stop_idle()
        pool, self._pool = self._pool, None
        if pool is not None:
            have_workers, have_streams = pool.size
            if pool.usable and have_workers >= workers and have_streams >= streams:
                return pool
            await self._close_pool(pool)
        pool = FetchPool(workers=workers, streams=streams, piece_bytes=self.piece_bytes,
                         request_bytes=self.request_bytes, priority=self.priority,
                         on_restart=self._worker_restarted, silence_s=self.worker_silence_s)
        self._pools.add(pool)
        try:
            return await pool.start()  # a start that fails closes the pool itself
        except BaseException:
            self._pools.discard(pool)
            raise

    async def _put_back(self, pool: FetchPool, keep: bool) -> None:
        if keep and self.keep_workers_s > 0 and pool.usable:
            self._pool = pool
            self._idle = asyncio.create_task(self._stop_when_idle(pool), name="pull-workers-idle")
        else:
            await self._close_pool(pool)

    async def _stop_when_idle(self, pool: FetchPool) -> None:
        await asyncio.sleep(self.keep_workers_s)
        if self._pool is pool:
            self._pool = None
            log.debug("stop the pull workers: no pull for %g s", self.keep_workers_s)
            await self._close_pool(pool)

    async def _stop_idle(self) -> None:
        """Cancel the idle timer; a stop it began is finished first (the pool reaps under
        cancellation)."""
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.cancel()
            await asyncio.gather(idle, return_exceptions=True)

    def _plan(self, chunks: int) -> tuple[int, int]:
        """(workers, streams) for a version of ``chunks`` chunks: a small one needs fewer, and
        each costs a start."""
        streams = min(self.streams, chunks)
        return min(self.workers, streams), streams

    def _worker_restarted(self, pids: list[int]) -> None:
        self.progress.worker_restarts += 1
        if self.progress.ended_at is None:  # not a kept worker between pulls
            self.progress.worker_pids = pids
        if self.on_worker_restart is not None:
            self.on_worker_restart()

    async def _stream(self, plan: ChunkPlan, manifest: Manifest, partial: Partial, pool: FetchPool,
                      failures: dict[int, int]) -> None:
        while (pick := await plan.next()) is not None:  # each chunk goes to one stream at a time
            await self._fetch_chunk(manifest, plan, pick, partial, pool, failures)

    async def _fetch_chunk(self, manifest: Manifest, plan: ChunkPlan, pick: Pick, partial: Partial,
                           pool: FetchPool, failures: dict[int, int]) -> None:
        """One attempt at one chunk from the source the plan chose. A failure puts the chunk back
        in the plan: a failed peer is dropped and the chunk fetched elsewhere; a failed origin
        transfer counts against ``max_chunk_retries``."""
        entry, index, source = pick.entry, pick.index, pick.source
        where = f"version {manifest.version} file {entry.name} chunk {index}"
        start, end = manifest.chunk_span(entry, index)
        job = ChunkJob(source, manifest.version, entry.name, partial.path(entry.name), start, end, manifest.hash,
                       entry.chunks[index], timeout_s=self.peer_chunk_timeout_s if source.is_peer else None,
                       allocate=not partial.has_pages(entry.name, end))
        try:
            await self._attempt(pool, job)
        except OSError as e:  # the mirror's file: no other source helps
            # The chunk is not put back in the plan: the pull ends, and another stream must not
            # take it up meanwhile (so on the other fatal paths below).
            raise PullError(f"{where}: cannot write to the mirror: {e}") from None
        except (ChunkCorrupt, WorkerCrashed, errors.RegistryError) as e:
            last = _describe(e)
            if source.is_peer:  # whatever a peer answered, another source may do better
                self.progress.retries += 1
                plan.failed(pick, f"{where}: {last}")
                return
            if isinstance(e, _FATAL):
                gone = isinstance(e, (errors.VersionRetired, errors.VersionUnknown))
                raise (VersionGone if gone else PullError)(f"{where}: {last}") from None
            attempt = failures[pick.bit] = failures.get(pick.bit, 0) + 1
            if attempt > self.max_chunk_retries:
                raise PullError(f"{where}: failed {attempt} times; last: {last}") from None
            self.progress.retries += 1
            log.warning("retry %s (attempt %d of %d failed): %s", where, attempt, self.max_chunk_retries + 1, last)
            await asyncio.sleep(min(2.0, self.retry_delay_s * 2 ** (attempt - 1)))
            plan.failed(pick, last)
            return
        plan.done(pick, end - start)
        self.swarm.landed(pick, plan)  # announced if it is the swarm's plan in progress

    async def _attempt(self, pool: FetchPool, job: ChunkJob) -> None:
        """One attempt at a chunk. A failed attempt takes back the bytes it had added to the
        progress: they will be written again."""
        added = 0

        def progress(n: int) -> None:
            nonlocal added
            added += n
            self.progress.add(n)
            self.progress.bytes_fetched += n
        try:
            await pool.fetch(job, progress)
        except BaseException:
            self.progress.take_back(added)
            self.progress.bytes_fetched -= added
            raise

    # -- the lease --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _leased(self, version: int | str) -> AsyncIterator[LeaseInfo]:
        """Hold a lease on ``version`` for the block (renewed meanwhile by :meth:`_keep_lease`, taken
        again if it expired); released on every way out, best effort."""
        lease = await self._take_lease(version)
        try:
            yield lease
        finally:
            await self._release()

    async def _take_lease(self, version: int | str) -> LeaseInfo:
        try:
            self._lease = await self.client.lease(self.holder, version, self.lease_ttl_s)
        except (errors.NoVersions, errors.VersionUnknown, errors.VersionRetired) as e:
            raise PullError(f"cannot lease version {version}: {_describe(e)}") from None
        log.info("lease version %d as %s (lease %s, ttl %.0f s)", self._lease.version, self.holder,
                 self._lease.lease_id, self._lease.ttl_s)
        return self._lease

    async def _keep_lease(self, version: int) -> None:
        """Renew until cancelled. A lease that is gone anyway (expired, e.g. after a long stall)
        is taken again on the same version; if the version cannot be leased any more its bytes
        may be reclaimed at any moment, so the pull fails."""
        while True:
            await asyncio.sleep(min(self.renew_every_s, self._lease.ttl_s / 3))
            try:
                self._lease = await self.client.renew(self._lease.lease_id, self.lease_ttl_s)
            except (errors.LeaseExpired, errors.LeaseUnknown) as e:
                log.warning("lost lease %s on version %d (%s): lease it again", self._lease.lease_id,
                            version, _describe(e))
                await self._lease_again(version)
            except errors.RegistryError as e:  # unreachable for a moment: the lease may still hold
                log.warning("cannot renew lease %s on version %d: %s; try again in %.0f s",
                            self._lease.lease_id, version, _describe(e), self.renew_every_s)

    async def _lease_again(self, version: int) -> None:
        try:
            self._lease = await self.client.lease(self.holder, version, self.lease_ttl_s)
        except (errors.VersionRetired, errors.VersionUnknown) as e:
            self._lease = None
            raise VersionGone(f"version {version}: the lease expired mid-pull and the version cannot "
                            f"be leased again ({_describe(e)})") from None
        log.info("lease version %d again as %s (lease %s)", version, self.holder, self._lease.lease_id)

    async def _release(self) -> None:
        """Best effort: a lease not released expires on its own."""
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await asyncio.wait_for(self.client.release(lease.lease_id), RELEASE_TIMEOUT_S)
            log.info("release lease %s on version %d", lease.lease_id, lease.version)
        except (errors.LeaseExpired, errors.LeaseUnknown):
            pass
        except Exception as e:
            log.warning("cannot release lease %s on version %d: %s", lease.lease_id, lease.version, _describe(e))


def _delta_files(manifest: Manifest) -> Manifest:
    """A delta version's delta files as a manifest of their own (its version, hash and chunk
    size): what a chunk plan and a partial directory take."""
    return Manifest(version=manifest.version, hash=manifest.hash, chunk_bytes=manifest.chunk_bytes,
                    files=[FileEntry(name=f.name, size=f.size, chunks=f.chunks) for f in manifest.delta.files])


def _rebuild_jobs(manifest: Manifest, base_dir: Path, base: Manifest, partial: Partial,
                  staged: Partial) -> list[ApplyJob]:
    """One rebuild per target file: from the base's files and its delta file, into the partial."""
    base_files = {e.name: base_dir / e.name for e in base.files}
    by_target = {f.target: f for f in manifest.delta.files}
    return [ApplyJob(manifest.version, entry.name, base_files, staged.path(by_target[entry.name].name),
                     partial.path(entry.name), manifest.hash, manifest.chunk_bytes, tuple(entry.chunks))
            for entry in manifest.files]


def _bytes_of(manifest: Manifest, bits: int) -> int:
    """Bytes of the chunks ``bits`` names."""
    every = chunk_index(manifest)
    return sum(end - start for start, end in (manifest.chunk_span(*every[bit]) for bit in ones(bits)))


def _intact(partial: Partial) -> bool:
    """Every file of the partial directory is still there at its size (nobody removed it)."""
    try:
        return all(os.stat(partial.path(e.name)).st_size == e.size for e in partial.manifest.files)
    except OSError:
        return False


def _first(group: BaseExceptionGroup) -> BaseException:
    """The error to report from a task group: a PullError if there is one."""
    leaves = list(_leaves(group))
    return next((e for e in leaves if isinstance(e, PullError)), leaves[0])


def _leaves(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            yield from _leaves(sub)
    else:
        yield e


async def _settle(awaitable, undo: Callable | None = None):
    """Await work that runs in a thread and cannot be stopped halfway. If cancelled meanwhile,
    let it finish, hand its result to ``undo``, then re-raise the cancellation."""
    fut = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            result = await fut
            if undo is not None:
                await asyncio.to_thread(undo, result)
        raise


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, PullError) else f"{type(e).__name__}: {text}"
