"""The daemon end to end: ``rolloutd run`` with two real ``vllm serve`` children (CPU build), a
real registry over HTTP (behind a proxy that can slow byte transfers), and the admin API.

One daemon runs for the whole module and the tests walk it through a node's life in order:
first sync, versions 1 -> 2 -> 3, a slow pull, the lag policy with a demand, a version retired
while an update waits, a damaged mirror copy, crashes, the registry going away and coming back
as a new instance, a reload adding and removing servers, and the stop. Each test asserts on
the state the previous ones left, so they run in file order (as pytest runs them).

The reference for "the right weights" is transformers' greedy decoding of each version's
weights, computed here (``tiny_reference``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.puller import Puller, PullSettings
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.trainer import EmbeddedRegistry
from tests.conftest import free_port
from tests.support.daemon_harness import DaemonProcess, config, tagged_pids, vllm_server, wait_until
from tests.support.processes import group_pids
from tests.support.registry_proxy import RegistryProxy
from tests.support.vllm_server import engine_core, tiny_reference, tiny_tokens

pytestmark = [pytest.mark.timeout(600)]

TOKEN = "admin-secret-7f3a"
SEED = {v: 20 + v for v in range(1, 10)}  # version -> weights seed; the servers start on seed 0
SHARD, CHUNK = 600_000, 1 << 16


class Node:
    """Everything the module shares: registry (+ proxy), daemon, models, the seed of each version."""

    def __init__(self, d: Path):
        self.dir = d
        self.start_model = tinymodel.build(d / "start", seed=0)
        self.registry_port = free_port()
        self.registry = EmbeddedRegistry(port=self.registry_port).start()
        self.proxy = RegistryProxy(self.registry_port).start()
        (d / "admin.token").write_text(TOKEN + "\n")
        servers = [vllm_server("gpu0", self.start_model, "0"), vllm_server("gpu1", self.start_model, "1")]
        self.cfg = config(d, self.proxy.url, servers, admin={"token_file": str(d / "admin.token")})
        self.daemon = DaemonProcess(self.cfg, d)
        self.seeds: dict[tuple[str, int], int] = {}  # (registry instance, version) -> weights seed
        self.refs: dict[int, list] = {}  # seed -> transformers' outputs

    def publish(self, version: int, seed: int | None = None) -> None:
        seed = seed or SEED[version]
        self.registry.publish(version, tinymodel.state_dict(tinymodel.TINY, seed), shard_bytes=SHARD,
                              chunk_bytes=CHUNK)
        self.seeds[(self.registry.service.store.instance, version)] = seed

    def reference(self, version: int) -> list[list[int]]:
        """transformers' greedy outputs on ``version`` of the registry running now."""
        seed = self.seeds[(self.registry.service.store.instance, version)]
        if seed not in self.refs:
            self.refs[seed] = tiny_reference(seed)
        return self.refs[seed]

    def outputs(self, name: str) -> list[list[int]]:
        return tiny_tokens(self.daemon.socket(name))  # straight to the server, on its private socket

    def replicas(self) -> dict[str, dict]:
        return {r["server"]: r for r in self.registry.replicas()}

    def close(self) -> None:
        self.daemon.kill_everything()
        self.proxy.stop()
        self.registry.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("node"))
    try:
        n.publish(1)
        n.daemon.start()
        yield n
    finally:
        n.close()


def pull_count(status_metrics: str, result: str) -> float:
    m = re.search(rf'^rolloutd_pulls_total{{result="{result}"}} (\S+)$', status_metrics, re.M)
    return float(m.group(1)) if m else 0.0


def metrics(node: Node) -> str:
    return httpx.get(node.daemon.url + "/metrics", timeout=10).text


def failures(node: Node) -> dict[str, float]:
    found = re.findall(r'^rolloutd_update_failures_total{kind="(\w+)"} (\S+)$', metrics(node), re.M)
    return {kind: float(n) for kind, n in found if float(n) > 0}


