"""The gateway's transport: the only way to a ``vllm serve`` from other hosts.

vLLM's pause and weight routes and ``/collective_rpc`` have no authentication, so every vLLM
child listens on a UNIX socket only the daemon's user can reach (supervise/sockets.py). For each
server, the daemon listens on the node's public address (``gateway.host``, the server's
``public_port``) and relays what the server's :class:`Policy` (policy.py: allow-list, token,
pause and hold, counting) lets through to that socket:

- **Streaming.** The answer is passed on piece by piece as vLLM writes it (SSE included),
  never buffered whole. A client that goes away (closes its side) closes the connection to
  vLLM, which aborts the request there. If vLLM breaks off an answer, the client's connection
  is closed before the answer's end, so a cut answer never looks complete.
- **Bounded.** Each client connection is a state machine (:class:`Reading`) whose states carry
  their timeouts (head, body, idle keep-alive; none while a request is being answered); at most
  ``max_connections`` per gateway, where a connection that never sent the token gives way to a
  new one; per connection, a bounded number of requests and bytes read ahead (heads, bodies,
  and a chunked body's framing and trailers, which are never passed on), no new answer while
  the client does not take the last one, and nothing parsed after a request without the token.

Errors are JSON ``{"error": {"code", "message"}}``, as in the admin API and the registry.

It is a relay at the level of asyncio protocols, with llhttp (``httptools``) parsing both
sides: a streamed generation passes through it once per token, so each request and each piece
must cost microseconds, not the hundreds a general HTTP client and server spend (see
bench/README.md, "Gateway cost"). One request per client connection is answered at a time,
in order (pipelined requests wait their turn); requests to vLLM go over kept-alive connections
to its socket.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import http
import json
import logging
import socket
import time
from pathlib import Path

import httptools

from rolloutd.config import Gateway as GatewaySettings
from rolloutd.gateway.policy import Policy, Unavailable
from rolloutd.metrics import Metrics
from rolloutd.wire import version_contract
from rolloutd.wire.states import ServerState

log = logging.getLogger("rolloutd.gateway.relay")

HEAD_LIMIT = 64 * 1024  # request line and headers, as most servers allow
# Bytes of a chunked body that carry no data (size lines, extensions, and the trailer section
# after the last chunk), read in a row: llhttp passes a trailer's value to httptools in pieces it
# joins by concatenation, so an unbounded one costs memory and quadratic time on the daemon's loop.
FRAMING_LIMIT = HEAD_LIMIT
IDLE_UPSTREAM_S = 2.0  # a kept-alive connection to vLLM older than this is not reused (uvicorn drops them at 5 s)
IDLE_UPSTREAM_MAX = 64
LINGER_S = 2.0  # after a refusal whose body still comes: drop it (max_body_bytes at most) this long, then close
MAX_HEADERS = 128  # header lines of one request (64 KiB of tiny ones would be thousands of objects)
PIPELINE_MAX = 16  # requests of one connection read ahead of the one being answered
FEED_BYTES = 4096  # what one read is parsed in pieces of, so that reading ahead stops near PIPELINE_MAX

# Per-connection headers (RFC 9110 7.6.1), framing (set by the relay itself), the client's token,
# and what must not pass: the relay answers ``Expect`` itself and names no server.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
                  b"te", b"trailer", b"transfer-encoding", b"upgrade", b"content-length"})
_MIN_VERSION = version_contract.MIN_VERSION_HEADER.lower().encode()
_DROP_REQUEST = _HOP | {b"host", b"authorization", b"expect", _MIN_VERSION}
_DROP_RESPONSE = _HOP | {b"server"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_VERSION = -1


class GatewayError(OSError):
    """The gateway cannot listen (address in use, not available)."""


class Gateway:
    """One server's public listener: client connections in, kept-alive connections to vLLM out,
    and between them the server's :class:`Policy`."""

    def __init__(self, name: str, upstream: Path, port: int, settings: GatewaySettings, token: str | None,
                 metrics: Metrics):
        self.name, self.port, self.settings, self.metrics = name, port, settings, metrics
        self.policy = Policy(name, settings, token, metrics)
        self.upstream = str(upstream)  # vLLM's UNIX socket
        self.limit = int(settings.max_body_bytes)
        self.host_header = b"localhost"
        self._server: asyncio.Server | None = None
        self._clients: set[_Client] = set()
        # Connections that have sent no request with the token yet, oldest first: when the
        # gateway is full, a new connection takes the place of the oldest of them, so clients
        # without the token can never keep a trainer out.
        self._strangers: dict[_Client, None] = {}
        self._idle: list[_Upstream] = []  # kept-alive connections to vLLM, newest last
        self._busy: set[_Upstream] = set()  # connections to vLLM with a request sent and not yet answered
        self._quiet = asyncio.Event()  # set while _busy is empty
        self._quiet.set()
        self._answering = asyncio.Event()  # set when an answer of vLLM begins or a request settles
        self.max_connections = settings.max_connections
        self.refused = metrics.gateway_refused_connections.labels(server=name)
        self.timeouts = {Reading.HEAD: settings.head_timeout_s, Reading.BODY: settings.body_timeout_s,
                         Reading.IDLE: settings.idle_timeout_s}
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on ``gateway.host:port``; GatewayError with the reason when that fails."""
        self.loop = loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _Client(self), self.settings.host, self.port,
                                                    reuse_address=True)
        except OSError as e:
            raise GatewayError(f"gateway {self.name}: cannot listen on {self.settings.host}:{self.port}: "
                               f"{e.strerror or e}") from None
        log.info("gateway %s: listening on %s:%d -> %s", self.name, self.settings.host, self.port, self.upstream)

    async def stop(self) -> None:
        """Stop listening and end every connection (a request in flight is cut off)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for client in list(self._clients):
            client.close()
        for up in self._idle:
            up.transport.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run

    def on_state(self, new: ServerState) -> None:
        """Follow the server's lifecycle (a listener of its Lifecycle)."""
        self.policy.on_state(new)

    def admit(self, client: _Client) -> bool:
        """Take ``client`` on, as a stranger until it sends the token; when the gateway is full,
        by ending the oldest stranger's connection. False when every connection has sent the
        token: ``client`` is refused."""
        if len(self._clients) >= self.max_connections:
            oldest = next(iter(self._strangers), None)
            if oldest is None:
                return False
            self.drop(oldest)
            oldest.transport.abort()  # (no answer: it never showed the token)
            self.refused.inc()
        self._clients.add(client)
        self._strangers[client] = None
        return True

    def drop(self, client: _Client) -> None:
        """``client``'s connection has ended (or is being ended): its place is free."""
        self._clients.discard(client)
        self._strangers.pop(client, None)

    def on_version(self, version: int | None) -> None:
        """The version the server holds now (set by its supervisor before it serves it)."""
        self.policy.on_version(version)

    async def quiet(self, timeout_s: float) -> bool:
        """Wait until no request the gateway sent to vLLM is still unanswered; False if some
        still are after ``timeout_s``. Once the server has left SERVING nothing new is sent, so
        an update that waits for this before it pauses vLLM knows that every request vLLM got
        was answered by the weights it held: a request sent a moment before could otherwise
        reach vLLM's engine after the pause began, wait there, and run on the new weights
        after the resume, before the gate has passed them."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._quiet.wait()
            return True
        except TimeoutError:
            return False

    async def recall_unanswered(self, grace_s: float) -> int:
        """Once vLLM has paused with ``abort``: take back every request it has not begun to
        answer within ``grace_s``, to be sent again after the update. vLLM ends the requests it
        was running as it pauses (their answers begin within moments), but one that reached its
        engine after the pause began is queued there, and would run on the new weights as the
        server resumes for its gate. Closing that connection makes vLLM drop the request; the
        gateway sends it again as it sends any request that came during the update (held, or
        refused with ``while_paused: reject``). Returns how many were taken back."""
        if self.policy.serving:
            return 0
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
            up.transport.close()  # connection_lost sends the request again: not serving, so held
        return len(unbegun)

    def sent(self, up: _Upstream) -> None:
        self._busy.add(up)
        self._quiet.clear()

    def answering(self) -> None:
        """An answer of vLLM began: its head went to the client."""
        self._answering.set()

    def settled(self, up: _Upstream) -> None:
        """``up`` has no request in flight any more (answered, dropped, or closed)."""
        self._busy.discard(up)
        self._answering.set()
        if not self._busy:
            self._quiet.set()

    # -- forwarding -----------------------------------------------------------------------------
    def forward(self, exchange: _Exchange) -> None:
        """Send a request on to vLLM: at once on a kept-alive connection while serving (the
        common case, no task at all), else through the policy and a new connection."""
        if self.policy.serving:
            up = self._take_idle()
            if up is not None:
                up.send(exchange, reused=True)
                return
        exchange.task = asyncio.get_running_loop().create_task(self._forward_later(exchange))

    async def _forward_later(self, exchange: _Exchange) -> None:
        try:
            while True:
                await self.policy.ready(exchange.deadline)
                if (refusal := self.policy.behind(exchange.min_version)) is not None:
                    exchange.client.answer_error(exchange, *refusal)
                    return
                up = reused = self._take_idle()
                if up is None:
                    try:
                        up = await self._connect()
                    except OSError as e:
                        if not self.policy.serving:
                            continue  # the server left SERVING meanwhile: the policy decides
                        why = e.strerror or type(e).__name__
                        exchange.client.answer_error(exchange, 502, "upstream",
                                                     f"server {self.name} did not answer: {why}", ())
                        return
                    if not self.policy.serving:  # it left SERVING while connecting: never send then
                        self.give_back(up)
                        continue
                up.send(exchange, reused=reused is not None)
                return
        except Unavailable as e:
            exchange.client.answer_error(exchange, *self.policy.unavailable(str(e)))
        finally:
            exchange.task = None

    def resend(self, exchange: _Exchange) -> None:
        """Send a request again: through the policy, on another connection."""
        exchange.task = asyncio.get_running_loop().create_task(self._forward_later(exchange))

    def failed(self, exchange: _Exchange, why: str) -> None:
        """vLLM dropped a request: the policy decides again when it is no longer serving (it
        paused or stopped); while it is serving, that is its failure (502)."""
        if self.policy.serving:
            exchange.client.answer_error(exchange, 502, "upstream", f"server {self.name} {why}", ())
        else:
            self.resend(exchange)

    # -- connections to vLLM --------------------------------------------------------------------
    async def _connect(self) -> _Upstream:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(5):
            _, up = await loop.create_unix_connection(lambda: _Upstream(self), self.upstream)
        return up

    def _take_idle(self) -> _Upstream | None:
        now = time.monotonic()
        while self._idle:
            up = self._idle.pop()
            if not up.transport.is_closing() and now - up.idle_since < IDLE_UPSTREAM_S:
                return up
            up.transport.close()
        return None

    def give_back(self, up: _Upstream) -> None:
        if len(self._idle) >= IDLE_UPSTREAM_MAX or self._server is None:
            up.transport.close()
            return
        up.idle_since = time.monotonic()
        self._idle.append(up)

    def forget(self, up: _Upstream) -> None:
        if up in self._idle:
            self._idle.remove(up)


class _Exchange:
    """One request from a client and what the gateway does with it."""

    __slots__ = ("client", "method", "target", "path", "headers", "authorization", "length", "expect", "body",
                 "dropped", "refusal", "keep_alive", "http10", "deadline", "task", "upstream", "min_version")

    def __init__(self, client: _Client):
        self.client = client
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.authorization: bytes | None = None
        self.length: int | None = None  # Content-Length, when given
        self.expect = False
        self.body = bytearray()
        self.dropped = 0  # body bytes of a refused request, read and dropped
        self.refusal: tuple | None = None
        self.keep_alive = True
        self.http10 = False
        self.task: asyncio.Task | None = None
        self.upstream: _Upstream | None = None
        self.min_version: int | None = None  # X-Rolloutd-Min-Version (_BAD_VERSION: not a version)

    def request_bytes(self, host: bytes, connection_tokens: frozenset[bytes]) -> bytes:
        """The request as sent to vLLM: the same target, method, headers and body; a Host of
        its own, framing of its own (the whole body is here), nothing per-connection."""
        lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (self.method.encode(), self.target, host)]
        for name, value in self.headers:
            low = name.lower()
            if low not in _DROP_REQUEST and low not in connection_tokens:
                lines.append(b"%s: %s\r\n" % (name, value))
        if self.body or self.method != "GET":
            lines.append(b"Content-Length: %d\r\n" % len(self.body))
        lines.append(b"\r\n")
        lines.append(self.body)
        return b"".join(lines)


def _connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names a ``Connection`` header declares per-connection (RFC 9110 7.6.1)."""
    tokens = [t.strip().lower() for name, value in headers if name.lower() == b"connection" for t in value.split(b",")]
    return frozenset(tokens)


