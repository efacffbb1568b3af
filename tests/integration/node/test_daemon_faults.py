"""The daemon's fault paths, with the fake vLLM (tests/support/fake_vllm.py) as its children: servers
that never become healthy, exit at once, ignore SIGTERM, fail or hang a weight route, freeze;
a daemon killed without a chance to clean up; bad input at start. The real registry serves a
real version, and the fake checks the mirror directory it is given like the plugin does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.support.cgroup_harness import cgroup_of, delegated_cgroup, inside, label
from tests.support.daemon_harness import DaemonProcess, alive, config, failed_closes, tagged_pids, wait_until
from tests.support.registry_proxy import RegistryProxy

pytestmark = [pytest.mark.slow, pytest.mark.parallel, pytest.mark.timeout(120)]  # fake vLLM: beside other such tests


@pytest.fixture(scope="module")
def registry():
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
        yield reg


def server(daemon: DaemonProcess) -> dict:
    return daemon.status()["servers"][0]


def requests_seen(daemon: DaemonProcess, name: str = "s0") -> list[str]:
    """The routes the fake answered (health probes aside), in order, from its lines in the daemon's log."""
    routes = re.findall(rf"{name}\[\d+\]: .*?(?:GET|POST) (/[a-z_0-9/]+)", daemon.log_text())
    return [r for r in routes if r != "/health"]


# -- starting -------------------------------------------------------------------------------------
def test_a_server_that_never_becomes_healthy_ends_fatal_and_can_be_restarted(daemons):
    d = daemons("never_healthy", restart={"start_timeout_s": 1, "backoff_initial_s": 0.1,
                                                         "backoff_max_s": 0.2, "max_retries": 2})
    st = d.wait(lambda s: s["servers"][0]["state"] == "FATAL", 60, "FATAL")
    # the log, not /status polled every 0.2 s: BACKOFF lasts 0.1-0.2 s, and a poll missed it (seen)
    log = d.log_text()
    assert "state s0: STARTING -> BACKOFF" in log and "state s0: BACKOFF -> STARTING" in log, log
    s = st["servers"][0]
    assert s["restarts"] == 2 and s["incarnation"] == 3 and s["pid"] is None
    assert "not healthy within restart.start_timeout_s=1" in s["last_error"]
    assert st["ready"] is True  # every server is SERVING or gave up
    assert tagged_pids(d.tag) == [], "a FATAL server left processes"
    r = d.action("/servers/s0/restart")
    assert r.status_code == 200, r.text
    d.wait(lambda s: s["servers"][0]["incarnation"] == 4, 20, "a fourth start after the restart")
    log = d.log_text()
    assert "state s0: FATAL -> STOPPING" in log and "state s0: STOPPED -> STARTING" in log


def test_a_server_that_exits_at_once_is_retried_with_growing_delays(daemons):
    d = daemons("exit_at_start=3")
    st = d.wait(lambda s: s["servers"][0]["state"] == "FATAL", 60, "FATAL")
    assert "exited before it was healthy: exited with status 3" in st["servers"][0]["last_error"]
    delays = [float(x) for x in re.findall(r"backoff s0: restart \d of 2 in ([\d.]+) s", d.log_text())]
    assert delays == [0.2, 0.4], delays


def test_a_missing_vllm_command_is_a_clear_error(daemons, tmp_path):
    d = daemons(vllm={"command": ["/nonexistent/vllm", "serve"]})
    st = d.wait(lambda s: s["servers"][0]["state"] == "FATAL", 60, "FATAL")
    assert "/nonexistent/vllm" in st["servers"][0]["last_error"]
    assert "Traceback" not in d.log_text()


# -- serving ----------------------------------------------------------------------------------------
def test_the_first_sync_loads_the_newest_version_before_serving(daemons):
    d = daemons()
    st = d.wait_versions({"s0": 1}, 30)
    seen = requests_seen(d)
    load = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/weight_info"]
    assert seen[seen.index("/pause"):][:5] == load, seen
    # after the load: resume, then the gate (straight to the server), the last requests before SERVING
    assert seen[-3:] == ["/resume", "/v1/models", "/v1/completions"], seen
    assert st["servers"][0]["incarnation"] == 1
    gate = st["servers"][0]["last_update"]["gate"]  # the version has no canary: the probe only
    assert gate == {"ok": True, "canary": False, "tokens": 4, "tolerance": None, "max_abs_dlogprob": None}


