"""The gateway's connections to one vLLM server's UNIX socket: kept alive, one request at a time.

:class:`UpstreamPool` is what the rest of the daemon sees of them: :meth:`UpstreamPool.quiet`
(no request sent to vLLM is still unanswered) and :meth:`UpstreamPool.recall_unanswered` (take
back what vLLM has not begun to answer), which the update sequence calls through the gateway
(relay.py), and, for the relay, :meth:`UpstreamPool.take`, :meth:`UpstreamPool.connect` and
:meth:`UpstreamPool.close`. An :class:`Upstream` passes one answer of vLLM on to the client
piece by piece as it comes (SSE included), never buffered whole, with a head of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Protocol

import httptools

from rolloutd.gateway.exchange import HOP, Exchange, connection_header, connection_tokens

log = logging.getLogger("rolloutd.gateway.relay")

IDLE_UPSTREAM_S = 2.0  # a kept-alive connection to vLLM older than this is not reused (uvicorn drops them at 5 s)
IDLE_UPSTREAM_MAX = 64
CONNECT_TIMEOUT_S = 5.0
_DROP_RESPONSE = HOP | {b"server"}


class Relay(Protocol):
    """What an answer's end needs of the gateway (relay.py's Gateway)."""

    name: str

    def held_again(self, status: int) -> bool: ...
    def resend(self, exchange: Exchange) -> None: ...
    def failed(self, exchange: Exchange, why: str) -> None: ...


class UpstreamPool:
    """The kept-alive connections to one vLLM server, and the requests in flight on them."""

    def __init__(self, socket_path: Path | str, relay: Relay):
        self.path = str(socket_path)
        self.relay = relay
        self.host_header = b"localhost"
        self._open = True  # False once closed: a connection coming back is closed, not kept
        self._idle: list[Upstream] = []  # kept-alive connections to vLLM, newest last
        self._busy: set[Upstream] = set()  # connections to vLLM with a request sent and not yet answered
        self._quiet = asyncio.Event()  # set while _busy is empty
        self._quiet.set()
        self._answering = asyncio.Event()  # set when an answer of vLLM begins or a request settles

    # -- what the update sequence uses (through the gateway) --------------------------------------
    async def quiet(self, timeout_s: float) -> bool:
        """Wait until no request sent to vLLM is still unanswered; False if some still are after
        ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._quiet.wait()
            return True
        except TimeoutError:
            return False

    async def recall_unanswered(self, grace_s: float) -> int:
        """Close the connection of every request vLLM has not begun to answer within ``grace_s``
        (which makes vLLM drop it; the relay sends it again). Returns how many."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(not up.started for up in self._busy) and (left := deadline - loop.time()) > 0:
            self._answering.clear()
            try:
                async with asyncio.timeout(left):
                    await self._answering.wait()
            except TimeoutError:
                break
        unbegun = [up for up in self._busy if not up.started]
        for up in unbegun:
            up.transport.close()  # connection_lost sends the request again (Relay.resend, failed)
        return len(unbegun)

    # -- what the relay uses --------------------------------------------------------------------
    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        """Close the idle connections; a busy one is closed when its answer ends."""
        self._open = False
        for up in self._idle:
            up.transport.close()
        self._idle.clear()

    def take(self) -> Upstream | None:
        """A kept-alive connection young enough to reuse, if there is one."""
        now = time.monotonic()
        while self._idle:
            up = self._idle.pop()
            if not up.transport.is_closing() and now - up.idle_since < IDLE_UPSTREAM_S:
                return up
            up.transport.close()
        return None

    async def connect(self) -> Upstream:
        """A new connection (OSError or TimeoutError when vLLM does not take it)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            _, up = await loop.create_unix_connection(lambda: Upstream(self), self.path)
        return up

    def give_back(self, up: Upstream) -> None:
        """``up`` has no request on it: kept for the next one, or closed."""
        if len(self._idle) >= IDLE_UPSTREAM_MAX or not self._open:
            up.transport.close()
            return
        up.idle_since = time.monotonic()
        self._idle.append(up)

    # -- what its connections tell it -----------------------------------------------------------
    def _sent(self, up: Upstream) -> None:
        self._busy.add(up)
        self._quiet.clear()

    def _began(self) -> None:
        """An answer of vLLM began: its head went to the client."""
        self._answering.set()

    def _settled(self, up: Upstream) -> None:
        """``up`` has no request in flight any more (answered, dropped, or closed)."""
        self._busy.discard(up)
        self._answering.set()
        if not self._busy:
            self._quiet.set()

    def _forget(self, up: Upstream) -> None:
        if up in self._idle:
            self._idle.remove(up)


