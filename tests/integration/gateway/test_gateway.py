"""The gateway in front of small fake servers, for what a real ``vllm serve`` cannot be made to
show (its tests with a real vLLM are in tests/system/test_gateway.py): the policy for requests
that arrive while the server is paused, answers the server breaks off, slow clients and pipelining.

The gateway runs on its own event loop (tests/support/gateway_harness.py); the test plays the
supervisor and tells the gateway the server's state, as the daemon does. vLLM 0.33 refuses new
requests during a pause with 503 where 0.32 (the build here) queues them; ``FakeUpstream`` is a
small stand-in with 0.33's behaviour, to show the gateway gives the same answers on both.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from rolloutd.wire.states import ServerState as S
from tests.conftest import free_port
from tests.support.daemon_harness import wait_until
from tests.support.gateway_clients import (
    TOKEN,
    FakeUpstream,
    generate_body,
    post_in_thread,
    responses,
    talk,
)
from tests.support.gateway_harness import GatewayThread, socket_path
from tests.support.loop_thread import LoopThread

pytestmark = pytest.mark.timeout(600)


# -- the allow-list -------------------------------------------------------------------------------


# -- streaming ----------------------------------------------------------------------------------


def test_each_chunk_is_passed_on_before_the_next_exists():
    """Not buffered: the first event reaches the client while the server still holds the second
    (a fake server that waits for the test's go-ahead between its events)."""
    with FakeUpstream() as fake:
        gw = GatewayThread(fake.socket, free_port()).start()
        try:
            with httpx.Client(timeout=30) as c, c.stream("POST", gw.url + "/inference/v1/generate", json={}) as r:
                chunks = r.iter_raw()
                assert next(chunks) == b"data: 1\n\n"  # while the fake holds "data: 2" (until go)
                assert fake.waiting.wait(5)  # (set by the fake right after it wrote "data: 1")
                fake.go.set()
                assert b"".join(chunks) == b"data: 2\n\n"
        finally:
            gw.stop()


def test_a_client_that_leaves_ends_the_request_upstream():
    """A client that hangs up mid-stream: the gateway closes its connection to the server, which
    is what makes vLLM abort the request (a fake server that streams until its client leaves)."""
    with FakeUpstream() as fake:
        gw = GatewayThread(fake.socket, free_port()).start()
        try:
            with httpx.Client(timeout=30) as c, c.stream("POST", gw.url + "/inference/v1/generate?endless=1",
                                                            json={}) as r:
                chunks = r.iter_raw()
                for _ in range(3):
                    next(chunks)
            left = time.monotonic()
            assert fake.gone.wait(5), "the server's client (the gateway) never went away"
            assert time.monotonic() - left < 2
        finally:
            gw.stop()


# -- paused, starting, restarting ---------------------------------------------------------------


def stream_in_thread(url: str) -> dict:
    """A streamed ``/inference/v1/generate`` from a thread; the result dict gets status and body."""
    result: dict = {}

    def run() -> None:
        with httpx.stream("POST", url + "/inference/v1/generate", json=generate_body(stream=True), timeout=30) as r:
            result.update(status=r.status_code, body=r.read())
    result["thread"] = thread = threading.Thread(target=run)
    thread.start()
    return result


def test_a_request_refused_by_a_pausing_033_server_is_held_and_sent_again():
    with FakeUpstream(refuse_after_s=0.5) as fake:
        gw = GatewayThread(fake.socket, free_port(), while_paused="hold", hold_max_s=30).start()
        try:
            fake.paused = True  # vLLM paused a moment before the gateway heard of it
            held = post_in_thread(gw.url + "/inference/v1/generate?plain=1", json=generate_body())
            wait_until(lambda: fake.seen == 1, 10, "at the server", every_s=0.01)  # the request is at the server ...
            gw.set_state(S.UPDATING)  # ... which the gateway then hears has paused
            wait_until(lambda: gw.metrics.registry.get_sample_value(  # its 503 came back: held
                "rolloutd_gateway_held_total", {"server": "gpu0"}) == 1, 10, "held")
            time.sleep(0.5)
            assert held["thread"].is_alive()
            fake.paused = False
            gw.set_state(S.SERVING)
            held["thread"].join(30)
        finally:
            gw.stop()
    assert held["status"] == 200 and held["json"]["choices"][0]["token_ids"] == [7, 7, 7]
    assert fake.seen == 2  # refused once while pausing, then sent again after the resume


def test_an_update_pauses_only_once_every_request_sent_before_it_is_answered():
    """What an update with ``pause_mode: wait`` waits for before it pauses vLLM (Gateway.quiet):
    a request the gateway sent while serving could otherwise reach vLLM's engine after the
    pause began, wait there, and run on the new weights before the gate has passed them."""
    with FakeUpstream() as fake:
        gw = GatewayThread(fake.socket, free_port(), while_paused="hold", hold_max_s=30).start()
        try:
            assert gw._call(gw.gateway.quiet(0.1)) is True  # nothing sent yet
            answer = stream_in_thread(gw.url)
            wait_until(fake.waiting.is_set, 10, "the request at the server")  # half answered
            gw.set_state(S.UPDATING)  # the update begins: nothing new is sent ...
            held = post_in_thread(gw.url + "/inference/v1/generate?plain=1", json=generate_body())
            wait_until(lambda: gw.metrics.registry.get_sample_value(
                "rolloutd_gateway_held_total", {"server": "gpu0"}) == 1, 10, "held")
            assert gw._call(gw.gateway.quiet(0.3)) is False  # ... but one request is still unanswered
            fake.go.set()
            assert gw._call(gw.gateway.quiet(10)) is True  # answered: now the server may pause
            answer["thread"].join(10)
            assert fake.seen == 1  # the held request never reached the server while it updated
            gw.set_state(S.SERVING)
            held["thread"].join(30)
        finally:
            fake.go.set()
            gw.stop()
    assert (answer["status"], answer["body"]) == (200, b"data: 1\n\ndata: 2\n\n")
    assert held["status"] == 200 and fake.seen == 2


def test_an_update_that_aborts_takes_back_what_vllm_queued_instead_of_aborting():
    """With ``pause_mode: abort`` the update does not wait; after the pause, a request vLLM has
    not begun to answer (it reached the engine as the pause began: queued, not aborted) is taken
    back (Gateway.recall_unanswered), so it cannot run on the new weights before the gate has
    passed them; it is sent again once the server serves. An answer already begun is left alone."""
    with FakeUpstream() as fake:
        gw = GatewayThread(fake.socket, free_port(), while_paused="hold", hold_max_s=30).start()
        try:
            begun = stream_in_thread(gw.url)
            wait_until(fake.waiting.is_set, 10, "an answer begun")
            queued = post_in_thread(gw.url + "/inference/v1/generate?queued=1", json=generate_body())
            wait_until(lambda: fake.queued == 1, 10, "a request at the server, not answered")
            gw.set_state(S.UPDATING)  # vLLM paused: this one was queued by it, not aborted
            assert gw._call(gw.gateway.recall_unanswered(0.3)) == 1
            wait_until(fake.gone.is_set, 10, "the server to see the request dropped")
            wait_until(lambda: gw.metrics.registry.get_sample_value(
                "rolloutd_gateway_held_total", {"server": "gpu0"}) == 1, 10, "the request held")
            assert fake.queued == 1 and queued["thread"].is_alive()  # held: not sent again while updating
            fake.go.set()
            begun["thread"].join(10)
            gw.set_state(S.SERVING)
            queued["thread"].join(30)
        finally:
            fake.go.set()
            gw.stop()
    assert (begun["status"], begun["body"]) == (200, b"data: 1\n\ndata: 2\n\n")  # begun before: not taken back
    assert queued["status"] == 200 and queued["json"]["choices"][0]["token_ids"] == [7, 7, 7]
    assert fake.queued == 2  # sent once more, after the update


# -- HTTP as it comes: pipelining, Expect, chunked bodies, HTTP/1.0, bad heads --------------------


# -- faults of the server, and slow clients (small fakes: vLLM cannot be made to show them) -------

class FakeRawUpstream:
    """A fake server scripted at the socket level: ``script(n, reader, writer)`` handles its
    ``n``-th connection (from 1)."""

    def __init__(self, script):
        self.script, self.connections, self.sent = script, 0, 0
        self.socket = socket_path()
        self.thread = LoopThread("fake-raw-upstream").start()
        self.server = self.thread.call(asyncio.start_unix_server(self._connection, str(self.socket)))

    async def _connection(self, reader, writer) -> None:
        self.connections += 1
        try:
            await self.script(self, self.connections, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.thread.loop.call_soon_threadsafe(self.server.close)  # its connections: cancelled by stop
        self.thread.stop()


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def test_an_answer_the_server_breaks_off_is_broken_off_for_the_client():
    async def script(fake, n, reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # and then the server dies, the stream unfinished
    fake = FakeRawUpstream(script)
    gw = GatewayThread(fake.socket, free_port()).start()
    try:
        with httpx.Client(timeout=10) as c, c.stream("POST", gw.url + "/inference/v1/generate", json={}) as r:
            chunks = r.iter_raw()
            assert next(chunks) == b"data: 1\n\n"
            with pytest.raises(httpx.RemoteProtocolError):
                next(chunks)
        # An answer framed by the end of the connection is complete when it ends.
        fake.script = close_delimited
        r = httpx.post(gw.url + "/inference/v1/generate", json={}, timeout=10)
        assert (r.status_code, r.content) == (200, b"all of it")
    finally:
        gw.stop()
        fake.close()


async def close_delimited(fake, n, reader, writer):
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(b" it")


def test_a_kept_alive_connection_the_server_drops_is_not_a_failure():
    """The race of every keep-alive client: the server closes an idle connection just as a
    request goes out on it. The gateway sends the request again on a new connection."""
    async def script(fake, n, reader, writer):
        for i in range(100):
            await read_request(reader)
            if n == 1 and i == 1:
                return  # the second request on the first connection: dropped unanswered
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    fake = FakeRawUpstream(script)
    gw = GatewayThread(fake.socket, free_port()).start()
    try:
        with httpx.Client(timeout=10) as c:
            assert [c.get(gw.url + "/health").text for _ in range(3)] == ["ok"] * 3
        assert fake.connections == 2
    finally:
        gw.stop()
        fake.close()


def test_a_slow_client_holds_the_server_back_instead_of_filling_the_gateway():
    total = 256 << 20

    async def script(fake, n, reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        piece = b"z" * (1 << 20)
        for _ in range(total // len(piece)):
            writer.write(piece)
            await writer.drain()  # blocks while nobody reads
            fake.sent += len(piece)
    fake = FakeRawUpstream(script)
    gw = GatewayThread(fake.socket, free_port()).start()
    try:
        with httpx.Client(timeout=30) as c, c.stream("GET", gw.url + "/health") as r:
            stalled, deadline = -1, time.monotonic() + 20
            while fake.sent != stalled and time.monotonic() < deadline:  # the client reads nothing ...
                stalled = fake.sent
                time.sleep(0.5)
            assert fake.sent == stalled < total // 2, (fake.sent, stalled)  # ... and the server waits
            assert sum(len(chunk) for chunk in r.iter_raw()) == total  # and everything arrives
    finally:
        gw.stop()
        fake.close()


def test_a_server_that_cannot_be_reached_or_drops_the_request_is_a_502():
    gw = GatewayThread(socket_path(), free_port()).start()  # nothing listens on the server's socket
    try:
        r = httpx.get(gw.url + "/health", timeout=10)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream"
        assert r.json()["error"]["message"].startswith("server gpu0 did not answer: ")
    finally:
        gw.stop()

    async def script(fake, n, reader, writer):
        await read_request(reader)  # and closes without an answer
    fake = FakeRawUpstream(script)
    gw = GatewayThread(fake.socket, free_port()).start()
    try:
        r = httpx.get(gw.url + "/health", timeout=10)
        assert (r.status_code, r.json()["error"]["message"]) == \
            (502, "server gpu0 closed the connection without an answer")
        assert httpx.get(gw.url + "/health", timeout=10).status_code == 502  # and still answers
    finally:
        gw.stop()
        fake.close()


# -- hardening: timeouts, the connection cap, bounded memory, Expect behind another request -------

def connect(gw: GatewayThread):
    import socket
    host, port = gw.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock, timeout_s: float = 10) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes the connection, and how long that took."""
    sock.settimeout(timeout_s)
    t0, data = time.monotonic(), b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


async def answer_ok(fake, n, reader, writer):
    """A kept-alive server that answers every request at once."""
    while True:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()


def test_a_head_that_stalls_is_answered_408_and_closed():
    """Slowloris: half a head, then nothing (or a byte now and then): 408 after head_timeout_s,
    counted from the head's first byte, however the bytes trickle in."""
    fake = FakeRawUpstream(answer_ok)
    gw = GatewayThread(fake.socket, free_port(), head_timeout_s=0.5).start()
    try:
        with connect(gw) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            data, took = read_until_closed(s)
        [(status, headers, body)] = responses(data)
        assert (status, headers["connection"], json.loads(body)["error"]["code"]) == (408, "close", "timeout")
        assert 0.4 <= took < 2, took
        with connect(gw) as s:  # trickled: a byte every 0.1 s does not extend it
            t0 = time.monotonic()
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 30:
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.1)
                if time.monotonic() - t0 > 1.5:
                    break
            data, _ = read_until_closed(s)
        assert data.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < 2.5
        with connect(gw) as s:  # a connection that never sends anything: closed without a word
            data, took = read_until_closed(s)
        assert data == b"" and 0.4 <= took < 2, (data, took)
        assert gw.requests("other", 408) == 2
        assert httpx.get(gw.url + "/health").text == "ok"
    finally:
        gw.stop()
        fake.close()


def test_a_body_that_stalls_is_answered_408_and_closed():
    fake = FakeRawUpstream(answer_ok)
    gw = GatewayThread(fake.socket, free_port(), body_timeout_s=0.5).start()
    try:
        with connect(gw) as s:
            s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
            for _ in range(4):  # a body that moves is not timed out: 0.5 s between reads
                time.sleep(0.3)
                s.sendall(b"y" * 10)
            t0 = time.monotonic()
            data, _ = read_until_closed(s)
        [(status, headers, _)] = responses(data)
        assert (status, headers["connection"]) == (408, "close") and 0.4 <= time.monotonic() - t0 < 2
        assert gw.requests("/tokenize", 408) == 1
    finally:
        gw.stop()
        fake.close()


def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout():
    fake = FakeRawUpstream(answer_ok)
    gw = GatewayThread(fake.socket, free_port(), idle_timeout_s=0.5).start()
    try:
        with connect(gw) as s:
            for _ in range(3):  # kept alive between requests that come in time
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(4096).endswith(b"\r\n\r\nok")
                time.sleep(0.3)
            data, took = read_until_closed(s)
        assert data == b"" and 0.1 <= took < 1.5, (data, took)
    finally:
        gw.stop()
        fake.close()


def test_a_request_being_answered_is_not_timed_out():
    """Generation can take minutes: while vLLM has not answered, or streams slowly, no timeout of
    the client connection applies."""
    async def slow(fake, n, reader, writer):
        await read_request(reader)
        await asyncio.sleep(1.2)  # thinking, longer than every timeout of the gateway
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(1.2)  # and between two events
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)
    fake = FakeRawUpstream(slow)
    gw = GatewayThread(fake.socket, free_port(), head_timeout_s=0.3, body_timeout_s=0.3, idle_timeout_s=0.3).start()
    try:
        r = httpx.post(gw.url + "/inference/v1/generate", json={}, timeout=10)
        assert (r.status_code, r.content) == (200, b"data: 1\n\ndata: 2\n\n")
    finally:
        gw.stop()
        fake.close()


def test_connections_past_the_cap_are_refused_and_the_others_served():
    fake = FakeRawUpstream(answer_ok)
    gw = GatewayThread(fake.socket, free_port(), max_connections=2).start()
    try:
        established = [connect(gw), connect(gw)]
        for s in established:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).endswith(b"ok")
        for _ in range(3):
            with connect(gw) as extra:
                data, took = read_until_closed(extra, timeout_s=5)
            assert took < 1 and (data == b"" or data.startswith(b"HTTP/1.1 503 ")), data
        for s in established:  # unaffected
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).endswith(b"ok")
            s.close()
        assert gw.metrics.registry.get_sample_value("rolloutd_gateway_refused_connections_total",
                                                    {"server": "gpu0"}) == 3
        wait_until(lambda: gw.buffered()["connections"] == 0, 5, "closed")
        assert httpx.get(gw.url + "/health").text == "ok"  # room again
    finally:
        gw.stop()
        fake.close()


