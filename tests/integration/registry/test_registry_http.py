"""The registry over real HTTP on loopback: every route of API v1 and its error codes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time

import httpx
import pytest

from rolloutd.demo.tinymodel import llama_state_dict
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.manifest import build_manifest
from tests.conftest import run_cli
from tests.support.daemon_harness import wait_until

CHUNK = 4096


def small(seed: int) -> dict:
    return llama_state_dict(seed, hidden=64, layers=2, vocab=128, intermediate=96)


def publish(reg, version, seed=None, **kw):
    return reg.publish(version, small(seed if seed is not None else version), chunk_bytes=CHUNK, **kw)


def code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


# -- publish, latest, long-poll ----------------------------------------------------------------

def test_publish_then_latest_and_manifest(registry, http):
    assert http.get("/v1/versions/latest").json()["version"] is None
    m = publish(registry, 1)
    latest = http.get("/v1/versions/latest").json()
    assert latest == {"instance": registry.service.store.instance, "version": 1, "digest": m.digest,
                      "total_bytes": m.total_bytes}
    r = http.get("/v1/versions/1")
    assert r.json() == json.loads(m.model_dump_json())
    assert r.headers["x-rolloutd-version-state"] == "live"


def test_long_poll_wakes_within_100ms_of_a_publish(registry, http):
    publish(registry, 1)
    result = {}

    def poll():
        t0 = time.monotonic()
        body = http.get("/v1/versions/latest", params={"after": 1, "wait_s": 20}).json()
        result.update(body=body, returned=time.monotonic(), waited=time.monotonic() - t0)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.5)
    assert t.is_alive(), "the long-poll returned before anything newer existed"
    publish(registry, 2)
    published = time.monotonic()
    t.join(5)
    assert result["body"]["version"] == 2
    assert result["returned"] - published < 0.1, result
    assert result["waited"] >= 0.5


def test_long_poll_times_out_with_the_current_latest(registry, http):
    publish(registry, 1)
    t0 = time.monotonic()
    body = http.get("/v1/versions/latest", params={"after": 1, "wait_s": 0.3}).json()
    assert body["version"] == 1 and 0.3 <= time.monotonic() - t0 < 2


def test_long_poll_returns_at_once_for_another_instance(registry, http):
    publish(registry, 5)
    t0 = time.monotonic()
    body = http.get("/v1/versions/latest", params={"after": 9, "instance": "old", "wait_s": 20}).json()
    assert body["version"] == 5 and time.monotonic() - t0 < 1


def test_409_when_not_newer_and_idempotent_republish(registry, http):
    m2 = publish(registry, 2)
    # the same manifest again: 200, nothing changes
    r = http.post("/v1/versions", content=m2.model_dump_json())
    assert r.status_code == 200 and r.json()["created"] is False
    assert publish(registry, 2).digest == m2.digest
    with pytest.raises(Exception) as e:
        publish(registry, 1)
    assert getattr(e.value, "code", None) == "version_not_newer"
    with pytest.raises(Exception) as e:
        publish(registry, 2, seed=9)
    assert getattr(e.value, "code", None) == "version_conflict"
    r = http.put("/v1/uploads/2/files/model.safetensors", content=b"x")
    assert r.status_code == 409 and code(r) == "version_conflict"


def test_404_unknown_410_retired(registry, http):
    publish(registry, 1)
    assert code(http.get("/v1/versions/7")) == "version_unknown"
    assert http.get("/v1/versions/7").status_code == 404
    assert http.delete("/v1/versions/1").json()["state"] == "reclaimed"
    r = http.get("/v1/versions/1")
    assert r.status_code == 410 and code(r) == "version_retired"
    assert http.get("/v1/versions/1/files/model.safetensors").status_code == 410
    r = http.post("/v1/leases", json={"holder": "n", "version": 1})
    assert r.status_code == 410


def test_keep_newest_k(registry, http):
    for v in (1, 2, 3, 4):
        publish(registry, v)
    assert [(v["version"], v["state"]) for v in http.get("/v1/versions").json()["versions"]] == \
        [(2, "live"), (3, "live"), (4, "live")]


# -- leases ------------------------------------------------------------------------------------

def test_lease_renew_release_and_expiry_with_injected_clock(registry, http, clock):
    publish(registry, 1)
    lease = http.post("/v1/leases", json={"holder": "n1", "version": "latest", "ttl_s": 10}).json()
    assert lease["version"] == 1 and lease["expires_in_s"] == 10 and lease["digest"]
    clock.advance(8)
    renewed = http.put(f"/v1/leases/{lease['lease_id']}", json={"ttl_s": 20}).json()
    assert renewed["expires_in_s"] == 20
    clock.advance(21)
    r = http.put(f"/v1/leases/{lease['lease_id']}")
    assert r.status_code == 410 and code(r) == "lease_expired"
    r = http.delete("/v1/leases/nope")
    assert r.status_code == 404 and code(r) == "lease_unknown"
    other = http.post("/v1/leases", json={"holder": "n2", "version": 1}).json()
    assert http.delete(f"/v1/leases/{other['lease_id']}").status_code == 204
    assert code(http.put(f"/v1/leases/{other['lease_id']}")) == "lease_unknown"


def test_retired_bytes_readable_by_lease_holder_then_reclaimed(registry, http, clock):
    m = publish(registry, 1)
    lease = http.post("/v1/leases", json={"holder": "n1", "version": 1, "ttl_s": 30}).json()
    assert http.delete("/v1/versions/1").json()["state"] == "retired"
    r = http.get("/v1/versions/1/files/model.safetensors")
    assert r.status_code == 200 and len(r.content) == m.files[0].size
    assert http.get("/v1/versions/1").headers["x-rolloutd-version-state"] == "retired"
    assert code(http.post("/v1/leases", json={"holder": "n2", "version": 1})) == "version_retired"
    http.delete(f"/v1/leases/{lease['lease_id']}")
    assert http.get("/v1/versions/1/files/model.safetensors").status_code == 410


def test_retired_version_reclaimed_when_its_lease_expires(registry, http, clock):
    publish(registry, 1)
    http.post("/v1/leases", json={"holder": "n1", "version": 1, "ttl_s": 5})
    http.delete("/v1/versions/1")
    assert http.get("/v1/versions/1").status_code == 200
    clock.advance(6)
    assert http.get("/v1/versions/1").status_code == 410


@pytest.fixture
def registry_k2(clock):
    with EmbeddedRegistry(port=0, clock=clock, keep_versions=2) as reg:
        yield reg


def test_lease_on_latest_is_atomic_under_concurrent_publish(registry_k2):
    """With keep_versions=2 each publish retires a version: a lease on "latest" must never
    name a retired version, and the leased bytes must stay readable while it is held."""
    reg = registry_k2
    publish(reg, 1)
    failures, leased = [], []
    per_thread = 60

    def leaser():
        with httpx.Client(base_url=reg.url, timeout=10) as c:
            for _ in range(per_thread):
                r = c.post("/v1/leases", json={"holder": "n", "version": "latest", "ttl_s": 30})
                if r.status_code != 201:
                    failures.append(r.text)
                    continue
                lease = r.json()
                leased.append(lease["version"])
                got = c.get(f"/v1/versions/{lease['version']}/files/model.safetensors",
                            headers={"range": "bytes=0-99"})
                if got.status_code != 206:
                    failures.append(f"v{lease['version']}: {got.status_code} {got.text[:200]}")
                c.delete(f"/v1/leases/{lease['lease_id']}")

    threads = [threading.Thread(target=leaser) for _ in range(3)]
    for t in threads:
        t.start()
    v = 1
    while any(t.is_alive() for t in threads) and v < 2000:
        v += 1
        publish(reg, v)
    for t in threads:
        t.join(30)
    assert failures == []
    assert len(leased) == 3 * per_thread
    assert len(set(leased)) >= 5, "publishes did not interleave with the leases"
    assert [x["version"] for x in reg.versions()] == [v - 1, v]  # nothing left pinned


# -- replicas and demand -----------------------------------------------------------------------

HB = {"node": "n1", "server": "s0", "endpoint": "http://n1:8000", "state": "SERVING", "version": 1,
      "target": 1, "incarnation": 2, "timings": {"pause_s": 0.4}}


def test_replica_directory_age_on_registry_clock(registry, http, clock):
    r = http.put("/v1/replicas/n1.s0", json=HB)
    assert r.status_code == 200
    clock.advance(3.25)
    http.put("/v1/replicas/n2.s0", json={**HB, "node": "n2"})
    reps = {r["replica_id"]: r for r in http.get("/v1/replicas").json()["replicas"]}
    assert reps["n1.s0"]["age_s"] == 3.25 and reps["n2.s0"]["age_s"] == 0
    assert reps["n1.s0"]["incarnation"] == 2 and reps["n1.s0"]["timings"] == {"pause_s": 0.4}
    assert http.delete("/v1/replicas/n1.s0").status_code == 204
    assert http.delete("/v1/replicas/n1.s0").status_code == 204  # idempotent
    assert [r["replica_id"] for r in http.get("/v1/replicas").json()["replicas"]] == ["n2.s0"]


def test_replica_counts_fold_the_directory_and_skip_silent_replicas(registry, http, clock):
    http.put("/v1/replicas/n1.s0", json=HB)
    http.put("/v1/replicas/n1.s1", json={**HB, "server": "s1", "state": "UPDATING"})
    clock.advance(40)
    http.put("/v1/replicas/n2.s0", json={**HB, "node": "n2"})
    http.put("/v1/replicas/n3.s0", json={**HB, "node": "n3", "version": None, "state": "STARTING"})
    body = http.get("/v1/replica-counts").json()
    assert body["total"] == 4
    assert body["counts"] == [{"state": "SERVING", "version": 1, "count": 2},
                              {"state": "STARTING", "version": None, "count": 1},
                              {"state": "UPDATING", "version": 1, "count": 1}]
    recent = http.get("/v1/replica-counts", params={"max_age_s": 30}).json()["counts"]
    assert recent == [{"state": "SERVING", "version": 1, "count": 1},
                      {"state": "STARTING", "version": None, "count": 1}]
    assert registry.wait_for_replicas(1, min_version=1, timeout_s=1)[0]["replica_id"] == "n2.s0"
    with pytest.raises(TimeoutError, match="1 of 2 replicas SERVING"):
        registry.wait_for_replicas(2, min_version=1, timeout_s=0.2, poll_s=0.05)  # n1.s0 is silent


def test_demand_in_heartbeat_replies(registry, http):
    assert code(http.put("/v1/demand", json={"min_version": 1})) == "demand_ahead"
    publish(registry, 1)
    publish(registry, 2)
    assert http.put("/v1/demand", json={"min_version": 2}).json() == {"min_version": 2}
    reply = http.put("/v1/replicas/n1.s0", json=HB).json()
    assert reply["demand"] == {"min_version": 2} and reply["latest"] == 2
    http.put("/v1/demand", json={"min_version": None})
    assert http.put("/v1/replicas/n1.s0", json=HB).json()["demand"] == {"min_version": None}


@pytest.mark.parametrize("body", [{**HB, "state": ""}, {**HB, "state": "RUNNING"}, {**HB, "extra": 1},
                                  {**HB, "version": 0}, {"node": "n1"}, "not json"])
def test_bad_heartbeats_are_422(http, body):
    r = http.put("/v1/replicas/n1.s0", **({"content": body} if isinstance(body, str) else {"json": body}))
    assert r.status_code == 422 and code(r) == "invalid_request"


# -- bytes -------------------------------------------------------------------------------------

@pytest.fixture(params=["memory", "disk"])
def any_registry(request, tmp_path, clock):
    """The same registry with its bytes in memory, then on disk."""
    data_dir = tmp_path / "data" if request.param == "disk" else None
    with EmbeddedRegistry(port=0, clock=clock, data_dir=data_dir) as reg:
        yield reg


def test_range_206_and_416(any_registry):
    registry = any_registry
    http = httpx.Client(base_url=registry.url)
    publish(registry, 1)
    full = http.get("/v1/versions/1/files/model.safetensors")
    data, size = full.content, len(full.content)
    assert full.status_code == 200 and full.headers["accept-ranges"] == "bytes"
    r = http.get("/v1/versions/1/files/model.safetensors", headers={"range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == data[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{size}"
    assert http.get("/v1/versions/1/files/model.safetensors", headers={"range": "bytes=-5"}).content == data[-5:]
    assert http.get("/v1/versions/1/files/model.safetensors",
                    headers={"range": f"bytes={size - 3}-"}).content == data[-3:]
    assert len(http.get("/v1/versions/1/files/model.safetensors",
                        headers={"range": f"bytes=0-{size + 100}"}).content) == size
    for bad in (f"bytes={size}-", "bytes=5-2", "bytes=0-1,5-6", "items=0-1", "bytes=x-1", "bytes=-0"):
        r = http.get("/v1/versions/1/files/model.safetensors", headers={"range": bad})
        assert r.status_code == 416 and code(r) == "range_not_satisfiable", bad
        assert r.headers["content-range"] == f"bytes */{size}"
    head = http.head("/v1/versions/1/files/model.safetensors", headers={"range": "bytes=0-9"})
    assert head.status_code == 206 and head.headers["content-length"] == "10" and head.content == b""
    # a disk store's bytes are sent by the kernel (sendfile), a memory store's from memory
    sent = sendfile_responses(http)
    assert sent == (5 if registry.settings.data_dir else 0), sent


def sendfile_responses(http: httpx.Client) -> int:
    return int(metric(http, "rolloutd_registry_sendfile_responses_total"))


def test_sendfile_bytes_on_one_connection_a_client_that_leaves_and_a_reclaimed_version(tmp_path, clock):
    """Many ranges on one kept-alive connection, each whole; a client that disconnects halfway
    leaves the registry serving; a version reclaimed mid-transfer still reaches its reader."""
    with EmbeddedRegistry(port=0, clock=clock, data_dir=tmp_path / "data") as registry:
        data = os.urandom(6 << 20)
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "model.safetensors").write_bytes(data)
        registry.publish_dir(1, tmp_path / "src")
        url = "/v1/versions/1/files/model.safetensors"
        with httpx.Client(base_url=registry.url) as http:
            for start in range(0, len(data), 1 << 20):
                r = http.get(url, headers={"range": f"bytes={start}-{start + (1 << 20) - 1}"})
                assert r.status_code == 206 and r.content == data[start:start + (1 << 20)]
            with socket.create_connection(("127.0.0.1", registry.port)) as s:  # reads the head, then leaves
                s.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert s.recv(100).startswith(b"HTTP/1.1 200")
            lease = http.post("/v1/leases", json={"holder": "n", "version": 1, "ttl_s": 30}).json()
            with http.stream("GET", url) as r:
                pieces = r.iter_bytes()
                got = bytearray(next(pieces))
                assert http.delete("/v1/versions/1").status_code == 200  # retired: its bytes go once
                http.delete(f"/v1/leases/{lease['lease_id']}")             # the last lease ends
                assert http.get("/v1/versions/1").status_code == 410
                assert not (tmp_path / "data" / "versions" / "1").exists()
                for piece in pieces:
                    got += piece
            assert bytes(got) == data
            assert sendfile_responses(http) >= 8


STALLED = 70  # more clients stalled mid-body than a pool of 64 sending threads would have had


@pytest.mark.slow  # 70 stalled clients: 9 s
@pytest.mark.parallel
def test_ranges_sent_at_once_each_arrive_whole_and_stalled_clients_hold_up_none(tmp_path, monkeypatch, caplog):
    """One thread sends every range: eight clients reading ranges at once each get exactly
    theirs while 70 others have stopped reading mid-body; the stalled ones are dropped after
    ``STALL_S``, and a registry stopped under another stalled client leaves no descriptor open."""
    from rolloutd.registry import direct
    monkeypatch.setattr(direct, "STALL_S", 3.0)
    caplog.set_level(logging.INFO, logger="rolloutd.registry")
    data = os.urandom(48 << 20)  # more than loopback's socket buffers hold: a client that stops reading blocks
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(data)
    url = "/v1/versions/1/files/model.safetensors"
    request = f"GET {url} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    fds = open_fds()
    with EmbeddedRegistry(port=0, data_dir=tmp_path / "data") as registry:
        registry.publish_dir(1, tmp_path / "src")
        stalled = [socket.create_connection(("127.0.0.1", registry.port)) for _ in range(STALLED)]
        for s in stalled:
            s.sendall(request)
        for s in stalled:
            assert s.recv(100).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        got: dict[int, bytes] = {}

        def fetch(i: int) -> None:
            start, end = i * (6 << 20), (i + 1) * (6 << 20) - 1
            with httpx.Client(base_url=registry.url, timeout=30) as http:
                r = http.get(url, headers={"range": f"bytes={start}-{end}"})
                assert r.status_code == 206
                got[i] = r.content
        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert b"".join(got[i] for i in range(8)) == data
        dropped = lambda: any("the client left or stalled" in r.getMessage() for r in caplog.records)  # noqa: E731
        assert not dropped()  # the eight were served while the stalled ranges were still being sent
        wait_until(lambda: sum("the client left or stalled" in r.getMessage() for r in caplog.records) >= STALLED,
                   15, "every stalled client dropped")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # a client leaving is no error
        for s in stalled:
            s.close()
        # stopped while another client is stalled mid-body: its range ends with the registry
        monkeypatch.setattr(direct, "STALL_S", 600.0)
        second = socket.create_connection(("127.0.0.1", registry.port))
        second.sendall(request)
        assert second.recv(100).startswith(b"HTTP/1.1 200")
    second.close()

    def sends_open() -> set[str]:  # the connections' and the blob's duplicates (the sending thread stays)
        return {f for f in open_fds() - fds if "socket:" in f or str(tmp_path) in f}
    wait_until(lambda: not sends_open(), 10, "every descriptor of the sends closed", every_s=0.02)


def test_a_send_that_fails_unexpectedly_ends_its_range_alone(tmp_path, monkeypatch, caplog):
    """Crash policy of the sending thread: a surprise while sending one range (a fake
    ``sendfile`` that raises once) ends that range, short, and is logged; the thread goes on
    sending the next one whole."""
    from rolloutd.registry import direct
    data = os.urandom(8 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(data)
    real, calls = os.sendfile, []

    def fake_sendfile(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("a fake surprise")
        return real(*a)
    with EmbeddedRegistry(port=0, data_dir=tmp_path / "data") as registry, \
            httpx.Client(base_url=registry.url, timeout=30) as http:
        registry.publish_dir(1, tmp_path / "src")
        monkeypatch.setattr(direct.os, "sendfile", fake_sendfile)
        url = "/v1/versions/1/files/model.safetensors"
        with pytest.raises(httpx.HTTPError):  # the body ends short: the client is told, not fed less
            http.get(url)
        assert "sending a range failed" in caplog.text and "a fake surprise" in caplog.text
        r = http.get(url)
        assert r.status_code == 200 and r.content == data and len(calls) > 1


def raw_get(port: int, target: str) -> bytes:
    """An HTTP request with the path sent exactly as given (clients normalise '..')."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("target", [
    "/v1/versions/1/files/../../../../etc/passwd",
    "/v1/versions/1/files/..%2F..%2F..%2Fetc%2Fpasswd",
    "/v1/versions/1/files/%2e%2e",
    "/v1/versions/1/files/manifest.json",
    "/v1/versions/1/files/.%2Fmodel.safetensors",
])
def test_file_names_cannot_escape_the_version(tmp_path, target):
    with EmbeddedRegistry(port=0, data_dir=tmp_path / "data") as reg:
        publish(reg, 1)
        head, _, body = raw_get(reg.port, target).partition(b"\r\n\r\n")
        status = int(head.split()[1])
        assert status in (400, 404), head
        assert b"root:" not in body and b'"files"' not in body