def test_non_finite_logprobs_fail_the_gate_and_the_server_is_never_serving(daemons):
    d = daemons("logprob=nan")
    states = set()

    def fatal(st: dict) -> bool:
        states.add(st["servers"][0]["state"])
        return st["servers"][0]["state"] == "FATAL"
    status = d.wait(fatal, 60, "FATAL")
    st = status["servers"][0]
    assert "SERVING" not in states, states
    # version 1 failed in two processes (the second start does not count toward FATAL) and was
    # refused; the start model then failed the probe too in every later process: a broken server
    assert [r["version"] for r in status["refused"]] == [1]
    assert "its start model fails the gate's probe too" in st["last_error"], st["last_error"]
    assert "gate: non-finite logprobs at 4 of 4 positions" in st["last_error"], st["last_error"]
    assert st["last_update"]["gate"]["ok"] is False
    text = httpx.get(d.url + "/metrics", timeout=10).text
    # 2 processes for the version, each: the load and its re-apply
    assert re.search(r'^rolloutd_update_failures_total\{kind="gate"\} 4\.0$', text, re.M), text


def test_a_frozen_server_fails_its_probes_and_is_restarted(daemons):
    d = daemons()
    pid = d.wait_versions({"s0": 1}, 30)["servers"][0]["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing
    st = d.wait(lambda s: s["servers"][0]["incarnation"] == 2 and s["servers"][0]["state"] == "SERVING", 60,
                "restarted")
    assert st["servers"][0]["version"] == 1
    assert "/health failed 3 times in a row" in d.log_text()
    assert not alive(pid), "the frozen process was not killed"


def test_a_failed_load_is_reapplied_and_never_resumed_half_loaded(daemons):
    d = daemons("fail_once=/update_weights")
    d.wait_versions({"s0": 1}, 30)
    seen = requests_seen(d)
    i = seen.index("/update_weights")
    # after the failed load: start again, load, finish; no /resume in between
    assert seen[i + 1:i + 4] == ["/start_weight_update", "/update_weights", "/finish_weight_update"], seen
    assert "/resume" not in seen[:i + 4]
    assert server(d)["incarnation"] == 1
    assert "apply s0: version 1 failed: /update_weights: HTTP 500" in d.log_text()


def test_a_load_that_always_fails_refuses_the_version_and_never_resumes_the_server(daemons):
    d = daemons("fail=/update_weights")
    st = d.wait(lambda s: s["refused"] and s["servers"][0]["state"] == "SERVING", 60, "refused, serving")
    assert "loading version 1 failed 2 time(s)" in st["refused"][0]["reason"], st["refused"]
    assert "/resume" not in requests_seen(d), "a server was resumed after a failed load"
    assert st["servers"][0]["version"] is None and st["servers"][0]["incarnation"] == 3, "its start model"


def test_a_hanging_load_times_out(daemons):
    d = daemons("hang=/update_weights", update={"load_timeout_s": 0.5, "max_reapply": 0})
    st = d.wait(lambda s: s["servers"][0]["restarts"] >= 1, 30, "a restart after the timeout")
    assert "no answer within 0.5 s" in d.log_text()
    assert 'rolloutd_update_failures_total{kind="timeout"}' in httpx.get(d.url + "/metrics").text
    assert st["servers"][0]["state"] in ("BACKOFF", "STARTING", "SYNCING", "FATAL")


# -- stopping ---------------------------------------------------------------------------------------
def test_sigterm_kills_a_server_that_ignores_it_and_its_child(daemons):
    d = daemons("ignore_term,spawn_child", servers=2)
    d.wait_versions({"s0": 1, "s1": 1}, 30)
    assert len(tagged_pids(d.tag)) == 4  # two fakes, each with a child
    t0 = time.monotonic()
    assert d.stop(30) == 0
    assert tagged_pids(d.tag) == []
    assert time.monotonic() - t0 < 10
    assert "killed by SIGKILL" in d.log_text()


def test_no_descriptor_is_closed_twice_in_a_daemon_life(daemons, tmp_path):
    """strace (attached to the running daemon, every thread and child) records each ``close`` that
    fails: EBADF is a descriptor closed twice. Between the two closes another thread may open a
    file under the same number and lose it to the second: uvloop closed each server's output pipe
    itself and then closed the file object it was given too, and a scan of /proc in a worker
    thread failed with EBADF during a stop, which then hung. The life traced: two servers
    serving, a version pulled (the pull workers) and loaded, one server killed and started
    again, the daemon stopped."""
    own = EmbeddedRegistry(port=0).start()  # its own: the version published here is no other test's
    own.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
    try:
        _trace_a_life(daemons(servers=2, registry_url=own.url), own, tmp_path / "close.trace")
    finally:
        own.stop()


def _trace_a_life(d: DaemonProcess, registry: EmbeddedRegistry, trace: Path) -> None:
    d.wait_versions({"s0": 1, "s1": 1}, 30)
    with failed_closes(d.proc.pid, trace) as failed:
        registry.publish(2, tinymodel.state_dict(tinymodel.TINY, 2), shard_bytes=600_000, chunk_bytes=1 << 16)
        d.wait_versions({"s0": 2, "s1": 2}, 30)
        first = d.server("s0")["pid"]
        os.killpg(first, signal.SIGKILL)
        d.wait(lambda st: st["servers"][0]["state"] == "SERVING" and st["servers"][0]["pid"] != first, 30,
               "s0 started again and serving")
        assert d.stop(30) == 0
    assert not failed, "\n".join(failed)


def test_leftovers_of_a_killed_daemon_are_cleaned_at_the_next_start(daemons, tmp_path):
    first = daemons("ignore_term,spawn_child", servers=2, directory=tmp_path / "node")
    first.wait_versions({"s0": 1, "s1": 1}, 30)
    left = tagged_pids(first.tag)
    first.proc.kill()  # no chance to clean up
    first.proc.wait(10)
    assert sorted(tagged_pids(first.tag)) == sorted(left), "the children should outlive a killed daemon"
    second = DaemonProcess(first.cfg, tmp_path / "node")
    second.log = tmp_path / "node" / "second.log"
    second.start()
    try:
        second.wait_versions({"s0": 1, "s1": 1}, 30)
        assert not any(alive(p) for p in left), "leftovers not cleaned"
        assert len(tagged_pids(first.tag)) == 4, "exactly one fake (and its child) per server"
        assert re.search(r"clean s\d: process group \d+", second.log_text())
    finally:
        second.stop(30)



def test_a_daemon_killed_mid_pull_into_recycled_files_leaves_nothing_and_the_next_serves_the_version(
        daemons, tmp_path):
    """kill -9 of the daemon and of everything it started, as systemd does (KillMode=mixed), while
    it pulls a version into the files of one it removed, with the pull workers it kept from the
    pulls before: they end with it, and the next daemon removes the half-written version, pulls
    it whole and serves it. The served bytes are checked against the tensors published, not
    against the daemon's own account."""
    from safetensors.numpy import load_file

    with EmbeddedRegistry(port=0) as reg:
        def publish(version: int) -> None:
            reg.publish(version, tinymodel.state_dict(tinymodel.TINY, version), shard_bytes=600_000,
                        chunk_bytes=1 << 16)
        proxy = RegistryProxy(reg.port).start()
        try:
            publish(1)
            first = daemons(registry_url=proxy.url, directory=tmp_path / "node", pull={"workers": 1, "streams": 1})
            first.wait_versions({"s0": 1}, 30)
            for version in (2, 3):
                publish(version)
                first.wait_versions({"s0": version}, 30)
            st = first.wait(lambda st: st["mirror"]["spare_bytes"] > 0, 10, "a removed version's files kept as spares")
            kept = st["pull_workers_kept"]
            assert len(kept) == 1 and alive(kept[0]) and st["pull"]["workers"] == []  # idle between pulls
            mirror = Path(first.cfg["mirror"]["dir"])
            proxy.byte_delay_s = 0.2  # per 64 KiB chunk: the pull of version 4 takes seconds
            publish(4)
            st = first.wait(lambda st: (st["pull"] or {}).get("version") == 4 and st["pull"]["bytes_done"] > 0,
                            30, "version 4 partly pulled")
            workers = st["pull"]["workers"]
            assert workers == kept, "the kept worker takes up the next pull"
            assert (mirror / ".4.partial").is_dir() and not (mirror / ".spare").exists()
            servers = tagged_pids(first.tag)
            first.kill_everything()  # the daemon, then every process of its servers: SIGKILL
            wait_until(lambda: not any(alive(p) for p in workers), 10, "the pull workers gone with their daemon")
            assert (mirror / ".4.partial").is_dir()  # what a killed pull leaves
            proxy.byte_delay_s = 0.0
            second = DaemonProcess(first.cfg, tmp_path / "node")
            second.log = tmp_path / "node" / "second.log"
            second.start()
            try:
                second.wait_versions({"s0": 4}, 60)
                assert f"remove leftover {mirror / '.4.partial'}" in second.log_text()
                assert not any(alive(p) for p in servers)
                assert len(tagged_pids(first.tag)) == 1, "exactly one fake per server"
                served = {}
                for f in sorted((mirror / "4").glob("*.safetensors")):
                    served.update(load_file(f))
                published = tinymodel.state_dict(tinymodel.TINY, 4)
                assert served.keys() == published.keys()
                for name, array in published.items():
                    assert served[name].dtype == array.dtype and np.array_equal(served[name], array), name
                assert second.stop() == 0
                assert tagged_pids(first.tag) == []
                assert not [p.name for p in mirror.iterdir() if p.name.endswith(".partial")]
            finally:
                second.kill_everything()
        finally:
            proxy.stop()


def test_in_a_delegated_cgroup_a_killed_daemon_leaves_one_server_each(registry, tmp_path):
    """The daemon in a delegated cgroup (as under systemd's Delegate=yes): each fake in its own
    cgroup with everything it started, the one that left its session too; killed, the next daemon
    finds them by cgroup (no record) and stops them before it starts its own."""
    faults = "ignore_term,spawn_child,escape_child"
    specs = [{"name": f"s{i}", "model": "fake-model", "env": {"FAKE_VLLM_FAULTS": faults}} for i in range(2)]
    cfg = config(tmp_path, registry.url, specs, fake=True, shutdown={"server_grace_s": 1, "kill_wait_s": 5},
                 restart={"start_timeout_s": 10, "backoff_initial_s": 0.2, "max_retries": 2})
    with delegated_cgroup() as top:
        first = DaemonProcess(cfg, tmp_path, prefix=inside(top)).start()
        second = DaemonProcess(cfg, tmp_path, prefix=inside(top))
        second.log = tmp_path / "second.log"
        try:
            first.wait_versions({"s0": 1, "s1": 1}, 60)
            wait_until(lambda: len(tagged_pids(first.tag)) == 6, 10, "a fake, its child and its escaped child each")
            left = tagged_pids(first.tag)
            where = sorted(cgroup_of(p) for p in left)
            assert where == [f"{label(top)}/server-s0"] * 3 + [f"{label(top)}/server-s1"] * 3, where
            assert cgroup_of(first.proc.pid) == f"{label(top)}/daemon"
            first.proc.kill()  # no chance to clean up
            first.proc.wait(10)
            assert all(alive(p) for p in left), "the servers should outlive a killed daemon"
            second.start()
            second.wait_versions({"s0": 1, "s1": 1}, 60)
            assert not any(alive(p) for p in left), "leftovers not cleaned"
            wait_until(lambda: len(tagged_pids(first.tag)) == 6, 10, "exactly one fake (and its children) per server")
            log = second.log_text()
            assert f"contain: each server in its own cgroup under {label(top)} (delegated)" in log
            for name in ("s0", "s1"):
                assert (f"clean {name}: cgroup {label(top)}/server-{name} (3 processes) left by an earlier run: "
                        "killed with SIGKILL") in log
            assert not any((tmp_path / "state" / "children").glob("*.json")), "the cgroup way writes no record"
            assert second.stop(30) == 0
            assert tagged_pids(first.tag) == []
            assert sorted(p.name for p in top.iterdir() if p.is_dir()) == ["daemon"]
        finally:
            first.kill_everything()
            second.kill_everything()


# -- bad input at start ---------------------------------------------------------------------------
def test_a_bad_config_stops_the_start_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("registry:\n  url: http://r:1\nservers:\n  - name: s0\n    model: m\n    port: 99999\n")
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "run", "-c", str(bad)], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 2
    assert f"{bad}:6: servers[0].port" in run.stderr and "Traceback" not in run.stderr


