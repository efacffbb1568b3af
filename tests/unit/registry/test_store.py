"""The registry's state machine, without HTTP: every version arrow, leases, replicas, demand."""

import pytest

from rolloutd.registry.store import Store, VersionState
from rolloutd.wire import errors
from rolloutd.wire.messages import Heartbeat
from tests.support.store_versions import publish


@pytest.fixture
def reclaimed():
    return []


@pytest.fixture
def store(clock, reclaimed):
    return Store(keep_versions=2, clock=clock, reclaim=lambda v, blobs: reclaimed.append(v), replica_forget_after_s=100)


def test_live_to_retired_keeps_bytes_while_leased(store, reclaimed):
    v1 = publish(store, 1)
    lease = store.lease("n1", 1, ttl_s=30)
    store.retire(1)
    assert v1.state is VersionState.RETIRED and reclaimed == []
    assert store.get(1) is v1  # bytes still there for the holder
    with pytest.raises(errors.VersionRetired, match="no new leases"):
        store.lease("n2", 1, ttl_s=30)
    store.release(lease.id)
    assert v1.state is VersionState.RECLAIMED and reclaimed == [1]
    with pytest.raises(errors.VersionRetired, match="reclaimed"):
        store.get(1)


def test_retired_without_lease_is_reclaimed_at_once(store, reclaimed):
    publish(store, 1)
    store.retire(1)
    assert reclaimed == [1]


def test_reclaimed_is_final_and_bad_arrows_are_refused(store):
    v = publish(store, 1)
    store.retire(1)
    with pytest.raises(AssertionError, match="RECLAIMED -> LIVE"):
        store._set_state(v, VersionState.LIVE, "test")


def test_keep_newest_k_retires_older(store, reclaimed):
    for v in (1, 2, 3):
        publish(store, v)
    assert [v.number for v in store.versions()] == [2, 3]
    assert reclaimed == [1] and store.latest.number == 3


def test_keep_counts_live_versions_only(store):
    for v in (1, 2, 3):
        publish(store, v)
    store.retire(3)                  # retired by hand: 2 is the only live one
    publish(store, 4)
    assert [(v.number, v.state) for v in store.versions()] == [(2, VersionState.LIVE), (4, VersionState.LIVE)]


def test_versions_strictly_increase_and_republish_is_idempotent(store):
    publish(store, 5)
    assert publish(store, 5).number == 5  # identical: no-op
    with pytest.raises(errors.VersionConflict):
        publish(store, 5, b"other")
    with pytest.raises(errors.VersionNotNewer):
        publish(store, 4)
    store.retire(5)
    with pytest.raises(errors.VersionNotNewer):  # a retired number is never reused
        publish(store, 5, b"other")


def test_lease_expiry_with_injected_clock(store, clock, reclaimed):
    publish(store, 1)
    lease = store.lease("n1", "latest", ttl_s=10)
    store.retire(1)
    clock.advance(9)
    store.renew(lease.id)             # renewed: 10 s more from now
    clock.advance(9.5)
    store.sweep()
    assert reclaimed == []
    clock.advance(1)
    store.sweep()
    assert reclaimed == [1]
    with pytest.raises(errors.LeaseExpired):
        store.renew(lease.id)
    with pytest.raises(errors.LeaseUnknown):
        store.renew("never-granted")


def test_lease_latest_without_versions_and_bad_ttl(store):
    with pytest.raises(errors.NoVersions):
        store.lease("n1", "latest", ttl_s=10)
    publish(store, 1)
    assert store.lease("n1", "latest", ttl_s=10_000).ttl_s == 3600  # capped at max_lease_ttl_s
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(errors.InvalidRequest, match="ttl_s"):
            store.lease("n1", "latest", ttl_s=bad)
    with pytest.raises(errors.VersionUnknown):
        store.lease("n1", 9, ttl_s=10)


def test_retiring_latest_falls_back_and_tells_listeners(store):
    changes = []
    store.listeners.append(lambda: changes.append(store.latest.number if store.latest else None))
    publish(store, 1)
    publish(store, 2)
    store.retire(2)
    assert changes == [1, 2, 1]


def test_replica_age_on_registry_clock_and_forgetting(store, clock):
    hb = Heartbeat(node="n1", server="s0", state="SERVING", version=1)
    store.heartbeat("n1.s0", hb)
    clock.advance(2.5)
    assert store.replicas()[0]["age_s"] == 2.5
    clock.advance(98)
    store.sweep()
    assert store.replicas() == []
    with pytest.raises(errors.InvalidRequest):
        store.heartbeat("../x", hb)


def test_demand_rides_heartbeat_replies(store):
    hb = Heartbeat(node="n1", server="s0", state="SERVING")
    with pytest.raises(errors.DemandAhead):
        store.set_demand(1)
    publish(store, 1)
    store.set_demand(1)
    reply = store.heartbeat("n1.s0", hb)
    assert reply["demand"] == {"min_version": 1} and reply["latest"] == 1
    assert reply["instance"] == store.instance


def test_a_skipped_number_is_unknown_not_retired(store):
    publish(store, 1)
    publish(store, 5)
    with pytest.raises(errors.VersionUnknown):
        store.get(3)
    store.retire(1)
    with pytest.raises(errors.VersionRetired):
        store.get(1)