def test_upload_names_cannot_escape_either(registry, http):
    r = http.put("/v1/uploads/1/files/..%2Fevil", content=b"x")
    assert r.status_code in (404, 422)
    r = http.put("/v1/uploads/1/files/.evil", content=b"x")
    assert r.status_code == 422 and code(r) == "invalid_request"


# -- publishing over HTTP only (a non-Python trainer) -----------------------------------------

def test_publish_over_http_alone(registry, http, tmp_path):
    from rolloutd.trainer.publish import save_shards
    paths = save_shards(small(3), tmp_path, shard_bytes=20_000)
    assert len(paths) > 1
    m = build_manifest(1, paths, chunk_bytes=CHUNK)
    body = json.loads(m.model_dump_json())
    del body["digest"]  # optional: the registry seals it
    r = http.post("/v1/versions", json=body)
    assert r.status_code == 409 and code(r) == "upload_incomplete"
    for p in paths:
        r = http.put(f"/v1/uploads/1/files/{p.name}", content=p.read_bytes())
        assert r.status_code == 201 and r.json()["size"] == p.stat().st_size
    r = http.post("/v1/versions", json=body)
    assert r.status_code == 201 and r.json()["digest"] == m.digest
    for p in paths:
        assert http.get(f"/v1/versions/1/files/{p.name}").content == p.read_bytes()


