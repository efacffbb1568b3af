"""The daemon outlives what used to end it: a reload that restarts slow-to-stop servers (the
watchdog and /healthz keep ticking, the stops overlap), a registry that answers garbage (counted,
served through, recovered from), a bug in a long-lived task (logged, counted, retried); and on
shutdown every replica is deregistered before its server is signalled. Children are the fake vLLM
(tests/support/fake_vllm.py); the registry is real, behind a threaded proxy that can lie or record.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket as sk
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web

from rolloutd.config import ConfigError, parse_config
from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.conftest import free_port
from tests.support.daemon_harness import DaemonProcess, alive
from tests.support.registry_proxy import RegistryProxy

pytestmark = [pytest.mark.slow, pytest.mark.parallel, pytest.mark.timeout(120)]  # fake vLLM: beside other such tests


@pytest.fixture(scope="module")
def registry():
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
        yield reg


class LyingProxy(RegistryProxy):
    """Forwards to the registry; while ``lying``, answers heartbeats and ``/v1/versions/latest``
    with 200 and a body the client cannot use. Records every DELETE of a replica with ``on_delete``."""

    GARBAGE = (  # (content type, body)
        ("application/json", b"[1, 2, 3]"),
        ("application/json", b'{"instance": 7, "latest": "new", "demand": []}'),
        ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
        ("application/json", b"null"),
        ("application/json", b'"ok"'),
    )

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port)
        self.lying = False
        self.lies: dict[str, int] = {"heartbeat": 0, "latest": 0}
        self.on_delete = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind = ("heartbeat" if request.method == "PUT" and request.path.startswith("/v1/replicas/") else
                "latest" if request.path == "/v1/versions/latest" else None)
        if self.lying and kind is not None:
            await request.read()
            n = self.lies[kind] = self.lies[kind] + 1
            content_type, body = self.GARBAGE[n % len(self.GARBAGE)]
            return web.Response(status=200, body=body, headers={"content-type": content_type})
        if request.method == "DELETE" and request.path.startswith("/v1/replicas/") and self.on_delete:
            self.on_delete(request.path.rsplit("/", 1)[1])
        return await super()._handle(request)


@pytest.fixture
def proxy(registry):
    p = LyingProxy(urlsplit(registry.url).port).start()
    yield p
    p.stop()


class NotifyListener:
    """systemd's side of the notify socket: every datagram with its arrival time."""

    def __init__(self, path: str):
        self.sock = sk.socket(sk.AF_UNIX, sk.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.got: list[tuple[float, str]] = []
        self._on = True
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while self._on:
            try:
                self.got.append((time.monotonic(), self.sock.recv(4096).decode()))
            except TimeoutError:
                continue

    def pings(self, since: float, until: float) -> list[float]:
        return [t for t, m in self.got if m == "WATCHDOG=1" and since <= t <= until]

    def close(self) -> None:
        self._on = False
        self._thread.join(5)
        self.sock.close()


def metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    text = httpx.get(daemon.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^rolloutd_{name}{{{re.escape(want)}}} (\S+)$" if want else
                      rf"^rolloutd_{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


# -- 1. a reload never starves the watchdog; changed servers stop together ---------------------------
def test_a_reload_of_slow_to_stop_servers_keeps_the_watchdog_and_healthz_alive(daemons, tmp_path):
    grace = 3.0
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    try:
        d = daemons("ignore_term", servers=3, shutdown={"server_grace_s": grace, "kill_wait_s": 5},
                    env={"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": "1000000"})
        d.wait_versions({"s0": 1, "s1": 1, "s2": 1}, 30)
        cfg = {**d.cfg, "servers": [{**s, "env": {**s["env"], "CHANGED": "1"}} for s in d.cfg["servers"]]}
        d.write(cfg)
        health: list[tuple[float, int]] = []
        t0 = time.monotonic()
        d.signal(signal.SIGHUP)
        while "reload: servers" not in d.log_text() and time.monotonic() - t0 < 30:
            try:
                health.append((time.monotonic(), httpx.get(d.url + "/healthz", timeout=2).status_code))
            except httpx.HTTPError as e:
                health.append((time.monotonic(), repr(e)))
            time.sleep(0.2)
        t1 = time.monotonic()
        log = d.log_text()
        assert "reload: servers added none, removed none, restarted ['s0', 's1', 's2']" in log, d.tail()
        # the stops overlap: every server was STOPPING before the first one was STOPPED
        arrows = re.findall(r"state (s\d): (SERVING -> STOPPING|STOPPING -> STOPPED)", log)
        first_stopped = next(i for i, (_, a) in enumerate(arrows) if a.endswith("STOPPED"))
        assert {n for n, a in arrows[:first_stopped]} == {"s0", "s1", "s2"}, arrows
        assert t1 - t0 < 2 * grace, f"the reload took {t1 - t0:.1f} s: stops one after another?"
        pings = [t0, *listener.pings(t0, t1), t1]
        assert max(b - a for a, b in zip(pings, pings[1:], strict=False)) < 0.9, pings
        assert health and all(code == 200 for _, code in health), health
        d.wait_versions({"s0": 1, "s1": 1, "s2": 1}, 30)
    finally:
        listener.close()


def test_a_refused_reload_stays_visible_until_one_succeeds_and_a_restart_keeps_counting(daemons, tmp_path):
    """A SIGHUP with a bad file keeps the running configuration, and monitoring sees it until a
    reload succeeds: ``STATUS=`` on every tick (not replaced by the routine line), ``/status``
    ``reload``, the metrics. A reload that restarts a server goes on counting its incarnations."""
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    try:
        d = daemons(servers=1, env={"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": "1000000"})
        before = d.wait_versions({"s0": 1}, 30)
        assert before["reload"] == {"last_attempt_unix": None, "ok": None, "error": None, "where": None,
                                    "needs_restart": []}
        good = d.path.read_text()
        line = next(i for i, text in enumerate(good.splitlines(), 1) if text.strip() == "failures: 3")
        where = f"{d.path}:{line}"
        d.path.write_text(good.replace("failures: 3", "failures: many"))
        t0 = time.time()
        d.signal(signal.SIGHUP)
        st = d.wait(lambda s: s["reload"]["ok"] is False, 30, "the refused reload in /status")
        assert st["reload"]["where"] == where and "health.failures" in st["reload"]["error"], st["reload"]
        assert st["reload"]["last_attempt_unix"] >= t0
        assert metric(d, "reload_failures_total") == 1 and metric(d, "reload_ok") == 0
        refused = f"STATUS=configuration error at {where}, running the previous one; s0 SERVING v1; registry ok"

        def statuses_after(t: float) -> list[str]:
            return [m for at, m in listener.got if at >= t and m.startswith("STATUS=")]
        deadline = time.monotonic() + 30
        while refused not in statuses_after(0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused in statuses_after(0), statuses_after(0)
        shown = next(at for at, m in listener.got if m == refused)
        deadline = time.monotonic() + 30
        while len(listener.pings(shown, time.monotonic())) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # five ticks of the main loop, each of which sets STATUS=
        assert len(listener.pings(shown, time.monotonic())) >= 5
        assert statuses_after(shown) == [refused], statuses_after(shown)
        assert d.status()["servers"][0]["pid"] == before["servers"][0]["pid"]

        d.path.write_text(good)  # a reload that succeeds clears it everywhere
        d.signal(signal.SIGHUP)
        st = d.wait(lambda s: s["reload"]["ok"] is True, 30, "the reload that succeeded in /status")
        assert st["reload"]["error"] is None and st["reload"]["where"] is None
        assert metric(d, "reload_failures_total") == 1 and metric(d, "reload_ok") == 1
        deadline = time.monotonic() + 30  # the listener's thread may not have taken the datagram yet
        while "STATUS=s0 SERVING v1; registry ok" not in statuses_after(shown) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert statuses_after(shown)[-1] == "STATUS=s0 SERVING v1; registry ok", statuses_after(shown)

        cfg = {**d.cfg, "servers": [{**s, "env": {**s["env"], "CHANGED": "1"}} for s in d.cfg["servers"]]}
        d.write(cfg)  # the server's entry changed: a reload restarts it, as a new process of the same server
        d.signal(signal.SIGHUP)
        old = before["servers"][0]
        after = d.wait(lambda s: s["servers"][0]["pid"] not in (None, old["pid"])
                       and s["servers"][0]["state"] == "SERVING", 30, "s0 restarted by the reload")
        assert after["servers"][0]["incarnation"] == old["incarnation"] + 1, (old, after["servers"][0])

        d.write({**d.cfg, "pull": {"streams": 2}})  # the file no longer says what runs: /status says so
        d.signal(signal.SIGHUP)
        d.wait(lambda s: s["reload"]["needs_restart"] == ["pull (all but timeout_s)"], 30, "needs_restart")
    finally:
        listener.close()


def test_a_mirror_larger_than_its_filesystem_is_said_once_at_start_and_at_each_reload(daemons):
    d = daemons(servers=1, mirror={"max_bytes": "1PiB"})
    d.wait_versions({"s0": 1}, 30)

    def said() -> list[str]:
        return re.findall(r"^\S+ \S+ WARNING rolloutd: check mirror: mirror\.max_bytes is 1024\.0 TiB but the "
                          r"filesystem holding (\S+) can give it \d.*; set mirror\.max_bytes to at most \d",
                          d.log_text(), re.M)
    assert said() == [d.cfg["mirror"]["dir"]], d.tail()
    d.signal(signal.SIGHUP)
    d.wait(lambda s: s["reload"]["ok"] is True, 10, "the reload")
    assert len(said()) == 2, d.tail()


# -- 2. an unusable registry reply is an error value, never the end of the daemon ---------------------
def test_garbage_from_the_registry_is_counted_and_served_through_until_it_answers_again(daemons, proxy):
    d = daemons(servers=2, registry_url=proxy.url)
    pids = {s["name"]: s["pid"] for s in d.wait_versions({"s0": 1, "s1": 1}, 30)["servers"]}
    proxy.lying = True
    deadline = time.monotonic() + 30
    while min(proxy.lies.values()) < 2 * len(LyingProxy.GARBAGE) and time.monotonic() < deadline:
        assert d.proc.poll() is None, f"rolloutd exited with {d.proc.returncode}\n{d.tail(30)}"
        d.action("/update")  # the updater asks for the newest version now, not after its long poll
        time.sleep(0.3)
    assert min(proxy.lies.values()) >= 2 * len(LyingProxy.GARBAGE), proxy.lies
    st = d.status()
    assert d.proc.poll() is None, d.tail()
    assert {s["name"]: (s["state"], s["pid"]) for s in st["servers"]} == {n: ("SERVING", p) for n, p in pids.items()}
    assert st["registry"]["reachable"] is False and "unexpected reply" in st["registry"]["last_error"], st
    assert metric(d, "heartbeat_failures_total", server="s0") >= len(LyingProxy.GARBAGE)
    proxy.lying = False
    d.wait(lambda s: s["registry"]["reachable"] and all(x["heartbeat_age_s"] is not None and
                                                        x["heartbeat_age_s"] < 1 for x in s["servers"]),
           20, "the registry reachable again, every heartbeat delivered")
    log = d.log_text()
    assert "heartbeat node-a.s0: delivered again" in log and "reach registry" in log.split("lose registry")[-1]
    assert d.stop(30) == 0


def test_a_bug_in_a_long_lived_task_is_logged_counted_and_retried():
    """The crash policy in-process: a task that raises is restarted after a growing delay, with its
    traceback in the log and ``rolloutd_task_errors_total{task}`` counted; cancelling still ends it."""
    from rolloutd.metrics import Metrics
    from rolloutd.node.daemon import keep

    async def scenario():
        metrics, calls = Metrics(), []

        async def flaky():
            calls.append(time.monotonic())
            if len(calls) < 3:
                raise ValueError(f"bug {len(calls)}")
            await asyncio.Event().wait()
        task = asyncio.ensure_future(keep("heartbeat", flaky, metrics, initial_s=0.05, max_s=1))
        await asyncio.sleep(0.5)
        assert not task.done() and len(calls) == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return metrics, calls
    metrics, calls = asyncio.run(scenario())
    assert metrics.task_errors.labels(task="heartbeat")._value.get() == 2
    assert calls[2] - calls[1] >= 0.1 > calls[1] - calls[0] >= 0.05  # the delay grows


def test_a_task_whose_cleanup_fails_as_the_daemon_stops_is_not_started_again():
    """A server's loop stops its server when cancelled; if that cleanup raises, the crash policy
    must not start the loop again (it would spawn a server while the daemon stops, and the stop
    would wait for it forever): the error is logged and counted, the cancellation goes on."""
    from rolloutd.metrics import Metrics
    from rolloutd.node.daemon import keep

    async def scenario():
        metrics, calls = Metrics(), []

        async def server_loop():
            calls.append(time.monotonic())
            if len(calls) > 1:
                return  # started again: end at once (done() says so), so that the test ends too
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise OSError(9, "Bad file descriptor") from None  # the stop's look at /proc failed
        task = asyncio.ensure_future(keep("server-s0", server_loop, metrics, initial_s=0.01, max_s=0.1,
                                          done=lambda: len(calls) > 1))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return metrics, calls
    metrics, calls = asyncio.run(scenario())
    assert len(calls) == 1
    assert metrics.task_errors.labels(task="server-s0")._value.get() == 1


@pytest.mark.parametrize(("node", "servers", "message"), [
    ("node a", ["s0"], "node.name"),
    ("-node", ["s0"], "node.name"),
    ("node/7", ["s0"], "node.name"),
    ("n" * 100, ["s" * 30], "node.name"),  # node.server over the registry's 128 characters
])
def test_a_node_name_the_registry_would_refuse_is_a_config_error(node, servers, message):
    servers_yaml = "".join(f"  - {{name: {s}, model: m, public_port: {9001 + i}}}\n" for i, s in enumerate(servers))
    text = f"registry: {{url: 'http://r:1'}}\nnode: {{name: {json.dumps(node)}}}\nservers:\n{servers_yaml}"
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        parse_config(text)
    assert "replica" in str(e.value)


def test_a_node_name_the_registry_takes_is_accepted():
    cfg = parse_config("registry: {url: 'http://r:1'}\nnode: {name: 'gpu-node_7.rack2:a@b'}\n"
                       f"servers:\n  - {{name: {'s' * 63}, model: m, public_port: 9001}}\n")
    assert cfg.node_name == "gpu-node_7.rack2:a@b"


# -- 3. shutdown: deregister first, then stop ------------------------------------------------------
def test_shutdown_deregisters_every_replica_before_its_server_is_signalled(daemons, proxy):
    d = daemons(servers=2, registry_url=proxy.url)
    pids = {s["name"]: s["pid"] for s in d.wait_versions({"s0": 1, "s1": 1}, 30)["servers"]}
    seen: dict[str, tuple[bool, bool]] = {}

    def on_delete(replica: str) -> None:  # what the server's process looks like as the DELETE arrives
        name = replica.removeprefix("node-a.")
        seen[name] = (alive(pids[name]), f"state {name}: SERVING -> STOPPING" in d.log_text())
    proxy.on_delete = on_delete
    assert d.stop(30) == 0
    assert seen == {"s0": (True, False), "s1": (True, False)}, seen
    for name, pid in pids.items():  # and the server was stopped after, as usual
        assert f"{name}[{pid}]: fake_vllm: stopping" in d.log_text()


# -- 4. a restart during a registry outage -----------------------------------------------------------
@pytest.mark.parametrize("serve_mirror", [False, True], ids=["wait", "serve_mirror"])
def test_a_restart_while_the_registry_is_down_serves_the_mirror_only_when_asked(daemons, tmp_path, serve_mirror):
    node = tmp_path / "node"
    first = daemons(directory=node)
    first.wait_versions({"s0": 1}, 30)  # version 1 is now complete in the node's mirror
    assert first.stop(30) == 0
    # The registry is down: the daemon's registry address is a proxy to a port nothing listens on.
    way_in = RegistryProxy(free_port()).start()
    try:
        d = daemons(directory=node, registry_url=way_in.url,
                    update={"serve_mirror_when_registry_down": serve_mirror})
        if serve_mirror:
            st = d.wait_versions({"s0": 1}, 30)
            assert st["registry"]["reachable"] is False and st["target"]["version"] == 1
            assert "serve version 1 from the mirror: the registry is unreachable at start" in d.log_text()
        else:
            d.wait(lambda s: s["servers"][0]["state"] == "SYNCING" and s["registry"]["last_error"], 30,
                   "SYNCING, the registry unreachable")
            for _ in range(10):  # retries every 0.2-2 s meanwhile; the server keeps waiting for the registry
                assert d.server("s0")["state"] == "SYNCING" and d.status()["target"] is None
                time.sleep(0.2)
        # The registry comes back with the same version 1: served, and never loaded twice. It is
        # reachable only once version 1 is in it: a registry that answers "no version yet" is rightly
        # a decision to serve the start model, and then loading version 1 is no second load.
        with EmbeddedRegistry(port=0) as back:
            back.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
            way_in.upstream = back.url
            d.wait(lambda s: metric(d, "pulls_total", result="reused") == 1, 30,
                   "the registry's version 1 found in the mirror (the updater's step done, its target published)")
            d.wait_versions({"s0": 1}, 30)  # (wait: the first sync is under way)
            for _ in range(10):  # a server that took it for new weights would be UPDATING within milliseconds
                st = d.status()
                assert (st["servers"][0]["state"], st["servers"][0]["version"]) == ("SERVING", 1)
                assert "-> UPDATING" not in d.log_text(), "the same weights were loaded again"
                time.sleep(0.1)
            assert d.stop(30) == 0
    finally:
        way_in.stop()
