"""The admin API over real HTTP (AdminServer on a free port, a fake daemon behind it): the status
document, metrics, health, each action with and without the token, JSON errors, the token never
echoed, a schemathesis run with no 5xx; and the client commands (``rolloutd status`` and the
actions) against it, plus the status table rendered from a fixed document."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from rolloutd import config as config_mod
from rolloutd.config import Config
from rolloutd.httpserver import run
from rolloutd.metrics import Metrics
from rolloutd.node.admin import AdminServer, NodeStatus, action_token, create_app, write_token
from rolloutd.node.adminctl import DEFAULT_URL, add_parsers, render_status, resolve
from rolloutd.rollout.apply import UpdateRecord
from rolloutd.rollout.gate import GateResult
from rolloutd.rollout.puller import PullProgress, PullState
from rolloutd.rollout.updater import RegistryView
from rolloutd.supervise.supervisor import Supervisor
from rolloutd.wire.states import ServerState
from tests.support.tls import CONTEXT as TLS

TOKEN = "adm-7f3c9e-secret-token"
NOW = 1_750_000_000.0
CONFIG = {"registry": {"url": "http://trainer:8700"}, "servers": [{"name": "gpu0", "model": "/m", "public_port": 9001,
                                                                   "gpus": [0]}]}

STATUS = {
    "node": "node7", "rolloutd_version": "0.1.0", "pid": 4321, "uptime_s": 7384.5, "ready": True,
    "registry": {"url": "http://trainer:8700", "reachable": True, "instance": "r-5e1f", "latest": 12,
                 "demand": 11, "last_error": None, "last_contact_age_s": 1.25},
    "target": {"version": 12, "digest": "xxh3:00ff00ff"},
    "pull": {"target": "latest", "version": 12, "state": "pulling", "bytes_done": 1 << 30,
             "bytes_total": 4 << 30, "bytes_resumed": 0, "rate_bytes_per_s": 512.0 * (1 << 20), "eta_s": 6.0,
             "retries": 1,
             "workers": [4400, 4401], "worker_restarts": 1, "seconds": 2.0, "error": None, "kind": "full",
             "base": None, "bytes_fetched": 1 << 30, "version_bytes": 4 << 30, "reconstruct_s": None,
             "delta_error": None},
    "pull_workers_kept": [],
    "pull_sources": {"peers": True, "last_pull": {"origin": 1 << 30, "peers": 7 << 30},
                     "url": "http://10.0.0.7:9300", "served_bytes": 9 << 30, "served_requests": 1152},
    "reload": {"last_attempt_unix": NOW - 60, "ok": False, "error": "c.yaml:3: servers[0].port: bad",
               "where": "c.yaml:3", "needs_restart": ["mirror"]},
    "mirror": {"dir": "/dev/shm/rolloutd", "max_bytes": 32 << 30, "usage_bytes": 8 << 30, "spare_bytes": 0,
               "versions": [10, 11]},
    "servers": [
        {"name": "gpu0", "state": "SERVING", "pid": 5001, "socket": "/var/lib/rolloutd/sockets/gpu0.sock",
         "public_port": 9001, "gpus": [0, 1],
         "endpoint": "http://node7:9001", "version": 11, "target": 12, "last_good": 11, "incarnation": 1,
         "restarts": 0,
         "state_age_s": 182.0, "last_error": None,
         "last_update": {"version": 11, "ok": True, "at_unix": NOW - 300, "phases_s": {"pause": 0.01, "load": 0.4},
                         "error": None, "gate": {"ok": True, "canary": True, "tokens": 23, "tolerance": 0.05,
                                                 "max_abs_dlogprob": 6.7e-06}},
         "heartbeat_age_s": 2.0},
        {"name": "gpu1", "state": "BACKOFF", "pid": None, "socket": "/var/lib/rolloutd/sockets/gpu1.sock",
         "public_port": 9002, "gpus": [2],
         "endpoint": "http://node7:9002", "version": None, "target": 12, "last_good": None, "incarnation": 3,
         "restarts": 2,
         "state_age_s": 4.5, "last_error": "exited with status 1 before /health passed: CUDA out of memory "
                                           "while loading the model's weights on GPU 2",
         "last_update": {"version": 12, "ok": False, "at_unix": NOW - 40, "phases_s": {}, "error": "load failed",
                         "gate": None},
         "heartbeat_age_s": None},
    ],
    "last_good": 8,
    "refused": [{"version": 9, "digest": "ab" * 32, "reason": "version 9 failed the gate: gate: the server cannot "
                 "score the canary of 600 tokens: /v1/completions: HTTP 400", "server": "gpu0", "at_unix": NOW - 900}],
}


class FakeNode:
    """Stands in for the daemon behind the admin API: canned answers, and a record of the calls."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.metrics = Metrics()
        self.doc = copy.deepcopy(STATUS)
        self.health = (True, "main loop ticked 0.2 s ago")
        self.reload_result = {"ok": True, "message": "servers added none, removed none, restarted none"}
        self.calls: list[tuple] = []

    def status(self) -> dict:
        return copy.deepcopy(self.doc)

    def healthz(self) -> tuple[bool, str]:
        return self.health

    async def restart_server(self, name: str) -> str:
        if name not in {s["name"] for s in self.doc["servers"]}:
            raise KeyError(name)
        self.calls.append(("restart", name))
        return f"server {name} restarted"

    async def update_now(self) -> str:
        self.calls.append(("update",))
        return "the updater is checking the registry now"

    async def reload(self) -> dict:
        self.calls.append(("reload",))
        return dict(self.reload_result)