def test_an_admin_port_in_use_fails_before_anything_starts(daemons, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        d = daemons(admin={"port": busy})
        assert d.proc.wait(30) == 1
        assert f"cannot listen on 127.0.0.1:{busy}" in d.log_text()
        assert "Traceback" not in d.log_text()
        assert tagged_pids(d.tag) == []


# -- rollout, reload, systemd ------------------------------------------------------------------------
def test_a_rolling_update_pauses_one_server_at_a_time(daemons, registry):
    d = daemons(servers=3, update={"strategy": "rolling", "max_unavailable": 1})
    d.wait_versions({"s0": 1, "s1": 1, "s2": 1}, 30)
    registry.publish(2, tinymodel.state_dict(tinymodel.TINY, 2), shard_bytes=600_000, chunk_bytes=1 << 16)
    try:
        d.wait_versions({"s0": 2, "s1": 2, "s2": 2}, 30)
    finally:
        registry.retire(2)
    updating, most = set(), 0
    for name, arrow in re.findall(r"state (s\d): (SERVING -> UPDATING|UPDATING -> \w+)", d.log_text()):
        (updating.add if arrow.endswith("UPDATING") else updating.discard)(name)
        most = max(most, len(updating))
    assert most == 1
    assert d.log_text().count("-> UPDATING") == 3


# -- pulls cut short -------------------------------------------------------------------------------
def test_a_version_slower_than_pull_timeout_s_arrives_in_tries_that_take_up_where_the_last_stopped(
        daemons, registry):
    """Byte ranges slowed by a fake network path so that a whole pull takes about three times
    pull.timeout_s: each try is cut at the timeout, keeps the chunks it checked, and the next
    try fetches only the others, so the version arrives (tries that started over would be cut
    again and again). Each chunk crosses the path about once; the stop removes what a try kept."""
    proxy = RegistryProxy(registry.port).start()
    proxy.byte_delay_s = 0.25  # per range: with 2 streams, 16 rounds of chunks, about 4 s
    try:
        d = daemons(registry_url=proxy.url, pull={"timeout_s": 1.5, "workers": 1, "streams": 2})
        st = d.wait(lambda s: s["servers"][0]["state"] == "SERVING", 90, "SERVING after several tries")
        version = st["servers"][0]["version"]
        chunks = sum(len(f.chunks) for f in registry.manifest(version).files)
        log = d.log_text()
        tries = log.count("failed: no result within pull.timeout_s=1.5")
        assert tries >= 2, log[-3000:]
        # every try after a cut one takes up its chunks (the first try may be cut before it checked any)
        assert tries - 1 <= log.count("checked by the last try") <= tries
        assert st["pull"]["state"] == "done" and st["pull"]["bytes_resumed"] > 0
        # every chunk once, but for the ranges in flight when a try was cut (2 streams)
        assert chunks <= proxy.byte_requests <= chunks + 2 * tries, (proxy.byte_requests, chunks, tries)

        # A try cut short, then the stop: nothing of the pull is left behind.
        d2 = daemons(registry_url=proxy.url, pull={"timeout_s": 1.5, "workers": 1, "streams": 2})
        wait_until(lambda: "checked by the last try" in d2.log_text(), 60, "a try that resumed")
        assert d2.stop() == 0
        mirror = Path(d2.cfg["mirror"]["dir"])
        assert [p.name for p in mirror.iterdir() if p.name.startswith(".")] == [], list(mirror.iterdir())
        assert "discard partial version" in d2.log_text()
    finally:
        proxy.stop()


def pull_workers(tag: str) -> list[int]:
    """The daemon's pull workers (they inherit its environment, tag included)."""
    found = []
    for pid in tagged_pids(tag):
        try:
            if b"rolloutd.rollout.fetch_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


STOP_DEADLINE_S = 1 + 5 + 5 + 2  # the daemons fixture's shutdown.longest_s: server grace, kill wait, deregister, admin


def test_a_stop_wins_over_a_pull_whose_source_answers_60_kb_errors_or_whose_worker_hangs(daemons, registry):
    """Every byte range answered with a 404 of 60 KB of JSON: the pull used to hang on it (the
    pool's reader died on the worker's line) and SIGTERM never ended the daemon, because the
    cancelled pull ended as a failure and the updater started another that hung the same way.
    Now each pull fails at once with the typed error, cut short, and SIGTERM ends the daemon
    within its stop deadline with no pull worker left. The same with a pull stuck for good:
    its byte range never answered and its worker stopped by SIGSTOP."""
    import json
    import uuid
    proxy = RegistryProxy(registry.port).start()
    proxy.error_body = json.dumps({"error": {"code": "file_unknown", "message": "é" * 30_000}},
                                  ensure_ascii=False).encode()
    try:
        tag = uuid.uuid4().hex[:12]
        d = daemons(registry_url=proxy.url, tag=tag, env={"ROLLOUTD_TEST_TAG": tag},
                    pull={"workers": 1, "streams": 1, "keep_workers_s": 0})
        st = d.wait(lambda s: (s["pull"] or {}).get("state") == "failed", 30, "a failed pull")
        assert "FileUnknown: " + "é" * 1000 in st["pull"]["error"] and len(st["pull"]["error"]) < 1200, st["pull"]
        wait_until(lambda: d.log_text().count("failed: version 1 file") >= 2, 30, "a second try, failed as fast")
        t0 = time.monotonic()
        assert d.stop(30) == 0
        assert time.monotonic() - t0 < STOP_DEADLINE_S
        assert tagged_pids(tag) == []  # servers and pull workers

        proxy.error_body, proxy.byte_delay_s = None, 3600  # now no byte range is ever answered
        tag = uuid.uuid4().hex[:12]
        d = daemons(registry_url=proxy.url, tag=tag, env={"ROLLOUTD_TEST_TAG": tag}, pull={"workers": 1, "streams": 1})
        wait_until(lambda: proxy.byte_requests >= 1 and pull_workers(tag), 30, "a pull waiting for its bytes")
        [worker] = pull_workers(tag)
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        assert d.stop(30) == 0
        assert time.monotonic() - t0 < STOP_DEADLINE_S
        assert tagged_pids(tag) == [] and not alive(worker)
    finally:
        proxy.stop()


def test_a_bad_config_on_reload_keeps_the_running_one(daemons):
    d = daemons(servers=1)
    before = d.wait_versions({"s0": 1}, 30)["servers"][0]
    good = d.path.read_text()
    d.path.write_text(good.replace("servers:", "servers_typo:"))
    d.signal(signal.SIGHUP)
    wait_until(lambda: "reload failed, the running configuration stays" in d.log_text(), 10, "the failed reload")
    r = d.action("/reload")
    assert r.status_code == 409 and "servers_typo" in r.json()["error"]["message"], r.text
    after = d.status()["servers"][0]
    assert (after["pid"], after["incarnation"], after["state"]) == (before["pid"], before["incarnation"], "SERVING")
    d.path.write_text(good)
    r = d.action("/reload")
    assert r.status_code == 200 and "restarted none" in r.json()["message"], r.text
    # a section that cannot change while running: kept, and said so
    d.write({**d.cfg, "pull": {"streams": 2}, "heartbeat": {**d.cfg["heartbeat"], "interval_s": 0.7}})
    r = d.action("/reload")
    assert r.status_code == 200, r.text
    assert r.json()["message"].endswith("needs a restart of rolloutd: pull (all but timeout_s)"), r.text


def test_a_second_sigterm_kills_at_once(daemons):
    d = daemons("ignore_term", servers=1, shutdown={"server_grace_s": 60, "kill_wait_s": 5})
    d.wait_versions({"s0": 1}, 30)
    d.signal(signal.SIGTERM)
    time.sleep(1)
    assert d.proc.poll() is None  # waiting out the grace period
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0 and time.monotonic() - t0 < 10
    assert tagged_pids(d.tag) == []
    assert "stop asked again: killing every server's process group now" in d.log_text()


def test_the_systemd_notify_protocol(daemons, tmp_path):
    """A datagram socket stands in for systemd: READY=1 only once the servers serve, STATUS= on
    changes, WATCHDOG=1 at half of WATCHDOG_USEC, RELOADING=1 then READY=1 on SIGHUP,
    STOPPING=1 on SIGTERM; the children never see NOTIFY_SOCKET."""
    import socket as sk
    path = str(tmp_path / "notify.sock")
    sock = sk.socket(sk.AF_UNIX, sk.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    got: list[tuple[float, str]] = []
    listening = True

    def listen() -> None:  # each datagram with its arrival time
        while listening:
            try:
                got.append((time.monotonic(), sock.recv(4096).decode()))
            except TimeoutError:
                continue
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()

    def drain() -> None:
        time.sleep(0.3)

    d = daemons(servers=2, restart={"start_timeout_s": 10, "backoff_initial_s": 0.2, "max_retries": 2})
    d.proc.kill()  # restart it with the notify environment (the fixture started it without)
    d.proc.wait()
    d.start(NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    st = d.wait_versions({"s0": 1, "s1": 1}, 30)

    def pings_after_ready() -> list[float]:
        messages = [m for _, m in got]
        ready = messages.index("READY=1") if "READY=1" in messages else len(got)
        return [t for t, m in got[ready:] if m == "WATCHDOG=1"]
    deadline = time.monotonic() + 20
    while len(pings_after_ready()) < 7 and time.monotonic() < deadline:
        time.sleep(0.1)
    drain()
    messages = [m for _, m in got]
    ready = messages.index("READY=1")
    statuses = [m for m in messages if m.startswith("STATUS=")]
    before = [m for m in messages[:ready] if m.startswith("STATUS=")]
    assert any("s0 STARTING" in m for m in before), messages[:ready]
    assert before[-1] == "STATUS=s0 SERVING v1; s1 SERVING v1; registry ok", before
    assert all(m.count("SERVING") < 2 for m in before[:-1]), before
    assert messages.count("READY=1") == 1 and len(statuses) == len(set(statuses))
    pings = pings_after_ready()
    gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
    # Every half of WATCHDOG_USEC on average (the ticks keep a fixed rate, so a late one does not
    # shift the rest), and never as late as systemd's limit, 2 s: a loaded machine may delay one
    # ping (the test's own listener thread too), which systemd tolerates up to the limit.
    assert len(gaps) >= 6 and 0.9 < (pings[-1] - pings[0]) / len(gaps) < 1.1 and max(gaps) < 1.8, gaps
    env = Path(f"/proc/{st['servers'][0]['pid']}/environ").read_bytes()
    assert b"NOTIFY_SOCKET" not in env and b"WATCHDOG_USEC" not in env
    got.clear()
    d.signal(signal.SIGHUP)
    time.sleep(1.5)
    drain()
    messages = [m for _, m in got]
    reloading = next(i for i, m in enumerate(messages) if m.startswith("RELOADING=1"))
    assert "MONOTONIC_USEC=" in messages[reloading] and "READY=1" in messages[reloading:]
    got.clear()
    assert d.stop(30) == 0
    drain()
    assert "STOPPING=1" in [m for _, m in got]
    listening = False
    listener.join(5)
    sock.close()
