"""The fake vLLM (tests/support/fake_vllm.py) behaves as specified: other tests trust it to stand in for
``vllm serve`` and to show each fault exactly when asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer.publish import save_shards
from rolloutd.wire.manifest import build_manifest
from tests.support.daemon_harness import uds_client

# Real processes (each fake is a new Python): the slow tier, beside the tests that use the fake.
pytestmark = [pytest.mark.slow, pytest.mark.parallel, pytest.mark.timeout(60)]  # fake vLLM: beside other such tests

FAKE = Path(__file__).parents[2] / "support" / "fake_vllm.py"


class Fake:
    """One fake in its own session, output in a file."""

    def __init__(self, tmp: Path, faults: str):
        self.socket = tmp / f"fake-{uuid.uuid4().hex[:8]}.sock"  # as rolloutd starts it: on a UNIX socket
        self.log = self.socket.with_suffix(".log")
        env = {**os.environ, "FAKE_VLLM_FAULTS": faults}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(FAKE), "serve", "some-model", "--uds", str(self.socket),
                 "--weight-transfer-config", '{"backend": "rolloutd"}', "--enable-scale-out", "--dtype", "float32"],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.http = uds_client(self.socket, timeout=5)

    def listening(self, timeout_s: float = 15) -> Fake:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.output()}"
            try:
                self.http.get("/health")
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError(f"not listening after {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def group(self) -> list[int]:
        out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
        return [int(p) for p, g, st in (line.split()[:3] for line in out.splitlines())
                if int(g) == self.proc.pid and not st.startswith("Z")]

    def close(self) -> None:
        self.http.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def fake(tmp_path):
    started: list[Fake] = []

    def start(faults: str = "") -> Fake:
        started.append(Fake(tmp_path, faults))
        return started[-1]

    yield start
    for f in started:
        f.close()
        assert f.group() == [], "the fake's group outlived SIGKILL"


@pytest.fixture(scope="module")
def version(tmp_path_factory):
    """A complete mirror directory of version 3, and its manifest's digest."""
    d = tmp_path_factory.mktemp("mirror") / "3"
    files = save_shards(tinymodel.state_dict(tinymodel.TINY, 3), d, shard_bytes=600_000)
    m = build_manifest(3, files, chunk_bytes=1 << 16)
    (d / "manifest.json").write_text(m.model_dump_json())
    return str(d), m.digest


def generate(f: Fake, prompt=(1, 2, 3)) -> dict:
    r = f.http.post("/inference/v1/generate", json={"token_ids": list(prompt), "stream": False,
                                                    "sampling_params": {"max_tokens": 6, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def error_of(r: httpx.Response) -> str:
    assert r.status_code == 500, (r.status_code, r.text)
    return r.json()["error"]["message"]


# -- the routes ------------------------------------------------------------------------------------
def test_the_update_sequence_loads_a_checked_mirror_and_labels_the_weights(fake, version):
    f = fake().listening()
    path, digest = version
    assert f.http.get("/health").status_code == 200
    assert f.http.get("/weight_info").json() == {"weight_version": "default"}
    before = generate(f)
    assert before["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert len(before["token_ids"]) == 6 and generate(f) == before  # deterministic

    assert "without start_weight_update" in error_of(f.http.post("/finish_weight_update",
                                                                 json={"weight_version": "9"}))
    assert "without start_weight_update" in error_of(f.http.post(
        "/update_weights", json={"update_info": {"path": path, "digest": digest}}))
    assert f.http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert f.http.get("/is_paused").json() == {"is_paused": True}
    assert f.http.post("/start_weight_update").status_code == 200
    assert "not the requested" in error_of(f.http.post(
        "/update_weights", json={"update_info": {"path": path, "digest": "0" * 64}}))
    assert "no such mirror directory" in error_of(f.http.post(
        "/update_weights", json={"update_info": {"path": path + "x", "digest": digest}}))
    assert f.http.post("/update_weights", json={"update_info": {"path": path, "digest": digest}}).status_code == 200
    assert f.http.post("/finish_weight_update", json={"weight_version": "3"}).status_code == 200
    assert f.http.get("/weight_info").json() == {"weight_version": "3"}
    assert f.http.post("/resume").json() == {"status": "resumed"}
    assert f.http.get("/is_paused").json() == {"is_paused": False}

    after = generate(f)
    assert after["weight_versions"][0]["version"] == "3" and after["token_ids"] != before["token_ids"]
    out = f.output()
    assert f"fake_vllm: serving some-model on unix:{f.socket}" in out
    assert "fake_vllm: POST /pause?mode=keep -> 200" in out and "fake_vllm: POST /update_weights -> 500" in out


def test_generate_waits_while_paused(fake):
    f = fake().listening()
    f.http.post("/pause", params={"mode": "keep"})
    with pytest.raises(httpx.ReadTimeout):
        f.http.post("/inference/v1/generate", json={"token_ids": [1]}, timeout=0.5)
    f.http.post("/resume")
    assert generate(f)["weight_versions"][0]["version"] == "default"


def test_unknown_pause_mode_and_routes_are_errors(fake):
    f = fake().listening()
    assert f.http.post("/pause", params={"mode": "sometimes"}).status_code == 400
    assert f.http.get("/nowhere").status_code == 404


# -- faults on routes ------------------------------------------------------------------------------
def test_route_faults(fake):
    f = fake("never_healthy,fail=/resume,fail_once=/pause,hang=/weight_info").listening()
    assert f.http.get("/health").status_code == 503
    assert "injected failure of /pause" in error_of(f.http.post("/pause"))
    assert f.http.post("/pause").status_code == 200
    assert [f.http.post("/resume").status_code for _ in range(2)] == [500, 500]
    with pytest.raises(httpx.ReadTimeout):
        f.http.get("/weight_info", timeout=0.5)
    assert f.http.get("/is_paused").json() == {"is_paused": True}  # the fake still answers the rest
    assert f.http.post("/fake/health", json={"ok": True}).status_code == 200
    assert f.http.get("/health").status_code == 200
    assert "GET /weight_info -> never answered" in f.output()


def test_crash_on_a_route_exits_with_1(fake):
    f = fake("crash_on=/start_weight_update").listening()
    with pytest.raises(httpx.TransportError):
        f.http.post("/start_weight_update")
    assert f.proc.wait(10) == 1


# -- faults of the process -------------------------------------------------------------------------
def test_exit_at_start_and_exit_after(fake):
    at_start, later = fake("exit_at_start=7"), fake("exit_after=1")
    assert at_start.proc.wait(10) == 7
    later.listening()
    t0 = time.monotonic()
    assert later.proc.wait(10) == 1
    assert time.monotonic() - t0 < 1.5
    assert "exiting with status 1 after 1 s" in later.output()


def test_no_listen_and_slow_start(fake):
    silent, slow = fake("no_listen"), fake("slow_start=1.5")
    t0 = time.monotonic()
    slow.listening()
    assert time.monotonic() - t0 >= 1.4
    assert silent.proc.poll() is None
    with pytest.raises(httpx.ConnectError):
        silent.http.get("/health")


def test_sigterm_stops_it_unless_ignored_and_spawn_child_joins_its_group(fake):
    polite, deaf = fake(), fake("ignore_term,spawn_child")
    polite.listening(), deaf.listening()
    assert len(deaf.group()) == 2  # the fake and its sleep
    polite.proc.send_signal(signal.SIGTERM)
    assert polite.proc.wait(10) == 0
    os.killpg(deaf.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert len(deaf.group()) == 2, "SIGTERM should be ignored by the fake and its child"
    assert deaf.http.get("/health").status_code == 200
