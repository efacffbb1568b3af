"""The fleet view's figures, without HTTP: publish-to-serving per version, lag, state age, problems,
filters and pages (the store and ``FleetView`` with a fake clock)."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.registry.fleet import FAILING_STATES, FleetQuery, FleetView
from rolloutd.registry.rollouts import RolloutLog
from rolloutd.registry.store import Store
from rolloutd.wire.messages import GateReport, Heartbeat, PullReport, RefusedVersion
from rolloutd.wire.states import ServerState
from tests.support.store_versions import publish


@pytest.fixture
def store(clock):
    return Store(keep_versions=2, clock=clock)


@pytest.fixture
def view(store):
    return FleetView(store, cache_s=0)


def beat(store, node: str, server: str, state: str = "SERVING", version: int | None = None, **kw) -> None:
    store.heartbeat(f"{node}.{server}", Heartbeat(node=node, server=server, state=state, version=version, **kw))


def test_publish_to_serving_counts_each_replica_once_on_the_registry_clock(store, clock):
    beat(store, "n1", "s0")
    beat(store, "n1", "s1")
    clock.advance(1)
    publish(store, 1)
    clock.advance(2.5)
    beat(store, "n1", "s0", version=1)
    beat(store, "n1", "s1", "UPDATING", version=None)
    clock.advance(4)
    beat(store, "n1", "s1", version=1)
    beat(store, "n1", "s0", "UPDATING", version=1)   # a later failed update...
    clock.advance(1)
    beat(store, "n1", "s0", version=1)               # ...and serving it again: not a second arrival
    [r1] = store.rollouts.stats(clock())
    assert r1 == {"version": 1, "published_age_s": 7.5, "reached": 2, "min_s": 2.5, "p50_s": 2.5, "p90_s": 6.5,
                  "max_s": 6.5}


def test_a_replica_that_registered_after_the_publish_is_not_timed(store, clock):
    publish(store, 1)
    clock.advance(60)
    beat(store, "late", "s0", version=1)  # its 60 s say when it joined, not how fast the fleet moved
    assert store.rollouts.stats(clock())[0]["reached"] == 0


def test_rollout_history_is_bounded_and_quantiles_are_measured_values():
    log = RolloutLog(history=3)
    for v in range(1, 6):
        log.published(v, at=float(v))
    assert [r["version"] for r in log.stats(10.0)] == [3, 4, 5]
    for i in range(10):
        log.serving(5, replica_first_seen=0.0, now=5.0 + i + 1)  # delays 1..10
    five = log.stats(10.0)[-1]
    assert (five["min_s"], five["p50_s"], five["p90_s"], five["max_s"]) == (1, 5, 9, 10)
    log.serving(1, replica_first_seen=0.0, now=9.0)  # forgotten version: ignored
    assert log.published_at(1) == 1.0  # publish times are kept longer, for lag


def test_lag_counts_versions_published_since_and_how_long_ago_the_first_was(clock):
    log = RolloutLog()
    for v, at in ((10, 100.0), (20, 130.0), (30, 170.0)):
        log.published(v, at)
    assert log.lag(30, 30, 200.0) == (0, 0.0)
    assert log.lag(20, 30, 200.0) == (1, 30.0)       # numbers are training steps: two versions, not ten
    assert log.lag(10, 30, 200.0) == (2, 70.0)
    assert log.lag(None, 30, 200.0) == (None, None)  # the start model
    assert log.lag(5, 30, 200.0) == (3, 100.0)


def test_state_age_is_when_the_registry_first_saw_the_state(store, clock, view):
    beat(store, "n1", "s0", "STARTING")
    clock.advance(3)
    beat(store, "n1", "s0", "STARTING")
    clock.advance(2)
    beat(store, "n1", "s0", "SERVING")
    clock.advance(1.5)
    [row] = view.document(FleetQuery())["nodes"]["items"][0]["replicas"]
    assert (row["state"], row["state_age_s"], row["age_s"]) == ("SERVING", 1.5, 1.5)


def test_a_row_carries_what_the_replica_reported_and_its_problems(store, clock, view):
    publish(store, 1)
    publish(store, 2)
    bad_gate = GateReport(ok=False, canary=True, max_abs_dlogprob=0.4, tolerance=0.05, tokens=8)
    beat(store, "n1", "s0", version=1, target=2, timings={"paused": 0.42, "pull": 3.5, "load": 0.3},
         gate=bad_gate, last_error="version 2 failed the gate", endpoint="http://n1:9001", incarnation=2)
    beat(store, "n1", "s1", "FATAL", version=2)
    beat(store, "n2", "s0", version=2)
    clock.advance(20)
    beat(store, "n2", "s0", version=2)
    doc = view.document(FleetQuery())
    n1, n2 = doc["nodes"]["items"]
    s0, s1 = n1["replicas"]
    assert s0 == {"replica_id": "n1.s0", "server": "s0", "state": "SERVING", "state_age_s": 20.0, "version": 1,
                  "target": 2, "lag": 1, "lag_s": 20.0, "incarnation": 2, "endpoint": "http://n1:9001",
                  "age_s": 20.0, "paused_s": 0.42, "pull_s": 3.5,
                  "timings": {"paused": 0.42, "pull": 3.5, "load": 0.3}, "gate": bad_gate.model_dump(),
                  "error": "version 2 failed the gate", "refused": [], "pull": None, "problems": ["gate", "silent"]}
    assert s1["problems"] == ["state", "silent"] and n2["replicas"][0]["problems"] == []
    assert (n1["with_problems"], n1["states"], n1["max_age_s"]) == (2, {"SERVING": 1, "FATAL": 1}, 20.0)
    assert doc["summary"] == {"replicas": 3, "nodes": 2, "by_state": {"FATAL": 1, "SERVING": 2},
                              "with_problems": 2, "silent": 2,
                              "behind": {"0": 2, "1": 1, "2": 0, "3+": 0, "start model": 0}}
    assert doc["latest"] == {"version": 2, "published_age_s": 20.0}
    assert [(v["version"], v["held_by"], v["serving"]) for v in doc["versions"]] == [(1, 1, 1), (2, 2, 1)]
    assert view.document(FleetQuery(stale_s=30))["summary"]["silent"] == 0


def test_a_row_shows_the_last_pull_and_the_share_of_the_version_it_fetched(store, view):
    publish(store, 1)
    publish(store, 2)
    delta = PullReport(version=2, kind="delta", base=1, bytes_fetched=21_000, version_bytes=1_000_000, seconds=0.5,
                       reconstruct_s=0.125)
    fell_back = PullReport(version=2, kind="full", bytes_fetched=1_000_000, version_bytes=1_000_000, seconds=2.0,
                           delta_error="version 2: delta file w.safetensors.delta: chunk 0 digest differs")
    beat(store, "n1", "s0", version=2, last_pull=delta)
    beat(store, "n2", "s0", version=2, last_pull=fell_back)
    beat(store, "n3", "s0", version=2, last_pull=delta.model_copy(update={"version_bytes": 0, "bytes_fetched": 0}))
    n1, n2, n3 = (n["replicas"][0]["pull"] for n in view.document(FleetQuery())["nodes"]["items"])
    assert n1 == {"version": 2, "kind": "delta", "base": 1, "bytes_fetched": 21_000, "version_bytes": 1_000_000,
                  "seconds": 0.5, "reconstruct_s": 0.125, "delta_error": None, "fetched_ratio": 0.021}
    assert (n2["kind"], n2["base"], n2["fetched_ratio"], n2["reconstruct_s"]) == ("full", None, 1.0, None)
    assert n2["delta_error"].startswith("version 2: delta file w.safetensors.delta")
    assert n3["fetched_ratio"] is None  # an empty version: no share to speak of


def test_a_replica_whose_node_refused_the_newest_version_has_a_problem_until_it_holds_a_newer_one(store, clock,
                                                                                                   view):
    publish(store, 1)
    newest = publish(store, 2)
    why = "version 2 failed the gate 2 time(s): gate: canary mismatch"
    refused = [RefusedVersion(version=2, digest=newest.manifest.digest, reason=why)]
    beat(store, "n1", "s0", version=1, refused=refused)
    beat(store, "n2", "s0", version=1, refused=[RefusedVersion(version=2, digest="0" * 64, reason="other bytes")])
    row = view.document(FleetQuery())["nodes"]["items"][0]["replicas"][0]
    assert row["problems"] == ["refused"] and row["refused"] == [r.model_dump(mode="json") for r in refused]
    assert view.document(FleetQuery(problems=True))["nodes"]["total"] == 1, "a refusal of other bytes is none"
    assert store.refusals(2, None) == {"version": 2, "replicas": 1, "reasons": [{"reason": why, "count": 1}]}
    assert store.refusals(3, None) is None and store.refusals(1, None) is None
    publish(store, 3)
    assert view.document(FleetQuery(problems=True))["nodes"]["total"] == 0, "a newer version to move to"
    assert store.refusals(2, None) is None


def test_filters_and_pages_group_replicas_by_node(store, view):
    for n in range(7):
        for s in range(3):
            beat(store, f"node{n}", f"s{s}", "BACKOFF" if (n, s) in {(2, 1), (5, 0)} else "SERVING")
    page = view.document(FleetQuery(page=2, per_page=3))["nodes"]
    assert (page["total"], page["replicas"], page["pages"], page["page"]) == (7, 21, 3, 2)
    assert [n["node"] for n in page["items"]] == ["node3", "node4", "node5"]
    assert all(len(n["replicas"]) == 3 for n in page["items"])
    failing = view.document(FleetQuery(problems=True))["nodes"]
    assert [(n["node"], [r["server"] for r in n["replicas"]]) for n in failing["items"]] == \
        [("node2", ["s1"]), ("node5", ["s0"])]
    assert view.document(FleetQuery(state="BACKOFF"))["nodes"]["replicas"] == 2
    assert [n["node"] for n in view.document(FleetQuery(node="DE4"))["nodes"]["items"]] == ["node4"]
    beyond = view.document(FleetQuery(page=9, per_page=3))["nodes"]
    assert beyond["items"] == [] and beyond["pages"] == 3


def test_the_summary_pass_is_cached_for_every_viewer(store, clock):
    view = FleetView(store, cache_s=1.0)
    beat(store, "n1", "s0")
    assert view.document(FleetQuery())["summary"]["replicas"] == 1
    beat(store, "n2", "s0")
    assert view.document(FleetQuery())["summary"]["replicas"] == 1  # within the second: the same pass
    clock.advance(1.0)
    assert view.document(FleetQuery())["summary"]["replicas"] == 2


def test_a_replica_gone_since_the_pass_is_left_out(store, clock):
    view = FleetView(store, cache_s=10)
    beat(store, "n1", "s0")
    beat(store, "n1", "s1")
    view.document(FleetQuery())
    store.deregister("n1.s1")
    assert [r["server"] for r in view.document(FleetQuery())["nodes"]["items"][0]["replicas"]] == ["s0"]


async def test_the_pass_gives_the_loop_turns_runs_once_for_all_viewers_and_gives_the_same_document(store,
                                                                                                      monkeypatch):
    from rolloutd.registry import fleet
    publish(store, 1)
    for i in range(3000):
        beat(store, f"node{i // 8:04d}", f"s{i % 8}", version=1 if i % 3 else None)
    q = FleetQuery(per_page=20)
    inline = FleetView(store, cache_s=0).document(q)
    passes, turns = [], 0
    real_scan = fleet._scan
    monkeypatch.setattr(fleet, "_scan", lambda *a: passes.append(1) or real_scan(*a))

    async def other_work():  # a heartbeat's turn, as the loop would give it
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1
    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    view = FleetView(store, cache_s=1.0)
    docs = await asyncio.gather(*(view.document_async(q) for _ in range(5)))
    other.cancel()
    assert all(d == inline for d in docs)  # the same figures as the pass done in one go
    assert len(passes) == 1                # five viewers at once: one pass
    # Other work ran between the pass's steps of SLICE replicas (in one go, the pass over
    # 10,000 replicas held up every heartbeat that arrived for 17 ms: bench/ui_load.py).
    assert turns >= 3000 // fleet.SLICE, turns


def test_failing_states_are_the_daemons_state_names():
    assert FAILING_STATES <= {s.name for s in ServerState}


def test_the_registry_exports_the_fleet_figures_as_metrics(clock):
    from prometheus_client import generate_latest

    from rolloutd.registry.service import RegistryService
    from rolloutd.registry.settings import RegistrySettings
    service = RegistryService(RegistrySettings(), clock=clock)

    def beat(rid: str, state: str, version: int | None = None) -> None:
        node, server = rid.split(".")
        service.heartbeat(rid, Heartbeat(node=node, server=server, state=state, version=version).model_dump_json())
    for rid in ("n1.s0", "n1.s1", "n2.s0"):
        beat(rid, "SERVING")
    publish(service.store, 1)
    publish(service.store, 2)
    clock.advance(3)
    beat("n1.s0", "SERVING", 2)
    beat("n1.s1", "BACKOFF", 1)
    clock.advance(30)
    beat("n2.s0", "SERVING", 2)
    service.metrics.refresh(service.store)
    text = generate_latest(service.metrics.registry).decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples['rolloutd_registry_replica_states{state="SERVING"}'] == "2.0"
    assert samples['rolloutd_registry_replica_states{state="BACKOFF"}'] == "1.0"
    buckets = ("0", "1", "2", "3+", "start model")
    behind = [samples[f'rolloutd_registry_replicas_behind{{behind="{b}"}}'] for b in buckets]
    assert behind == ["2.0", "1.0", "0.0", "0.0", "0.0"]
    assert samples["rolloutd_registry_publish_to_serving_seconds_count"] == "2.0"
    assert samples["rolloutd_registry_publish_to_serving_seconds_sum"] == "36.0"
    assert samples['rolloutd_registry_publish_to_serving_seconds_bucket{le="5.0"}'] == "1.0"
    beat("n1.s1", "SERVING", 2)
    service.metrics.refresh(service.store)
    assert 'state="BACKOFF"' not in generate_latest(service.metrics.registry).decode()