def reload(node: Node, cfg: dict) -> None:
    """Write ``cfg``, SIGHUP the daemon, wait until it logged the reload."""
    done = node.daemon.log_text().count("reload: servers")
    node.daemon.write(cfg)
    node.daemon.signal(signal.SIGHUP)
    wait_until(lambda: node.daemon.log_text().count("reload: servers") > done, 20, "the reload logged")


def with_update(node: Node, **update) -> dict:
    cfg = json.loads(json.dumps(node.daemon.cfg))
    cfg["update"] = {**cfg.get("update", {}), **update}
    return cfg


def registry_served_bytes(node: Node) -> float:
    text = httpx.get(node.registry.url + "/metrics", timeout=10).text
    return float(re.search(r"^rolloutd_registry_served_bytes_total (\S+)$", text, re.M).group(1))


# -- the node's life, in order -------------------------------------------------------------------
def test_first_sync_happens_before_serving(node):
    """Both servers start on the start model and are SERVING only once they hold version 1."""
    seen = []
    st = node.daemon.wait(lambda s: seen.append([(x["state"], x["version"]) for x in s["servers"]]) or all(
        x["state"] == "SERVING" for x in s["servers"]), 300, "both servers SERVING")
    assert all(x["version"] == 1 for x in st["servers"]), st
    assert all(v == 1 for states in seen for state, v in states if state == "SERVING"), seen
    log = node.daemon.log_text()
    for name in ("gpu0", "gpu1"):
        arrows = re.findall(rf"state {name}: (\w+ -> \w+.*)", log)
        assert arrows[:3] == ["STOPPED -> STARTING (incarnation 1)", "STARTING -> SYNCING",
                              "SYNCING -> SERVING (version 1)"], arrows
        assert re.search(rf"update {name}\[\d+\]: version 1 loaded", log)
        assert node.outputs(name) == node.reference(1)
    assert st["ready"] is True and st["registry"]["reachable"] is True


def test_servers_follow_versions_pulled_once_per_node(node):
    served_before = registry_served_bytes(node)
    outputs = {}
    for v in (2, 3):
        node.publish(v)
        st = node.daemon.wait_versions({"gpu0": v, "gpu1": v})
        outputs[v] = {name: node.outputs(name) for name in ("gpu0", "gpu1")}
    sizes = sum(m.total_bytes for m in (node.registry.manifest(v) for v in (2, 3)))
    assert registry_served_bytes(node) - served_before == sizes  # every byte once, for two servers
    for v in (2, 3):
        assert outputs[v] == {"gpu0": node.reference(v), "gpu1": node.reference(v)}, f"version {v}"
    assert pull_count(metrics(node), "ok") == 3  # versions 1, 2, 3
    # /status and the registry's directory agree
    wait_until(lambda: all(node.replicas().get(n, {}).get("version") == 3 for n in ("gpu0", "gpu1")), 10,
               "the registry seeing version 3")
    reps = node.replicas()
    for s in st["servers"]:
        r = reps[s["name"]]
        assert (r["state"], r["version"], r["incarnation"], r["node"]) == ("SERVING", 3, s["incarnation"], "node-a")
        assert r["endpoint"] == f"http://node-a.test:{s['public_port']}" == s["endpoint"]  # the gateway's
        assert set(s["last_update"]["phases_s"]) >= {"pause", "start", "load", "finish", "check", "resume", "paused"}
    assert st["target"]["version"] == 3 and st["mirror"]["versions"][-1] == 3
    # vLLM's access log reaches the journal through the daemon: the weight routes' lines, never a
    # line per generation request or health probe (vllm.log_every_request is false by default)
    log = node.daemon.log_text()
    assert re.search(r'gpu0\[\d+\]: INFO: .*"POST /start_weight_update HTTP/1\.1" 200', log)
    assert re.search(r'gpu1\[\d+\]: INFO: .*"POST /finish_weight_update HTTP/1\.1" 200', log)
    assert not re.search(r'"(GET|POST) /(health|v1/completions|v1/chat/completions|inference/v1/generate)[ ?]', log)


