"""Supervision faults around updates, with the fake vLLM (tests/support/fake_vllm.py) as the daemon's
children: a pause that keeps failing (the server serves on, on the weights it holds, and the
update is retried with growing delays), a server that dies or stops answering in the middle of
a load (BACKOFF within a few probes, not after ``update.load_timeout_s``), a restart asked while
a stop waits out its grace period (one stop, whose end the restart waits for), and the failure
counters of each step.

Faults are set on a running fake through ``POST /fake/faults``, so a server first syncs cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.support.daemon_harness import DaemonProcess, alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.parallel, pytest.mark.timeout(120)]  # fake vLLM: beside other such tests


class Versions:
    """A registry of its own, so that the tests here can publish new versions freely."""

    def __init__(self, reg: EmbeddedRegistry):
        self.reg, self.newest = reg, 0
        self.publish()

    @property
    def url(self) -> str:
        return self.reg.url

    def publish(self) -> int:
        self.newest += 1
        self.reg.publish(self.newest, tinymodel.state_dict(tinymodel.TINY, self.newest), shard_bytes=600_000,
                         chunk_bytes=1 << 16)
        return self.newest


@pytest.fixture(scope="module")
def registry():
    with EmbeddedRegistry(port=0) as reg:
        yield Versions(reg)


def s0(d: DaemonProcess) -> dict:
    return d.status()["servers"][0]


def fake(d: DaemonProcess, route: str, body: dict) -> None:
    with d.vllm("s0", timeout=5) as c:  # on the server's socket, as the daemon reaches it
        c.post(route, json=body).raise_for_status()


def failures(d: DaemonProcess) -> dict[str, float]:
    text = httpx.get(d.url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r'^rolloutd_update_failures_total\{kind="(\w+)"\} (\S+)$', text,
                                               re.M)}


def metric(d: DaemonProcess, name: str) -> float:
    text = httpx.get(d.url + "/metrics", timeout=10).text
    return float(re.search(rf'^rolloutd_{name}\{{server="s0"\}} (\S+)$', text, re.M).group(1))


def replica(registry: Versions, d: DaemonProcess) -> dict:
    """``d``'s server in the registry's directory (its latest heartbeat); the module's other
    daemons may be listed too."""
    (mine,) = [r for r in registry.reg.http.replicas() if r["endpoint"] == s0(d)["endpoint"]]
    return mine


def serving(d: DaemonProcess, version: int, timeout_s: float = 30) -> dict:
    return d.wait_versions({"s0": version}, timeout_s)["servers"][0]


# -- 5: a failed pause ----------------------------------------------------------------------------
def test_a_failing_pause_keeps_the_version_and_retries_with_growing_delays(daemons, registry):
    d = daemons(restart={"start_timeout_s": 10, "backoff_initial_s": 0.2, "backoff_factor": 2,
                         "backoff_max_s": 0.8, "max_retries": 2})
    held = serving(d, registry.newest)["version"]
    fake(d, "/fake/faults", {"faults": "fail=/pause"})
    new = registry.publish()
    wait_until(lambda: d.log_text().count(f"retry s0: update to version {new} again") >= 4, 30, "four retries")
    st = s0(d)
    assert st["state"] in ("SERVING", "UPDATING") and st["version"] == held, st  # untouched weights
    assert st["incarnation"] == 1 and "pause failed" in st["last_error"]
    assert metric(d, "server_version") == held
    assert held in d.status()["mirror"]["versions"], "the version a server holds was collected"
    delays = [float(x) for x in re.findall(rf"retry s0: update to version {new} again in ([\d.]+) s", d.log_text())]
    assert delays[:4] == [0.2, 0.4, 0.8, 0.8], delays  # growing, then capped at backoff_max_s
    assert failures(d)["pause"] >= 4
    fake(d, "/fake/faults", {"faults": ""})
    assert serving(d, new)["incarnation"] == 1  # loaded once the pause works again, no restart


# -- a server the plugin will not load into -------------------------------------------------------
def test_a_server_the_plugin_will_not_load_into_refuses_each_version_and_serves_on_unrestarted(daemons, registry):
    """vLLM's CPU build with mixture-of-experts layers: the plugin refuses at the start of the load,
    before touching a layer. Each new version is refused on the node at once (no re-apply, no
    restart, never FATAL), and the server goes on serving what it holds; the refusals reach the
    heartbeat, so a trainer waiting for the version hears why."""
    d = daemons()
    held = serving(d, registry.newest)["version"]
    fake(d, "/fake/faults", {"faults": "reload_unsupported"})
    first, second = registry.publish(), registry.publish()  # B then C: the second one is refused too
    # refused, and back to SERVING (the refusal is recorded a moment before the server leaves UPDATING)
    st = d.wait(lambda s: [r["version"] for r in s["refused"]] in ([second], [first, second])
                and s["servers"][0]["state"] == "SERVING", 30, "refused, and serving")
    server = st["servers"][0]
    assert (server["state"], server["version"], server["incarnation"], server["restarts"]) == ("SERVING", held, 1, 0)
    assert "cannot load versions in place" in server["last_error"] and "reload unsupported" in server["last_error"]
    assert d.log_text().count("POST /start_weight_update -> 500") == len(st["refused"]), "a refusal was re-applied"
    assert d.log_text().count("POST /resume -> 200") >= len(st["refused"]), "left paused"
    assert failures(d)["start"] == len(st["refused"])
    with d.vllm("s0", timeout=5) as c:
        assert c.get("/is_paused").json() == {"is_paused": False}
    refused = [r["version"] for r in st["refused"]]
    wait_until(lambda: [r["version"] for r in replica(registry, d)["refused"] or []] == refused, 15,
               "the refusals in the registry's directory")  # the heartbeat carries them to trainers
    fake(d, "/fake/faults", {"faults": ""})
    newest = registry.publish()  # a version the server can take again (a new process, say): taken, no restart
    assert serving(d, newest)["incarnation"] == 1


def test_a_version_the_plugin_refuses_is_refused_by_the_node_once_and_no_server_restarts(daemons, registry):
    """A version that lacks a tensor of the served model: the plugin refuses it before touching
    the model. Each server that tries it (both at once, or one while the other waits for a
    rollout slot and then skips it) tries it once and resumes on the weights it holds; the node
    refuses the version; no server restarts; both take the next version. Before, such a version
    was applied again and then restarted every server that tried it: a fleet-wide outage for one
    bad publish."""
    d = daemons(servers=2)
    held = registry.newest
    d.wait(lambda s: all((x["state"], x["version"]) == ("SERVING", held) for x in s["servers"]), 30, "both serving")
    for name in ("s0", "s1"):
        with d.vllm(name, timeout=5) as c:
            c.post("/fake/faults", json={"faults": "version_refused"}).raise_for_status()
    bad = registry.publish()
    st = d.wait(lambda s: [r["version"] for r in s["refused"]] == [bad]
                and all(x["state"] == "SERVING" for x in s["servers"]), 30, "refused, and serving")
    for server in st["servers"]:
        assert (server["version"], server["incarnation"], server["restarts"]) == (held, 1, 0), server
    log = d.log_text()
    tries = {name: len(re.findall(rf"{name}\[\d+\]: fake_vllm: POST /update_weights -> 500", log))
             for name in ("s0", "s1")}
    assert max(tries.values()) == 1, f"re-applied: {tries}"
    assert failures(d)["load"] == sum(tries.values())
    tried = [x for x in st["servers"] if x["last_error"]]
    assert len(tried) == sum(tries.values()) and f"the plugin refused version {bad}" in tried[0]["last_error"] and \
        "lacks 1 tensor" in tried[0]["last_error"], st["servers"]
    for name in ("s0", "s1"):
        with d.vllm(name, timeout=5) as c:
            assert c.get("/is_paused").json() == {"is_paused": False}
            c.post("/fake/faults", json={"faults": ""}).raise_for_status()
    wait_until(lambda: [r["version"] for r in replica(registry, d)["refused"] or []] == [bad], 15,
               "the refusal in the registry's directory")
    good = registry.publish()
    st = d.wait(lambda s: all((x["state"], x["version"]) == ("SERVING", good) for x in s["servers"]), 30,
                "both on the next version")
    assert [x["incarnation"] for x in st["servers"]] == [1, 1]


def test_a_server_healthy_only_after_a_refusal_serves_the_nodes_last_good_version(daemons, registry):
    """A server that had served nothing yet (here: slow to start) becomes healthy after the node
    refused its newest version: it loads the version the node last served, not its start model,
    and the node serves one policy."""
    d = daemons(("", "never_healthy"), servers=2, restart={"start_timeout_s": 60})
    held = registry.newest
    d.wait(lambda s: (s["servers"][0]["state"], s["servers"][0]["version"], s["servers"][1]["state"])
           == ("SERVING", held, "STARTING"), 30, "s0 serving, s1 still starting")
    fake(d, "/fake/faults", {"faults": "version_refused"})
    bad = registry.publish()
    d.wait(lambda s: [r["version"] for r in s["refused"]] == [bad] and s["servers"][0]["state"] == "SERVING", 30,
           "refused on s0")
    with d.vllm("s1", timeout=5) as c:
        c.post("/fake/health", json={"ok": True}).raise_for_status()
    st = d.wait(lambda s: s["servers"][1]["state"] == "SERVING", 30, "s1 serving")
    assert (st["servers"][1]["version"], st["servers"][1]["incarnation"]) == (held, 1), st["servers"][1]
    assert st["last_good"] == held and str(held) in os.listdir(d.cfg["mirror"]["dir"])
    for name in ("s0", "s1"):  # what each fake holds, by its own account
        with d.vllm(name, timeout=5) as c:
            assert c.get("/weight_info").json() == {"weight_version": str(held)}, name
    assert f"back s1: to version {held}, the node's last good version (version {bad} is refused" in d.log_text()
    assert not re.search(r"s1\[\d+\]: fake_vllm: POST /update_weights .*", d.log_text().split("back s1")[0])


# -- 9: nothing left unwatched during an update ---------------------------------------------------
def wait_updating(d: DaemonProcess, route: str) -> dict:
    st = d.wait(lambda s: s["servers"][0]["state"] == "UPDATING", 20, "UPDATING")
    wait_until(lambda: f"{route} -> never answered" in d.log_text(), 10, f"the fake holding {route}")
    return st["servers"][0]


@pytest.mark.parametrize("how", ["engine_dies", "unhealthy"])
def test_a_server_that_dies_mid_update_is_in_backoff_within_seconds(daemons, registry, how):
    """As vLLM when its engine core is killed mid-load: the API process lives on with its listener
    closed and never answers the request in flight (or, alive, it fails /health)."""
    d = daemons("spawn_child", update={"load_timeout_s": 300})
    serving(d, registry.newest)
    fake(d, "/fake/faults", {"faults": "hang=/update_weights"})
    new = registry.publish()
    pid = wait_updating(d, "/update_weights")["pid"]
    t0 = time.monotonic()
    if how == "engine_dies":
        fake(d, "/fake/engine_dies", {})
    else:
        fake(d, "/fake/health", {"ok": False})  # as vLLM's API server with a dead engine: /health fails
    d.wait(lambda s: s["servers"][0]["state"] == "BACKOFF", 10, "BACKOFF")
    to_backoff = time.monotonic() - t0
    assert to_backoff < 4.0, to_backoff  # health 0.5 s x 3 probes; not update.load_timeout_s
    st = serving(d, new, 30)  # the new process has no faults: it syncs to the new version
    assert st["incarnation"] == 2 and not alive(pid)
    assert f"/health failed 3 times in a row while loading version {new}" in d.log_text()
    print(f"{how}: BACKOFF after {to_backoff:.2f} s, SERVING after {time.monotonic() - t0:.2f} s")


def test_a_server_that_dies_while_waiting_for_its_first_sync_is_restarted(daemons, registry, tmp_path):
    """SYNCING is watched too: here the registry is unreachable, so the first sync waits."""
    d = daemons(registry={"url": "http://127.0.0.1:9", "retry_initial_s": 0.2, "retry_max_s": 0.5})
    st = d.wait(lambda s: s["servers"][0]["state"] == "SYNCING", 20, "SYNCING")["servers"][0]
    os.kill(st["pid"], signal.SIGKILL)
    d.wait(lambda s: s["servers"][0]["incarnation"] == 2, 10, "a restart")
    assert "exited: killed by SIGKILL" in d.log_text()
    assert failures(d)["sync"] >= 1


# -- 6: one stop per child -------------------------------------------------------------------------
def test_a_restart_during_a_stop_waits_for_that_stop_and_keeps_the_new_record(daemons, registry):
    d = daemons("ignore_term", restart={"start_timeout_s": 10, "backoff_initial_s": 0.2, "failed_grace_s": 4})
    old = serving(d, registry.newest)["pid"]
    fake(d, "/fake/health", {"ok": False})
    wait_until(lambda: f"stop s0[{old}]: SIGTERM to process group" in d.log_text(), 10, "the stop's SIGTERM")
    r = d.action("/servers/s0/restart")  # mid-grace: the stop is hurried to SIGKILL, and waited for
    assert r.status_code == 200, r.text
    assert not alive(old), "the restart returned while the old process group was still alive"
    new = serving(d, registry.newest)["pid"]
    time.sleep(4.5)  # past the first stop's grace period: nothing of it may act any more
    record = json.loads((Path(d.cfg["state_dir"]) / "children" / "s0.json").read_text())
    assert record["pid"] == new, "the record of the new child was removed by the old one's stop"
    assert s0(d)["pid"] == new and s0(d)["state"] == "SERVING"
    assert d.log_text().count(f"stop s0[{old}]: SIGTERM to process group") == 1, "a second stop ran"
    assert f"stop s0[{old}]: cancelled during the grace period" in d.log_text()


# -- 10: every step's failure counted ---------------------------------------------------------------
@pytest.mark.parametrize("route, kind", [("/pause", "pause"), ("/weight_info", "check"), ("/resume", "resume")])
def test_failures_of_each_step_are_counted(daemons, registry, route, kind):
    d = daemons(f"fail={route}", restart={"start_timeout_s": 10, "backoff_initial_s": 0.1, "backoff_max_s": 0.1,
                                          "max_retries": 1})
    d.wait(lambda s: s["servers"][0]["state"] == "FATAL", 60, "FATAL")
    got = failures(d)
    assert got[kind] >= 2, got  # each of the two processes failed its first sync on this step
    assert got["sync"] == 2, got
