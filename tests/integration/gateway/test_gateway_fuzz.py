"""Bad input at the gateway, tried at scale (hypothesis): any method, any raw path, any
Authorization header, bodies around the size limit, requests cut off halfway, and valid
requests with bytes replaced, inserted, deleted or repeated.

Every answer must be the gateway's own 4xx (400 for what is not HTTP, 401, 404, 405, 413, 431)
or the upstream's answer for an allowed, authorised request; never a 5xx, never an error or a
traceback in the log, and the gateway keeps serving. The upstream is ``EchoUpstream``, a small
fake that answers every allowed route with 200: the point is the gateway's handling of what
comes in, not vLLM's.
"""

from __future__ import annotations

import logging
import socket

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutd.gateway.policy import ROUTES
from tests.conftest import free_port
from tests.support.gateway_harness import GatewayThread, socket_path
from tests.support.loop_thread import LoopThread, serve

pytestmark = [pytest.mark.slow, pytest.mark.parallel]  # thousands of requests: not the fast tier

TOKEN = "fuzz-gw-token"
LIMIT = 4096
CASES = {"requests": 0, "cut": 0, "mutated": 0}
ERRORS: list[str] = []  # what was logged at ERROR or above while the gateway ran


class Errors(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        ERRORS.append(self.format(record))


class EchoUpstream:
    """A fake upstream: 200 with the request's method and path for anything."""

    def __init__(self):
        self.socket = socket_path()
        self.thread = LoopThread("echo-upstream").start()
        self.runner, _ = self.thread.call(serve(self.echo, unix=self.socket))

    def stop(self) -> None:
        self.thread.call(self.runner.cleanup())
        self.thread.stop()

    async def echo(self, request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.json_response({"method": request.method, "path": request.raw_path})


ADDRESS: list = []  # (host, port) of the gateway under test, set by the module's fixture


@pytest.fixture(scope="module", autouse=True)
def gateway_under_test():
    upstream = EchoUpstream()
    gateway = GatewayThread(upstream.socket, free_port(), token=TOKEN, max_body_bytes=f"{LIMIT}B").start()
    ADDRESS[:] = ["127.0.0.1", int(gateway.url.rsplit(":", 1)[1])]
    errors = Errors(logging.ERROR)
    logging.getLogger().addHandler(errors)
    yield
    logging.getLogger().removeHandler(errors)
    gateway.stop()
    upstream.stop()

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


def send(raw: bytes, timeout_s: float = 10, hang_up: bool = False, wait_s: float | None = None) -> int | None:
    """Status code of the answer to ``raw`` (None: the gateway closed without answering).
    ``hang_up``: the client closes its side right after sending, as one that gave up;
    ``wait_s``: it does so when no answer came in that time (a request that is not complete)."""
    with socket.create_connection(tuple(ADDRESS), timeout=timeout_s) as s:
        s.sendall(raw)
        if hang_up:
            s.shutdown(socket.SHUT_WR)
        head = b""
        while b"\r\n" not in head:
            if wait_s is not None:
                s.settimeout(wait_s)
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                s.shutdown(socket.SHUT_WR)
                s.settimeout(timeout_s)
                wait_s = None
                continue
            if not chunk:
                return None
            head += chunk
    assert head.startswith(b"HTTP/1.1 "), head
    return int(head.split(b" ", 2)[1])


def request_bytes(method: str, path: str, auth: str | None, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: node\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    if auth is not None:
        head += f"Authorization: {auth}\r\n"
    return head.encode() + b"\r\n" + body


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
        return  # not HTTP llhttp will parse (e.g. a method it does not know): refused up front
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


@settings(max_examples=500, deadline=None)
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


pieces = st.sampled_from([b"\r\n", b"\n", b"\r", b"\x00", b":", b" ", b"\t", b"0", b"9" * 12, b"-", b"\xff",
                          b"Transfer-Encoding: chunked\r\n", b"Content-Length: 5\r\n", b"Expect: 100-continue\r\n",
                          b"Connection: upgrade\r\nUpgrade: h2c\r\n"])
mutations = st.lists(st.tuples(st.sampled_from(["replace", "insert", "delete", "repeat"]), st.integers(0, 400),
                               st.integers(1, 8), pieces), min_size=1, max_size=4)


def mutate(raw: bytes, edits) -> bytes:
    for kind, at, n, piece in edits:
        at %= len(raw) + 1
        if kind == "replace":
            raw = raw[:at] + piece + raw[at + len(piece):]
        elif kind == "insert":
            raw = raw[:at] + piece + raw[at:]
        elif kind == "delete":
            raw = raw[:at] + raw[at + n:]
        else:
            raw = raw[:at] + raw[at:at + n] * 3 + raw[at + n:]
    return raw


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(ROUTES)), st.binary(max_size=48), mutations)
def test_mangled_requests_get_a_4xx_or_the_upstream_answer(path, body, edits):
    CASES["mutated"] += 1
    method = sorted(ROUTES[path])[0]
    status = send(mutate(request_bytes(method, path, f"Bearer {TOKEN}", body), edits), wait_s=0.2)
    assert status is None or status < 500, status


def test_the_gateway_still_serves_and_counted_the_cases():
    assert CASES["requests"] >= 3000 and CASES["cut"] >= 500 and CASES["mutated"] >= 1000, CASES
    assert send(request_bytes("GET", "/health", f"Bearer {TOKEN}", b"")) == 200
    assert ERRORS == []
    print(f"bad-input: gateway: {CASES['requests']} requests, {CASES['cut']} cut off, {CASES['mutated']} mangled, "
          "0 failures")
