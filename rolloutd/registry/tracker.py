"""The tracker: which node holds which chunks of which version, and where each puller should
take the chunks it lacks, so that the origin (the registry, or the version's object store)
sends about one copy of a version however many nodes pull it.

Pure logic with an injected clock, called on the registry's loop only (like ``Store``).

Every node with peers on announces ``PUT /v1/holders/{node}`` every second or so while it
pulls, and less often at rest: its peer listener's URL and, per version, the manifest digest
and the chunks it holds (all of them, or a chunk map). An announcement is the node's whole
state: versions it no longer names are forgotten. A node silent for ``holder_ttl_s`` is
forgotten (its chunks, and the origin chunks it was given, go to others).

The reply, for each version the node is pulling:

- ``peers``: at most ``max_peers`` holders that have some chunk the puller lacks, drawn at
  random (so no holder is handed to every puller); the puller takes those chunks from them.
  A holder that a puller reported as failed (``failed``: gone, too slow, bad bytes) is not
  handed out, and its chunks do not count as held, for ``holder_ttl_s``.
- ``origin``: chunks to take from the origin now: chunks that no live node holds and no other
  puller has been given (given chunks expire after ``assign_ttl_s`` if their puller never
  announces them). At most ``origin_per_puller`` at a time (four times as many for a puller
  alone), taken at a point of the version
  that depends on the node, so that concurrent pullers start on different chunks.

A delta version's delta files are a swarm of their own, beside its target's: a node pulling
the version from its delta announces it under the delta section's digest (``Delta.digest``)
with a chunk map over the delta files (in the section's order), and the reply for that version
is about the delta files; a node holding the version complete announces the target's digest as
ever, and, while it keeps the delta files it rebuilt the version from (until it commits another
version), the delta section's digest beside it (``HeldVersion.delta``): a complete holder of the
delta files too. So the origin sends about one copy of the delta, however many nodes rebuild
from it, whether their pulls overlap or not.

Cost per announcement: a few big-integer operations over the version's chunk maps (no loop
over chunks nor over holders: the union of what holders have is kept as they announce, and
peers are drawn by a bounded number of random probes); a departure makes the next reply
rebuild the union once, O(holders).
"""

from __future__ import annotations

import logging
import math
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutd.wire.chunkmap import from_hex, full, ones, to_hex
from rolloutd.wire.manifest import Manifest
from rolloutd.wire.messages import Announce

log = logging.getLogger("rolloutd.registry")


@dataclass
class _Held:
    url: str
    bits: int
    pulling: bool
    seen: float


@dataclass
class _Swarm:
    """One version's holders and the origin chunks handed out."""

    count: int                                   # chunks in the version
    holders: dict[str, _Held] = field(default_factory=dict)
    given: dict[int, tuple[str, float]] = field(default_factory=dict)  # chunk -> (node, expires at)
    given_bits: int = 0                          # the chunks of ``given``, as a map
    by_node: dict[str, int] = field(default_factory=dict)  # node -> the chunks given to it
    union: int = 0                               # chunks some holder (not suspect) has
    names: list[str] = field(default_factory=list)  # holders, to draw peers from
    pulling: set[str] = field(default_factory=set)  # holders pulling and not complete
    stale: bool = False                          # union and names need a rebuild (a holder left)

    def give(self, chunk: int, node: str, expires_at: float) -> None:
        self.given[chunk] = (node, expires_at)
        self.given_bits |= 1 << chunk
        self.by_node[node] = self.by_node.get(node, 0) | 1 << chunk

    def take_back(self, chunk: int) -> None:
        node, _ = self.given.pop(chunk)
        self.given_bits &= ~(1 << chunk)
        left = self.by_node[node] & ~(1 << chunk)
        if left:
            self.by_node[node] = left
        else:
            del self.by_node[node]


DELTA = "delta"  # the kind of a delta files' swarm; "" is the target's


def _key_name(key: tuple[int, str]) -> str:
    """A swarm's name in the summary: ``"12"`` (the version) or ``"12.delta"`` (its delta files)."""
    version, kind = key
    return f"{version}.{kind}" if kind else str(version)


def _swarm_of(manifest: Manifest, digest: str) -> tuple[str, int] | None:
    """(kind, chunks) of the swarm an announced digest names in ``manifest``: its target, or its
    delta files; None for another digest."""
    if digest == manifest.digest:
        return "", sum(len(f.chunks) for f in manifest.files)
    if manifest.delta is not None and digest == manifest.delta.digest:
        return DELTA, sum(len(f.chunks) for f in manifest.delta.files)
    return None