@contextlib.contextmanager
def serving(node: FakeNode, token: str | None):
    """The real app on a real AdminServer, in a thread with its own loop; yields the base URL."""
    admin = AdminServer(create_app(node, token), "127.0.0.1", 0)
    assert not admin.started
    thread = threading.Thread(target=run, args=(admin.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not admin.started:
        assert thread.is_alive() and time.monotonic() < deadline, "admin API did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{admin.port}"
    finally:
        admin.stop()
        thread.join(10)
        assert not thread.is_alive(), "admin API did not stop"


@pytest.fixture(scope="module")
def served():
    """One server for the module (a stop takes uvicorn ~0.2 s); each test resets its fake node."""
    fake = FakeNode()
    with serving(fake, TOKEN) as u:
        yield fake, u


@pytest.fixture
def node(served):
    served[0].reset()
    return served[0]


@pytest.fixture
def url(served, node):
    return served[1]


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, timeout=10, verify=TLS) as client:
        yield client


@pytest.fixture(autouse=True)
def no_default_config(monkeypatch, tmp_path):
    # The client reads the machine's config when it exists; these tests must not.
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", tmp_path / "absent.yaml")


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def error_of(resp: httpx.Response) -> dict:
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return body["error"]


# -- reads ----------------------------------------------------------------------------------------------

def test_status_is_the_node_status_document(http):
    resp = http.get("/status")
    assert resp.status_code == 200
    body = resp.json()
    NodeStatus.model_validate(body)
    assert body == STATUS


def test_status_model_takes_what_the_daemon_parts_produce():
    doc = copy.deepcopy(STATUS)
    progress = PullProgress(target="latest", version=12, bytes_total=100)
    progress.add(40)
    doc["pull"] = progress.status()
    doc["registry"] = RegistryView("http://trainer:8700").status(time.monotonic())
    doc["servers"][0]["last_update"] = UpdateRecord(version=3, phases_s={"pause": 0.001}, gate=GateResult(
        canary=False, ok=True, tokens=4)).status().model_dump()
    sup = Supervisor(Config.model_validate(CONFIG).servers[0], lambda: Config.model_validate(CONFIG),
                     SimpleNamespace(target=None), slots=asyncio.Semaphore, containment=None, plugin_dir=Path("/p"),
                     metrics=Metrics())
    # What the daemon adds to each supervisor's snapshot (see Daemon.status); endpoint is already there.
    doc["servers"][1] = dict(sup.snapshot()) | {"endpoint": "http://node7:9001", "heartbeat_age_s": None}
    st = NodeStatus.model_validate(doc)
    assert st.pull.state is PullState.LEASING and st.registry.reachable is False
    assert st.servers[1].state is ServerState.STOPPED and st.servers[1].gpus == [0]


def test_status_model_is_strict():
    doc = copy.deepcopy(STATUS)
    doc["servers"][0]["surprise"] = 1
    with pytest.raises(ValidationError):
        NodeStatus.model_validate(doc)
    doc = copy.deepcopy(STATUS)
    doc["servers"][0]["state"] = "DANCING"
    with pytest.raises(ValidationError):
        NodeStatus.model_validate(doc)


def test_a_broken_status_is_a_json_500_without_traceback(node, http, caplog):
    node.doc["servers"][0]["state"] = "DANCING"
    resp = http.get("/status")
    assert resp.status_code == 500
    assert error_of(resp)["code"] == "internal"
    assert "Traceback" not in resp.text and "DANCING" not in resp.text


def test_metrics_is_prometheus_text(node, http):
    node.metrics.server_version.labels(server="gpu0").set(11)
    node.metrics.pulls.labels(result="ok").inc(3)
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(resp.text) for s in f.samples}
    assert values[("rolloutd_server_version", (("server", "gpu0"),))] == 11
    assert values[("rolloutd_pulls_total", (("result", "ok"),))] == 3