def test_a_client_pipelining_without_reading_does_not_fill_the_gateway():
    """10,000 pipelined requests, each answered with 4 KiB, from a client that reads nothing for a
    while: the gateway reads requests only as it answers them and answers only as the client
    reads, so what it holds stays small; then every answer arrives, in order."""
    async def big(fake, n, reader, writer):
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + b"a" * 4096)
            await writer.drain()
            fake.sent += 1
    fake = FakeRawUpstream(big)
    gw = GatewayThread(fake.socket, free_port()).start()
    n = 10_000
    try:
        s = connect(gw)
        sender = threading.Thread(target=s.sendall, args=(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * n,), daemon=True)
        sender.start()
        peak: dict[str, int] = {}
        deadline, stalled = time.monotonic() + 30, -1
        while time.monotonic() < deadline:  # until the server side stops moving
            for key, value in gw.buffered().items():
                peak[key] = max(peak.get(key, 0), value)
            if fake.sent == stalled and fake.sent > 0:
                break
            stalled = fake.sent
            time.sleep(0.5)
        assert peak["queued"] <= 300 and peak["request_bytes"] < 256 << 10, peak
        assert peak["write_bytes"] < 1 << 20, peak
        assert fake.sent < n // 2, fake.sent
        got, want = 0, n * (4096 + len(b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n"))
        s.settimeout(30)
        while got < want:
            chunk = s.recv(1 << 20)
            assert chunk
            got += len(chunk)
        # The fake counts a reply once its drain returns, which may be just after the client
        # has read the reply's last byte.
        deadline = time.monotonic() + 10
        while fake.sent < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == want and fake.sent == n
        s.close()
    finally:
        gw.stop()
        fake.close()


def test_expect_100_continue_behind_another_request_gets_its_continue_in_turn():
    """A pipelined request with ``Expect: 100-continue`` waits behind one being answered: its
    ``100 Continue`` comes after that answer (never before, never dropped), then its own answer."""
    async def script(fake, n, reader, writer):
        first = True
        while True:
            request = await read_request(reader)
            if first:
                await asyncio.sleep(0.5)
                first = False
            body = request.partition(b"\r\n\r\n")[2]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body) + 2, b"ok" + body))
            await writer.drain()
    fake = FakeRawUpstream(script)
    gw = GatewayThread(fake.socket, free_port()).start()
    try:
        with connect(gw) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
            s.settimeout(5)
            data = b""
            while b"100 Continue" not in data:
                chunk = s.recv(4096)
                assert chunk, data
                data += chunk
            assert data == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 100 Continue\r\n\r\n", data
            s.sendall(b"hello")
            data = b""
            while not data.endswith(b"okhello"):
                chunk = s.recv(4096)
                assert chunk, data
                data += chunk
            assert data == b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nokhello"
    finally:
        gw.stop()
        fake.close()