def test_heartbeats_keep_arriving_during_a_slow_pull(node):
    node.proxy.byte_delay_s = 1.4  # about 12 s for the pull: long enough for a progress line
    try:
        node.publish(4)
        node.daemon.wait(lambda s: (s["pull"] or {}).get("version") == 4 and s["pull"]["state"] == "pulling", 30,
                         "pulling version 4")
        ages = []
        t0 = time.monotonic()
        while node.daemon.status()["pull"]["state"] == "pulling":
            ages.append(max(r["age_s"] for r in node.replicas().values() if r["server"] in ("gpu0", "gpu1")))
            time.sleep(0.25)
        pulled_s = time.monotonic() - t0
    finally:
        node.proxy.byte_delay_s = 0.0
    assert pulled_s > 10, f"the pull was not slow ({pulled_s:.1f} s): the test proves nothing"
    assert max(ages) < 2.0, f"heartbeat ages during the pull: {ages}"  # interval 0.5 s
    assert re.search(r"pull version 4: \d+% \([\d.]+ of 1\.8 MiB\), [\d.]+ MiB/s, ETA", node.daemon.log_text())
    node.daemon.wait_versions({"gpu0": 4, "gpu1": 4})


def test_a_reload_changes_the_policy_without_restarting_servers(node):
    before = {s["name"]: (s["pid"], s["incarnation"]) for s in node.daemon.status()["servers"]}
    reload(node, with_update(node, min_version_lag=3, max_update_delay_s=600))
    assert "reload: servers added none, removed none, restarted none" in node.daemon.log_text()
    after = {s["name"]: (s["pid"], s["incarnation"]) for s in node.daemon.status()["servers"]}
    assert after == before


def test_a_demand_below_the_lag_threshold_is_honoured(node):
    node.publish(5)
    time.sleep(3)  # lag 1 < 3: the node waits
    st = node.daemon.status()
    assert [s["version"] for s in st["servers"]] == [4, 4] and st["target"]["version"] == 4
    node.registry.demand(5)
    node.daemon.wait_versions({"gpu0": 5, "gpu1": 5}, 30)
    assert "demand: the trainer asks for version 5 or newer" in node.daemon.log_text()
    node.registry.demand(None)


def test_a_version_retired_while_the_update_waits_is_skipped(node):
    reload(node, with_update(node, max_update_delay_s=5))
    node.publish(6)
    node.publish(7)
    node.registry.retire(7)  # before the 5 s delay is over
    st = node.daemon.wait_versions({"gpu0": 6, "gpu1": 6}, 60)
    assert st["target"]["version"] == 6
    assert not any(s["last_error"] for s in st["servers"]), st
    assert failures(node) == {}


def damage_header(path: Path, old: bytes, new: bytes) -> None:
    """Change one tensor's dtype in the header of the first file of a mirrored version (same size)."""
    f = sorted(path.glob("*.safetensors"))[0]
    data = f.read_bytes()
    assert old in data[:4096]
    f.write_bytes(data.replace(old, new, 1))


def test_a_damaged_copy_in_the_mirror_is_never_reused(node):
    """Version 8 is planted in the daemon's mirror, complete by its manifest and its sizes, but
    with one tensor's dtype changed from F32 to I32 in a header (same width: the plugin's header
    checks cannot tell). Asked to update, the daemon reads the copy back, finds it damaged,
    pulls it again and loads the right weights."""
    reload(node, with_update(node, max_update_delay_s=600))
    node.publish(8)
    mirror = Mirror(Path(node.cfg["mirror"]["dir"]), max_bytes=1 << 30)

    async def plant():
        async with RegistryClient(node.registry.url) as c:
            return await Puller(c, mirror, PullSettings(holder="planter")).pull(8)
    damage_header(asyncio.run(plant()).path, b'"F32"', b'"I32"')

    assert node.daemon.action("/update").status_code == 401  # actions need the token
    r = node.daemon.action("/update", TOKEN)
    assert r.status_code == 200, r.text
    st = node.daemon.wait_versions({"gpu0": 8, "gpu1": 8}, 60)
    for name in ("gpu0", "gpu1"):
        assert node.outputs(name) == node.reference(8)
    log = node.daemon.log_text()
    assert "verify version 8: the mirror copy is damaged (model-00001-of-00004.safetensors: chunks [0] differ)" in log
    assert [s["incarnation"] for s in st["servers"]] == [1, 1]
    assert TOKEN not in log and TOKEN not in json.dumps(st)


