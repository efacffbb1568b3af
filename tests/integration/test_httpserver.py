"""The embedded HTTP server (rolloutd/httpserver.py): a stop lets requests in flight finish, closes
idle kept-alive connections, and is prompt when nothing is open (uvicorn alone takes 0.2 s); an
idle server wakes once a second, not ten times, and its Date header stays fresh."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx

from rolloutd import httpserver
from rolloutd.httpserver import ServerThread
from tests.support.tls import CONTEXT as TLS


async def app(scope, receive, send):
    """An ASGI app: ``/slow`` takes 0.3 s, anything else is answered at once."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_stop_lets_a_request_in_flight_finish_then_refuses_new_ones():
    server = ServerThread(app).start()
    url = f"http://127.0.0.1:{server.port}/slow"
    answers = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(url, timeout=10)))
    client.start()
    while not server.server.server_state.tasks:  # the request is being answered
        time.sleep(0.005)
    server.stop()
    client.join(10)
    assert [(r.status_code, r.text) for r in answers] == [(200, "ok")]
    try:
        httpx.get(url, timeout=2)
        raise AssertionError("a stopped server answered")
    except httpx.ConnectError:
        pass


def test_an_idle_server_stops_at_once_even_with_a_kept_alive_connection():
    took = []
    for _ in range(3):
        server = ServerThread(app).start()
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as c:
            assert c.get("/").text == "ok"  # the connection stays open, idle
            t0 = time.perf_counter()
            server.stop()
            took.append(time.perf_counter() - t0)
    assert min(took) < 0.1, f"{took}: as slow as uvicorn's 0.1 s tick plus its 0.1 s shutdown sleep"


def wakeups(tid: int) -> int:
    """Times the thread ``tid`` of this process was put on a CPU."""
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[2])


def test_an_idle_server_wakes_about_once_a_second_and_its_date_header_stays_fresh():
    server = ServerThread(app).start()
    try:
        thread = next(t for t in threading.enumerate() if t.name == f"http-{server.port}")
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as c:
            first = parsedate_to_datetime(c.get("/").headers["date"])
            before = wakeups(thread.native_id)
            time.sleep(3.0)
            woke = wakeups(thread.native_id) - before
            second = parsedate_to_datetime(c.get("/").headers["date"])
    finally:
        server.stop()
    assert woke <= 8, f"{woke} wake-ups in 3 s of idling (uvicorn's own tick: 30)"
    assert (second - first).total_seconds() >= 2, f"Date went from {first} to {second} over 3 s"


# -- what a client may cost before it is answered (registry, admin API: every embedded server) ------

async def echo_headers(scope, receive, send):
    """An ASGI app answering the request's header names and the length of its body."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = (",".join(sorted(n.decode() for n, _ in scope["headers"])) + f";{size}").encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _closed_within(s: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server closed ``s`` (reading and dropping what it sent), None if it did not."""
    start = time.monotonic()
    s.settimeout(0.2)
    while time.monotonic() - start < timeout_s:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    return None


def _bomb(s: socket.socket, stop: threading.Event, sent: list[int]) -> None:
    try:
        while not stop.is_set():
            s.sendall(b"a" * 65536)
            sent[0] += 65536
    except OSError:
        pass


def test_trailer_fields_are_never_passed_on_as_headers():
    server = ServerThread(echo_headers).start()
    try:
        s = _connect(server.port)
        s.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"3\r\nabc\r\n0\r\nX-Smuggled: 1\r\nAuthorization: Bearer t\r\n\r\n")
        answer = b""
        while b";3" not in answer:
            answer += s.recv(4096)
        assert b"x-smuggled" not in answer and b"authorization" not in answer
        assert answer.endswith(b"host,transfer-encoding;3")
        s.close()
    finally:
        server.stop()


def test_a_trailer_bomb_is_cut_short_and_the_server_answers_others_meanwhile():
    """Trailers streamed without end are refused after MAX_FRAMING_BYTES; before the bound, the
    server parsed them on its only loop, and every other request waited."""
    server = ServerThread(echo_headers).start()
    stop, sent = threading.Event(), [0]
    try:
        s = _connect(server.port)
        s.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-A: ")
        bomber = threading.Thread(target=_bomb, args=(s, stop, sent), daemon=True)
        bomber.start()
        slowest = 0.0
        with httpx.Client(timeout=5) as client:
            for _ in range(10):
                t0 = time.monotonic()
                assert client.get(f"http://127.0.0.1:{server.port}/ok").status_code == 200
                slowest = max(slowest, time.monotonic() - t0)
        assert _closed_within(s, 5) is not None
        stop.set()
        bomber.join(5)
        assert slowest < 1.0
        assert sent[0] < 8 << 20  # cut after tens of KiB; what the kernel's buffers took on top
    finally:
        stop.set()
        server.stop()