def test_corrupt_upload_is_refused_and_can_be_redone(registry, http, tmp_path):
    from rolloutd.trainer.publish import save_shards
    (p,) = save_shards(small(1), tmp_path)
    m = build_manifest(1, [p], chunk_bytes=CHUNK)
    bad = bytearray(p.read_bytes())
    bad[CHUNK * 2 + 1] ^= 1
    http.put(f"/v1/uploads/1/files/{p.name}", content=bytes(bad))
    r = http.post("/v1/versions", content=m.model_dump_json())
    assert r.status_code == 422 and code(r) == "digest_mismatch" and "chunks [2]" in r.json()["error"]["message"]
    assert http.get("/v1/versions/latest").json()["version"] is None
    http.put(f"/v1/uploads/1/files/{p.name}", content=p.read_bytes())
    assert http.post("/v1/versions", content=m.model_dump_json()).status_code == 201


def test_wrong_manifest_digest_is_refused(registry, http, tmp_path):
    from rolloutd.trainer.publish import save_shards
    (p,) = save_shards(small(1), tmp_path)
    body = json.loads(build_manifest(1, [p], chunk_bytes=CHUNK).model_dump_json())
    body["digest"] = "0" * 64
    r = http.post("/v1/versions", json=body)
    assert r.status_code == 422 and code(r) == "manifest_digest_mismatch"


