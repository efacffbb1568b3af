"""Daemon metrics: the text exposition parses and holds the values set; each Metrics has its own
registry; a removed server's series go away."""

from __future__ import annotations

from rolloutd.metrics import FAILURE_KINDS, PULL_KINDS, PULL_RESULTS, UPDATE_PHASES, Metrics
from rolloutd.wire.states import ServerState
from tests.support.metric_samples import samples


def test_values_set_are_in_the_text():
    m = Metrics()
    m.pull_bytes.labels(kind="full").inc(1 << 30)
    m.pull_rate.set(5e8)
    m.pull_seconds.observe(2.0)
    m.pulls.labels(result="ok").inc()
    m.pulls.labels(result="reused").inc(2)
    m.pause_seconds.labels(server="gpu0").observe(0.3)
    m.update_phase_seconds.labels(phase="load").observe(0.2)
    m.update_failures.labels(kind="finish").inc()
    m.updates.labels(server="gpu0").inc(3)
    m.restarts.labels(server="gpu0").inc()
    m.heartbeat_failures.labels(server="gpu0").inc(4)
    m.server_state.labels(server="gpu0").state("UPDATING")
    m.server_version.labels(server="gpu0").set(7)
    m.server_version.labels(server="gpu1").set(-1)
    m.registry_reachable.set(1)
    m.mirror_bytes.set(123456)
    s = samples(m)
    assert s[("rolloutd_pull_bytes_total", (("kind", "full"),))] == 1 << 30
    assert s[("rolloutd_pull_rate_bytes_per_second", ())] == 5e8
    assert s[("rolloutd_pull_seconds_count", ())] == 1 and s[("rolloutd_pull_seconds_sum", ())] == 2.0
    assert s[("rolloutd_pull_seconds_bucket", (("le", "2.5"),))] == 1
    assert s[("rolloutd_pull_seconds_bucket", (("le", "1.0"),))] == 0
    assert s[("rolloutd_pulls_total", (("result", "ok"),))] == 1
    assert s[("rolloutd_pulls_total", (("result", "reused"),))] == 2
    assert s[("rolloutd_pulls_total", (("result", "failed"),))] == 0
    assert s[("rolloutd_pause_seconds_count", (("server", "gpu0"),))] == 1
    assert s[("rolloutd_pause_seconds_bucket", (("le", "0.5"), ("server", "gpu0")))] == 1
    assert s[("rolloutd_pause_seconds_bucket", (("le", "0.25"), ("server", "gpu0")))] == 0
    assert s[("rolloutd_update_phase_seconds_count", (("phase", "load"),))] == 1
    assert s[("rolloutd_update_failures_total", (("kind", "finish"),))] == 1
    assert s[("rolloutd_updates_total", (("server", "gpu0"),))] == 3
    assert s[("rolloutd_server_restarts_total", (("server", "gpu0"),))] == 1
    assert s[("rolloutd_heartbeat_failures_total", (("server", "gpu0"),))] == 4
    assert s[("rolloutd_server_version", (("server", "gpu0"),))] == 7
    assert s[("rolloutd_server_version", (("server", "gpu1"),))] == -1
    assert s[("rolloutd_registry_reachable", ())] == 1
    assert s[("rolloutd_mirror_bytes", ())] == 123456
    states = {dict(k[1])["rolloutd_server_state"]: v for k, v in s.items()
              if k[0] == "rolloutd_server_state" and dict(k[1])["server"] == "gpu0"}
    assert states == {st.name: (1.0 if st is ServerState.UPDATING else 0.0) for st in ServerState}


def test_known_labels_start_at_zero():
    s = samples(Metrics())
    for result in PULL_RESULTS:
        assert s[("rolloutd_pulls_total", (("result", result),))] == 0
    for kind in PULL_KINDS:
        assert s[("rolloutd_pull_bytes_total", (("kind", kind),))] == 0
    for kind in FAILURE_KINDS:
        assert s[("rolloutd_update_failures_total", (("kind", kind),))] == 0
    for phase in UPDATE_PHASES:
        assert s[("rolloutd_update_phase_seconds_count", (("phase", phase),))] == 0


def test_a_pull_counts_its_bytes_by_kind_and_times_a_delta_s_rebuild():
    m = Metrics()
    m.pulled("delta", 21_000, seconds=0.5, reconstruct_s=0.125)
    m.pulled("delta", 9_000, seconds=0.25, reconstruct_s=0.05)
    m.pulled("full", 1_000_000, seconds=2.0, reconstruct_s=None)  # a full pull rebuilds nothing
    s = samples(m)
    assert s[("rolloutd_pull_bytes_total", (("kind", "delta"),))] == 30_000
    assert s[("rolloutd_pull_bytes_total", (("kind", "full"),))] == 1_000_000
    assert s[("rolloutd_pulls_total", (("result", "ok"),))] == 3 and s[("rolloutd_pull_seconds_count", ())] == 3
    assert s[("rolloutd_pull_reconstruct_seconds_count", ())] == 2
    assert s[("rolloutd_pull_reconstruct_seconds_sum", ())] == 0.175
    assert s[("rolloutd_pull_reconstruct_seconds_bucket", (("le", "0.1"),))] == 1


def test_buckets_span_the_quantities():
    s = samples(Metrics())
    pause = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "rolloutd_update_phase_seconds_bucket"
                   and dict(k[1])["phase"] == "pause")
    assert pause[0] == 0.01 and pause[-2] == 600 and pause[-1] == float("inf")
    pull = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "rolloutd_pull_seconds_bucket")
    assert pull[0] == 0.1 and pull[-2] == 3600 and pull[-1] == float("inf")
    rebuild = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "rolloutd_pull_reconstruct_seconds_bucket")
    assert rebuild[0] == 0.01 and rebuild[-2] == 600  # milliseconds for a small model, minutes at 1T


def test_each_metrics_has_its_own_registry():
    a, b = Metrics(), Metrics()  # a second one would raise "Duplicated timeseries" on a shared registry
    a.mirror_bytes.set(5)
    assert samples(b)[("rolloutd_mirror_bytes", ())] == 0
    assert samples(a)[("rolloutd_mirror_bytes", ())] == 5


def test_forget_server_removes_only_its_series():
    m = Metrics()
    for name in ("gpu0", "gpu1"):
        m.pause_seconds.labels(server=name).observe(1)
        m.updates.labels(server=name).inc()
        m.restarts.labels(server=name).inc()
        m.heartbeat_failures.labels(server=name).inc()
        m.server_state.labels(server=name).state("SERVING")
        m.server_version.labels(server=name).set(3)
    m.forget_server("gpu1")
    m.forget_server("never-there")  # no error
    servers = {dict(k[1]).get("server") for k in samples(m)} - {None}
    assert servers == {"gpu0"}
    m.forget_server("gpu0")
    m.server_state.labels(server="gpu0")  # a server added back starts from scratch
    s = samples(m)
    assert s[("rolloutd_server_state", (("rolloutd_server_state", "STARTING"), ("server", "gpu0")))] == 0
    assert ("rolloutd_updates_total", (("server", "gpu0"),)) not in s