def _error_bytes(status: int, code: str, message: str, extra: tuple, exchange: _Exchange | None) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    lines = [b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
             % (status, http.HTTPStatus(status).phrase.encode(), len(body))]
    lines += [b"%s: %s\r\n" % header for header in extra]
    lines.append(_connection_header(exchange))
    return b"".join(lines) + b"\r\n" + body


def _connection_header(exchange: _Exchange | None) -> bytes:
    if exchange is None or not exchange.keep_alive:
        return b"Connection: close\r\n"
    return b"Connection: keep-alive\r\n" if exchange.http10 else b""


class Reading(enum.Enum):
    """What a client connection is reading; each state has its own clock (``Gateway.timeouts``),
    which runs only while no request of the connection is being answered: a generation may take
    minutes, and a pipelining client may send its next request in pieces meanwhile."""

    HEAD = "head"  # a request line and headers (or, on a new connection, their first byte): head_timeout_s in all
    BODY = "body"  # a request body: body_timeout_s of silence at most
    IDLE = "idle"  # between requests, kept alive: idle_timeout_s
    DONE = "done"  # nothing more is read (refused, timed out, upgrade asked): what comes is dropped, then closed


# The arrows between them; any other is a bug, logged.
_ARROWS = {Reading.HEAD: frozenset({Reading.BODY, Reading.DONE}),
           Reading.BODY: frozenset({Reading.IDLE, Reading.DONE}),
           Reading.IDLE: frozenset({Reading.HEAD, Reading.DONE}),
           Reading.DONE: frozenset()}