def metric(http: httpx.Client, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.M).group(1))


def raw_put(port: int, head: str, body_parts, pause_s: float = 0.0) -> tuple[int, dict, bytes]:
    """A PUT sent by hand, its body in parts (a pause after each); the final reply's status and
    JSON body (status 0: the connection ended without a reply), and all that came back."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head.encode())
        for part in body_parts:
            s.sendall(part)
            time.sleep(pause_s)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    final = reply.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    if not final:
        return 0, {}, reply
    return int(final.split()[1]), json.loads(final.partition(b"\r\n\r\n")[2] or b"null"), reply


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_large_upload_is_read_straight_from_the_socket_and_its_connection_closes(tmp_path, store):
    """A body of 1 MiB or more is read from the socket past uvicorn's buffers (counted by
    ``rolloutd_registry_direct_uploads_total``: the installed uvicorn takes the path), whole and
    in order, including what arrived with the head and a ``100-continue``; the connection then
    closes; a smaller body keeps its connection. The published bytes are read back."""
    data = {"a.safetensors": os.urandom(3 << 20), "b.safetensors": os.urandom((1 << 20) + 7),
            "c.safetensors": os.urandom(200_000)}
    data_dir = tmp_path / "data" if store == "disk" else None
    with EmbeddedRegistry(port=0, data_dir=data_dir) as reg, httpx.Client(base_url=reg.url, timeout=30) as http:
        r = http.put("/v1/uploads/1/files/a.safetensors", content=data["a.safetensors"])
        assert r.status_code == 201 and r.json()["size"] == 3 << 20 and r.headers["connection"] == "close"
        b = data["b.safetensors"]
        status, body, reply = raw_put(reg.port, f"PUT /v1/uploads/1/files/b.safetensors HTTP/1.1\r\nHost: x\r\n"
                                                f"Content-Length: {len(b)}\r\nExpect: 100-continue\r\n\r\n",
                                      [b[:5000], b[5000:700_000], b[700_000:]], pause_s=0.05)
        assert status == 201 and body["size"] == len(b) and reply.startswith(b"HTTP/1.1 100 Continue"), reply
        r = http.put("/v1/uploads/1/files/c.safetensors", content=data["c.safetensors"])
        assert r.status_code == 201 and "connection" not in r.headers
        assert metric(http, "rolloutd_registry_direct_uploads_total") == 2
        src = tmp_path / "src"
        src.mkdir()
        for name, content in data.items():
            (src / name).write_bytes(content)
        m = build_manifest(1, sorted(src.glob("*.safetensors")), chunk_bytes=1 << 20)
        r = http.post("/v1/versions", content=m.model_dump_json())
        assert r.status_code == 201, r.text
        for name, content in data.items():
            assert http.get(f"/v1/versions/1/files/{name}").content == content, name


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_large_upload_cut_silent_or_failing_ends_with_a_reply_and_leaves_nothing(tmp_path, store, monkeypatch,
                                                                                   caplog):
    """Read straight from the socket, a body that stops early (the client closes), goes silent
    for ``STALL_S``, or cannot be written (a fake store write that fails) ends in an error reply
    where the client still listens, not a reset; nothing is staged; no descriptor of the
    connection or the store is left open; the same upload then works."""
    from rolloutd.registry import direct
    monkeypatch.setattr(direct, "STALL_S", 0.5)
    caplog.set_level(logging.WARNING)
    size = 4 << 20
    data = os.urandom(size)
    head = f"PUT /v1/uploads/1/files/model.safetensors HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n"
    data_dir = tmp_path / "data" if store == "disk" else None
    with EmbeddedRegistry(port=0, data_dir=data_dir) as reg, httpx.Client(base_url=reg.url, timeout=30) as http:
        fds = open_fds()
        # silent after 2 MiB: the registry stops waiting and says why
        t0 = time.monotonic()
        status, body, _ = raw_put(reg.port, head, [data[:2 << 20]])
        assert status == 409 and body["error"]["code"] == "upload_incomplete", body
        assert "no bytes for 0.5 s" in body["error"]["message"] and time.monotonic() - t0 < 10
        # closed halfway: aborted
        before = sum("abort upload" in r.getMessage() for r in caplog.records)
        with socket.create_connection(("127.0.0.1", reg.port)) as s:
            s.sendall(head.encode() + data[:3 << 20])
        wait_until(lambda: sum("abort upload" in r.getMessage() for r in caplog.records) > before, 10,
                   "the upload closed halfway aborted", every_s=0.02)
        # the store fails after the first piece: the client, still sending, gets the error
        probe = reg.service.blobs.upload(2, "x.safetensors", 1)
        probe.abort()
        real = type(probe)
        calls = []

        def failing_write(self, pieces):
            calls.append(len(pieces))
            if len(calls) > 1:
                raise OSError(28, "No space left on device (a fake)")
            return real_write(self, pieces)
        real_write = real.write
        monkeypatch.setattr(real, "write", failing_write)
        status, body, _ = raw_put(reg.port, head, [data[i:i + (1 << 20)] for i in range(0, size, 1 << 20)])
        assert status == 500 and body["error"]["code"] == "internal", body
        monkeypatch.setattr(real, "write", real_write)
        assert reg.service.blobs.staged_sizes(1) == {}
        assert data_dir is None or [p for p in (data_dir / "staging").rglob("*") if p.is_file()] == []
        wait_until(lambda: open_fds() <= fds, 10, "every descriptor of the uploads closed", every_s=0.02)
        r = http.put("/v1/uploads/1/files/model.safetensors", content=data)
        assert r.status_code == 201 and reg.service.blobs.read_staged(1, "model.safetensors", 0, size) == data


def open_fds() -> set[str]:
    """What this process's descriptors are open on."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
    return found