# -- trailers, and clients without the token ---------------------------------------------------

CHUNKED_HEAD = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"


def recording(fake_requests: list):
    """A kept-alive server that answers every request at once and keeps what it was sent."""
    async def script(fake, n, reader, writer):
        while True:
            fake_requests.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    return script


def send_forever(sock, first: bytes, filler: bytes, stop: threading.Event, sent: list | None = None
                 ) -> threading.Thread:
    """Send ``first``, then ``filler`` again and again until ``stop`` or the gateway closes;
    ``sent`` gets the bytes sent."""
    def go() -> None:
        n = 0
        try:
            sock.sendall(first)
            while not stop.is_set():
                sock.sendall(filler)
                n += len(filler)
        except OSError:
            pass
        if sent is not None:
            sent.append(n)
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_trailers_are_bounded_dropped_and_not_counted_against_the_next_head():
    """A chunked body's trailer section is never passed on as headers, does not count against
    the next request's head, and is bounded like a head: 64 KiB of framing or trailers in a
    row, or 128 trailer fields, is 431 and the end of the connection, whoever sends it."""
    seen: list[bytes] = []
    fake = FakeRawUpstream(recording(seen))
    gw = GatewayThread(fake.socket, free_port()).start()  # no token: every local client may send
    try:
        trailers = (b"X-Sneak: 1\r\nAuthorization: Bearer other\r\nHost: elsewhere\r\n"
                    + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(40)))  # 40 KiB
        big_head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"h" * 40_000 + b"\r\nConnection: close\r\n\r\n"
        data = talk(gw.url, CHUNKED_HEAD + b"\r\n5\r\nhello\r\n0\r\n" + trailers + b"\r\n" + big_head)
        assert [status for status, _, _ in responses(data)] == [200, 200], data[:200]
        head, _, body = seen[0].partition(b"\r\n\r\n")
        assert body == b"hello" and head.endswith(b"\r\nContent-Length: 5")
        assert not any(name in head.lower() for name in (b"x-sneak", b"x-pad", b"authorization", b"elsewhere")), head
        # A trailer bomb: one field whose value never ends.
        n = len(seen)
        with connect(gw) as s:
            stop = threading.Event()
            sender = send_forever(s, CHUNKED_HEAD + b"\r\n5\r\nhello\r\n0\r\nX-Bomb: ", b"a" * 65536, stop)
            data, took = read_until_closed(s, timeout_s=10)
            stop.set()
            sender.join(10)
        [(status, headers, body)] = responses(data)
        assert (status, headers["connection"], json.loads(body)["error"]["code"]) == (431, "close", "too_large")
        # Many small fields.
        many = b"".join(b"X-T: %d\r\n" % i for i in range(200))
        [(status, headers, _)] = responses(talk(gw.url, CHUNKED_HEAD + b"\r\n5\r\nhello\r\n0\r\n" + many + b"\r\n"))
        assert (status, headers["connection"]) == (431, "close")
        # Chunk extensions that never end are framing too.
        with connect(gw) as s:
            stop = threading.Event()
            sender = send_forever(s, CHUNKED_HEAD + b"\r\n5;ext=", b"e" * 65536, stop)
            data, _ = read_until_closed(s, timeout_s=10)
            stop.set()
            sender.join(10)
        assert data.startswith(b"HTTP/1.1 431 "), data[:100]
        assert len(seen) == n and gw.requests("/tokenize", 431) == 3
        assert httpx.get(gw.url + "/health").text == "ok"
    finally:
        gw.stop()
        fake.close()