def test_healthz_follows_the_main_loop(node, http):
    resp = http.get("/healthz")
    assert resp.status_code == 200 and resp.json() == {"ok": True, "reason": "main loop ticked 0.2 s ago"}
    node.health = (False, "main loop ticked 31.0 s ago")
    resp = http.get("/healthz")
    assert resp.status_code == 503 and resp.json() == {"ok": False, "reason": "main loop ticked 31.0 s ago"}


def test_reads_need_no_token(http):
    for path in ("/status", "/metrics", "/healthz"):
        assert http.get(path).status_code == 200


# -- actions ----------------------------------------------------------------------------------------------

ACTIONS = [("/servers/gpu0/restart", ("restart", "gpu0"), "server gpu0 restarted"),
           ("/update", ("update",), "the updater is checking the registry now"),
           ("/reload", ("reload",), "servers added none, removed none, restarted none")]


@pytest.mark.parametrize(("path", "call", "message"), ACTIONS)
def test_action_with_the_token(node, http, path, call, message):
    resp = http.post(path, headers=bearer(TOKEN))
    assert resp.status_code == 200 and resp.json() == {"ok": True, "message": message}
    assert node.calls == [call]


@pytest.mark.parametrize(("path", "call", "message"), ACTIONS)
@pytest.mark.parametrize("headers", [{}, bearer("wrong"), bearer(TOKEN + "x"), bearer(TOKEN[:-1]),
                                     {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN},
                                     {"Authorization": "Bearer"},
                                     {"Authorization": "Bearer ü".encode()}],
                         ids=["none", "wrong", "longer", "shorter", "basic", "bare", "empty", "non-ascii"])
def test_action_without_the_right_token_is_refused(node, http, path, call, message, headers):
    resp = http.post(path, headers=headers)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert error_of(resp)["code"] == "unauthorized"
    assert node.calls == []


@pytest.mark.parametrize(("path", "call", "message"), ACTIONS)
def test_action_with_allow_unauthenticated_and_no_token_is_open(node, path, call, message):
    with serving(node, None) as u:
        resp = httpx.post(u + path, timeout=10)
        assert resp.status_code == 200 and resp.json()["message"] == message
        assert httpx.post(u + path, headers=bearer("anything"), timeout=10).status_code == 200
    assert node.calls == [call, call]