class Tracker:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, holder_ttl_s: float = 30.0,
                 assign_ttl_s: float = 30.0, max_peers: int = 8, origin_per_puller: int = 8,
                 rng: random.Random | None = None):
        self._clock = clock
        self.holder_ttl_s, self.assign_ttl_s = holder_ttl_s, assign_ttl_s
        self.max_peers, self.origin_per_puller = max_peers, origin_per_puller
        self._rng = rng or random.Random()
        self._swarms: dict[tuple[int, str], _Swarm] = {}  # (version, "" or DELTA) -> its swarm
        self._nodes: dict[str, set[tuple[int, str]]] = {}  # node -> the swarms it named last time
        self._suspect: dict[str, float] = {}  # node -> until when no puller is sent to it

    def announce(self, node: str, body: Announce, manifest_of: Callable[[int], Manifest | None]) -> dict:
        """Record ``node``'s state; the reply's ``versions`` has a view for each one it pulls.
        ``manifest_of(v)`` is the version's manifest if its bytes still exist (else None: the
        version is ignored, and forgotten)."""
        now = self._clock()
        for peer in body.failed:
            if peer != node:
                if peer not in self._suspect:
                    log.info("suspect holder %s for %.0f s: %s could not use it", peer, self.holder_ttl_s, node)
                    for swarm in self._swarms.values():
                        swarm.stale = True  # its chunks no longer count as held
                self._suspect[peer] = now + self.holder_ttl_s
        named: set[tuple[int, str]] = set()
        views = {}
        for key, held in body.versions.items():
            version = int(key)
            manifest = manifest_of(version)
            which = None if manifest is None else _swarm_of(manifest, held.digest)
            if which is None:
                continue  # unknown, reclaimed, or another registry's version of that number
            kind, count = which
            named.add((version, kind))
            try:
                bits = full(count) if held.chunks is None else from_hex(held.chunks, count)
            except ValueError:
                continue
            swarm = self._hold(node, body.url, (version, kind), count, bits, held.pulling, now)
            if held.pulling and bits != full(count):
                views[key] = self._view(swarm, node, bits, now)
            if held.delta is not None and kind == "" and bits == full(count) and (
                    delta := _swarm_of(manifest, held.delta)) is not None and delta[0] == DELTA:
                # The version complete, and the delta files it was rebuilt from kept: a holder
                # of the delta swarm too, complete, for the nodes that pull the same delta later.
                named.add((version, DELTA))
                self._hold(node, body.url, (version, DELTA), delta[1], full(delta[1]), False, now)
        for gone in self._nodes.get(node, set()) - named:
            self._drop(gone, node)
        self._nodes[node] = named
        return views

    def forget_node(self, node: str) -> None:
        for key in self._nodes.pop(node, set()):
            self._drop(key, node)

    def forget_version(self, version: int) -> None:
        """The version's bytes are gone (reclaimed): nobody should be sent for them (its
        target's nor its delta files)."""
        self._swarms.pop((version, ""), None)
        self._swarms.pop((version, DELTA), None)

    def sweep(self) -> None:
        """Forget holders silent for ``holder_ttl_s``; take back origin chunks whose puller did
        not announce them within ``assign_ttl_s``, to give them again."""
        now = self._clock()
        for node in [n for n, until in self._suspect.items() if until <= now]:
            del self._suspect[node]
            for swarm in self._swarms.values():
                swarm.stale = True  # its chunks count again
        for key, swarm in list(self._swarms.items()):
            for chunk in [c for c, (_, expires) in swarm.given.items() if expires <= now]:
                log.info("take back chunk %d of version %s from %s (not delivered in %.0f s)", chunk, _key_name(key),
                         swarm.given[chunk][0], self.assign_ttl_s)
                swarm.take_back(chunk)
            for node in [n for n, h in swarm.holders.items() if now - h.seen > self.holder_ttl_s]:
                log.info("forget holder %s of version %s (silent for %.0f s)", node, _key_name(key),
                         now - swarm.holders[node].seen)
                self._drop(key, node)
                self._nodes.get(node, set()).discard(key)

    def summary(self) -> dict[str, dict]:
        """``{"12": {"holders", "complete", "pulling", "given"}, "13.delta": {...}}`` for status
        and metrics: each version's target, and the delta files of a version pulled as a delta."""
        out = {}
        for key, swarm in sorted(self._swarms.items()):
            done = full(swarm.count)
            out[_key_name(key)] = {"holders": len(swarm.holders),
                            "complete": sum(h.bits == done for h in swarm.holders.values()),
                            "pulling": sum(h.pulling and h.bits != done for h in swarm.holders.values()),
                            "given": len(swarm.given)}
        return out

    # -- inside ---------------------------------------------------------------------------------
    def _swarm(self, key: tuple[int, str], count: int) -> _Swarm:
        swarm = self._swarms.get(key)
        if swarm is None:
            swarm = self._swarms[key] = _Swarm(count)
        return swarm

    def _hold(self, node: str, url: str, key: tuple[int, str], count: int, bits: int, pulling: bool,
              now: float) -> _Swarm:
        """Record that ``node`` holds chunks ``bits`` of swarm ``key``: its swarm."""
        swarm = self._swarm(key, count)
        before = swarm.holders.get(node)
        if before is None:
            swarm.names.append(node)
        elif before.bits & ~bits:
            swarm.stale = True  # it lost chunks (a damaged copy removed, pulled again): off the union
        swarm.holders[node] = _Held(url, bits, pulling, now)
        if node not in self._suspect:
            swarm.union |= bits
        if pulling and bits != full(count):
            swarm.pulling.add(node)
        else:
            swarm.pulling.discard(node)
        for chunk in ones(bits & swarm.given_bits):
            swarm.take_back(chunk)  # delivered (by whoever was given it): it is held now
        return swarm

    def _drop(self, key: tuple[int, str], node: str) -> None:
        swarm = self._swarms.get(key)
        if swarm is None:
            return
        swarm.holders.pop(node, None)
        swarm.pulling.discard(node)
        swarm.stale = True
        for chunk in ones(swarm.by_node.get(node, 0)):
            swarm.take_back(chunk)
        if not swarm.holders:
            del self._swarms[key]

    def _refresh(self, swarm: _Swarm) -> None:
        """Rebuild what a departure made stale: O(holders), only after someone left."""
        if swarm.stale:
            swarm.names = list(swarm.holders)
            swarm.union = 0
            for n, h in swarm.holders.items():
                if n not in self._suspect:
                    swarm.union |= h.bits
            swarm.stale = False

    def _peers(self, swarm: _Swarm, node: str, lacking: int) -> list[tuple[str, _Held]]:
        """Up to ``max_peers`` holders with a chunk ``node`` lacks, drawn at random: every holder
        looked at in a small swarm, a bounded number in a large one (the cost of an announcement
        does not grow with the fleet)."""
        names = swarm.names
        if not names:
            return []
        size = len(names)
        # A random walk over distinct places of the list (a start and a stride prime to its length):
        # spread over the holders, and no run of pullers with nothing to give can hide the rest.
        start, stride = self._rng.randrange(size), self._rng.randrange(1, size) if size > 1 else 1
        while math.gcd(stride, size) != 1:
            stride += 1
        probes = size if size <= 4 * self.max_peers else 8 * self.max_peers
        chosen: dict[str, _Held] = {}
        for k in range(probes):
            n = names[(start + k * stride) % size]
            h = swarm.holders.get(n)
            if n == node or n in chosen or h is None or n in self._suspect or not h.bits & lacking:
                continue
            chosen[n] = h
            if len(chosen) == self.max_peers:
                break
        return list(chosen.items())

    def _view(self, swarm: _Swarm, node: str, mine: int, now: float) -> dict:
        self._refresh(swarm)
        lacking = full(swarm.count) & ~mine
        peers = self._peers(swarm, node, lacking)
        held_anywhere = swarm.union
        mine_given = swarm.by_node.get(node, 0) & lacking
        pullers = len(swarm.pulling)
        # Alone, a puller may run further ahead: nobody else would take those chunks anyway.
        limit = self.origin_per_puller * (1 if pullers > 1 else 4)
        want = limit - mine_given.bit_count()
        free = lacking & ~held_anywhere & ~swarm.given_bits
        for chunk in _take(free, want, _start(node, swarm.count)):
            swarm.give(chunk, node, now + self.assign_ttl_s)
            mine_given |= 1 << chunk
        return {"peers": [{"node": n, "url": h.url, "chunks": to_hex(h.bits)} for n, h in peers],
                "origin": to_hex(mine_given),
                "pullers": pullers}


def _start(node: str, count: int) -> int:
    """Where ``node`` starts taking origin chunks: spread over the version by the node's name."""
    return zlib.crc32(node.encode()) % count if count else 0


def _take(bits: int, n: int, start: int) -> list[int]:
    """Up to ``n`` set bits of ``bits``, the first at or after ``start``, wrapping around."""
    if n <= 0 or not bits:
        return []
    taken = [start + i for i in _lowest(bits >> start, n)]
    return taken + _lowest(bits & ((1 << start) - 1), n - len(taken))


def _lowest(bits: int, n: int) -> list[int]:
    out = []
    while bits and len(out) < n:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out