@pytest.mark.parametrize("store", ["memory", "disk"])
@pytest.mark.parametrize("sent", [300_000, 9_000_000])  # under one write batch; two batches (one in flight)
def test_upload_cut_off_halfway_leaves_nothing(tmp_path, store, sent):
    """Nothing staged, no file or memory file left open, whether or not a batch was being written."""
    def blob_fds() -> int:
        return sum(f.split(":", 1)[1].startswith(("/memfd:rolloutd-blob", str(tmp_path))) for f in open_fds())
    data_dir = tmp_path / "data" if store == "disk" else None
    with EmbeddedRegistry(port=0, data_dir=data_dir) as reg:
        before = blob_fds()  # other registries of this process may still hold blobs
        with socket.create_connection(("127.0.0.1", reg.port)) as s:
            s.sendall(b"PUT /v1/uploads/1/files/model.safetensors HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 20000000\r\n\r\n" + b"x" * sent)
            time.sleep(0.3)
        deadline = time.monotonic() + 5
        staging = tmp_path / "data" / "staging" / "1"
        while (any(staging.glob("*")) or blob_fds() > before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(staging.glob("*")) == [] and blob_fds() == before
        assert reg.service.blobs.staged_sizes(1) == {}
        # the same file then arrives whole (a memory file's mapping holds a descriptor of it)
        r = httpx.put(f"{reg.url}/v1/uploads/1/files/model.safetensors", content=b"y" * 9_000_000)
        assert r.status_code == 201 and reg.service.blobs.staged_sizes(1) == {"model.safetensors": 9_000_000}
        assert reg.service.blobs.read_staged(1, "model.safetensors", 8_999_999, 1) == b"y"
        assert blob_fds() == before + (store == "memory")


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_uploads_cannot_be_dropped_while_their_version_is_published(tmp_path, store, monkeypatch):
    """``DELETE /v1/uploads/{v}`` while v's bytes are being checked: refused (409), and the
    publish goes on with the uploaded bytes (a disk store committed an empty version before)."""
    data = os.urandom(300_000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(data)
    m = build_manifest(1, [src / "model.safetensors"], chunk_bytes=CHUNK)
    data_dir = tmp_path / "data" if store == "disk" else None
    with EmbeddedRegistry(port=0, data_dir=data_dir) as reg, httpx.Client(base_url=reg.url, timeout=30) as http:
        assert http.put("/v1/uploads/1/files/model.safetensors", content=data).status_code == 201
        verifying, go_on = threading.Event(), threading.Event()
        real_verify = reg.service.blobs.verify_staged

        def fake_slow_verify(manifest):  # holds the publish between its start and its commit
            verifying.set()
            go_on.wait(10)
            return real_verify(manifest)

        monkeypatch.setattr(reg.service.blobs, "verify_staged", fake_slow_verify)
        published = {}
        poster = threading.Thread(target=lambda: published.update(
            r=httpx.post(f"{reg.url}/v1/versions", content=m.model_dump_json(), timeout=30)))
        poster.start()
        try:
            assert verifying.wait(10)
            dropped = http.delete("/v1/uploads/1")
        finally:
            go_on.set()
            poster.join(30)
        assert dropped.status_code == 409 and code(dropped) == "version_conflict", dropped.text
        assert "being published" in dropped.json()["error"]["message"]
        assert published["r"].status_code == 201, published["r"].text
        assert http.get("/v1/versions/1/files/model.safetensors").content == data
        assert http.delete("/v1/uploads/1").status_code == 204  # once published: nothing staged, nothing done


def test_a_publish_outlives_its_request_and_a_post_of_the_same_manifest_waits_for_it(tmp_path, monkeypatch):
    """Verifying takes as long as it takes (a fake_ verify held until the test lets it go): with
    ``Prefer: respond-async, wait=N`` the registry answers 202 after N s and the publish goes on;
    a client that gives up stops nothing; the same manifest POSTed meanwhile waits for that very
    publish (one verify in all); a failed publish keeps its error for the next POST of its
    manifest (not verified again), whoever was waiting when it ended, until an upload comes."""
    from rolloutd.trainer.publish import save_shards
    (p,) = save_shards(small(1), tmp_path)
    m = build_manifest(1, [p], chunk_bytes=CHUNK)
    prefer = {"prefer": "respond-async, wait=0.2"}
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url, timeout=30) as http:
        real_verify = reg.service.blobs.verify_staged
        verifies, go_on = [], threading.Event()

        def fake_slow_verify(manifest):
            verifies.append(manifest.version)
            go_on.wait(30)
            return real_verify(manifest)
        monkeypatch.setattr(reg.service.blobs, "verify_staged", fake_slow_verify)
        bad = bytearray(p.read_bytes())
        bad[CHUNK + 1] ^= 1
        assert http.put(f"/v1/uploads/1/files/{p.name}", content=bytes(bad)).status_code == 201
        r = http.post("/v1/versions", content=m.model_dump_json(), headers=prefer)
        assert r.status_code == 202 and r.headers["preference-applied"] == "respond-async", r.text
        assert r.json() == {"version": 1, "digest": m.digest, "state": "publishing"}
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up
            httpx.post(f"{reg.url}/v1/versions", content=m.model_dump_json(), timeout=0.2)
        go_on.set()
        r = http.post("/v1/versions", content=m.model_dump_json(), headers={"prefer": "respond-async, wait=30"})
        assert r.status_code == 422 and code(r) == "digest_mismatch", r.text  # the first publish's own error
        assert verifies == [1]
        go_on.clear()
        assert http.put(f"/v1/uploads/1/files/{p.name}", content=p.read_bytes()).status_code == 201
        waited: dict = {}  # a client without Prefer: its POST waits for the end (a fresh publish, not the old error)
        waiter = threading.Thread(target=lambda: waited.update(
            r=httpx.post(f"{reg.url}/v1/versions", content=m.model_dump_json(), timeout=30)))
        waiter.start()
        wait_until(lambda: verifies == [1, 1], 10, "the new bytes being verified")
        r = http.post("/v1/versions", content=m.model_dump_json(), headers=prefer)
        assert r.status_code == 202, r.text  # joined it
        go_on.set()
        waiter.join(30)
        assert waited["r"].status_code == 201 and waited["r"].json()["digest"] == m.digest, waited["r"].text
        assert verifies == [1, 1]  # one publish for both POSTs
        r = http.post("/v1/versions", content=m.model_dump_json(), headers=prefer)
        assert r.status_code == 200 and r.json()["created"] is False
        assert http.get(f"/v1/versions/1/files/{p.name}").content == p.read_bytes()


# -- auth, limits, errors ------------------------------------------------------------------------

def test_bearer_token_required_everywhere_but_healthz(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with EmbeddedRegistry(port=0, token_file=token_file) as reg:
        plain = httpx.Client(base_url=reg.url)
        assert plain.get("/healthz").status_code == 200
        for method, path in [("GET", "/v1/versions/latest"), ("GET", "/metrics"), ("GET", "/v1/replicas"),
                             ("PUT", "/v1/replicas/a"), ("POST", "/v1/leases"), ("GET", "/nope")]:
            r = plain.request(method, path)
            assert r.status_code == 401 and code(r) == "unauthorized", path
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = plain.get("/v1/versions/latest", headers={"authorization": "Bearer s3cret-toke"})
        assert wrong.status_code == 401
        publish(reg, 1)  # the library sends the token
        assert reg.latest()["version"] == 1
        ok = plain.get("/v1/versions/latest", headers={"authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200
        metrics = plain.get("/metrics", headers={"authorization": "Bearer s3cret-token"}).text
        assert 'route="unmatched",status="401"} 7.0' in metrics  # refusals are counted too
        plain.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "trainer.lan"])
def test_a_registry_off_loopback_without_a_token_refuses_to_start(tmp_path, capsys, host):
    """Fail closed: embedded or standalone, a registry on an address other hosts reach needs a
    token file or an explicit allow_unauthenticated (before: every route open to them)."""
    with pytest.raises(ValueError, match=r"needs a token file \(--token-file, token_file=\), or "
                                         r"allow_unauthenticated"):
        EmbeddedRegistry(host=host, port=0)
    r = run_cli(capsys, "registry", "--host", host, "--port", "0")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == (f"rolloutd: a registry on {host} (not loopback) needs a token file (--token-file, "
                        "token_file=), or allow_unauthenticated (--allow-unauthenticated) to let anyone who can "
                        "reach it publish and read versions\n")


def test_a_registry_off_loopback_serves_with_a_token_or_when_allowed_open(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with EmbeddedRegistry(host="0.0.0.0", port=0, token_file=token_file) as reg:
        assert httpx.get(f"{reg.url}/v1/versions/latest").status_code == 401
    with EmbeddedRegistry(host="0.0.0.0", port=0, allow_unauthenticated=True) as reg:
        assert httpx.get(f"{reg.url}/v1/versions/latest").status_code == 200
    with EmbeddedRegistry(host="127.0.0.1", port=0) as reg:  # loopback: no token needed
        assert httpx.get(f"{reg.url}/v1/versions/latest").status_code == 200


def test_oversized_bodies_are_refused(tmp_path):
    with EmbeddedRegistry(port=0, max_json_bytes=8192, max_file_bytes=10_000) as reg:
        http = httpx.Client(base_url=reg.url)
        r = http.put("/v1/replicas/a", content=b"{" + b" " * 9000 + b"}")
        assert r.status_code == 413 and code(r) == "body_too_large"
        r = http.put("/v1/uploads/1/files/a.safetensors", content=b"x" * 10_001)
        assert r.status_code == 413
        # a chunked body with no Content-Length is counted as it arrives
        r = http.put("/v1/uploads/1/files/a.safetensors", content=iter([b"x" * 6000, b"x" * 6000]))
        assert r.status_code == 413 and code(r) == "body_too_large"
        assert reg.service.blobs.staged_sizes(1) == {}
        http.close()


def test_unknown_routes_and_methods_are_json_errors(http):
    r = http.get("/v2/anything")
    assert r.status_code == 404 and code(r) == "not_found"
    r = http.patch("/v1/versions/latest")
    assert r.status_code == 405 and code(r) == "method_not_allowed"
    r = http.get("/v1/versions/abc")
    assert r.status_code == 404 and code(r) == "not_found"
    r = http.delete("/v1/versions/latest")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    r = http.request("OPTIONS", "/v1/versions")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    r = http.put("/v1/demand", json={"min_version": True})
    assert r.status_code == 422 and "boolean" in r.json()["error"]["message"]
    r = http.post("/v1/leases", content=b"{bad json")
    assert r.status_code == 422
    for bad in ({"holder": "n", "version": 0}, {"holder": "n", "version": "newest"},
                {"holder": "", "version": 1}, {"holder": "n", "version": 1, "ttl_s": -1}):
        r = http.post("/v1/leases", json=bad)
        assert r.status_code == 422 and code(r) == "invalid_request", bad


def test_metrics_count_requests_and_state(registry, http):
    publish(registry, 1)
    http.put("/v1/replicas/n1.s0", json=HB)
    text = http.get("/metrics").text
    assert "rolloutd_registry_latest_version 1.0" in text
    assert "rolloutd_registry_heartbeats_total 1.0" in text
    assert 'rolloutd_registry_requests_total{route="/v1/replicas/{replica_id}",status="200"} 1.0' in text


# -- persistence ---------------------------------------------------------------------------------

def test_disk_registry_keeps_versions_across_restart_with_a_new_instance(tmp_path):
    data = tmp_path / "data"
    with EmbeddedRegistry(port=0, data_dir=data) as reg:
        m = publish(reg, 1)
        publish(reg, 2)
        first_instance = reg.latest()["instance"]
        content = httpx.get(reg.url + "/v1/versions/1/files/model.safetensors").content
    (data / "staging" / "9").mkdir(parents=True)  # a publish cut off by the restart
    (data / "versions" / "7").mkdir()               # a version dir without its manifest
    with EmbeddedRegistry(port=0, data_dir=data) as reg:
        latest = reg.latest()
        assert latest["version"] == 2 and latest["instance"] != first_instance
        assert reg.manifest(1).digest == m.digest
        assert httpx.get(reg.url + "/v1/versions/1/files/model.safetensors").content == content
        assert not (data / "staging" / "9").exists()
        assert [v["version"] for v in reg.versions()] == [1, 2]