def test_a_refused_body_is_dropped_only_up_to_the_limit():
    """The body of a request refused with the token (404, 405) is read and dropped so that the
    connection can go on; one that never ends is dropped up to ``max_body_bytes``, then the
    refusal is answered and the connection closed."""
    fake = FakeRawUpstream(answer_ok)
    gw = GatewayThread(fake.socket, free_port(), max_body_bytes="4KiB").start()
    try:
        with connect(gw) as s:
            stop = threading.Event()
            sender = send_forever(s, CHUNKED_HEAD.replace(b"/tokenize", b"/pause") + b"\r\n",
                                  b"400\r\n" + b"b" * 1024 + b"\r\n", stop)
            data, took = read_until_closed(s, timeout_s=10)
            stop.set()
            sender.join(10)
        [(status, headers, _)] = responses(data)
        assert (status, headers["connection"]) == (404, "close") and took < 5, took
        assert fake.connections == 0
    finally:
        gw.stop()
        fake.close()

def test_a_client_without_the_token_is_answered_once_and_closed():
    """A request without the token (401, or 404 off the list) ends its connection: nothing after
    it is read or parsed, not a pipelined request, not the rest of a body that never ends."""
    seen: list[bytes] = []
    fake = FakeRawUpstream(recording(seen))
    gw = GatewayThread(fake.socket, free_port(), token=TOKEN, max_body_bytes="4KiB").start()
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    try:
        for first in (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /pause HTTP/1.1\r\nHost: x\r\n\r\n",
                      b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n"):
            with connect(gw) as s:
                s.sendall(first + b"GET /health HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
                data, took = read_until_closed(s, timeout_s=5)
            [(status, headers, _)] = responses(data)
            assert status in (401, 404) and headers["connection"] == "close" and took < 1, (first, data, took)
        assert seen == []
        # A trailer bomb without the token: answered at once (its head was enough), then closed;
        # meanwhile at most a body's worth (4 KiB here) is read and dropped, so the sender stops
        # once the socket buffers are full instead of sending for as long as the gateway lingers.
        with connect(gw) as s:
            stop, sent = threading.Event(), []
            sender = send_forever(s, CHUNKED_HEAD.replace(b"/tokenize", b"/inference/v1/generate")
                                  + b"\r\n5\r\nhello\r\n0\r\nX-Bomb: ", b"a" * 65536, stop, sent)
            data, took = read_until_closed(s, timeout_s=10)
            sender.join(10)  # until the gateway's close ends it
            stop.set()
        [(status, headers, _)] = responses(data)
        assert (status, headers["connection"]) == (401, "close") and took < 5, took
        assert sent[0] < 64 << 20, sent
        # With the token, a connection is kept.
        with connect(gw) as s:
            for _ in range(2):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
                assert s.recv(4096).endswith(b"ok")
    finally:
        gw.stop()
        fake.close()


def test_clients_without_the_token_cannot_keep_a_trainer_out():
    """A full gateway makes room for a new connection by ending the oldest one that has sent no
    request with the token; connections that have are never ended for it."""
    fake = FakeRawUpstream(answer_ok)
    gw = GatewayThread(fake.socket, free_port(), token=TOKEN, max_connections=3).start()
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    refused = lambda: gw.metrics.registry.get_sample_value(  # noqa: E731
        "rolloutd_gateway_refused_connections_total", {"server": "gpu0"}) or 0
    try:
        trainer = connect(gw)
        trainer.sendall(ok)
        assert trainer.recv(4096).endswith(b"ok")
        strangers = [connect(gw), connect(gw)]  # silent, then half a head: each holds a place
        strangers[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        wait_until(lambda: gw.buffered()["connections"] == 3, 5, "three connections")
        for _ in range(4):  # each new trainer connection takes a stranger's place
            with connect(gw) as other:
                other.sendall(ok)
                assert other.recv(4096).endswith(b"ok")
            wait_until(lambda: gw.buffered()["connections"] == 2, 5, "the trainer's second connection closed")
            strangers.append(connect(gw))
            wait_until(lambda: gw.buffered()["connections"] == 3, 5, "three connections")
        for s in strangers[:4]:  # the oldest went first
            data, took = read_until_closed(s, timeout_s=5)
            assert data == b"" and took < 1
        trainer.sendall(ok)  # the first trainer is untouched
        assert trainer.recv(4096).endswith(b"ok")
        assert refused() == 4
        # Full of connections with the token: one more is refused as before.
        trainers = [trainer] + [connect(gw) for _ in range(2)]
        for s in trainers[1:]:
            s.sendall(ok)
            assert s.recv(4096).endswith(b"ok")
        with connect(gw) as extra:
            data, _ = read_until_closed(extra, timeout_s=5)
        assert data == b"" or data.startswith(b"HTTP/1.1 503 "), data
        assert refused() == 7  # the last two strangers, then the one refused
        for s in trainers + strangers:
            s.close()
    finally:
        gw.stop()
        fake.close()


# -- fail closed: a public gateway needs a token, or an explicit opt-out --------------------------

OPEN_CONFIG = """\
registry: {url: "http://trainer:8700"}
servers: [{name: gpu0, model: /m, public_port: 9001}]
gateway:
  host: %s
"""


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node7.lan"])
def test_a_public_gateway_without_a_token_is_refused(host):
    from rolloutd.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as e:
        parse_config(OPEN_CONFIG % f'"{host}"', "c.yaml")
    [line] = e.value.lines
    assert line.startswith("c.yaml:3: gateway.token_file: required when gateway.host") and \
        "gateway.allow_unauthenticated: true" in line, line
    text = OPEN_CONFIG % f'"{host}"'
    assert parse_config(text + "  allow_unauthenticated: true\n").gateway.allow_unauthenticated
    assert parse_config(text + "  token_file: /etc/rolloutd/gateway.token\n").gateway.token_file is not None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "localhost"])
def test_a_loopback_gateway_needs_no_token(host):
    from rolloutd.config import parse_config
    assert parse_config(OPEN_CONFIG % f'"{host}"').gateway.token_file is None


def test_the_default_gateway_is_loopback_and_needs_no_token():
    from rolloutd.config import parse_config
    g = parse_config('registry: {url: "http://trainer:8700"}\n'
                     'servers: [{name: gpu0, model: /m, public_port: 9001}]\n').gateway
    assert (g.host, g.token_file, g.allow_unauthenticated) == ("127.0.0.1", None, False)
    assert (g.head_timeout_s, g.body_timeout_s, g.idle_timeout_s, g.max_connections) == (10, 60, 60, 4096)
