"""Byte ranges over one keep-alive connection: against the real registry, and against a fake
server scripted byte by byte for what a healthy registry never sends."""

from __future__ import annotations

import asyncio
import json

import pytest

from rolloutd.registry import errors
from rolloutd.registry.client import RegistryClient
from rolloutd.registry.ranges import RangeConnection
from tests.test_puller import publish


class Collect:
    def __init__(self):
        self.data = bytearray()
        self.calls = 0

    def __call__(self, view: memoryview) -> None:
        self.data += view
        self.calls += 1


async def test_ranges_from_the_registry(registry):
    manifest, files = publish(registry, 1)
    entry = manifest.files[0]
    whole = files[entry.name]
    async with RegistryClient(registry.url) as client, client.range_connection(buffer_bytes=64 << 10) as conn:
        for start, end in ((0, entry.size), (5, 70_001), (entry.size - 1, entry.size), (100_000, 300_000)):
            sink = Collect()
            await conn.fetch(1, entry.name, start, end, sink)
            assert sink.data == whole[start:end], (start, end)
        sink = Collect()
        await conn.fetch(1, entry.name, 0, 512 << 10, sink)
        assert sink.calls == 8  # whole buffers only: writes land on page boundaries
        with pytest.raises(errors.FileUnknown):
            await conn.fetch(1, "nope.safetensors", 0, 10, Collect())
        with pytest.raises(errors.VersionUnknown):
            await conn.fetch(9, entry.name, 0, 10, Collect())
        with pytest.raises(errors.RangeNotSatisfiable):
            await conn.fetch(1, entry.name, entry.size, entry.size + 10, Collect())
        sink = Collect()
        await conn.fetch(1, entry.name, 0, 10, sink)  # the connection survived the errors
        assert sink.data == whole[:10]


async def test_a_sink_error_propagates_and_the_next_fetch_reconnects(registry):
    manifest, files = publish(registry, 1)
    entry = manifest.files[0]

    def full(view):
        raise OSError(28, "No space left on device")
    async with RegistryClient(registry.url) as client, client.range_connection() as conn:
        with pytest.raises(OSError, match="No space"):
            await conn.fetch(1, entry.name, 0, 200_000, full)
        sink = Collect()
        await conn.fetch(1, entry.name, 0, 100, sink)
        assert sink.data == files[entry.name][:100]


class ScriptedServer:
    """A fake HTTP server: each accepted connection answers its requests from ``replies``
    (bytes, sent as they are; ``None`` closes the connection; an int sleeps that long)."""

    def __init__(self, replies: list):
        self.replies = replies
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                reply = self.replies.pop(0)
                for part in reply if isinstance(reply, list) else [reply]:
                    if part is None:
                        writer.close()
                        return
                    if isinstance(part, (int, float)):
                        await asyncio.sleep(part)
                        continue
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def partial(start: int, body: bytes, total: int = 1000, extra: str = "") -> bytes:
    end = start + len(body) - 1
    return (f"HTTP/1.1 206 Partial Content\r\ncontent-length: {len(body)}\r\n"
            f"content-range: bytes {start}-{end}/{total}\r\n{extra}\r\n").encode() + body


async def test_head_split_across_reads_and_body_in_pieces():
    whole = partial(10, b"0123456789")
    async with ScriptedServer([[whole[:7], 0.01, whole[7:40], 0.01, whole[40:-3], 0.01, whole[-3:]]]) as srv:
        async with RangeConnection(srv.url, {"authorization": "Bearer t"}) as conn:
            sink = Collect()
            await conn.fetch(3, "m.safetensors", 10, 20, sink)
    assert sink.data == b"0123456789"
    assert srv.requests[0].startswith(b"GET /v1/versions/3/files/m.safetensors HTTP/1.1\r\n")
    assert b"Range: bytes=10-19\r\n" in srv.requests[0] and b"authorization: Bearer t\r\n" in srv.requests[0]


async def test_a_reply_that_is_not_the_range_asked_never_reaches_the_sink():
    whole_file = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789"
    wrong_range = partial(0, b"01234")
    async with ScriptedServer([whole_file]) as srv, RangeConnection(srv.url) as conn:
        sink = Collect()
        with pytest.raises(errors.RegistryUnavailable, match="asked bytes 2-6, got HTTP 200"):
            await conn.fetch(1, "m.safetensors", 2, 7, sink)
    async with ScriptedServer([wrong_range]) as srv, RangeConnection(srv.url) as conn:
        with pytest.raises(errors.RegistryUnavailable, match="Content-Range 'bytes 0-4/1000'"):
            await conn.fetch(1, "m.safetensors", 2, 7, sink)
    assert sink.calls == 0


@pytest.mark.parametrize("reply, message", [
    (b"HTTP/1.1 206 Partial Content\r\ntransfer-encoding: chunked\r\n\r\n", "chunked"),
    (b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-4/9\r\n\r\n", "without a Content-Length"),
    (b"SPDY 206\r\n\r\n", "not an HTTP/1.x status line"),
    (partial(0, b"01234")[:-2], "connection closed"),  # cut short
    (b"HTTP/1.1 206 Partial Content\r\n" + b"x-pad: " + b"a" * 70_000, "head longer than"),
])
async def test_broken_replies_are_unavailable(reply, message):
    async with ScriptedServer([[reply, None]]) as srv, RangeConnection(srv.url) as conn:
        with pytest.raises(errors.RegistryUnavailable, match=message):
            await conn.fetch(1, "m.safetensors", 0, 5, Collect())


async def test_error_replies_are_typed():
    body = json.dumps({"error": {"code": "version_retired", "message": "gone"}}).encode()
    reply = f"HTTP/1.1 410 Gone\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
    async with ScriptedServer([reply]) as srv, RangeConnection(srv.url) as conn:
        with pytest.raises(errors.VersionRetired, match="gone"):
            await conn.fetch(1, "m.safetensors", 0, 5, Collect())


async def test_a_connection_closed_while_idle_is_replaced_once():
    # the first connection answers one request, then the server closes it (idle keep-alive ends)
    async with ScriptedServer([[partial(0, b"abcde"), 0.05, None], partial(0, b"fghij")]) as srv:
        async with RangeConnection(srv.url) as conn:
            first, second = Collect(), Collect()
            await conn.fetch(1, "m.safetensors", 0, 5, first)
            await asyncio.sleep(0.1)
            await conn.fetch(1, "m.safetensors", 0, 5, second)
    assert (first.data, second.data, srv.connections) == (b"abcde", b"fghij", 2)


async def test_silence_is_a_timeout_and_cancellation_closes():
    async with ScriptedServer([[partial(0, b"abcde")[:60], 5]]) as srv:
        async with RangeConnection(srv.url, read_s=0.2) as conn:
            with pytest.raises(errors.RegistryUnavailable, match="no byte for 0.2 s"):
                await conn.fetch(1, "m.safetensors", 0, 5, Collect())
    async with ScriptedServer([[partial(0, b"abcde")[:60], 5]]) as srv:
        async with RangeConnection(srv.url) as conn:
            task = asyncio.create_task(conn.fetch(1, "m.safetensors", 0, 5, Collect()))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert conn._proto is None  # closed: half a response must never be read as the next one


async def test_unreachable_and_bad_urls():
    with pytest.raises(ValueError):
        RangeConnection("ftp://x")
    async with RangeConnection("http://127.0.0.1:1") as conn:
        with pytest.raises(errors.RegistryUnavailable, match="connect to 127.0.0.1:1"):
            await conn.fetch(1, "m.safetensors", 0, 5, Collect())
