"""The node's side of the chunk swarm: where each chunk of a pull comes from, what this node
holds for its peers, and the announcements that tie both to the registry's tracker.

- :class:`Ledger`: what this node can serve its peers: complete versions (the mirror), the
  checked chunks of the pull in progress (their partial directory) and the delta files a
  committed delta pull kept (``.<v>.delta``). The peer listener reads it,
  from its own thread; the puller writes it.
- :class:`ChunkPlan`: one pull's chunks. Workers ask :meth:`ChunkPlan.next` for a chunk and a
  source, then say :meth:`~ChunkPlan.done` or :meth:`~ChunkPlan.failed`. Order of preference:
  a peer that holds the chunk (the one this puller asks least, at random among equals); the
  origin (registry or object store) for chunks the tracker gave this node; else wait for the
  swarm to change. A pull that found nothing to do for ``origin_wait_s`` takes a chunk from
  the origin all the same: the registry is the last source, never a missing one. A peer that
  fails (gone, silent for its read timeout, slower than ``peer_chunk_timeout_s`` for a chunk,
  or serving bytes that fail the digest) is dropped for the rest of the pull and the chunk is
  fetched elsewhere; peer failures do not count against ``max_chunk_retries``. Dropped peers are
  named in every announcement of the pull, so the tracker does not count what they claim to
  hold. A pull with nothing to fetch and nothing in flight for ``4 × origin_wait_s`` takes one
  chunk from the origin whatever the tracker says.
- :class:`Swarm`: the node's sources and its announcer loop: ``PUT /v1/holders/{node}`` every
  ``announce_every_s`` while pulling (and soon after a chunk lands), every
  ``announce_idle_s`` at rest; each reply updates the plan of the pull in progress.

A delta version pulled from its delta (docs/deltas.md) has two swarms: its delta files and its
target. While this node fetches the delta files and rebuilds the version from them
(:meth:`Swarm.plan_delta`), it announces the version under the delta section's digest with a
chunk map over the delta files (in the section's order) and serves the checked ones from where
the pull staged them; the tracker hands pullers of the delta to holders of the delta. Once the
version is committed the node announces the version itself, as any complete one, and keeps
the delta files (the mirror moves them to ``.<v>.delta``, :meth:`Swarm.keep_delta`): it goes on
serving them, and announcing itself a complete holder of the delta (``HeldVersion.delta``),
until the mirror commits another version (or drops them for room, or the version is removed).
So a fleet that pulls a delta version takes about one copy of the delta from the origin whether
the nodes' pulls overlap or follow each other; room for one version's delta files is the cost.

Without peers (``peers.enabled: false``) the plan hands out every chunk from the origin, in
file order, and nothing is announced. The same for a version peers may not carry
(:func:`peers_refused`): its chunk digests are not cryptographic (a peer could forge bytes that
match an xxh3 digest), or it has more chunks than a chunk map holds; it is not announced either.

The token this node presents to its peers, and that its listener takes, is the peer token
(:func:`peer_token`), never the registry's: a peer can read chunks with it, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rolloutd.objstore import ObjectStoreSettings
from rolloutd.rollout.mirror import MANIFEST_NAME, Mirror
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.sources import SourceSpec
from rolloutd.wire import errors
from rolloutd.wire.chunkmap import MAX_CHUNKS, chunk_index, from_hex, full, to_hex
from rolloutd.wire.manifest import CRYPTO_HASHES, FileEntry, Manifest
from rolloutd.wire.messages import Announce, AnnounceReply, HeldVersion, SwarmView

log = logging.getLogger("rolloutd.rollout.swarm")

ANNOUNCE_MIN_GAP_S = 0.2  # a landed chunk is announced at most this soon after the last announcement
STALL_FACTOR = 4  # nothing to fetch and nothing in flight for this many origin_wait_s: one chunk from the origin
PEER_TOKEN_LABEL = b"rolloutd peer token v1"
VERSION_NAME_RE = re.compile(r"[1-9][0-9]{0,15}")  # a complete version's directory in the mirror


def peer_token(registry_token: str) -> str:
    """The token nodes present to each other's peer listeners, derived from the registry's:
    every node of a fleet computes the same one, and a peer that learns it (any URL a node
    announced receives it) can read chunks with it but cannot reach the registry (HMAC is one-way)."""
    return hmac.new(registry_token.encode(), PEER_TOKEN_LABEL, hashlib.sha256).hexdigest()


def peers_refused(manifest: Manifest) -> str | None:
    """Why a version is pulled from its origin only and not announced (None: peers may carry it)."""
    if manifest.hash not in CRYPTO_HASHES:
        return (f"its chunk digests are {manifest.hash}, which a hostile peer could forge (publish with "
                f"a cryptographic hash: {', '.join(sorted(CRYPTO_HASHES))})")
    count = sum(len(f.chunks) for f in manifest.files)
    if count > MAX_CHUNKS:
        return f"it has {count} chunks, more than a chunk map holds ({MAX_CHUNKS}; publish with larger chunks)"
    return None


@dataclass(frozen=True)
class SwarmSettings:
    enabled: bool = False
    url: str | None = None            # this node's peer listener, as other nodes reach it
    token: str | None = None          # the peer token: what peers present, and what this node presents to them
    announce_every_s: float = 0.5
    announce_idle_s: float = 10.0
    peer_timeout_s: float = 10.0      # longest silence from a peer
    peer_chunk_timeout_s: float = 60.0
    origin_wait_s: float = 5.0


# -- what this node holds -------------------------------------------------------------------------

@dataclass(frozen=True)
class PartialView:
    manifest: Manifest
    dir: Path
    bits: int
    first_bit: dict[str, int]  # file name -> the bit of its first chunk (computed once per pull)
    digest: str = ""  # what is announced: the manifest's digest, or a delta section's for its delta files


@dataclass(frozen=True)
class KeptDelta:
    """The delta files a complete version was rebuilt from, kept in ``dir`` for peers."""

    version: int
    files: Manifest  # the delta files alone (their names, sizes and chunks)
    dir: Path
    digest: str      # the delta section's digest: what is announced beside the version's


def first_bits(manifest: Manifest) -> dict[str, int]:
    out, bit = {}, 0
    for f in manifest.files:
        out[f.name] = bit
        bit += len(f.chunks)
    return out


class Ledger:
    """Complete versions come from the mirror; the pull in progress from :meth:`begin`/:meth:`add`;
    the delta files a committed delta pull kept from :meth:`keep_delta`, while the mirror has them.

    Read at every announcement and every peer request: a complete version's manifest is parsed
    and checked by the mirror once (a large one takes a fifth of a second) and kept while the
    version's directory and its ``manifest.json`` are the same files, unchanged (inode, owner,
    size, mtime, ctime): a commit, a removal, a replaced copy or a chown makes the mirror look again.
    """

    MAX_HELD = 8  # complete versions announced (newest first), within Announce's 16

    def __init__(self, mirror: Mirror):
        self.mirror = mirror
        self._lock = threading.Lock()
        self._partial: PartialView | None = None
        self._kept: KeptDelta | None = None
        self._complete: dict[int, tuple[tuple[int, ...], Manifest | None]] = {}
        self._complete_lock = threading.Lock()  # the announcer's thread and the peer listener's share it

    def begin(self, manifest: Manifest, directory: Path, bits: int = 0, *, digest: str | None = None) -> None:
        """The pull in progress writes ``manifest``'s files into ``directory``; announced under
        ``digest`` (default: the manifest's; a delta section's for a delta pull's files)."""
        with self._lock:
            self._partial = PartialView(manifest, directory, bits, first_bits(manifest), digest or manifest.digest)

    def add(self, bit: int) -> None:
        with self._lock:
            p = self._partial
            if p is not None:
                self._partial = PartialView(p.manifest, p.dir, p.bits | 1 << bit, p.first_bit, p.digest)

    def end(self) -> None:
        with self._lock:
            self._partial = None

    def keep_delta(self, kept: KeptDelta) -> None:
        """Serve and announce ``kept`` (the delta files of a version just committed) while its
        directory is there: the mirror removes it (the next commit, room, the version removed)."""
        self._kept = kept

    def kept_delta(self, version: int) -> KeptDelta | None:
        """The delta files kept for ``version``, if the mirror still has them."""
        k = self._kept  # one read: the view is immutable
        if k is None or k.version != version:
            return None
        if not os.path.isdir(k.dir):  # dropped by the mirror: forget them
            if self._kept is k:
                self._kept = None
            return None
        return k

    def partial(self, version: int) -> PartialView | None:
        p = self._partial  # one read: the view is immutable
        return p if p is not None and p.manifest.version == version else None

    def complete(self, version: int) -> Manifest | None:
        """The manifest of a complete version in the mirror (None: not there, or broken), parsed
        and checked by the mirror once per ``manifest.json``."""
        with self._complete_lock:
            vdir = self.mirror.path(version)
            try:
                d = os.stat(vdir, follow_symlinks=False)
                f = os.stat(vdir / MANIFEST_NAME, follow_symlinks=False)
            except OSError:
                self._complete.pop(version, None)
                return None
            key = (d.st_ino, d.st_uid, d.st_mode, f.st_ino, f.st_uid, f.st_mode, f.st_size, f.st_mtime_ns,
                   f.st_ctime_ns)
            known = self._complete.get(version)
            if known is not None and known[0] == key:
                return known[1]
            manifest = self.mirror.manifest(version)
            self._complete[version] = (key, manifest)
            return manifest

    def complete_versions(self) -> list[int]:
        """Complete versions in the mirror, oldest first (directories named like a version)."""
        try:
            names = [e.name for e in os.scandir(self.mirror.dir) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        versions = sorted(int(n) for n in names if VERSION_NAME_RE.fullmatch(n))
        with self._complete_lock:
            for gone in set(self._complete) - set(versions):
                del self._complete[gone]
        return [v for v in versions if self.complete(v) is not None]

    def held(self) -> dict[str, HeldVersion]:
        """What peers may take from this node: the newest complete versions and the pull in
        progress, each only if peers may carry it (:func:`peers_refused`)."""
        out: dict[str, HeldVersion] = {}
        complete = [(v, m) for v in self.complete_versions() if (m := self.complete(v)) is not None
                    and peers_refused(m) is None]
        for version, manifest in complete[-self.MAX_HELD:]:
            kept = self.kept_delta(version)
            out[str(version)] = HeldVersion(digest=manifest.digest, delta=kept.digest if kept is not None else None)
        p = self._partial
        if p is not None and str(p.manifest.version) not in out:
            out[str(p.manifest.version)] = HeldVersion(digest=p.digest, chunks=to_hex(p.bits), pulling=True)
        return out


# -- one pull's chunks ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Pick:
    bit: int
    entry: FileEntry
    index: int
    source: SourceSpec


class ChunkPlan:
    def __init__(self, manifest: Manifest, origin: SourceSpec, *, peers: bool = False,
                 make_peer: Callable[[str, str], SourceSpec] | None = None, origin_wait_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 done_bits: int = 0):
        self.manifest, self.origin = manifest, origin
        self.chunks = chunk_index(manifest)
        self.count = len(self.chunks)
        self.peers_on, self._make_peer = peers, make_peer
        self.origin_wait_s, self._clock = origin_wait_s, clock
        self._rng = rng or random.Random()
        self.done_bits = done_bits  # checked already (by an earlier try of the same pull): never fetched
        self._inflight = 0
        self._given = 0 if peers else full(self.count)  # chunks to take from the origin
        self._holders: dict[str, tuple[SourceSpec, int]] = {}  # node -> (source, chunk map)
        self._dropped: set[str] = set()
        self._asking: dict[str, int] = {}  # node -> chunks in flight from it
        self._changed = asyncio.Event()
        self._idle_since: float | None = None
        self.tracker_ok_at: float | None = None  # the last tracker reply
        self.bytes_from: dict[str, int] = {}  # "origin" / "peers" -> bytes checked

    @property
    def complete(self) -> bool:
        return self.done_bits == full(self.count)

    def update(self, view: SwarmView) -> None:
        """A tracker reply: the holders worth asking, and the chunks to take from the origin."""
        self.tracker_ok_at = self._clock()
        try:
            self._given = from_hex(view.origin, self.count)  # the tracker's word: it takes chunks back
        except ValueError:
            log.warning("ignore a tracker reply: its origin map is not hex")
        for peer in view.peers:
            if peer.node in self._dropped or self._make_peer is None:
                continue
            try:
                bits = from_hex(peer.chunks, self.count)
            except ValueError:
                continue
            known = self._holders.get(peer.node)
            same = known is not None and known[0].url == peer.url.rstrip("/")
            source = known[0] if same else self._make_peer(peer.node, peer.url)
            self._holders[peer.node] = (source, bits)
        self._changed.set()

    async def next(self) -> Pick | None:
        """The next chunk to fetch and where from; None once every chunk is done or in flight."""
        while True:
            left = full(self.count) & ~self.done_bits & ~self._inflight
            if not left:
                return None
            pick = self._from_peer(left) or self._from_origin(left & self._given)
            if pick is None and self._tracker_silent():
                # Nothing to do for a while and no word from the tracker: the origin is the last
                # source, never a missing one (a registry without the tracker, or unreachable).
                log.info("take the rest of version %d from the %s: no tracker reply for %.0f s",
                         self.manifest.version, self.origin.label, self.origin_wait_s)
                self._given |= left
                pick = self._from_origin(left)
            elif pick is None and self._stalled():
                # The tracker answers but gives nothing this puller can use, and nothing is in
                # flight: whatever the reason (a holder only this node cannot reach), one chunk
                # from the origin, so that no view of the swarm can stop a pull.
                pick = self._from_origin(left)
                log.info("take chunk %d of version %d from the %s: nothing to fetch for %.0f s", pick.bit,
                         self.manifest.version, self.origin.label, STALL_FACTOR * self.origin_wait_s)
            if pick is not None:
                self._idle_since = None
                self._inflight |= 1 << pick.bit
                if pick.source.is_peer:
                    self._asking[pick.source.node] = self._asking.get(pick.source.node, 0) + 1
                return pick
            if self._idle_since is None:
                self._idle_since = self._clock()
            self._changed.clear()
            wait = self.origin_wait_s - (self._clock() - self._idle_since)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.01, wait)):
                    await self._changed.wait()

    @property
    def dropped(self) -> list[str]:
        """Peers this pull gave up on: told to the tracker at every announcement, so that it keeps
        their chunks from counting as held while any puller cannot use them."""
        return sorted(self._dropped)[:64]

    def _tracker_silent(self) -> bool:
        now = self._clock()
        idle = self._idle_since is not None and now - self._idle_since >= self.origin_wait_s
        return idle and (self.tracker_ok_at is None or now - self.tracker_ok_at >= self.origin_wait_s)

    def _stalled(self) -> bool:
        idle = self._idle_since is not None and self._clock() - self._idle_since >= STALL_FACTOR * self.origin_wait_s
        return idle and not self._inflight

    def _from_peer(self, left: int) -> Pick | None:
        best: list[tuple[int, float, str, int]] = []
        for node, (_, bits) in self._holders.items():
            have = bits & left
            if have:
                best.append((self._asking.get(node, 0), self._rng.random(), node, have))
        if not best:
            return None
        _, _, node, have = min(best)
        # Rarest first would need every holder's map; a random chunk of the chosen peer spreads
        # the pullers' requests over the version as well.
        bit = self._random_bit(have)
        return self._pick(bit, self._holders[node][0])

    def _from_origin(self, candidates: int) -> Pick | None:
        if not candidates:
            return None
        low = candidates & -candidates
        return self._pick(low.bit_length() - 1, self.origin)

    def _random_bit(self, bits: int) -> int:
        count = bits.bit_count()
        nth = self._rng.randrange(count)
        for _ in range(nth):
            bits &= bits - 1
        return (bits & -bits).bit_length() - 1

    def _pick(self, bit: int, source: SourceSpec) -> Pick:
        entry, index = self.chunks[bit]
        return Pick(bit, entry, index, source)

    def done(self, pick: Pick, nbytes: int) -> None:
        self._release(pick)
        self.done_bits |= 1 << pick.bit
        kind = "peers" if pick.source.is_peer else "origin"
        self.bytes_from[kind] = self.bytes_from.get(kind, 0) + nbytes
        self._changed.set()

    def failed(self, pick: Pick, why: str) -> None:
        """The chunk goes back to the pool; a peer that failed is not asked again in this pull."""
        self._release(pick)
        if pick.source.is_peer:
            node = pick.source.node
            self._dropped.add(node)
            self._holders.pop(node, None)
            log.warning("drop peer %s for version %d: %s", node, self.manifest.version, why[:300])
        self._changed.set()

    def _release(self, pick: Pick) -> None:
        self._inflight &= ~(1 << pick.bit)
        if pick.source.is_peer:
            node = pick.source.node
            self._asking[node] = max(0, self._asking.get(node, 0) - 1)