def test_chunk_extensions_without_end_are_cut_short_too():
    server = ServerThread(echo_headers).start()
    stop, sent = threading.Event(), [0]
    try:
        s = _connect(server.port)
        s.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n1;e=")
        threading.Thread(target=_bomb, args=(s, stop, sent), daemon=True).start()
        assert _closed_within(s, 5) is not None
    finally:
        stop.set()
        server.stop()


def test_a_large_chunked_body_in_small_chunks_is_not_taken_for_a_bomb():
    """The framing bound counts bytes since the body last moved, not the framing of a whole body."""
    server = ServerThread(echo_headers).start()
    try:
        s = _connect(server.port)
        s.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"1;pad=" + b"p" * 1000 + b"\r\nx\r\n"  # 1 byte of body per 1 KiB of framing
        s.sendall(chunk * 2000 + b"0\r\n\r\n")  # 2 MB of framing in all
        answer = b""
        while b";2000" not in answer:
            data = s.recv(4096)
            assert data, "the server closed the connection"
            answer += data
        s.close()
    finally:
        server.stop()


def test_a_head_over_the_bound_is_refused_with_431(monkeypatch):
    server = ServerThread(echo_headers).start()
    try:
        s = _connect(server.port)
        s.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\nX-Big: " + b"b" * (httpserver.MAX_HEAD_BYTES + 1024))
        answer = b""
        while not answer.endswith(b"\r\n\r\n"):
            data = s.recv(4096)
            if not data:
                break
            answer += data
        assert answer.startswith(b"HTTP/1.1 431")
        assert _closed_within(s, 5) is not None
    finally:
        server.stop()


def test_a_half_sent_head_is_closed_at_the_head_deadline_also_on_a_kept_alive_connection(monkeypatch):
    monkeypatch.setattr(httpserver, "HEAD_TIMEOUT_S", 0.5)
    server = ServerThread(echo_headers).start()
    try:
        fresh = _connect(server.port)
        fresh.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\n")  # and never the rest
        waited = _closed_within(fresh, 5)
        assert waited is not None and 0.4 < waited < 3
        kept = _connect(server.port)
        kept.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle between requests: the keep-alive timeout's business, not the head's
        kept.sendall(b"GET /x HTTP/1.1\r\n")  # a second head, trickled
        for _ in range(4):
            time.sleep(0.2)
            try:
                kept.sendall(b"X: y\r\n")
            except OSError:
                break
        assert _closed_within(kept, 5) is not None
    finally:
        server.stop()


def test_connections_past_the_cap_are_closed_at_once(monkeypatch):
    monkeypatch.setattr(httpserver.BoundedHttpToolsProtocol, "max_connections", 3)
    server = ServerThread(echo_headers).start()
    try:
        held = [_connect(server.port) for _ in range(3)]
        while len(server.server.server_state.connections) < 3:
            time.sleep(0.01)
        extra = _connect(server.port)
        assert _closed_within(extra, 3) is not None
        for s in held:
            s.close()
    finally:
        server.stop()


def test_a_registry_with_a_token_answers_while_a_token_less_client_sends_a_trailer_bomb(tmp_path):
    """The registry as the trainer runs it: the bomb comes before any token is checked."""
    from rolloutd.trainer import EmbeddedRegistry
    token = tmp_path / "token"
    token.write_text("s3cret-token-value")
    stop, sent = threading.Event(), [0]
    with EmbeddedRegistry(port=0, token_file=str(token)) as reg:
        s = _connect(reg.port)
        s.sendall(b"POST /v1/versions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-A: ")
        threading.Thread(target=_bomb, args=(s, stop, sent), daemon=True).start()
        try:
            slowest = 0.0
            for _ in range(10):
                t0 = time.monotonic()
                assert httpx.get(reg.url + "/healthz", timeout=5, verify=TLS).status_code == 200
                slowest = max(slowest, time.monotonic() - t0)
            assert _closed_within(s, 5) is not None
            assert slowest < 1.0
        finally:
            stop.set()


def test_every_embedded_server_takes_the_bounded_protocol():
    assert httpserver.server_config(echo_headers).http is httpserver.BoundedHttpToolsProtocol