def server_lines(log: str, name: str, pid: int) -> list[tuple[str, str]]:
    """(level, line) of each line process ``pid`` of server ``name`` printed, as the daemon logged it."""
    return re.findall(rf"^\S+ \S+ (\w+) rolloutd\.server\.{name}: {name}\[{pid}\]: (.*)$", log, re.M)


def test_killed_servers_come_back_through_backoff_on_the_newest_version(node):
    """Both servers are killed (one whole group, one engine core alone), and the mirror copy of
    the version they held is damaged meanwhile (a dtype of another width: the plugin refuses it
    after start_weight_update). Each comes back through BACKOFF; its first sync fails to load,
    is not resumed, the copy is checked and pulled again, the load re-applied; only then SERVING.
    (The servers come back at different times: the first to sync hits the damaged copy.)"""
    st = node.daemon.status()
    pids = {s["name"]: s["pid"] for s in st["servers"]}
    damage_header(Path(node.cfg["mirror"]["dir"]) / "8", b'"F32"', b'"F16"')
    os.killpg(pids["gpu1"], signal.SIGKILL)                     # the whole group of gpu1
    os.kill(engine_core(pids["gpu0"]), signal.SIGKILL)         # gpu0's engine core alone
    seen: set[tuple[str, str]] = set()

    def back(s: dict) -> bool:
        seen.update((x["name"], x["state"]) for x in s["servers"])
        return all(x["state"] == "SERVING" and x["incarnation"] == 2 for x in s["servers"])
    st = node.daemon.wait(back, 300, "both servers restarted")
    assert {("gpu0", "BACKOFF"), ("gpu1", "BACKOFF")} <= seen, seen
    assert all(s["version"] == 8 and s["restarts"] == 1 and s["pid"] != pids[s["name"]] for s in st["servers"])
    for name in ("gpu0", "gpu1"):
        assert node.outputs(name) == node.reference(8)
        assert not group_pids(pids[name]), f"{name}'s old process group is still alive"
    wait_until(lambda: all(r["incarnation"] == 2 for r in node.replicas().values()), 10, "registry incarnation 2")
    log = node.daemon.log_text()
    # the first server to sync hits the damaged copy (the other may find it pulled again already)
    # (vLLM wraps a worker's error in more words when the worker is a process of its own)
    failures = dict(re.findall(r"apply (gpu\d): version 8 failed: /update_weights: HTTP 500: .*?<path>: (.*?)"
                               r"(?:', please check the stack trace above for the root cause)? \(attempt", log))
    # the plugin's words, through vLLM: the damaged header; and a server that tried to load while
    # the copy was being pulled again finds no directory (then re-applies the fresh one)
    assert "needs 131072 bytes, its offsets span 262144" in " ".join(failures.values()), failures
    assert all("its offsets span" in why or why == "no such mirror directory" for why in failures.values()), failures
    for name in failures:
        failed = log.rindex(f"apply {name}: version 8 failed")
        assert log.index(f"update {name}[", failed) > failed  # loaded after the failure, in the same sync
        assert f"state {name}: SYNCING -> SERVING (version 8)" in log[failed:]
    assert "verify version 8: the mirror copy is damaged" in log
    # an engine core that died without rolloutd asking is a failure, logged as vLLM logs it, also
    # when rolloutd saw the death first and stopped the rest before vLLM said it (then vLLM does not
    # print its warning "engine core exited unexpectedly"; its EngineDeadError record it does)
    died = {level for level, line in server_lines(log, "gpu0", pids["gpu0"])
            if "EngineDeadError" in line or "engine core exited unexpectedly" in line}
    assert "ERROR" in died and died <= {"ERROR", "WARNING"}, died