# -- the node's sources and its announcer --------------------------------------------------------------

class Swarm:
    def __init__(self, settings: SwarmSettings, client: RegistryClient, mirror: Mirror, *, node: str,
                 object_store: ObjectStoreSettings | None = None, read_timeout_s: float = 30.0):
        self.settings, self.client, self.node = settings, client, node
        self.ledger = Ledger(mirror)
        self.object_store = object_store or ObjectStoreSettings()
        self.read_timeout_s = read_timeout_s
        self._plan: ChunkPlan | None = None
        self.last_plan: ChunkPlan | None = None  # the last pull's plan, kept after it ends: its bytes by source
        self._dirty = asyncio.Event()
        self._last_announce = 0.0
        self._refused_logged: set[str] = set()  # manifest digests whose origin-only pull was logged

    @property
    def registry(self) -> SourceSpec:
        c = self.client
        return SourceSpec("registry", c.url, c.token, connect_timeout_s=c.timeouts.connect_s,
                          read_timeout_s=c.timeouts.read_s)

    def origin(self, manifest: Manifest) -> SourceSpec:
        """The registry, or the object store the manifest names."""
        if manifest.source is None:
            return self.registry
        return SourceSpec("s3", manifest.source, read_timeout_s=self.read_timeout_s,
                          store=self.object_store.model_dump_json())

    def plan(self, manifest: Manifest, directory: Path, done_bits: int = 0) -> ChunkPlan:
        """The plan of a pull into ``directory`` (its partial directory, where the chunks
        ``done_bits`` are checked already), announced from now on."""
        on = self.settings.enabled and self._peers_may_carry(manifest)
        plan = ChunkPlan(manifest, self.origin(manifest), peers=on, make_peer=self._peer if on else None,
                         origin_wait_s=self.settings.origin_wait_s, done_bits=done_bits)
        self._plan = self.last_plan = plan
        if on:
            self.ledger.begin(manifest, directory, done_bits)
            self._dirty.set()
        return plan

    def plan_delta(self, manifest: Manifest, files: Manifest, directory: Path) -> ChunkPlan:
        """The plan of a delta pull's delta files (``files``: a manifest of them alone, as the
        pull stages them in ``directory``), announced from now on under the delta section's
        digest, with the same rule as a version's chunks: peers only for cryptographic digests."""
        on = self.settings.enabled and self._peers_may_carry(manifest, files=files)
        plan = ChunkPlan(files, self.origin(manifest), peers=on, make_peer=self._peer if on else None,
                         origin_wait_s=self.settings.origin_wait_s)
        self._plan = self.last_plan = plan
        if on:
            self.ledger.begin(files, directory, digest=manifest.delta.digest)
            self._dirty.set()
        return plan

    def _peers_may_carry(self, manifest: Manifest, *, files: Manifest | None = None) -> bool:
        """Whether peers may carry ``manifest``'s chunks (or, given, its delta ``files``'); a
        refusal is logged once per digest."""
        why = peers_refused(files or manifest)
        digest = manifest.digest if files is None else manifest.delta.digest
        if why is not None and digest not in self._refused_logged:
            self._refused_logged.add(digest)
            log.warning("pull %sversion %d from the %s only, without peers: %s",
                        "the delta files of " if files is not None else "", manifest.version,
                        self.origin(manifest).label, why)
        return why is None

    def landed(self, pick: Pick, plan: ChunkPlan | None = None) -> None:
        """A chunk of the pull's plan (``plan``, when given, must be the one in progress) is
        written and checked: peers may have it."""
        if plan is not None and plan is not self._plan:
            return
        if self.settings.enabled:  # a plan without peers began no partial in the ledger: a no-op
            self.ledger.add(pick.bit)
            self._dirty.set()

    def keep_delta(self, plan: ChunkPlan, manifest: Manifest, directory: Path) -> bool:
        """The delta pull of ``plan`` ended with ``manifest``'s version committed and its delta
        files moved to ``directory``: serve and announce them from there from now on (the
        pull's staged view ends in the same step, so no peer request falls between). False, and
        the pull simply finished, if its plan had no peers: nobody would take them."""
        kept = plan.peers_on and self._plan is plan
        if kept:
            self.ledger.keep_delta(KeptDelta(manifest.version, plan.manifest, directory, manifest.delta.digest))
        self.finish(plan)
        return kept

    def finish(self, plan: ChunkPlan) -> None:
        if self._plan is plan:
            self._plan = None
            self.ledger.end()
            self._dirty.set()

    def _peer(self, node: str, url: str) -> SourceSpec:
        timeout = self.settings.peer_timeout_s
        return SourceSpec("peer", url.rstrip("/"), self.settings.token, node=node,
                          connect_timeout_s=min(5.0, timeout), read_timeout_s=timeout)

    # -- announcements ---------------------------------------------------------------------------
    async def run_announcer(self) -> None:
        """Until cancelled (then the registry is told this node holds nothing, best effort)."""
        if not self.settings.enabled:
            await asyncio.Event().wait()
        try:
            while True:
                every = self.settings.announce_every_s if self._plan else self.settings.announce_idle_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every):
                        await self._dirty.wait()
                gap = self._last_announce + ANNOUNCE_MIN_GAP_S - time.monotonic()
                if gap > 0:
                    await asyncio.sleep(gap)
                self._dirty.clear()
                await self.announce()
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self.client.forget_holder(self.node)

    async def announce(self) -> AnnounceReply | None:
        self._last_announce = time.monotonic()
        plan = self._plan
        failed = plan.dropped if plan is not None else []
        # Off the loop: the first look at a version parses its manifest (a large one takes long: docs/peers.md).
        body = Announce(url=self.settings.url, versions=await asyncio.to_thread(self.ledger.held), failed=failed)
        try:
            reply = await self.client.announce(self.node, body)
        except errors.RegistryError as e:
            log.debug("announce: %s", e)
            return None
        if plan is not None and (view := reply.versions.get(str(plan.manifest.version))) is not None:
            plan.update(view)
        return reply
