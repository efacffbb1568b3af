"""The tests of test_gateway.py that run one at a time in the slow tier (slow by this folder);
the rest is in tests/integration/gateway/test_gateway.py, the helpers and fixtures they share in
tests/support/gateway_clients.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from rolloutd.wire.states import ServerState as S
from tests.conftest import free_port
from tests.support import gateway_clients
from tests.support.gateway_clients import (
    AUTH,
    DEV_ROUTES,
    PROMPT,
    TOKEN,
    TRICKS,
    FakeUpstream,
    generate_body,
    post,
    post_in_thread,
    raw_request,
    responses,
    stream_arrivals,
    talk,
)
from tests.support.gateway_harness import GatewayThread

# the module's fixtures, by name, for the tests below
gateway = gateway_clients.gateway
vllm = gateway_clients.vllm

pytestmark = pytest.mark.timeout(600)


def test_allowed_routes_answer_as_vllm_does(vllm, gateway):
    gw = gateway(token=TOKEN)
    with httpx.Client(timeout=60) as c, vllm.client(timeout=60) as d:
        direct = d.post("/inference/v1/generate", json=generate_body()).json()
        via = c.post(gw.url + "/inference/v1/generate", json=generate_body(), headers=AUTH)
        assert via.status_code == 200 and via.json()["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        model = c.get(gw.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
        completion = c.post(gw.url + "/v1/completions", headers=AUTH,
                            json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert completion.status_code == 200 and completion.json()["choices"][0]["text"] is not None
        chat = c.post(gw.url + "/v1/chat/completions", headers=AUTH,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == d.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code
        tokens = c.post(gw.url + "/tokenize", headers=AUTH, json={"model": model, "prompt": "hello"}).json()
        direct_tokens = d.post("/tokenize", json={"model": model, "prompt": "hello"}).json()["tokens"]
        assert tokens["tokens"] == direct_tokens
        text = c.post(gw.url + "/detokenize", headers=AUTH, json={"model": model, "tokens": tokens["tokens"]})
        assert text.status_code == 200 and "prompt" in text.json()
        abort = c.post(gw.url + "/inference/v1/abort_requests", headers=AUTH, json={"request_ids": ["none"]})
        assert abort.status_code == d.post("/inference/v1/abort_requests",
                                           json={"request_ids": ["none"]}).status_code
        assert c.get(gw.url + "/health", headers=AUTH).status_code == 200
    assert gw.requests("/inference/v1/generate", 200) == 1


def test_dev_routes_and_their_disguises_are_404(vllm, gateway):
    gw = gateway(token=TOKEN)
    assert vllm.client().get("/is_paused").status_code == 200  # vLLM has them (dev mode) ...
    for method, path in DEV_ROUTES:  # ... the gateway does not, with or without the token
        assert raw_request(gw.url, method, path, AUTH) == 404, path
        assert raw_request(gw.url, method, path) == 404, path
    for path in TRICKS:
        assert raw_request(gw.url, "POST", path, AUTH) == 404, path
    assert vllm.client().get("/is_paused").json() == {"is_paused": False}  # nothing reached vLLM
    assert gw.requests("other", 404) == 2 * len(DEV_ROUTES) + len(TRICKS)


def test_token_is_required_and_not_passed_on(gateway, caplog):
    gw = gateway(token=TOKEN)
    with httpx.Client(timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
            r = c.post(gw.url + "/inference/v1/generate", json=generate_body(), headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", headers
            assert r.json()["error"]["code"] == "unauthorized" and TOKEN not in r.text
        assert c.get(gw.url + "/health").status_code == 401
        assert c.post(gw.url + "/inference/v1/generate", json=generate_body(), headers=AUTH).status_code == 200
    assert TOKEN not in caplog.text


def test_wrong_method_and_large_body(gateway):
    gw = gateway(max_body_bytes="4KiB")
    r = httpx.get(gw.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    big = httpx.post(gw.url + "/inference/v1/generate", content=b"x" * 5000,
                     headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "too_large"


def test_streaming_passes_vllms_events_on(vllm, gateway):
    gw = gateway()
    _, direct_body = stream_arrivals(vllm.client(timeout=60))
    times, body = stream_arrivals(httpx.Client(base_url=gw.url, timeout=60))

    def tokens(raw: bytes) -> list[int]:
        out = []
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                out += json.loads(line[6:])["choices"][0]["token_ids"]
        return out
    assert tokens(body) == tokens(direct_body) and len(tokens(body)) == 48
    assert body.rstrip().endswith(b"data: [DONE]")


def test_hold_while_paused_then_forward(vllm, gateway):
    gw = gateway(while_paused="hold", hold_max_s=30)
    expected = vllm.client().post("/inference/v1/generate", json=generate_body(), timeout=60).json()
    gw.set_state(S.UPDATING)
    assert vllm.client().post("/pause", params={"mode": "keep"}, timeout=30).status_code == 200
    try:
        held = post_in_thread(gw.url + "/inference/v1/generate", json=generate_body())
        time.sleep(1.5)
        assert held["thread"].is_alive()  # held at the gateway
    finally:
        vllm.client().post("/resume", timeout=30)
        gw.set_state(S.SERVING)
    held["thread"].join(60)
    assert held["status"] == 200 and held["seconds"] >= 1.5
    assert held["json"]["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert gw.metrics.registry.get_sample_value("rolloutd_gateway_held_total", {"server": "gpu0"}) == 1


def test_hold_has_a_bound_then_503(gateway):
    gw = gateway(while_paused="hold", hold_max_s=0.5, retry_after_s=7)
    gw.set_state(S.UPDATING)
    t0 = time.perf_counter()
    r = httpx.post(gw.url + "/inference/v1/generate", json=generate_body(), timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"] == "7"
    assert 0.5 <= time.perf_counter() - t0 < 3
    assert "still UPDATING after 0.5 s" in r.json()["error"]["message"]


@pytest.mark.parametrize("state, settings", [(S.UPDATING, {"while_paused": "reject"}), (S.SYNCING, {}),
                                             (S.STARTING, {}), (S.BACKOFF, {}), (S.STOPPING, {})])
def test_503_with_retry_after_when_not_serving(gateway, state, settings):
    gw = gateway(retry_after_s=3, **settings)
    gw.set_state(state)
    t0 = time.perf_counter()
    r = httpx.post(gw.url + "/inference/v1/generate", json=generate_body(), timeout=30)
    assert (r.status_code, r.headers["Retry-After"]) == (503, "3")
    assert time.perf_counter() - t0 < 1
    assert r.json()["error"] == {"code": "unavailable", "message": f"server gpu0 is {state.name}"}


def test_same_answers_on_032_and_033_while_paused(vllm, gateway):
    """While paused, new requests never reach either server: held, or 503 with reject."""
    with FakeUpstream() as fake:
        for settings, expect in (({"while_paused": "reject"}, 503), ({"while_paused": "hold", "hold_max_s": 0.3}, 503)):
            answers = []
            for upstream in (vllm.socket, fake.socket):
                gw = GatewayThread(upstream, free_port(), **settings).start(S.UPDATING)
                try:
                    r = httpx.post(gw.url + "/inference/v1/generate", json=generate_body(), timeout=30)
                    answers.append((r.status_code, r.headers.get("Retry-After"), r.json()["error"]["code"]))
                finally:
                    gw.stop()
            assert answers[0] == answers[1] == (expect, "2", "unavailable"), answers
        assert fake.seen == 0


def test_pipelined_requests_are_answered_in_order(vllm, gateway):
    gw = gateway(token=TOKEN)
    model = vllm.client().get("/v1/models").json()["data"][0]["id"]
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    words = ["hello", "pause", "world"]
    expected = [vllm.client().post("/tokenize", json={"model": model, "prompt": w}).json()["tokens"]
                for w in words]
    data = talk(gw.url, b"".join([post("/tokenize", {"model": model, "prompt": words[0]}, extra=auth),
                                  b"POST /pause HTTP/1.1\r\nHost: node\r\nContent-Length: 0\r\n"  # 404, in turn
                                  + auth.encode() + b"\r\n",
                                  post("/tokenize", {"model": model, "prompt": words[2]}, extra=auth),
                                  post("/tokenize", {"model": model, "prompt": words[1]},
                                       extra=auth + "Connection: close\r\n")]))
    answers = responses(data)
    assert [status for status, _, _ in answers] == [200, 404, 200, 200]
    assert [json.loads(body)["tokens"] for _, _, body in (answers[0], answers[2], answers[3])] == \
        [expected[0], expected[2], expected[1]]
    assert answers[3][1]["connection"] == "close"


def test_expect_100_continue(vllm, gateway):
    gw = gateway(token=TOKEN)
    body = json.dumps(generate_body()).encode()
    head = (f"POST /inference/v1/generate HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n").encode()
    # Allowed: "100 Continue" first, then the body is read and forwarded.
    answers = responses(talk(gw.url, head + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode(), body, pause_s=0.3))
    assert [status for status, _, _ in answers] == [100, 200], answers
    assert len(json.loads(answers[1][2])["choices"][0]["token_ids"]) == 12
    # Refused: the answer comes at once, without waiting for a body the client holds back.
    t0 = time.perf_counter()
    answers = responses(talk(gw.url, head + b"\r\n", timeout_s=5))
    assert [status for status, _, _ in answers] == [401] and time.perf_counter() - t0 < 2


def test_a_chunked_request_body_is_forwarded_whole(vllm, gateway):
    gw = gateway()
    model = vllm.client().get("/v1/models").json()["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "hello world"}).encode()
    half = len(body) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    head = (b"POST /tokenize HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    [(status, _, answer)] = responses(talk(gw.url, head + chunked[:20], chunked[20:], pause_s=0.2))
    assert status == 200, answer
    direct = vllm.client().post("/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert json.loads(answer)["tokens"] == direct.json()["tokens"]


def test_http_1_0_clients(vllm, gateway):
    gw = gateway()
    # A streamed answer to HTTP/1.0 has no chunked framing: it ends with the connection.
    data = talk(gw.url, post("/inference/v1/generate", generate_body(max_tokens=5, stream=True), version="1.0"))
    [(status, headers, body)] = responses(data)
    assert status == 200 and "transfer-encoding" not in headers and body.rstrip().endswith(b"data: [DONE]")
    # Keep-alive asked for: kept, and said so.
    keep = b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    answers = responses(talk(gw.url, keep, b"GET /v1/models HTTP/1.0\r\n\r\n", pause_s=0.3))
    assert [(status, headers.get("connection")) for status, headers, _ in answers] == \
        [(200, "keep-alive"), (200, "close")]


def test_what_is_not_http_or_too_large_a_head_is_refused_and_closed(gateway):
    gw = gateway(token=TOKEN)
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    for raw, status in ((b"hello\r\n\r\n", 400), (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400),
                        (b"GET /health HTTP/1.1\r\n" + auth + b"X-Pad: " + b"p" * 70_000 + b"\r\n\r\n", 431),
                        (b"GET /health HTTP/1.1\r\n" + auth + b"X-Pad: " + b"p" * 70_000, 431),  # and more to come
                        (b"CONNECT node:443 HTTP/1.1\r\nHost: node:443\r\n" + auth + b"\r\n", 404)):
        [(got, headers, body)] = responses(talk(gw.url, raw, timeout_s=10))
        assert (got, headers.get("connection")) == (status, "close"), raw[:40]
        assert json.loads(body)["error"]["code"] in ("bad_request", "too_large", "not_found")
    # Asked to upgrade: answered as any request, never upgraded, and the connection ends.
    upgrade = b"GET /health HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    [(got, headers, _)] = responses(talk(gw.url, upgrade + auth + b"\r\n", timeout_s=10))
    assert (got, headers.get("connection")) == (200, "close")
    [(got, headers, _)] = responses(talk(gw.url, upgrade + b"\r\n", timeout_s=10))
    assert (got, headers.get("connection")) == (401, "close")
    assert httpx.get(gw.url + "/health", headers=AUTH).status_code == 200