class _Client(asyncio.Protocol):
    """One connection from a client: parses its requests, answers them in order.

    Bounded: at most ``PIPELINE_MAX`` requests read ahead of the one being answered, and request
    bytes held beyond the one being answered stay near ``max_body_bytes``; past that, the rest of
    what was read waits unparsed (``stash``, at most one read) and the socket is not read. The next
    answer starts only while the client takes what is written (``pause_writing``), so a client
    that pipelines and reads nothing fills its own socket, not the gateway."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.state = Reading.HEAD
        self.reading: _Exchange | None = None  # the request being read
        self.queue: collections.deque[_Exchange] = collections.deque()  # read, not yet answered; [0] is in hand
        self.held = 0  # request bytes (targets, headers, bodies) of the queue and of the one being read
        self.stash: bytes | memoryview | None = None  # read, not yet parsed: no room for more requests
        self.head_size = 0  # of the request line and headers read so far
        self.head_pending = 0  # bytes read while a head is not complete (a bound on what llhttp holds)
        self.heads = 0  # heads read whole
        self.body_bytes = 0  # of every body parsed so far, dropped ones included (a sign of progress)
        self.framing = 0  # bytes parsed in the body state since the last body bytes (FRAMING_LIMIT)
        self.trailers = 0  # trailer fields of the request being read (MAX_HEADERS)
        self.lingered = 0  # bytes dropped after a refusal (max_body_bytes)
        self.last: bytes | None = None  # one last answer, once the requests before it are answered
        self.deadline: float | None = None  # when the current state's clock runs out; None: no clock
        self.timer: asyncio.TimerHandle | None = None  # fires at or before deadline
        self.write_paused = False  # the client's socket is full: no new answer starts
        self.stalled = False  # an answer waits for the socket to drain (resume_writing goes on)
        self.advancing = self.feeding = False  # re-entry guards of _next and _feed

    # -- the transport's callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        gw = self.gw
        if not gw.admit(self):  # full of clients with the token: refused at once, the others untouched
            self.state = Reading.DONE
            gw.refused.inc()
            transport.write(_error_bytes(503, "unavailable", f"gateway {gw.name}: too many connections",
                                         ((b"Retry-After", str(gw.settings.retry_after_s).encode()),), None))
            transport.close()
            return
        _nodelay(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gw.drop(self)
        self.state = Reading.DONE
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
        for exchange in self.queue:
            _abandon(exchange)
        self.queue.clear()

    def eof_received(self) -> bool:
        # A client that closes its side has left (as nginx takes it): what it asked for is ended
        # (connection_lost follows), which for a generation aborts it in vLLM.
        return False

    def pause_writing(self) -> None:  # the client reads slower than we write: stop reading vLLM
        self.write_paused = True
        up = self.queue[0].upstream if self.queue else None
        if up is not None:
            up.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        up = self.queue[0].upstream if self.queue else None
        if up is not None:
            up.transport.resume_reading()
        if self.stalled:
            self.stalled = False
            self._next()

    def data_received(self, data: bytes) -> None:
        if self.state is Reading.DONE:
            # Lingering after a refusal: dropped, up to a body's worth (what a client that sends
            # its whole body before it reads may still send), then no longer read.
            self.lingered += len(data)
            if self.lingered > self.gw.limit:
                self.transport.pause_reading()
            return
        if self.stash is not None:  # (reading is paused: only a read already under way lands here)
            self.stash = bytes(self.stash) + data
            return
        self._feed(data)
        if self.state is Reading.BODY:
            self._arm()  # the body moves: its clock starts again

    # -- reading, within bounds -------------------------------------------------------------------
    def _full(self) -> bool:
        """No room to read ahead: enough requests wait behind the one being answered."""
        return bool(self.queue) and (len(self.queue) > PIPELINE_MAX or self.held > self.gw.limit)

    def _feed(self, data: bytes | memoryview) -> None:
        """Parse ``data`` in pieces, until it is all parsed or there is no room for more."""
        if self.feeding:
            return
        self.feeding = True
        try:
            while len(data) and self.state is not Reading.DONE:
                if self._full():
                    self.stash = data
                    self.transport.pause_reading()
                    return
                if len(data) > FEED_BYTES:
                    view = memoryview(data)
                    piece, data = view[:FEED_BYTES], view[FEED_BYTES:]
                else:
                    piece, data = data, b""
                self._parse(piece)
        finally:
            self.feeding = False

    def _parse(self, piece: bytes | memoryview) -> None:
        heads, body_bytes = self.heads, self.body_bytes
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self._no_upgrade()
        except httptools.HttpParserError:
            self.finish(400, "bad_request", "not a valid HTTP/1.1 request")
        else:
            if self.state is Reading.HEAD and self.heads == heads:  # a head still coming, over more than
                # this piece (llhttp keeps a header's pieces until it is whole: this bounds that)
                self.head_pending += len(piece)
                if self.head_pending > HEAD_LIMIT:
                    self.finish(*self._head_too_large())
            elif self.state is Reading.BODY and self.body_bytes == body_bytes:
                # A piece of a body without a byte of data: chunk framing or trailers (counted a
                # piece at a time, so at most one piece more than the limit is ever parsed).
                self.framing += len(piece)
                if self.framing > FRAMING_LIMIT:
                    self.finish(*self._trailers_too_large(), exchange=self.reading)

    def _read_on(self) -> None:
        """There is room again: parse what waited, then read the socket again."""
        if self.feeding or self.state is Reading.DONE or self.transport.is_closing():
            return
        if self.stash is not None:
            data, self.stash = self.stash, None
            self._feed(data)
        if self.stash is None and self.state is not Reading.DONE:
            self.transport.resume_reading()

    # -- the clock of each state ------------------------------------------------------------------
    def _set_state(self, new: Reading) -> None:
        old = self.state
        if new is old:
            return
        if new not in _ARROWS[old]:
            log.error("gateway %s: connection state %s -> %s is not an arrow", self.gw.name, old.name, new.name)
        self.state = new
        self._arm()

    def _arm(self) -> None:
        """Start the current state's clock, unless a request is being answered (or nothing more is
        read). The timer is moved only when the deadline comes earlier: most deadlines move later
        (a body's at each read), and the timer then looks again when it fires."""
        if self.queue or self.state is Reading.DONE:
            self.deadline = None
            return
        loop = self.gw.loop
        self.deadline = deadline = loop.time() + self.gw.timeouts[self.state]
        if self.timer is None or self.timer.when() > deadline:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if self.deadline is None or self.transport.is_closing():
            return
        if self.gw.loop.time() < self.deadline:
            self.timer = self.gw.loop.call_at(self.deadline, self._expire)
            return
        self.deadline = None
        if self.state is Reading.IDLE or (self.state is Reading.HEAD and self.reading is None):
            self._set_state(Reading.DONE)
            self.transport.close()  # kept alive long enough, or never said a word: closed quietly
        elif self.state is Reading.HEAD:
            self.finish(408, "timeout", f"request head not received within {self.gw.settings.head_timeout_s:g} s")
        else:
            self.finish(408, "timeout", f"request body stalled for {self.gw.settings.body_timeout_s:g} s",
                        exchange=self.reading)

    # -- the parser's callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.reading = _Exchange(self)
        self.framing = self.trailers = 0
        if self.state is not Reading.DONE:  # (llhttp parses on after a refusal: dropped)
            self._set_state(Reading.HEAD)

    def on_url(self, url: bytes) -> None:
        self.reading.target += url
        self.head_size += len(url)
        self.held += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state is not Reading.HEAD:
            self._trailer()
            return
        ex = self.reading
        if len(ex.headers) >= MAX_HEADERS:
            self.head_size = HEAD_LIMIT + 1  # refused as too large a head, once it is whole
            return
        ex.headers.append((name, value))
        size = len(name) + len(value) + 4
        self.head_size += size
        self.held += size
        low = name.lower()
        if low == b"authorization":
            ex.authorization = value
        elif low == b"content-length":
            ex.length = int(value)  # llhttp has checked it is a number
        elif low == b"expect":
            ex.expect = value.lower() == b"100-continue"
        elif low == _MIN_VERSION:
            ex.min_version = version_contract.parse_min_version(value) or _BAD_VERSION

    def _trailer(self) -> None:
        """A field of a chunked body's trailer section: never passed on (vLLM has no use for
        one, and it must not become a header of the request), counted, bounded like a head."""
        self.trailers += 1
        if self.trailers > MAX_HEADERS and self.state is Reading.BODY:
            self.finish(*self._trailers_too_large(), exchange=self.reading)

    def on_headers_complete(self) -> None:
        if self.state is Reading.DONE:
            return
        if self.head_size > HEAD_LIMIT:
            self.finish(*self._head_too_large())
            return
        self.head_size, self.head_pending = 0, 0
        self.heads += 1
        self._set_state(Reading.BODY)
        ex, gw = self.reading, self.gw
        ex.method = self.parser.get_method().decode("ascii")
        # llhttp stops after a request that asks to upgrade (or a CONNECT): it is answered as any
        # other (never upgraded), and the connection ends with it.
        ex.keep_alive = self.parser.should_keep_alive() and not self.parser.should_upgrade()
        ex.http10 = self.parser.get_http_version() == "1.0"
        ex.path = ex.target.partition(b"?")[0].decode("latin-1")
        ex.deadline = time.monotonic() + gw.settings.hold_max_s
        ex.refusal = gw.policy.refusal(ex.method, ex.path, ex.authorization)
        if not gw.policy.authorized(ex.authorization):
            # Without the token: its answer (401, or 404 off the list) ends the connection, and
            # nothing more of it is parsed, so a client without the token holds no place and no
            # parser for longer than one head.
            self.finish(*ex.refusal, exchange=ex)
            return
        gw._strangers.pop(self, None)
        if ex.refusal is None and ex.min_version == _BAD_VERSION:
            ex.refusal = (400, "bad_request", f"{version_contract.MIN_VERSION_HEADER} must be a positive integer", ())
        if ex.refusal is None and ex.length is not None and ex.length > gw.limit:
            ex.refusal = (413, "too_large", f"request body of {ex.length} bytes; the limit is {gw.limit}", ())
        if ex.refusal is not None and (ex.expect or ex.refusal[0] == 413) and ex.length:
            # The body is not wanted: answer now rather than read it all (the client of an Expect
            # does not even send it), then close.
            self.finish(*ex.refusal, exchange=ex)
        elif not self.queue:
            self._continue()
        # else: its 100 Continue comes when its turn does (_next), after the answers before it

    def on_body(self, body: bytes) -> None:
        ex = self.reading
        self.body_bytes += len(body)
        self.framing = 0
        if self.state is Reading.DONE:
            return
        if ex.refusal is not None:  # a refused request's body is read and dropped, up to the limit
            ex.dropped += len(body)
            if ex.dropped > self.gw.limit:
                self.finish(*ex.refusal, exchange=ex)
            return
        ex.body += body
        self.held += len(body)
        if len(ex.body) > self.gw.limit:
            ex.refusal = (413, "too_large", f"request body above the limit of {self.gw.limit} bytes", ())
            self.finish(*ex.refusal, exchange=ex)

    def on_message_complete(self) -> None:
        if self.state is Reading.DONE:
            return
        ex, self.reading = self.reading, None
        self.queue.append(ex)
        self._set_state(Reading.IDLE)
        if len(self.queue) == 1:
            self._next()

    def _continue(self) -> None:
        """``100 Continue`` for the request being read, if it asked and has sent no body yet."""
        ex = self.reading
        if ex is not None and ex.expect and self.state is Reading.BODY and not ex.body:
            ex.expect = False
            self.transport.write(_CONTINUE)

    def _head_too_large(self) -> tuple:
        return 431, "too_large", f"request line and headers above {HEAD_LIMIT} bytes or {MAX_HEADERS} headers"

    def _trailers_too_large(self) -> tuple:
        return (431, "too_large", f"chunk framing or trailers above {FRAMING_LIMIT} bytes in a row, "
                f"or above {MAX_HEADERS} trailer fields")

    def _no_upgrade(self) -> None:
        """After a request that asks to upgrade, llhttp reads nothing more; that request is
        answered, not upgraded, and ends the connection (``on_headers_complete``)."""
        if self.reading is not None:  # not even read whole
            self.finish(400, "bad_request", "not a valid HTTP/1.1 request")
        self._set_state(Reading.DONE)

    # -- answering --------------------------------------------------------------------------------
    def _next(self) -> None:
        """Answer what comes next, in order: the queued requests (the gateway's own refusals at
        once, one forwarded at a time), then the last answer; then read on."""
        if self.advancing:
            return  # (a refusal answered within this loop)
        self.advancing = True
        try:
            while self.queue:
                if self.write_paused:
                    self.stalled = True  # resume_writing goes on
                    return
                ex = self.queue[0]
                if ex.refusal is None:
                    ex.refusal = self.gw.policy.behind(ex.min_version)
                if ex.refusal is None:
                    self.gw.forward(ex)  # its answer comes later: answered() brings us back
                    return
                if self.transport.is_closing():
                    return
                self.transport.write(_error_bytes(*ex.refusal, ex))
                if not self._done_with(ex, ex.refusal[0]):
                    return
        finally:
            self.advancing = False
        if self.last is not None:
            self.transport.write(self.last)
            self._linger()
            return
        self._continue()
        self._arm()
        self._read_on()

    def answer_error(self, ex: _Exchange, status: int, code: str, message: str, extra: tuple) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(_error_bytes(status, code, message, extra, ex))
        self.answered(ex, status)

    def answered(self, ex: _Exchange, status: int) -> None:
        """``ex`` (the first in the queue) has its whole answer: on to the next, or close."""
        if self._done_with(ex, status):
            self._next()

    def _done_with(self, ex: _Exchange, status: int) -> bool:
        """Count ``ex``'s answer and take it off the queue; False when that ends the connection."""
        self.gw.policy.count(ex.path, status)
        self.queue.popleft()
        self.held -= len(ex.target) + len(ex.body) + sum(len(n) + len(v) + 4 for n, v in ex.headers)
        if not ex.keep_alive:
            self.transport.close()
            return False
        return True

    def finish(self, status: int, code: str, message: str, extra: tuple = (),
               exchange: _Exchange | None = None) -> None:
        """Refuse what is being read, after any request before it, and close: the rest of it is
        read and dropped for a while first, so that the client gets the answer rather than a
        reset for the bytes it still sends."""
        if self.state is Reading.DONE:
            return
        self._set_state(Reading.DONE)
        self.stash = None
        self.gw.policy.count(exchange.path if exchange is not None else "other", status)
        answer = _error_bytes(status, code, message, extra, None)
        if self.queue:  # the requests before it are answered first; nothing more is read meanwhile
            self.last = answer
            if not self.transport.is_closing():
                self.transport.pause_reading()
            return
        self.transport.write(answer)
        self._linger()

    def _linger(self) -> None:
        if self.lingered <= self.gw.limit:
            self.transport.resume_reading()  # reading is what drops the rest (data_received)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.gw.loop.call_later(LINGER_S, self.transport.close)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to vLLM, relaying one answer at a time to a client."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport  # a UNIX socket: no Nagle to turn off

    def send(self, exchange: _Exchange, reused: bool) -> None:
        self.exchange, exchange.upstream, self.reused = exchange, self, reused
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.reason, self.headers = 0, b"", []
        self.started = False  # the answer's head has gone to the client
        self.chunked = False  # the client gets chunked framing made here
        self.until_close = False  # vLLM ends this answer by closing the connection
        self.discard = False  # this answer is not passed on (a 503 from a pausing server)
        self.gw.sent(self)
        if exchange.client.write_paused:  # (a slow client paused it during the last answer, or now)
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()
        self.transport.write(exchange.request_bytes(self.gw.host_header, _connection_tokens(exchange.headers)))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            log.warning("gateway %s: the server's answer is not valid HTTP", self.gw.name)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gw.forget(self)
        self.gw.settled(self)
        ex, self.exchange = self.exchange, None
        if ex is None or ex.client.transport.is_closing():
            return  # idle, or its client has left
        ex.upstream = None
        if self.started and self.until_close:
            self._end(ex)
        elif self.started:
            log.warning("gateway %s: %s %s: the server broke off its answer", self.gw.name, ex.method, ex.path)
            ex.client.close()  # the client sees the answer cut, never a complete-looking one
        elif self.discard or (self.reused and not self.status):
            self.gw.resend(ex)  # a kept-alive connection vLLM had closed meanwhile: once more, anew
        else:
            self.gw.failed(ex, "closed the connection without an answer")

    # -- the parser's callbacks -------------------------------------------------------------------
    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.exchange
        self.status = self.parser.get_status_code()
        if self.status < 200 or self.gw.policy.held_again(self.status):
            self.discard = True  # an interim answer, or a pausing server's refusal: not passed on
            return
        dropped = _connection_tokens(self.headers)
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
        lines.append(_connection_header(ex))
        lines.append(b"\r\n")
        ex.client.transport.write(b"".join(lines))
        self.started = True
        self.gw.answering()

    def on_body(self, body: bytes) -> None:
        if self.discard:
            return
        if self.chunked:
            self.exchange.client.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        else:
            self.exchange.client.transport.write(body)

    def on_message_complete(self) -> None:
        if self.status < 200:  # after an interim answer, the real one follows
            self.status, self.reason, self.headers, self.discard = 0, b"", [], False
            return
        ex, self.exchange = self.exchange, None
        ex.upstream = None
        self.gw.settled(self)
        if self.parser.should_keep_alive():
            self.gw.give_back(self)
        else:
            self.transport.close()
        if self.discard:
            self.gw.resend(ex)
        else:
            self._end(ex)

    def _end(self, ex: _Exchange) -> None:
        if self.chunked:
            ex.client.transport.write(b"0\r\n\r\n")
        ex.client.answered(ex, self.status)


def _abandon(exchange: _Exchange) -> None:
    """The client left: stop waiting for the server, or close the connection to it, which
    makes vLLM abort the request."""
    if exchange.task is not None:
        exchange.task.cancel()
    up = exchange.upstream
    if up is not None:
        up.exchange = None
        up.transport.close()


def _nodelay(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
