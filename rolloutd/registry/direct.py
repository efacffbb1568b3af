"""Version bytes between a store and a connection's socket, past uvicorn's buffers.

ASGI has no zero-copy path that uvicorn implements (neither ``http.response.pathsend`` nor
``zerocopysend``), and every byte of a request body passes through four buffers of uvicorn's
before a route sees it. So, on a connection of uvicorn's httptools protocol:

- **Out**: the guard answers ``GET /v1/versions/{v}/files/{name}`` of a disk blob itself: the
  status line and headers go through uvicorn as usual, then the sending thread sends the byte
  range with ``os.sendfile`` on a duplicate of the connection's socket, and the response is
  completed through uvicorn again. The event loop never touches the bytes and never waits on
  the disk. One thread sends every range, as nginx's worker does (:class:`_SendLoop`), so no
  number of slow or stalled clients can hold up the others (a pool of threads could be filled).
- **In**: an upload's body (``PUT /v1/uploads/...`` with a Content-Length of at least
  ``RECEIVE_BYTES``) is read by a worker thread straight from a duplicate of the socket into
  one reused buffer, and written from there into the upload's file: one copy out of the
  kernel and one into the store. uvicorn stops reading the connection first and hands over
  what it had read of the body; as its parser never sees the rest, the connection closes
  after the response (the client opens another for its next request).

Contract:

- :func:`connection` finds the connection behind an ASGI ``send``: only uvicorn's httptools
  protocol, whose requests and responses this module knows how to take over; anything else
  (another server, uvicorn's h11 protocol) is None and the caller moves the bytes the ordinary
  way. A test checks that the installed uvicorn takes these paths, so an upgrade that changes
  them fails loudly.
- :func:`send_range` sends ``[start, end)`` of an open file after the response head was sent.
- :func:`receive_body` reads the declared body before any response is sent.
- The socket (and the file being sent) are duplicated first: if the client goes away and
  uvicorn closes its descriptor, or the caller closes the file, the number is never reused
  under the thread. A client silent for ``STALL_S`` is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger("rolloutd.registry")

# One thread per body being received; each spends its time in system calls or waiting for the
# client, without the interpreter lock.
_RECEIVERS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="registry-receive")
SEND_BYTES = 4 << 20  # one sendfile call: at most this much, then the other ranges get a turn
# Bodies from this size up are received directly (smaller ones keep their kept-alive
# connection), in pieces of this size: one reused buffer, written to the store per piece.
RECEIVE_BYTES = 1 << 20
STALL_S = 60.0  # a client silent this long, while sending or receiving bytes, is dropped
STALL_CHECK_S = 1.0  # how often the sending thread looks for stalled clients
SCOPE_KEY = "rolloutd.connection"  # where the guard leaves an upload's connection for its route
# What receive_body needs of uvicorn's request cycle besides what send_range needs.
_CYCLE_FIELDS = ("body", "more_body", "flow", "keep_alive", "waiting_for_100_continue")


@dataclass
class Connection:
    cycle: object       # uvicorn.protocols.http.httptools_impl.RequestResponseCycle
    transport: asyncio.Transport


def connection(send) -> Connection | None:
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or not all(
            hasattr(cycle, f) for f in ("expected_content_length", "disconnected")):
        return None
    transport = getattr(cycle, "transport", None)
    if transport is None or transport.get_extra_info("socket") is None:
        return None
    if transport.get_extra_info("sslcontext") is not None:  # the socket carries TLS records, not bytes
        return None
    return Connection(cycle, transport)


def can_receive(conn: Connection) -> bool:
    return all(hasattr(conn.cycle, f) for f in _CYCLE_FIELDS) and hasattr(conn.cycle.flow, "pause_reading")


class SendfileError(Exception):
    """The range could not be sent whole (the client left, or stalled)."""


async def send_range(conn: Connection, send, fd: int, start: int, end: int, stall_s: float | None = None) -> int:
    """Send bytes [start, end) of ``fd`` on the connection, after the head went out through
    ``send``; then complete the response through ``send``. Returns the bytes sent; raises
    :class:`SendfileError` after closing the connection if they could not all be sent. Cancelled,
    it stops the sending at once; the caller may close ``fd`` as soon as it returns or raises."""
    for _ in range(1000):  # the head must be on the wire first (uvloop writes it at once, normally)
        if conn.transport.get_write_buffer_size() == 0 or conn.transport.is_closing():
            break
        await asyncio.sleep(0.001)
    if conn.transport.is_closing():
        conn.cycle.disconnected = True
        raise SendfileError("the client left before the body was sent")
    sock = _duplicate(conn.transport)
    try:
        own_fd = os.dup(fd)
    except OSError:
        sock.close()
        raise
    job = _SendJob(sock, own_fd, start, end, STALL_S if stall_s is None else stall_s,
                   asyncio.get_running_loop().create_future())
    _SENDER.submit(job)
    try:
        sent = await asyncio.shield(job.done)
    except asyncio.CancelledError:
        _SENDER.cancel(job)
        raise
    if sent != end - start:
        conn.transport.close()
        conn.cycle.disconnected = True  # as uvicorn marks it once the close lands: no "response not completed" error
        raise SendfileError(f"sent {sent} of {end - start} bytes")
    # uvicorn counts the body bytes it was given against Content-Length: count these too.
    conn.cycle.expected_content_length -= sent
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return sent


def _duplicate(transport: asyncio.Transport) -> socket.socket:
    """The connection's socket under a descriptor of our own (see the module's contract)."""
    raw = transport.get_extra_info("socket")
    return socket.socket(raw.family, raw.type, fileno=os.dup(raw.fileno()))


@dataclass(eq=False)
class _SendJob:
    sock: socket.socket  # a duplicate of the connection's, non-blocking; the job's to close
    fd: int              # a duplicate of the file's; the job's to close
    offset: int
    end: int
    stall_s: float
    done: asyncio.Future  # the bytes sent, set on its event loop
    start: int = field(init=False)
    moved_at: float = field(default_factory=time.monotonic)  # the last time bytes went out
    ended: bool = False

    def __post_init__(self) -> None:
        self.start = self.offset


class _SendLoop:
    """One thread that sends every range with ``sendfile``, as nginx's worker does: it waits for
    room on all of the sockets at once (epoll) and gives each ready one a ``SEND_BYTES`` turn,
    so a client that stops reading holds up no other, however many do. Each socket is corked
    meanwhile (nginx's ``tcp_nopush``): only full segments go out until the last. Jobs come
    from the event loop through :meth:`submit` and :meth:`cancel`; a job ends exactly once (its
    descriptors closed, its future set) when sent, when the client goes away or is silent for
    the job's ``stall_s``, when cancelled, or when something unforeseen fails for it alone:
    the thread itself never ends."""

    def __init__(self) -> None:
        self._forget()
        # A child forked from a process that sent ranges (a trainer's data loader) has this
        # object but not its thread: it starts its own if it ever sends.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, _SendJob]] = []
        self._thread: threading.Thread | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake = -1

    def submit(self, job: _SendJob) -> None:
        self._post("send", job)

    def cancel(self, job: _SendJob) -> None:
        self._post("cancel", job)

    def _post(self, what: str, job: _SendJob) -> None:
        with self._lock:
            if self._thread is None:
                self._selector = selectors.DefaultSelector()
                self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._selector.register(self._wake, selectors.EVENT_READ, None)
                self._thread = threading.Thread(target=self._run, name="registry-sendfile", daemon=True)
                self._thread.start()
            self._inbox.append((what, job))
        os.eventfd_write(self._wake, 1)

    def _run(self) -> None:
        jobs: set[_SendJob] = set()
        checked = time.monotonic()
        while True:
            # Stalls are looked for once a second, not on every wake-up: a wake-up costs only
            # the sockets that are ready, however many ranges are being sent.
            ready = self._selector.select(STALL_CHECK_S if jobs else None)
            for key, _ in ready:
                if key.data is None:
                    self._take_inbox(jobs)
                elif key.data in jobs:
                    self._guarded(self._turn, key.data, jobs)
            now = time.monotonic()
            if now - checked >= STALL_CHECK_S:
                checked = now
                for job in [j for j in jobs if now - j.moved_at > j.stall_s]:
                    self._finish(job, jobs)  # the client stopped reading

    def _take_inbox(self, jobs: set[_SendJob]) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake)
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for what, job in inbox:
            if what == "send":
                self._guarded(self._start, job, jobs)
            else:
                self._finish(job, jobs)

    def _guarded(self, step, job: _SendJob, jobs: set[_SendJob]) -> None:
        try:
            step(job, jobs)
        except Exception:  # a bug or a surprise: end this range (its client sees a short body), not the thread
            log.exception("sending a range failed")
            self._finish(job, jobs)

    def _start(self, job: _SendJob, jobs: set[_SendJob]) -> None:
        _cork(job.sock, True)
        self._selector.register(job.sock, selectors.EVENT_WRITE, job)
        jobs.add(job)

    def _turn(self, job: _SendJob, jobs: set[_SendJob]) -> None:
        try:
            n = os.sendfile(job.sock.fileno(), job.fd, job.offset, min(SEND_BYTES, job.end - job.offset))
        except BlockingIOError:
            return  # no room: the selector says when there is
        except OSError:  # the client went away (EPIPE, ECONNRESET)
            n = 0
        if n:
            job.offset += n
            job.moved_at = time.monotonic()
        if n == 0 or job.offset >= job.end:  # done, gone, or the file is shorter than it should be
            self._finish(job, jobs)

    def _finish(self, job: _SendJob, jobs: set[_SendJob]) -> None:
        jobs.discard(job)
        if job.ended:  # a cancel that crossed the job's end
            return
        job.ended = True
        with contextlib.suppress(KeyError, ValueError):  # never registered
            self._selector.unregister(job.sock)
        _cork(job.sock, False)  # uncorking sends what is left at once
        job.sock.close()
        os.close(job.fd)
        with contextlib.suppress(RuntimeError):  # its event loop closed meanwhile
            job.done.get_loop().call_soon_threadsafe(_settle, job.done, job.offset - job.start)


def _settle(future: asyncio.Future, sent: int) -> None:
    if not future.done():
        future.set_result(sent)


_SENDER = _SendLoop()


def _cork(sock: socket.socket, on: bool) -> bool:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1 if on else 0)
    except OSError:  # not TCP, or closed by the client
        return False
    return True


class ClientGone(Exception):
    """The body stopped before its declared end (the client closed, or went silent)."""


async def receive_body(conn: Connection, length: int, write: Callable[[Sequence[bytes]], None],
                       stall_s: float | None = None) -> int:
    """Read the request's body, ``length`` bytes as its Content-Length declared, and hand it to
    ``write`` in order, in pieces, from a worker thread; returns ``length``. Raises
    :class:`ClientGone` if the body ends early or is silent for ``stall_s`` (``STALL_S``), and whatever
    ``write`` raises; either way no thread is left reading. The connection closes after the
    response, whatever it is."""
    cycle, transport = conn.cycle, conn.transport
    cycle.keep_alive = False  # from here on uvicorn's parser is out of step with the socket
    cycle.flow.pause_reading()
    if cycle.waiting_for_100_continue and not transport.is_closing():
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        cycle.waiting_for_100_continue = False
    early, cycle.body = cycle.body, bytearray()  # what uvicorn read of the body already
    if len(early) < length and not cycle.more_body:
        raise ClientGone(f"the body ended after {len(early)} of {length} bytes")
    dup = None
    if len(early) < length:
        if transport.is_closing():
            raise ClientGone(f"the connection closed after {len(early)} of {length} bytes")
        dup = _duplicate(transport)
        dup.settimeout(STALL_S if stall_s is None else stall_s)
    reading = asyncio.get_running_loop().run_in_executor(_RECEIVERS, _receive, dup, early, length, write)
    try:
        await asyncio.shield(reading)
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):
            if dup is not None:
                dup.shutdown(socket.SHUT_RD)  # the thread's read returns at once; replies may still go
        with contextlib.suppress(BaseException):
            await reading
        raise
    finally:
        if dup is not None:
            dup.close()
    return length


def _receive(sock: socket.socket | None, early: bytearray, length: int,
             write: Callable[[Sequence[bytes]], None]) -> None:
    """Blocking: ``early`` (the body's start, read already), then the rest of the ``length``
    bytes from the socket, written a piece at a time. Once a write fails, the rest of the body
    is read and dropped before its error is raised, so that the client, still sending, gets
    the error reply rather than a reset connection."""
    failed: Exception | None = None

    def put(piece) -> None:
        nonlocal failed
        if failed is None:
            try:
                write([piece])
            except Exception as e:
                failed = e
    if early:
        put(early)
    done, buffer = len(early), memoryview(bytearray(min(RECEIVE_BYTES, length)))
    while done < length:
        want, filled = min(len(buffer), length - done), 0
        while filled < want:
            try:
                n = sock.recv_into(buffer[filled:want])
            except TimeoutError:
                raise failed or ClientGone(f"no bytes for {sock.gettimeout():g} s after {done + filled} of "
                                           f"{length}") from None
            except OSError as e:  # reset by the client
                raise failed or ClientGone(f"{e.strerror or e} after {done + filled} of {length} bytes") from None
            if n == 0:
                raise failed or ClientGone(f"the body ended after {done + filled} of {length} bytes")
            filled += n
        put(buffer[:filled])
        done += filled
    if failed is not None:
        raise failed
