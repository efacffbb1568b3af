"""The fleet as an operator sees it: the document behind ``GET /v1/fleet``, which the page
``/ui`` and ``rolloutd fleet`` show.

Built in two steps so that it stays cheap at 10,000 replicas. A summary pass goes over every
replica once and keeps a light entry per replica (node, state, version, heartbeat age, problems)
and the fleet's counts; it is cached for ``CACHE_S``, so any number of open pages polling every
few seconds cost about one pass a second; for the HTTP route it runs in steps of about a
millisecond, so that heartbeats are answered between them. Then, per request, the entries are
filtered and grouped by node, and full rows are built only for the nodes of the requested page.

A replica has a *problem* when its state is BACKOFF or FATAL (``state``), its last gate failed
(``gate``), its node refused the newest version and it holds an older one (``refused``: it will
not move before a newer version; the row's ``refused`` says why), or the registry has not heard
from it for ``stale_s`` (``silent``). Its last error
is shown as it reported it: it stays after the server recovered, so it is not a problem by itself.
A row's ``pull`` is its node's last pull as the heartbeat reported it (full or delta, the base,
bytes fetched against the version's size, reconstruction seconds), or null.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from rolloutd.registry.rollouts import BEHIND_BUCKETS, behind_bucket
from rolloutd.registry.store import Replica, Store
from rolloutd.wire.messages import PullReport
from rolloutd.wire.states import ServerState

FAILING_STATES = frozenset({ServerState.BACKOFF, ServerState.FATAL})  # a failed server
CACHE_S = 1.0
MAX_PER_PAGE = 1000  # nodes per page
SLICE = 500  # replicas per step of a pass: about a millisecond, then the loop takes its turn


@dataclass(frozen=True)
class FleetQuery:
    page: int = 1            # 1-based, of nodes
    per_page: int = 50       # nodes per page
    node: str = ""           # only nodes whose name contains this (case-insensitive)
    state: str = ""          # only replicas in this state
    problems: bool = False   # only replicas with a problem
    stale_s: float = 15.0    # silent this long: a problem


class _Entry(NamedTuple):
    node: str          # first: entries sort by (node, replica id) as plain tuples
    replica_id: str
    state: str
    version: int | None
    problems: tuple[str, ...]


@dataclass
class _Pass:
    at: float
    stale_s: float
    entries: list[_Entry]   # sorted by (node, replica id)
    groups: list[tuple[str, list[_Entry]]]  # the entries by node, for a page without filters
    summary: dict
    held: Counter           # replicas per loaded version, any state
    serving: Counter        # replicas SERVING each version


class FleetView:
    def __init__(self, store: Store, cache_s: float = CACHE_S):
        self.store, self.cache_s = store, cache_s
        self._last: _Pass | None = None
        self._passing = asyncio.Lock()  # one pass at a time; viewers that came meanwhile wait for its result

    def document(self, q: FleetQuery) -> dict:
        """The document, its pass done right here."""
        now = self.store.now()
        if (p := self._cached(now, q.stale_s)) is None:
            scan = next(step for step in _scan(self._replicas(), now, q.stale_s, self._newest()) if step is not None)
            p = self._finish(scan, now, q.stale_s)
        return self._document(q, p, now)

    async def document_async(self, q: FleetQuery) -> dict:
        """The document, its pass over every replica in steps of ``SLICE`` replicas with a turn
        of the loop between them: in one go, the pass over every replica held up every
        heartbeat that came meanwhile; in a thread, worse (each of the loop's many takes of the
        interpreter lock then waits out the thread's switch interval; bench/README.md, "The
        fleet page at 10,000 replicas")."""
        if (p := self._cached(self.store.now(), q.stale_s)) is None:
            async with self._passing:
                now = self.store.now()
                if (p := self._cached(now, q.stale_s)) is None:  # the pass another viewer waited for
                    steps = _scan(self._replicas(), now, q.stale_s, self._newest())
                    while (scan := next(steps)) is None:
                        await asyncio.sleep(0)
                    p = self._finish(scan, now, q.stale_s)
        return self._document(q, p, self.store.now())

    def _document(self, q: FleetQuery, p: _Pass, now: float) -> dict:
        store = self.store
        latest = store.latest
        return {
            "instance": store.instance,
            "latest": None if latest is None else
            {"version": latest.number, "published_age_s": round(now - latest.published_at, 3)},
            "demand": store.demand,
            "stale_s": q.stale_s,
            "summary": p.summary,
            "versions": [{**v.summary(), "published_age_s": round(now - v.published_at, 3),
                          "held_by": p.held[v.number], "serving": p.serving[v.number]}
                         for v in store.versions()],
            "rollouts": store.rollouts.stats(now),
            "nodes": self._page(p, q, now),
        }

    # -- the pass over every replica -------------------------------------------------------------
    def _replicas(self) -> list[tuple[str, Replica]]:
        # One copy of the directory's items, made in C: a pass in steps then reads the replicas
        # while heartbeats add and remove them between its steps.
        return list(self.store.directory().items())

    def _newest(self) -> tuple[int, str] | None:
        latest = self.store.latest
        return None if latest is None else (latest.number, latest.manifest.digest)

    def _cached(self, now: float, stale_s: float) -> _Pass | None:
        last = self._last
        return last if last is not None and last.stale_s == stale_s and 0 <= now - last.at < self.cache_s else None

    def _finish(self, scan: _Scan, now: float, stale_s: float) -> _Pass:
        """The part of a pass that reads the store's other state, on the loop: how far behind
        each version held is (a handful of versions)."""
        store = self.store
        newest = store.latest.number if store.latest else None
        behind = Counter()
        for version, n in scan.held.items():
            behind[behind_bucket(version, store.rollouts.lag(version, newest, now)[0])] += n
        summary = {**scan.summary, "behind": {k: behind[k] for k in BEHIND_BUCKETS}}
        self._last = _Pass(now, stale_s, scan.entries, scan.groups, summary, scan.held, scan.serving)
        return self._last

    # -- one page of nodes -------------------------------------------------------------------------
    def _page(self, p: _Pass, q: FleetQuery, now: float) -> dict:
        groups = p.groups
        if q.node or q.state or q.problems:
            needle = q.node.lower()
            groups = _grouped(e for e in p.entries if not ((needle and needle not in e.node.lower())
                              or (q.state and e.state != q.state) or (q.problems and not e.problems)))
        pages = max(1, math.ceil(len(groups) / q.per_page))
        chosen = groups[(q.page - 1) * q.per_page:q.page * q.per_page]
        directory = self.store.directory()
        items = [self._node(name, [(e, directory.get(e.replica_id)) for e in members], now, q.stale_s)
                 for name, members in chosen]
        replicas = len(p.entries) if groups is p.groups else sum(len(m) for _, m in groups)
        return {"total": len(groups), "replicas": replicas, "page": q.page,
                "per_page": q.per_page, "pages": pages, "items": items}

    def _node(self, name: str, members: list[tuple[_Entry, Replica | None]], now: float, stale_s: float) -> dict:
        rows = [self._row(e, rep, now, stale_s) for e, rep in members if rep is not None]  # gone since the pass
        return {"node": name, "states": dict(Counter(r["state"] for r in rows)),
                "with_problems": sum(bool(r["problems"]) for r in rows),
                "max_age_s": max((r["age_s"] for r in rows), default=None), "replicas": rows}

    def _row(self, e: _Entry, rep: Replica, now: float, stale_s: float) -> dict:
        hb, store = rep.heartbeat, self.store
        newest = store.latest.number if store.latest else None
        lag, lag_s = store.rollouts.lag(hb.version, newest, now)
        return {"replica_id": e.replica_id, "server": hb.server, "state": hb.state,
                "state_age_s": round(now - rep.state_since, 3), "version": hb.version, "target": hb.target,
                "lag": lag, "lag_s": lag_s, "incarnation": hb.incarnation, "endpoint": hb.endpoint,
                "age_s": round(now - rep.last_seen, 3), "paused_s": hb.timings.get("paused"),
                "pull_s": hb.timings.get("pull"), "timings": hb.timings,
                "gate": None if hb.gate is None else hb.gate.model_dump(mode="json"),
                "error": hb.last_error,
                "refused": [r.model_dump(mode="json") for r in hb.refused] if hb.refused else [],
                "pull": _pull(hb.last_pull),
                "problems": list(_problems(rep, now, stale_s, self._newest()))}


def _pull(report: PullReport | None) -> dict | None:
    """The node's last pull as reported, with the share of the version's size it fetched (what a
    delta saved: 0.02 for a delta of 2 %)."""
    if report is None:
        return None
    ratio = report.bytes_fetched / report.version_bytes if report.version_bytes else None
    return {**report.model_dump(mode="json"), "fetched_ratio": None if ratio is None else round(ratio, 4)}


class _Scan(NamedTuple):
    entries: list[_Entry]   # sorted by (node, replica id)
    groups: list[tuple[str, list[_Entry]]]
    summary: dict
    held: Counter
    serving: Counter


def _scan(replicas: list[tuple[str, Replica]], now: float, stale_s: float,
          newest: tuple[int, str] | None) -> Iterator[_Scan | None]:
    """The per-replica part of a pass, in steps: None after each step of about a millisecond
    (``SLICE`` replicas), the result last."""
    entries = []
    for i, (rid, rep) in enumerate(replicas, 1):
        hb, last_seen = rep.heartbeat, rep.last_seen
        ok = (hb.state not in FAILING_STATES and (hb.gate is None or hb.gate.ok) and now - last_seen <= stale_s
              and not hb.refused)
        entries.append(_Entry(hb.node, rid, hb.state, hb.version, () if ok else _problems(rep, now, stale_s, newest)))
        if i % SLICE == 0:
            yield None
    entries.sort()
    yield None
    with_problems = [e.problems for e in entries if e.problems]
    summary = {"replicas": len(entries), "nodes": len({e.node for e in entries}),
               "by_state": dict(sorted(Counter(e.state for e in entries).items())),
               "with_problems": len(with_problems), "silent": sum("silent" in p for p in with_problems)}
    yield None
    groups = _grouped(entries)
    yield None
    yield _Scan(entries, groups, summary, Counter(e.version for e in entries),
                Counter(e.version for e in entries if e.state is ServerState.SERVING))


def _grouped(entries) -> list[tuple[str, list[_Entry]]]:
    """Sorted entries as (node, its entries), in order."""
    groups: list[tuple[str, list[_Entry]]] = []
    for e in entries:
        if groups and groups[-1][0] == e.node:
            groups[-1][1].append(e)
        else:
            groups.append((e.node, [e]))
    return groups


def _problems(rep: Replica, now: float, stale_s: float, newest: tuple[int, str] | None) -> tuple[str, ...]:
    hb = rep.heartbeat
    found = ()
    if hb.state in FAILING_STATES:
        found += ("state",)
    if hb.gate is not None and not hb.gate.ok:
        found += ("gate",)
    if newest is not None and hb.refused and (hb.version or 0) < newest[0] and any(
            (r.version, r.digest) == newest for r in hb.refused):
        found += ("refused",)
    if now - rep.last_seen > stale_s:
        found += ("silent",)
    return found