def test_actions_need_the_token_the_daemon_writes_when_none_is_configured(node, tmp_path, capsys):
    """No admin.token_file: the daemon writes a new random token to <state_dir>/admin.token at
    every start (mode 0600, its user's); an action without it is refused, and the rolloutd CLI
    finds it from the config and sends it."""
    cfg_path = write_config(tmp_path / "rolloutd.yaml", 9100, None, state_dir=tmp_path / "state")
    cfg = config_mod.load_config(cfg_path)
    token = action_token(cfg)
    path = tmp_path / "state" / "admin.token"
    assert cfg.admin_token_path == path
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.geteuid())
    assert path.read_text() == token + "\n" and len(token) >= 40
    with serving(node, token) as u:
        assert httpx.post(u + "/update", timeout=10).status_code == 401
        assert httpx.get(u + "/status", timeout=10).status_code == 200  # reads stay open
        write_config(cfg_path, int(u.rsplit(":", 1)[1]), None, state_dir=tmp_path / "state")
        args = parse("update", "-c", str(cfg_path))
        assert args.func(args) == 0, capsys.readouterr().err
    assert node.calls == [("update",)]
    again = action_token(cfg)  # the next start: a new token; the old one is worth nothing
    assert again != token and path.read_text() == again + "\n"


def test_the_generated_token_is_never_written_through_a_link(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (state / "admin.token").symlink_to(victim)  # left by someone who could write there
    token = write_token(state / "admin.token")
    assert victim.read_text() == "keep me"
    assert not (state / "admin.token").is_symlink() and (state / "admin.token").read_text() == token + "\n"
    assert sorted(p.name for p in state.iterdir()) == ["admin.token"]  # no part file left


def test_a_token_that_cannot_be_written_stops_the_start_with_the_reason(tmp_path):
    (tmp_path / "state").write_text("a file, not a directory")
    cfg = config_mod.load_config(write_config(tmp_path / "rolloutd.yaml", 9100, None, state_dir=tmp_path / "state"))
    with pytest.raises(OSError, match=r"admin: cannot write the actions' token to .*/state/admin.token: .*set "
                                      r"admin.token_file"):
        action_token(cfg)


# Runs as another local user (nobody): reads the token file, then acts without it and reads status.
OTHER_USER = textwrap.dedent("""
    import json, sys, urllib.error, urllib.request
    token_file, url = sys.argv[1:]
    out = {}
    try:
        open(token_file).read()
        out["read"] = "ok"
    except OSError as e:
        out["read"] = type(e).__name__
    try:
        action = urllib.request.Request(url + "/update", method="POST")
        out["update"] = urllib.request.urlopen(action, timeout=10).status
    except urllib.error.HTTPError as e:
        out["update"] = e.code
    out["status"] = urllib.request.urlopen(url + "/status", timeout=10).status
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to act as nobody")
def test_another_local_user_cannot_act_but_reads_status(node, tmp_path):
    """By default another local user can read /status but not restart, update or reload: the
    token file is 0600, even in a directory every user may enter (before: no token at all)."""
    top = Path(tempfile.mkdtemp(prefix="rolloutd-admin-"))
    try:
        os.chmod(top, 0o755)
        (top / "state").mkdir(mode=0o755)  # only the file's own mode keeps the token from other users
        cfg = config_mod.load_config(write_config(tmp_path / "rolloutd.yaml", 9100, None, state_dir=top / "state"))
        token = action_token(cfg)
        with serving(node, token) as u:
            other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                    "/usr/bin/python3", "-c", OTHER_USER, str(cfg.admin_token_path), u],
                                   capture_output=True, text=True, timeout=60, cwd="/")
        assert other.returncode == 0, other.stderr
        assert json.loads(other.stdout) == {"read": "PermissionError", "update": 401, "status": 200}
        assert node.calls == []
    finally:
        shutil.rmtree(top)


def test_restart_of_an_unknown_server_is_404(node, http):
    resp = http.post("/servers/gpu9/restart", headers=bearer(TOKEN))
    assert resp.status_code == 404
    assert error_of(resp) == {"code": "unknown_server", "message": "no server named 'gpu9'"}
    assert node.calls == []


def test_a_bad_config_on_reload_is_409_with_its_message(node, http):
    node.reload_result = {"ok": False, "message": "the running configuration stays: c.yaml:3: servers.0.port: "
                          "Input should be less than or equal to 65535"}
    resp = http.post("/reload", headers=bearer(TOKEN))
    assert resp.status_code == 409
    assert error_of(resp) == {"code": "reload_refused", "message": node.reload_result["message"]}


def test_bad_requests_are_json_errors(http):
    resp = http.get("/no/such/route")
    assert resp.status_code == 404 and error_of(resp)["code"] == "not_found"
    assert "GET /status" in error_of(resp)["message"]
    resp = http.delete("/status")
    assert resp.status_code == 405 and error_of(resp)["code"] == "method_not_allowed"
    assert resp.headers["allow"] == "GET"
    resp = http.get("/reload")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    resp = http.post("/servers/" + "x" * 300 + "/restart", headers=bearer(TOKEN))
    assert resp.status_code == 422 and error_of(resp)["code"] == "invalid_request"
    resp = http.post("/servers/%00%ff/restart", headers=bearer(TOKEN))
    assert resp.status_code == 404 and error_of(resp)["code"] == "unknown_server"


def test_the_token_never_appears_in_responses_or_logs(node, http, caplog):
    node.reload_result = {"ok": False, "message": "bad config"}
    # A token put in the URL itself is only checked against responses: a request line may be logged.
    answers = [http.post(f"/servers/{TOKEN}/restart", headers=bearer("wrong")),
               http.get(f"/servers/{TOKEN}/restart"), http.get(f"/{TOKEN}")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        answers += [http.get(p) for p in ("/status", "/metrics", "/healthz", "/openapi.json", "/nope")]
        for path, _, _ in ACTIONS:
            for headers in ({}, bearer(TOKEN), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"}):
                answers.append(http.post(path, headers=headers))
        answers.append(http.delete("/update", headers=bearer(TOKEN)))
    assert {r.status_code for r in answers} >= {200, 401, 404, 405, 409}
    for r in answers:
        assert TOKEN not in r.text and TOKEN not in str(r.headers), (r.request.url, r.text)
    assert [rec.getMessage() for rec in caplog.records if TOKEN in rec.getMessage()] == []


# -- the server ---------------------------------------------------------------------------------------------

def test_an_address_in_use_fails_at_construction_with_a_clear_error(node):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"^\[Errno \d+\] cannot listen on 127\.0\.0\.1:{port}: "
                                          r"Address already in use$"):
            AdminServer(create_app(node, None), "127.0.0.1", port)


async def test_serve_runs_as_a_task_until_stop(node):
    admin = AdminServer(create_app(node, None), "127.0.0.1", 0)
    task = asyncio.get_running_loop().create_task(admin.serve())
    for _ in range(500):
        if admin.started:
            break
        await asyncio.sleep(0.01)
    assert admin.started
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(f"http://127.0.0.1:{admin.port}/healthz")).status_code == 200
    admin.stop()
    await asyncio.wait_for(task, 10)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{admin.port}/healthz", timeout=2)


def test_stop_before_serve_releases_the_port(node):
    admin = AdminServer(create_app(node, None), "127.0.0.1", 0)
    port = admin.port
    admin.stop()
    AdminServer(create_app(node, None), "127.0.0.1", port).stop()  # the port is free again


# -- fuzzing ------------------------------------------------------------------------------------------------

FUZZ_CONFIG = """\
# A well-formed request may name a server that does not exist (404).
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "404"]
"""


def schemathesis() -> str:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(exe).exists():
        pytest.fail("schemathesis is not installed: scripts/bootstrap installs it with the test extras")
    return exe


@pytest.mark.slow  # a schemathesis process: seconds to start, then a few hundred requests
@pytest.mark.parallel
def test_admin_api_survives_fuzzing(url, tmp_path):
    (tmp_path / "schemathesis.toml").write_text(FUZZ_CONFIG)
    out = subprocess.run(
        [schemathesis(), "--config-file", str(tmp_path / "schemathesis.toml"), "run", f"{url}/openapi.json",
         "--checks", "all", "-H", f"Authorization: Bearer {TOKEN}", "--max-examples", "30", "--seed", "20261130",
         "--request-timeout", "10", "--no-color"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    cases = re.search(r"(\d+) generated", text)
    assert cases and int(cases.group(1)) >= 100, text[-3000:]


# -- the client: rolloutd status / restart / update / reload ---------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rolloutd")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_status_table():
    text = render_status(STATUS, now_unix=NOW)
    lines = text.splitlines()
    assert lines[0] == "node node7: rolloutd 0.1.0, pid 4321, up 2h03m, ready"
    assert lines[1] == ("registry http://trainer:8700: reachable, instance r-5e1f, latest v12, demand v11, "
                        "answered 1.2s ago")
    assert lines[2] == "target v12 (digest xxh3:00ff00ff)"
    assert lines[3] == ("pull v12: pulling, 1.0 GiB of 4.0 GiB (25%), 512.0 MiB/s, ETA 6.0s, 2 workers, 1 retries, "
                        "1 worker restarts")
    assert lines[4] == "mirror /dev/shm/rolloutd: 8.0 GiB of 32.0 GiB, versions v10, v11"
    header, gpu0, gpu1 = lines[6:9]
    assert cells(header) == ["NAME", "STATE", "PID", "PORT", "GPUS", "VERSION", "TARGET", "RESTARTS", "UPDATED",
                             "HEARTBEAT", "ERROR"]
    assert cells(gpu0) == ["gpu0", "SERVING 3m02s", "5001", "9001", "0,1", "v11", "v12", "0", "5m00s ago",
                           "2.0s ago", "-"]
    row = cells(gpu1)
    assert row[:10] == ["gpu1", "BACKOFF 4.5s", "-", "9002", "2", "base", "v12", "2", "40s ago (failed)", "-"]
    assert row[10].startswith("exited with status 1 before /health passed") and row[10].endswith("…")
    assert len(row[10]) == 60
    for line in (gpu0, gpu1):  # columns line up under their headers
        assert line.index("v12") == header.index("TARGET")
        assert line.index("ago") > header.index("UPDATED")
    assert lines[-3:] == ["", "reload refused: configuration error at c.yaml:3, running the previous one (c.yaml:3: "
                          "servers[0].port: bad)", "reload: mirror changed in the file; they take effect when "
                          "rolloutd restarts"]
    assert lines[-6] == "" and lines[-5] == ("refused v9 (gpu0, serving its last good version): version 9 failed the "
                                             "gate: gate: the server cannot score the canary of 600 tokens: "
                                             "/v1/completions:…"), "the reason clipped to 100 characters"
    assert lines[-4] == "the node's last good version: v8"


def test_status_table_before_anything_happened():
    doc = copy.deepcopy(STATUS)
    doc.update(target=None, pull=None, servers=[], ready=False, refused=[])
    doc["registry"].update(reachable=False, instance=None, latest=None, demand=None, last_contact_age_s=None,
                           last_error="connection refused")
    doc["mirror"]["versions"] = []
    doc["reload"] = {"last_attempt_unix": None, "ok": None, "error": None, "where": None, "needs_restart": []}
    lines = render_status(doc, now_unix=NOW).splitlines()
    assert lines[0].endswith(", not ready")
    assert lines[1] == "registry http://trainer:8700: UNREACHABLE, latest -, error: connection refused"
    assert lines[2:4] == ["target: none yet", "pull: none yet"]
    assert lines[4].endswith("versions none")
    assert lines[-1] == "(no servers configured)"


def test_status_names_the_spare_bytes_of_the_mirror():
    doc = copy.deepcopy(STATUS)
    doc["mirror"]["spare_bytes"] = 4 << 30
    assert render_status(doc, now_unix=NOW).splitlines()[4] == (
        "mirror /dev/shm/rolloutd: 8.0 GiB of 32.0 GiB (4.0 GiB spare, for the next pull), versions v10, v11")


@pytest.mark.parametrize(("pull", "expected"), [
    ({"state": "done", "bytes_done": 2 << 30, "bytes_total": 2 << 30, "seconds": 4.0,
      "rate_bytes_per_s": 512.0 * (1 << 20), "retries": 0, "workers": [], "worker_restarts": 0, "error": None},
     "pull v12: done, 2.0 GiB of 2.0 GiB in 4.0 s (512.0 MiB/s)"),
    ({"state": "failed", "bytes_done": 1024, "bytes_total": 4096, "seconds": 1.5, "rate_bytes_per_s": 0.0,
      "retries": 3, "workers": [], "worker_restarts": 0, "error": "chunk 0 of model.safetensors: bad digest"},
     "pull v12: failed, 1.0 KiB of 4.0 KiB in 1.5 s, 3 retries: chunk 0 of model.safetensors: bad digest"),
    ({"state": "done", "bytes_done": 4 << 30, "bytes_total": 4 << 30, "bytes_resumed": 3 << 30, "seconds": 2.0,
      "rate_bytes_per_s": 512.0 * (1 << 20), "retries": 0, "workers": [], "worker_restarts": 0, "error": None},
     "pull v12: done, 4.0 GiB of 4.0 GiB in 2.0 s (512.0 MiB/s), 3.0 GiB kept from the last try"),
    ({"state": "done", "bytes_done": (4 << 30) + (86 << 20), "bytes_total": (4 << 30) + (86 << 20), "seconds": 2.0,
      "rate_bytes_per_s": 43.0 * (1 << 20), "retries": 0, "worker_restarts": 0, "kind": "delta", "base": 11,
      "bytes_fetched": 86 << 20, "version_bytes": 4 << 30, "reconstruct_s": 1.5},
     "pull v12: done, 4.1 GiB of 4.1 GiB in 2.0 s (43.0 MiB/s); a delta on v11: fetched 86.0 MiB of 4.0 GiB (2.1%), "
     "rebuilt in 1.50 s"),
    ({"state": "done", "bytes_done": 4 << 30, "bytes_total": 4 << 30, "seconds": 4.0,
      "rate_bytes_per_s": 1024.0 * (1 << 20), "retries": 0, "worker_restarts": 0, "kind": "full", "base": None,
      "bytes_fetched": 4 << 30, "version_bytes": 4 << 30,
      "delta_error": "version 12: delta file model.safetensors.delta: chunk 3 differs"},
     "pull v12: done, 4.0 GiB of 4.0 GiB in 4.0 s (1.0 GiB/s); whole, its delta failed"),
])
def test_status_pull_line(pull, expected):
    doc = copy.deepcopy(STATUS)
    doc["pull"].update(pull)
    assert render_status(doc, now_unix=NOW).splitlines()[3] == expected


def test_status_command_prints_the_table(url, capsys):
    assert parse("status", "--url", url).func(parse("status", "--url", url)) == 0
    out = capsys.readouterr().out
    assert out.startswith("node node7: ")
    assert any(cells(line)[:2] == ["gpu0", "SERVING 3m02s"] for line in out.splitlines())


def test_status_command_json(url, capsys):
    args = parse("status", "--json", "--url", url + "/")
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == STATUS


def test_status_command_when_the_daemon_is_not_running(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        args = parse("status", "--url", f"http://127.0.0.1:{port}")
        assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rolloutd: cannot reach the admin API at http://127.0.0.1:{port}: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "call", "message"), [
    (("restart", "gpu1"), ("restart", "gpu1"), "server gpu1 restarted"),
    (("update",), ("update",), "the updater is checking the registry now"),
    (("reload",), ("reload",), "servers added none, removed none, restarted none"),
])
def test_action_commands_with_a_token_file(node, url, tmp_path, capsys, argv, call, message):
    (tmp_path / "token").write_text(TOKEN + "\n")
    args = parse(*argv, "--url", url, "--token-file", str(tmp_path / "token"))
    assert args.func(args) == 0
    assert capsys.readouterr().out == message + "\n"
    assert node.calls == [call]


def test_action_commands_refused(node, url, tmp_path, capsys):
    args = parse("update", "--url", url)
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("rolloutd: this action needs Authorization: Bearer <admin token>: admin.token_file's, "
                          "or without one <state_dir>/admin.token's") and err.splitlines()[0].endswith(
                          "(401 unauthorized)"), err
    (tmp_path / "token").write_text(TOKEN)
    args = parse("restart", "gpu9", "--url", url, "--token-file", str(tmp_path / "token"))
    assert args.func(args) == 1
    assert capsys.readouterr().err == "rolloutd: no server named 'gpu9' (404 unknown_server)\n"
    node.reload_result = {"ok": False, "message": "the running configuration stays: c.yaml:1: bad"}
    args = parse("reload", "--url", url, "--token-file", str(tmp_path / "token"))
    assert args.func(args) == 1
    assert capsys.readouterr().err == ("rolloutd: the running configuration stays: c.yaml:1: bad "
                                       "(409 reload_refused)\n")
    assert node.calls == [("reload",)]


def write_config(path: Path, port: int, token_file: Path | None, state_dir: Path | None = None) -> Path:
    # Every address only with a token file (the config refuses it otherwise).
    admin = f"  host: 0.0.0.0\n  port: {port}\n  token_file: {token_file}" if token_file else f"  port: {port}"
    state = f"state_dir: {state_dir}\n" if state_dir else ""
    path.write_text(f"registry:\n  url: http://trainer:8700\nadmin:\n{admin}\n{state}"
                    "servers:\n  - name: gpu0\n    model: /m\n    public_port: 9001\n")
    return path


def test_commands_find_the_api_and_token_from_the_config(node, url, tmp_path, capsys):
    port = int(url.rsplit(":", 1)[1])
    (tmp_path / "token").write_text(TOKEN)
    cfg = write_config(tmp_path / "rolloutd.yaml", port, tmp_path / "token")
    args = parse("update", "-c", str(cfg))
    assert resolve(args, with_token=True).url == f"http://127.0.0.1:{port}"  # 0.0.0.0 is reached on loopback
    assert args.func(args) == 0 and node.calls == [("update",)]
    assert capsys.readouterr().out == "the updater is checking the registry now\n"
    args = parse("status", "--json", "-c", str(cfg))
    assert args.func(args) == 0 and json.loads(capsys.readouterr().out)["node"] == "node7"


def test_the_default_config_file_is_used_when_readable(monkeypatch, node, url, tmp_path):
    port = int(url.rsplit(":", 1)[1])
    cfg = write_config(tmp_path / "rolloutd.yaml", port, None)
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", cfg)
    args = parse("update")
    assert resolve(args).url == f"http://127.0.0.1:{port}"
    (tmp_path / "token").write_text(TOKEN)
    cfg = write_config(tmp_path / "rolloutd.yaml", port, tmp_path / "absent-token")
    ep = resolve(parse("update"), with_token=True)
    assert ep.token is None and f"cannot read the admin token {tmp_path / 'absent-token'}" in ep.notes[0]


def test_without_a_config_the_default_url(tmp_path, capsys):
    assert resolve(parse("status")).url == DEFAULT_URL == "http://127.0.0.1:9100"
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers: [")
    ep = resolve(parse("status", "-c", str(bad)))
    assert ep.url == DEFAULT_URL and ep.notes and str(bad) in ep.notes[0]


def test_an_unreadable_token_file_given_on_the_command_line_fails(url, tmp_path):
    with pytest.raises(OSError, match="cannot read the token file"):
        resolve(parse("update", "--url", url, "--token-file", str(tmp_path / "nope")), with_token=True)