class Upstream(asyncio.Protocol):
    """One kept-alive connection to vLLM, relaying one answer at a time to a client."""

    def __init__(self, pool: UpstreamPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.started = False  # the answer's head has gone to the client

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport  # a UNIX socket: no Nagle to turn off

    # -- what the relay uses --------------------------------------------------------------------
    def send(self, exchange: Exchange, reused: bool) -> None:
        self.exchange, exchange.upstream, self.reused = exchange, self, reused
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.reason, self.headers = 0, b"", []
        self.started = False  # the answer's head has gone to the client
        self.chunked = False  # the client gets chunked framing made here
        self.until_close = False  # vLLM ends this answer by closing the connection
        self.discard = False  # this answer is not passed on (a 503 from a pausing server)
        self.pool._sent(self)
        if exchange.client.write_paused:  # (a slow client paused it during the last answer, or now)
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()
        self.transport.write(exchange.request_bytes(self.pool.host_header, connection_tokens(exchange.headers)))

    def pause(self) -> None:
        """The client reads slower than we write: stop reading vLLM."""
        self.transport.pause_reading()

    def resume(self) -> None:
        self.transport.resume_reading()

    def abandon(self) -> None:
        """The client left: closing the connection makes vLLM abort the request."""
        self.exchange = None
        self.transport.close()

    # -- the transport's callbacks ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            log.warning("gateway %s: the server's answer is not valid HTTP", self.pool.relay.name)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        pool, relay = self.pool, self.pool.relay
        pool._forget(self)
        pool._settled(self)
        ex, self.exchange = self.exchange, None
        if ex is None or ex.client.closing:
            return  # idle, or its client has left
        ex.upstream = None
        if self.started and self.until_close:
            self._end(ex)
        elif self.started:
            log.warning("gateway %s: %s %s: the server broke off its answer", relay.name, ex.method, ex.path)
            ex.client.close()  # the client sees the answer cut, never a complete-looking one
        elif self.discard or (self.reused and not self.status):
            relay.resend(ex)  # a kept-alive connection vLLM had closed meanwhile: once more, anew
        else:
            relay.failed(ex, "closed the connection without an answer")

    # -- the parser's callbacks -------------------------------------------------------------------
    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.exchange
        self.status = self.parser.get_status_code()
        if self.status < 200 or self.pool.relay.held_again(self.status):
            self.discard = True  # an interim answer, or a pausing server's refusal: not passed on
            return
        dropped = connection_tokens(self.headers)
        lines = [b"HTTP/1.1 %d %s\r\n" % (self.status, self.reason or b"-")]
        length = framed = None
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length":
                length = value
            elif low == b"transfer-encoding":
                framed = value
            elif low not in _DROP_RESPONSE and low not in dropped:
                lines.append(b"%s: %s\r\n" % (name, value))
        if length is not None:
            lines.append(b"Content-Length: %s\r\n" % length)
        elif self.status not in (204, 304):
            self.until_close = framed is None
            if ex.http10:
                ex.keep_alive = False  # an HTTP/1.0 client knows the end by the close
            else:
                lines.append(b"Transfer-Encoding: chunked\r\n")
                self.chunked = True
        lines.append(connection_header(ex))
        lines.append(b"\r\n")
        ex.client.write(b"".join(lines))
        self.started = True
        self.pool._began()

    def on_body(self, body: bytes) -> None:
        if self.discard:
            return
        if self.chunked:
            self.exchange.client.write(b"%x\r\n%s\r\n" % (len(body), body))
        else:
            self.exchange.client.write(body)

    def on_message_complete(self) -> None:
        if self.status < 200:  # after an interim answer, the real one follows
            self.status, self.reason, self.headers, self.discard = 0, b"", [], False
            return
        ex, self.exchange = self.exchange, None
        ex.upstream = None
        self.pool._settled(self)
        if self.parser.should_keep_alive():
            self.pool.give_back(self)
        else:
            self.transport.close()
        if self.discard:
            self.pool.relay.resend(ex)
        else:
            self._end(ex)

    def _end(self, ex: Exchange) -> None:
        if self.chunked:
            ex.client.write(b"0\r\n\r\n")
        ex.client.answered(ex, self.status)
