"""Bad input at the gateway, tried at scale (hypothesis): any method, any raw path, any
Authorization header, bodies around the size limit, requests cut off halfway.

Every answer must be the gateway's own 4xx (400 for what is not HTTP, 401, 404, 405, 413) or
the upstream's answer for an allowed, authorised request; never a 5xx, and the gateway keeps
serving. The upstream is ``EchoUpstream``, a small fake that answers every allowed route with
200: the point is the gateway's handling of what comes in, not vLLM's.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutd.gateway import ROUTES

from .conftest import free_port
from .gateway_harness import GatewayThread

TOKEN = "fuzz-gw-token"
LIMIT = 4096
CASES = {"requests": 0, "cut": 0}


class EchoUpstream:
    """A fake upstream: 200 with the request's method and path for anything."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        self.runner = web.ServerRunner(web.Server(self.echo))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def echo(self, request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.json_response({"method": request.method, "path": request.raw_path})


ADDRESS: list = []  # (host, port) of the gateway under test, set by the module's fixture


@pytest.fixture(scope="module", autouse=True)
def gateway_under_test():
    upstream = EchoUpstream()
    gateway = GatewayThread(upstream.port, free_port(), token=TOKEN, max_body_bytes=f"{LIMIT}B").start()
    ADDRESS[:] = ["127.0.0.1", int(gateway.url.rsplit(":", 1)[1])]
    yield
    gateway.stop()

path_chars = st.sampled_from(list("abcdefghijklmnopqrstuvwxyz0123456789/._-%~?=&;:@!$'()*+,") + ["%2e", "%2f", "%00",
                                                                                               "..", "//"])
paths = st.one_of(
    st.sampled_from(sorted(ROUTES)),
    st.builds(lambda r, s: r + s, st.sampled_from(sorted(ROUTES)), st.lists(path_chars, max_size=12).map("".join)),
    st.builds(lambda s: "/" + s, st.lists(path_chars, max_size=20).map("".join)),
    st.sampled_from(["/pause", "/resume", "/collective_rpc", "/update_weights", "/v1/../pause", "/%70ause", "*"]),
)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT", "FOO"])
auths = st.one_of(st.none(), st.just(f"Bearer {TOKEN}"), st.just(f"bearer {TOKEN}"),
                  st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
bodies = st.one_of(st.just(b""), st.binary(max_size=64), st.integers(LIMIT - 2, LIMIT + 2).map(lambda n: b"x" * n))


def send(raw: bytes, timeout_s: float = 10, hang_up: bool = False) -> int | None:
    """Status code of the answer to ``raw`` (None: the gateway closed without answering).
    ``hang_up``: the client closes its side right after sending, as one that gave up."""
    with socket.create_connection(tuple(ADDRESS), timeout=timeout_s) as s:
        s.sendall(raw)
        if hang_up:
            s.shutdown(socket.SHUT_WR)
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                return None
            head += chunk
    return int(head.split(b" ", 2)[1])


def request_bytes(method: str, path: str, auth: str | None, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: node\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    if auth is not None:
        head += f"Authorization: {auth}\r\n"
    return head.encode() + b"\r\n" + body


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(methods, paths, auths, bodies)
def test_every_request_gets_a_4xx_or_the_upstream_answer(method, path, auth, body):
    CASES["requests"] += 1
    status = send(request_bytes(method, path, auth, body))
    assert status is not None and status < 500, (method, path, auth, len(body), status)
    route = path.partition("?")[0]  # a query string is passed on; the path alone is checked
    allowed = route in ROUTES
    authorised = auth is not None and auth.partition(" ")[0].lower() == "bearer" and \
        auth.partition(" ")[2].strip() == TOKEN
    if status == 400:
        return  # not HTTP aiohttp will parse (e.g. "*" or a bad method for the target): refused up front
    if not allowed:
        assert status == 404
    elif not authorised:
        assert status == 401
    elif method not in ROUTES[route]:
        assert status == 405
    elif len(body) > LIMIT:
        assert status == 413
    else:
        assert status == 200


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(ROUTES)), st.integers(0, 200), st.integers(1, 4000))
def test_requests_cut_off_halfway_leave_the_gateway_serving(path, head_cut, length):
    CASES["cut"] += 1
    raw = request_bytes("POST", path, f"Bearer {TOKEN}", b"y" * length)
    cut = raw[: min(head_cut, len(raw) - 1)] if head_cut < 150 else raw[: len(raw) - length // 2 - 1]
    try:
        status = send(cut, timeout_s=5, hang_up=True)
    except TimeoutError:
        status = None  # still waiting for the rest of the body: fine, the client gave up
    assert status is None or status < 500


def test_the_gateway_still_serves_and_counted_the_cases():
    assert CASES["requests"] >= 600 and CASES["cut"] >= 150, CASES
    assert send(request_bytes("GET", "/health", f"Bearer {TOKEN}", b"")) == 200
    print(f"bad-input: gateway: {CASES['requests']} requests, {CASES['cut']} cut off, 0 failures")
