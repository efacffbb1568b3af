"""Embedded HTTP servers: uvicorn that owns no signals, on a socket bound before it starts.

Binding first means a caller learns the real port (``port=0`` picks a free one) and an
address already in use fails at once, with a clear error, in the caller's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("rolloutd")


# glibc's malloc gives each buffer over 128 KiB fresh pages of its own (mmap) and hands the
# heap's freed top back to the kernel. The body of an upload passes through a few such buffers
# per read (the socket's, the HTTP parser's, the request's), so every byte of it was written
# into new pages: a page fault per 4 KiB. Kept in the heap and reused instead, an upload is
# received markedly faster (docs/data-path.md, "Reused buffers").
MALLOC_MMAP_THRESHOLD = 16 << 20
MALLOC_TRIM_THRESHOLD = 256 << 20  # freed memory the process keeps for its next buffers
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from malloc.h


def reuse_freed_memory() -> bool:
    """Have this process's allocator reuse freed buffers of up to ``MALLOC_MMAP_THRESHOLD``
    rather than map new pages for each (a server process of its own: never a trainer's).
    False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def raise_open_files_limit() -> tuple[int, int]:
    """Lift this process's soft limit on open files to its hard limit, and return (before,
    after). A standalone registry holds a connection per node, a long-poll on some, and a
    descriptor per memory-store blob; the usual soft limit of 1024 is below a fleet of 1,000
    nodes. The loop uses epoll, never select(), so descriptors above 1024 are fine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # the kernel caps open files at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


def run(coro):
    """``asyncio.run`` on uvloop (uvicorn's own loop setting does not apply to a loop we make)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to whoever embeds it, and stops promptly.

    ``before_shutdown`` callbacks run on the server's loop as shutdown begins, before it waits
    for open requests: that is where long-polls are told to return at once.

    :meth:`exit` (from any thread) stops it at once; uvicorn itself looks at ``should_exit``
    every 0.1 s and then sleeps 0.1 s more whatever is open, so an idle server took 0.2 s to stop.
    Here shutdown waits for open connections and requests only as long as they take (at most
    ``timeout_graceful_shutdown``).
    """

    def __init__(self, config: uvicorn.Config, before_shutdown: list[Callable[[], None]] | None = None):
        super().__init__(config)
        self.before_shutdown = before_shutdown or []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def exit(self) -> None:
        """Stop serving; callable from any thread."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        # uvicorn's loop ticks every 0.1 s to see should_exit and renews the Date header every
        # tenth tick. exit() wakes this one, so it ticks once a second, each tick a tenth
        # (counter 0): the Date header as fresh, nine wake-ups a second fewer (bench/footprint.py).
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        should_exit = await self.on_tick(0)
        while not should_exit:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            should_exit = await self.on_tick(0)

    async def shutdown(self, sockets=None) -> None:
        for fn in self.before_shutdown:
            fn()
        for server in self.servers:  # no new connections
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):  # idle ones close now, busy ones after their answer
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while (state.connections or state.tasks) and not self.force_exit:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            log.error("stop: cancel %d request(s) still running after timeout_graceful_shutdown", len(state.tasks))
            for task in state.tasks:
                task.cancel()
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the
    # listener says TCP; without it each response's body waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(backlog)
    # Not inheritable (Python's default): every vLLM child would otherwise hold the admin API's
    # listening socket open for as long as it lives (uvloop's spawn closes only close-on-exec fds).
    return sock


# What a client may cost before its request is answered: a whole head within HEAD_TIMEOUT_S of
# connecting or of starting it, at most MAX_HEAD_BYTES of it, and at most MAX_FRAMING_BYTES of a
# body that are not body (chunk sizes, extensions, trailers) in a row. uvicorn bounds none of these
# with httptools: a half-sent head held its connection for as long as the client liked, and a
# trailer section streamed without end was parsed on the server's only loop by repeated
# concatenation, stalling every other request of the registry or the admin API (a token-less
# client was enough: authentication runs once the head is complete, trailers come after it).
HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 << 10
MAX_FRAMING_BYTES = 64 << 10
MAX_CONNECTIONS = 4096


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above; a connection past one is closed."""

    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # the parser is inside a request's head
        self._in_body = False  # ... inside its body (trailers included)
        self._head_bytes = 0
        self._framing = 0  # bytes fed since the body last moved, in a body
        self._body_moved = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("refuse a connection from %s: %d open", self.client, len(self.connections) - 1)
            transport.abort()
            return
        self._arm_head_timer()  # a connection that sends nothing is closed like a half-sent head

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._body_moved = False
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, "request head too large")
        elif self._in_body:
            self._framing = 0 if self._body_moved else self._framing + len(data)
            if self._framing > MAX_FRAMING_BYTES:
                self._refuse(431, "chunk framing or trailers too large")

    # The parser's callbacks say where in a request it is: the state the checks above read.
    def on_message_begin(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._arm_head_timer()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body, self._framing = False, True, 0
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_moved = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:  # a trailer field: never one of the request's headers
            return
        super().on_header(name, value)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, why: str) -> None:
        """Answer and close; a request already given to the app sees a disconnect."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.abort()  # its answer may be under way: nothing more on this connection
            return
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                             % (status, why.encode()))
        self.transport.close()


def server_config(app, **kwargs) -> uvicorn.Config:
    """uvicorn settings shared by every embedded server (no access log: it is per request)."""
    kwargs.setdefault("http", BoundedHttpToolsProtocol)
    kwargs.setdefault("timeout_keep_alive", 75)
    kwargs.setdefault("timeout_graceful_shutdown", 5)
    kwargs.setdefault("proxy_headers", False)  # no proxy is trusted: the peer is who connected
    return uvicorn.Config(app, access_log=False, log_config=None, lifespan="on", **kwargs)


class ServerThread:
    """Run an ASGI app in a thread with its own event loop; ``start`` returns once it accepts."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 before_shutdown: list[Callable[[], None]] | None = None, **config):
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = QuietServer(server_config(app, **config), before_shutdown)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"http-{self.port}", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            run(self._serve())
        except BaseException as e:  # surfaced to start()
            self._error = e

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on port {self.port} failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"HTTP server on port {self.port} not up after {timeout_s} s")
            time.sleep(0.005)
        return self

    def call(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        assert self.loop is not None, "server not started"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.exit()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.sock.close()
        if self._thread.is_alive():
            raise TimeoutError(f"HTTP server on port {self.port} did not stop within {timeout_s} s")
