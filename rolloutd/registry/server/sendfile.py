"""Version bytes from a disk store at sendfile speed: the kernel moves file pages to the socket.

ASGI has no zero-copy path that uvicorn implements (neither ``http.response.pathsend`` nor
``zerocopysend``), so the guard answers ``GET /v1/versions/{v}/files/{name}`` of a disk blob
itself: the status line and headers go through uvicorn as usual, then a worker thread sends
the byte range with ``os.sendfile`` on a duplicate of the connection's socket, and the response
is completed through uvicorn again. The event loop never touches the bytes, never waits on the
disk, and a slow client holds a thread, not the loop.

Contract:

- :func:`connection` finds the connection behind an ASGI ``send``: only uvicorn's httptools
  protocol, whose responses this module knows how to complete; anything else (another server,
  uvicorn's h11 protocol) is None and the caller streams the bytes the ordinary way. A test
  checks that the installed uvicorn takes this path, so an upgrade that changes it fails loudly.
- :func:`send_range` sends ``[start, end)`` of an open file after the response head was sent.
  The socket is duplicated first: if the client goes away and uvicorn closes its descriptor,
  the number is never reused under the thread. A client silent for ``stall_s`` is dropped.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# One thread per response being sent; each spends its time in sendfile or waiting for the
# client, without the interpreter lock.
_SENDERS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="registry-sendfile")
SEND_BYTES = 16 << 20  # one sendfile call: at most this much, so progress is seen in steps


@dataclass
class Connection:
    cycle: object       # uvicorn.protocols.http.httptools_impl.RequestResponseCycle
    transport: asyncio.Transport


def connection(send) -> Connection | None:
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or not hasattr(
            cycle, "expected_content_length"):
        return None
    transport = getattr(cycle, "transport", None)
    if transport is None or transport.get_extra_info("socket") is None:
        return None
    return Connection(cycle, transport)


class SendfileError(Exception):
    """The range could not be sent whole (the client left, or stalled)."""


async def send_range(conn: Connection, send, fd: int, start: int, end: int, stall_s: float = 60.0) -> int:
    """Send bytes [start, end) of ``fd`` on the connection, after the head went out through
    ``send``; then complete the response through ``send``. Returns the bytes sent; raises
    :class:`SendfileError` after closing the connection if they could not all be sent."""
    for _ in range(1000):  # the head must be on the wire first (uvloop writes it at once, normally)
        if conn.transport.get_write_buffer_size() == 0 or conn.transport.is_closing():
            break
        await asyncio.sleep(0.001)
    raw = conn.transport.get_extra_info("socket")
    dup = socket.socket(raw.family, raw.type, fileno=os.dup(raw.fileno()))  # the same connection, our descriptor
    try:
        sent = await asyncio.get_running_loop().run_in_executor(_SENDERS, _sendfile, dup, fd, start, end, stall_s)
    finally:
        dup.close()
    if sent != end - start:
        conn.transport.close()
        raise SendfileError(f"sent {sent} of {end - start} bytes")
    # uvicorn counts the body bytes it was given against Content-Length: count these too.
    conn.cycle.expected_content_length -= sent
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return sent


def _sendfile(sock: socket.socket, fd: int, start: int, end: int, stall_s: float) -> int:
    """Blocking: sendfile on a non-blocking socket, waiting for room with poll. The socket is
    corked meanwhile (nginx's ``tcp_nopush``): only full segments go out until the last."""
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLOUT)
    offset = start
    cork = _cork(sock, True)
    try:
        while offset < end:
            try:
                n = os.sendfile(sock.fileno(), fd, offset, min(SEND_BYTES, end - offset))
            except BlockingIOError:
                if not poll.poll(int(stall_s * 1000)):
                    break  # the client stopped reading
                continue
            except OSError:  # the client went away (EPIPE, ECONNRESET)
                break
            if n == 0:
                break  # the file is shorter than it should be
            offset += n
    finally:
        if cork:
            _cork(sock, False)  # uncorking sends what is left at once
    return offset - start


def _cork(sock: socket.socket, on: bool) -> bool:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1 if on else 0)
    except OSError:  # not TCP
        return False
    return True
