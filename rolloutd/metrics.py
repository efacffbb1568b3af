"""The daemon's Prometheus metrics, served by the admin API at ``GET /metrics``.

Contract: one :class:`Metrics` per daemon, on its own ``CollectorRegistry`` (never the process
global one, so several daemons in one test process do not collide). The puller's updater, the
appliers, the supervisors and the heartbeats set them; ``render()`` is the text exposition.
Series labelled with a server are removed by ``forget_server`` when a reload removes it.
Label values known in advance are created at start, so ``rate()`` sees a 0 before the first event.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import Enum as StateEnum

from rolloutd.wire.states import ServerState

# A pause is milliseconds on a small model and minutes on a large one over a slow mirror.
PAUSE_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# A pull is a fraction of a second from a warm page cache, up to an hour over a WAN.
PULL_BUCKETS = (.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# A loop that keeps up is late by about a millisecond; a deletion or a hash on it, by seconds.
LAG_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)

PULL_RESULTS = ("ok", "failed", "reused")
PULL_KINDS = ("full", "delta")  # a version's files fetched whole, or its delta files and rebuilt from a base
UPDATE_PHASES = ("pause", "start", "load", "finish", "check", "resume", "gate")
FAILURE_KINDS = ("pull", "pause", "start", "load", "finish", "check", "resume", "timeout", "sync", "gate")
TASKS = ("heartbeat", "updater", "reload", "loop_lag")  # the daemon's long-lived tasks with a crash policy


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.pull_bytes = Counter("rolloutd_pull_bytes", "Bytes fetched over the network by pulls that "
                                  "succeeded, by kind (full: the version's files; delta: its delta files, "
                                  "and the full files too when the delta failed and the pull fell back)",
                                  ["kind"], registry=r)
        self.pull_reconstruct_seconds = Histogram("rolloutd_pull_reconstruct_seconds", "Time a delta pull "
                                                  "took to rebuild the version's files from the base and the "
                                                  "delta, every chunk's digest checked", buckets=PAUSE_BUCKETS,
                                                  registry=r)
        self.pull_rate = Gauge("rolloutd_pull_rate_bytes_per_second", "Rate of the current pull (0 when idle)",
                               registry=r)
        self.pull_seconds = Histogram("rolloutd_pull_seconds", "Duration of whole pulls that succeeded",
                                      buckets=PULL_BUCKETS, registry=r)
        self.pulls = Counter("rolloutd_pulls", "Pulls by result (reused: the mirror already held the version)",
                             ["result"], registry=r)
        self.pull_worker_restarts = Counter("rolloutd_pull_worker_restarts", "Pull worker processes that exited "
                                            "mid-pull and were started again (their chunks are fetched again)",
                                            registry=r)
        self.pause_seconds = Histogram("rolloutd_pause_seconds", "Time a server was paused for one update "
                                       "(pause to resume)", ["server"], buckets=PAUSE_BUCKETS, registry=r)
        self.update_phase_seconds = Histogram("rolloutd_update_phase_seconds", "Duration of each phase of an "
                                              "update", ["phase"], buckets=PAUSE_BUCKETS, registry=r)
        self.update_failures = Counter("rolloutd_update_failures", "Failed updates by the step that failed",
                                       ["kind"], registry=r)
        self.updates = Counter("rolloutd_updates", "Updates that loaded a new version into a server",
                               ["server"], registry=r)
        self.restarts = Counter("rolloutd_server_restarts", "Restarts of a server's process", ["server"], registry=r)
        self.heartbeat_failures = Counter("rolloutd_heartbeat_failures", "Heartbeats the registry did not take",
                                          ["server"], registry=r)
        self.server_state = StateEnum("rolloutd_server_state", "Lifecycle state of each server", ["server"],
                                      states=[s.name for s in ServerState], registry=r)
        self.server_version = Gauge("rolloutd_server_version", "Version loaded in each server (-1: unknown or "
                                    "the base model)", ["server"], registry=r)
        self.registry_reachable = Gauge("rolloutd_registry_reachable", "1 when the registry answered last time",
                                        registry=r)
        self.gate_max_abs_dlogprob = Gauge("rolloutd_gate_max_abs_dlogprob", "Last gate of each server: max "
                                           "|served - expected| logprob over the version's canary (NaN: no "
                                           "canary, only the probe; +Inf: a served value was not finite)",
                                           ["server"], registry=r)
        self.task_errors = Counter("rolloutd_task_errors", "Crashes of a long-lived task of the daemon (a bug, "
                                   "logged with its traceback); the task is started again after a delay",
                                   ["task"], registry=r)
        self.loop_lag = Histogram("rolloutd_loop_lag_seconds", "How late the daemon's event loop woke a timer "
                                  "(sampled every 0.25 s): a blocked loop delays every token the gateways relay",
                                  buckets=LAG_BUCKETS, registry=r)
        self.loop_lag_max = Gauge("rolloutd_loop_lag_max_seconds", "The event loop's longest lateness since the "
                                  "daemon started", registry=r)
        self.mirror_bytes = Gauge("rolloutd_mirror_bytes", "Bytes held by the node mirror (its spares included)",
                                  registry=r)
        self.mirror_spare_bytes = Gauge("rolloutd_mirror_spare_bytes", "Bytes of removed versions' files the "
                                        "mirror keeps for the next pull to overwrite (mirror.recycle)", registry=r)
        self.gateway_requests = Counter("rolloutd_gateway_requests", "Requests answered by a server's gateway, "
                                        "by route (other: not on the allow-list) and HTTP status",
                                        ["server", "route", "code"], registry=r)
        self.gateway_held = Counter("rolloutd_gateway_held", "Requests a gateway held while its server was "
                                    "paused for an update", ["server"], registry=r)
        self.gateway_refused_connections = Counter("rolloutd_gateway_refused_connections", "Client connections "
                                                   "a gateway refused (503 and closed) at gateway.max_connections, or "
                                                   "ended there to make room (one that had not sent the token)",
                                                   ["server"], registry=r)
        self.reload_failures = Counter("rolloutd_reload_failures", "Reloads refused because the new "
                                       "configuration file was bad (the running configuration stays)", registry=r)
        self.reload_ok = Gauge("rolloutd_reload_ok", "0 while the last reload was refused (the file on disk is "
                               "not what runs), 1 once one succeeds or when none was tried", registry=r)
        self.reload_ok.set(1)
        self.versions_refused = Counter("rolloutd_versions_refused", "Versions this node refused: no server "
                                        "could be made to serve one correctly (each kept its last good "
                                        "version; /status says why)", registry=r)
        self.refused_version = Gauge("rolloutd_refused_version", "The version refused last (0: none)",
                                     registry=r)
        for result in PULL_RESULTS:
            self.pulls.labels(result=result)
        for kind in PULL_KINDS:
            self.pull_bytes.labels(kind=kind)
        for phase in UPDATE_PHASES:
            self.update_phase_seconds.labels(phase=phase)
        for kind in FAILURE_KINDS:
            self.update_failures.labels(kind=kind)
        for task in TASKS:
            self.task_errors.labels(task=task)

    def pulled(self, kind: str, bytes_fetched: int, seconds: float, reconstruct_s: float | None) -> None:
        """A pull that brought its version into the mirror (not one the mirror held already)."""
        self.pulls.labels(result="ok").inc()
        self.pull_bytes.labels(kind=kind).inc(bytes_fetched)
        self.pull_seconds.observe(seconds)
        if reconstruct_s is not None:
            self.pull_reconstruct_seconds.observe(reconstruct_s)

    def set_mirror(self, usage_bytes: int, spare_bytes: int) -> None:
        self.mirror_bytes.set(usage_bytes)
        self.mirror_spare_bytes.set(spare_bytes)

    @property
    def _per_server(self) -> tuple:
        return (self.pause_seconds, self.updates, self.restarts, self.heartbeat_failures, self.server_state,
                self.server_version, self.gateway_held, self.gate_max_abs_dlogprob,
                self.gateway_refused_connections)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def forget_server(self, name: str) -> None:
        """Drop every series of a server that no longer exists (a stale state would read as live)."""
        for metric in self._per_server:
            with contextlib.suppress(KeyError):  # a server may not have every series yet
                metric.remove(name)
        for family in self.gateway_requests.collect():
            for sample in family.samples:
                if sample.labels.get("server") == name and sample.name.endswith("_total"):
                    with contextlib.suppress(KeyError):
                        self.gateway_requests.remove(name, sample.labels["route"], sample.labels["code"])