def test_registry_away_for_12_s_then_back_as_a_new_instance(node):
    """Away for more than two long polls (5 s) and several retries at their cap (2 s)."""
    old_instance = node.daemon.status()["registry"]["instance"]
    node.registry.stop()
    time.sleep(3)
    st = node.daemon.status()
    assert st["registry"]["reachable"] is False
    t_end = time.monotonic() + 9
    while time.monotonic() < t_end:  # the servers keep generating
        assert node.outputs("gpu0") == node.reference(8)
        time.sleep(3)
    assert node.daemon.proc.poll() is None
    assert all(s["state"] == "SERVING" and s["version"] == 8 for s in node.daemon.status()["servers"])
    # back on the same port, as a new instance with different numbers and weights
    node.registry = EmbeddedRegistry(port=node.registry_port).start()
    node.publish(1, seed=31)
    st = node.daemon.wait(lambda s: s["registry"]["reachable"] and s["registry"]["instance"] != old_instance
                          and all(x["version"] == 1 and x["state"] == "SERVING" for x in s["servers"]), 60,
                          "resynced to the new registry's version 1")
    for name in ("gpu0", "gpu1"):
        assert node.outputs(name) == node.reference(1)
    wait_until(lambda: set(node.replicas()) == {"gpu0", "gpu1"}, 10, "heartbeats at the new registry")
    assert "resync: the registry restarted" in node.daemon.log_text()


def test_sighup_adds_and_removes_servers_without_touching_the_other(node):
    before = node.daemon.server("gpu0")
    old_gpu1 = node.daemon.server("gpu1")["pid"]
    cfg = json.loads(json.dumps(node.daemon.cfg))
    cfg["servers"] = [cfg["servers"][0], vllm_server("gpu2", node.start_model, "1")]
    reload(node, cfg)
    st = node.daemon.wait(lambda s: [x["name"] for x in s["servers"]] == ["gpu0", "gpu2"]
                          and s["servers"][1]["state"] == "SERVING", 300, "gpu2 serving, gpu1 gone")
    gpu0, gpu2 = st["servers"]
    assert (gpu0["pid"], gpu0["incarnation"], gpu0["state"]) == (before["pid"], before["incarnation"], "SERVING")
    assert gpu2["version"] == 1 and node.outputs("gpu2") == node.reference(1)
    assert not group_pids(old_gpu1)
    wait_until(lambda: "gpu1" not in node.replicas(), 10, "gpu1 deregistered")
    log = node.daemon.log_text()  # a stop the reload asked for: vLLM's shutdown noise is not a warning
    stopped = log[log.index(f"stop gpu1[{old_gpu1}]: SIGTERM"):]
    assert [(lv, ln) for lv, ln in server_lines(stopped, "gpu1", old_gpu1) if lv != "INFO"] == []


def test_sigterm_stops_everything(node):
    assert tagged_pids(node.daemon.tag)  # the servers are there before
    t0 = time.monotonic()
    assert node.daemon.stop(90) == 0
    stopped_s = time.monotonic() - t0
    assert tagged_pids(node.daemon.tag) == [], "processes of the daemon outlived its stop"
    assert node.replicas() == {}, "replicas not deregistered"
    log = node.daemon.log_text()
    assert "stop rolloutd: every server stopped" in log
    # A stop rolloutd asked for: what vLLM prints as it stops (its "[shutdown] ... force killing"
    # warnings, the shared memory Python says was leaked, an EngineDeadError) is no warning or
    # error to an operator. It was printed, and logged at INFO.
    stop = log[log.rindex("stop: deregister"):]
    assert re.findall(r"^\S+ \S+ (?:WARNING|ERROR|CRITICAL) rolloutd\.server\.\w+: .*$", stop, re.M) == []
    assert re.search(r"^\S+ \S+ INFO rolloutd\.server\.\w+: \w+\[\d+\]: \(APIServer pid=\d+\) WARNING .*\[shutdown\]",
                     stop, re.M), stop
    # vLLM's RotaryEmbedding warning at every update, every worker: expected, said once
    assert not re.search(r"^\S+ \S+ WARNING .*RotaryEmbedding: Failed to load weights", log, re.M)
    assert log.count("'RotaryEmbedding: Failed to load weights' at each update is expected") == 1
    assert stopped_s < 30, stopped_s
