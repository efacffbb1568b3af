"""The gateway's half of the version contract (``X-Rolloutd-Min-Version``), in front of a fake
generation server (tests/support/fake_replica.py): what reaches the server, and what a client is told
when the server is below the version it asks for. A real server behind the daemon's gateway:
tests/system/test_fleet_vllm.py."""

from __future__ import annotations

import re
import socket
import threading

import httpx
import pytest

from rolloutd.wire import version_contract as contract
from rolloutd.wire.states import ServerState as S
from tests.conftest import free_port
from tests.support.daemon_harness import wait_until
from tests.support.fake_replica import FakeReplica
from tests.support.gateway_harness import GatewayThread

BODY = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}, "stream": False}


@pytest.fixture
def upstream():
    f = FakeReplica("5").start()
    yield f
    f.stop()


@pytest.fixture
def gateway(upstream):
    g = GatewayThread(upstream.socket, free_port(), retry_after_s=3).start()
    yield g
    g.stop()


def post(gw: GatewayThread, min_version: str | bytes | None) -> httpx.Response:
    headers = {contract.MIN_VERSION_HEADER: min_version} if min_version is not None else {}
    return httpx.post(gw.url + "/inference/v1/generate", json=BODY, headers=headers, timeout=30)


def test_a_server_below_the_version_asked_for_refuses_it_retryably(upstream, gateway):
    gateway.set_version(5)
    for asked in ("5", "1", "0004"):
        assert post(gateway, asked).status_code == 200, asked
    assert len(upstream.requests) == 3
    assert all(contract.MIN_VERSION_HEADER not in r["headers"] for r in upstream.requests)  # not vLLM's business
    r = post(gateway, "6")
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_behind"
    assert r.headers["Retry-After"] == "3" and r.headers[contract.VERSION_HEADER] == "5"
    assert "holds version 5; the request wants 6" in r.json()["error"]["message"]
    assert post(gateway, None).status_code == 200  # no header: any version
    gateway.set_version(None)  # a restarted server, on its start model
    r = post(gateway, "1")
    assert r.status_code == 409 and r.headers[contract.VERSION_HEADER] == "none"
    assert len(upstream.requests) == 4
    assert gateway.requests("/inference/v1/generate", 409) == 2


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "", "99999999999999999999", "٣".encode()])
def test_a_header_that_is_not_a_version_is_a_bad_request(upstream, gateway, value):
    gateway.set_version(5)
    r = post(gateway, value)
    assert r.status_code == 400 and contract.MIN_VERSION_HEADER in r.json()["error"]["message"]
    assert upstream.requests == []


def test_a_request_held_during_an_update_is_judged_by_the_version_loaded(upstream, gateway):
    gateway.set_version(5)
    gateway.set_state(S.UPDATING)
    answers: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda v=v: answers.__setitem__(v, post(gateway, v))) for v in ("6", "7")]
    for t in threads:
        t.start()
    wait_until(lambda: gateway.metrics.registry.get_sample_value(
        "rolloutd_gateway_held_total", {"server": "gpu0"}) == 2, 10, "both requests held")
    assert upstream.requests == []
    gateway.set_version(6)  # the supervisor: the load is done, then the server serves
    gateway.set_state(S.SERVING)
    for t in threads:
        t.join(10)
    assert answers["6"].status_code == 200
    assert answers["7"].status_code == 409 and answers["7"].headers[contract.VERSION_HEADER] == "6"
    assert len(upstream.requests) == 1


def test_a_refusal_keeps_the_connection_and_the_order_of_pipelined_requests(upstream, gateway):
    gateway.set_version(5)
    body = b'{"token_ids":[1],"sampling_params":{"max_tokens":1}}'

    def request(version: int) -> bytes:
        return (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"%s: %d\r\nContent-Length: %d\r\n\r\n%s" % (contract.MIN_VERSION_HEADER.encode(), version,
                                                              len(body), body))
    with socket.create_connection(("127.0.0.1", gateway.gateway.port), timeout=10) as s:
        s.sendall(request(9) + request(5) + request(8) + request(4))
        data = b""
        while len(re.findall(rb"HTTP/1\.1 \d{3}", data)) < 4 or not data.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3})", data)]
    assert statuses == [409, 200, 409, 200]
