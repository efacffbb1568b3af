"""What the gateway's tests send and what they send it to: the token, the dev routes and their
tricky spellings, raw HTTP on one connection (``talk``, ``responses``, ``post``), a stream's
arrival times, a request in a thread, a real ``vllm serve`` behind a gateway (the ``vllm`` and
``gateway`` fixtures), and ``FakeUpstream``, a small stand-in with vLLM 0.33's behaviour during a
pause. Used by the gateway tests: tests/integration/gateway/test_gateway.py (the fakes) and
tests/system/test_gateway.py (the real vLLM)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from aiohttp import web

from rolloutd.demo.tinymodel import TINY, build
from rolloutd.supervise.plugin_path import install_plugin
from tests.conftest import free_port
from tests.support.gateway_harness import GatewayThread, socket_path
from tests.support.loop_thread import LoopThread, serve
from tests.support.tls import CONTEXT as TLS
from tests.support.vllm_server import VllmServer

TOKEN = "gw-secret-4b1d"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 5, 9, 13, 40]
# vLLM's own routes that must never be reachable through the gateway (dev mode is on).
DEV_ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/start_weight_update"),
              ("POST", "/update_weights"), ("POST", "/finish_weight_update"), ("GET", "/weight_info"),
              ("POST", "/init_weight_transfer_engine"), ("POST", "/collective_rpc"), ("GET", "/get_world_size"),
              ("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/metrics"),
              ("GET", "/server_info"), ("GET", "/openapi.json"), ("GET", "/docs"), ("POST", "/v1/load_lora_adapter"),
              ("GET", "/version"), ("POST", "/scale_elastic_ep")]
# Spellings of a dev route that a path-normalising proxy could let through.
TRICKS = ["/v1/../pause", "//pause", "/%70ause", "/v1/completions/../../pause", "/health/../pause", "/PAUSE",
          "/pause/", "/./pause", "/inference/v1/generate/../../../pause", "/inference/v1/generate/", "/health%00",
          "/v1/completions%2f..%2fpause"]


def generate_body(max_tokens: int = 12, stream: bool = False) -> dict:
    return {"token_ids": PROMPT, "stream": stream,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


def raw_request(url: str, method: str, path: str, headers: dict | None = None) -> int:
    """Status of a request whose path is sent exactly as given (httpx would normalise it)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    [(status, _, _)] = responses(talk(url, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n{extra}"
                                           "Connection: close\r\n\r\n".encode()))
    return status


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    d = tmp_path_factory.mktemp("gateway")
    server = VllmServer(build(d / "model", TINY, seed=3), d / "vllm.sock", d / "vllm.log",
                        pythonpath=[install_plugin(d / "plugin")]).wait_healthy()
    yield server
    server.stop()


@pytest.fixture
def gateway(vllm):
    made = []

    def make(**settings) -> GatewayThread:
        g = GatewayThread(vllm.socket, free_port(), **settings).start()
        made.append(g)
        return g
    yield make
    for g in made:
        g.stop()


def stream_arrivals(http: httpx.Client, headers: dict | None = None) -> tuple[list[float], bytes]:
    """Arrival times (s since the request) of each chunk of a streamed generation, and the body."""
    times, body = [], b""
    t0 = time.perf_counter()
    with http as c, c.stream("POST", "/inference/v1/generate",
                                               json=generate_body(max_tokens=48, stream=True),
                                               headers=headers or {}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            times.append(time.perf_counter() - t0)
            body += chunk
    return times, body


def post_in_thread(url: str, **kw) -> dict:
    """POST from a thread; the result dict gets status, body, headers and seconds."""
    result: dict = {}

    def run() -> None:
        t0 = time.perf_counter()
        r = httpx.post(url, timeout=60, verify=TLS, **kw)
        result.update(status=r.status_code, json=r.json(), headers=r.headers, seconds=time.perf_counter() - t0)
    thread = threading.Thread(target=run)
    thread.start()
    result["thread"] = thread
    return result


class FakeUpstream:
    """A small fake server, for what a real vLLM 0.32 cannot be made to show:

    - ``/inference/v1/generate`` with ``paused`` set behaves as vLLM 0.33 does during a pause
      (refused with 503, after ``refuse_after_s``) instead of queued as 0.32 does; otherwise it
      streams ``data: 1``, waits for ``go``, then ``data: 2``;
    - ``/inference/v1/generate?endless=1`` streams an event every 20 ms until its client leaves
      (``gone``);
    - ``/inference/v1/generate?queued=1`` the first time answers nothing until its client leaves
      (``gone``), as vLLM 0.32 queues a request that reaches its engine after a pause began; every
      later time it answers at once.
    """

    def __init__(self, refuse_after_s: float = 0.3):
        self.paused = False
        self.refuse_after_s = refuse_after_s
        self.seen = self.queued = 0
        self.go, self.waiting, self.gone = threading.Event(), threading.Event(), threading.Event()
        self.socket = socket_path()
        self.thread = LoopThread("fake-upstream")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        if self.paused:
            await asyncio.sleep(self.refuse_after_s)
            return web.json_response({"error": {"message": "paused"}}, status=503)
        if request.query.get("plain"):
            return web.json_response({"choices": [{"token_ids": [7, 7, 7]}]})
        if request.query.get("endless"):
            return await self.endless(request)
        if request.query.get("queued"):
            self.queued += 1
            while self.queued == 1 and request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)
            if self.queued == 1:
                self.gone.set()
            return web.json_response({"choices": [{"token_ids": [7, 7, 7]}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        self.waiting.set()
        await asyncio.to_thread(self.go.wait, 10)
        await response.write(b"data: 2\n\n")
        await response.write_eof()
        return response

    async def endless(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(1000):
                await response.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            self.gone.set()
            raise
        return response

    def __enter__(self) -> FakeUpstream:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        self.runner, _ = self.thread.start().call(serve(app, unix=self.socket))
        return self

    def __exit__(self, *exc) -> None:
        self.go.set()
        self.thread.call(self.runner.cleanup())
        self.thread.stop()


def talk(url: str, *parts: bytes, pause_s: float = 0.0, timeout_s: float = 30) -> bytes:
    """Send ``parts`` on one connection (``pause_s`` between them) and read until the gateway
    closes it: everything it answered, as bytes."""
    host, port = url.removeprefix("http://").split(":")

    async def go() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(pause_s)
            writer.write(part)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), timeout_s)
        writer.close()
        return data
    return asyncio.run(go())


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split what ``talk`` read into (status, headers, body), framed by Content-Length, chunked
    encoding, or the end of the data; a 1xx answer is one with no body."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status < 200:
            body = b""
        elif "content-length" in headers:
            n = int(headers["content-length"])
            body, data = data[:n], data[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                n = int(size, 16)
                body, data = body + data[:n], data[n + 2:]
                if n == 0:
                    break
        else:
            body, data = data, b""
        out.append((status, headers, body))
    return out


def post(path: str, payload: dict, *, extra: str = "", version: str = "1.1") -> bytes:
    body = json.dumps(payload).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: node\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body
