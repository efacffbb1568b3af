"""The gateway's transport: the only way to a ``vllm serve`` from other hosts.

vLLM's pause and weight routes and ``/collective_rpc`` have no authentication, so every vLLM
child listens on a UNIX socket only the daemon's user can reach (supervise/sockets.py). For each
server, the daemon listens on the node's public address (``gateway.host``, the server's
``public_port``) and relays what the server's :class:`Policy` (policy.py: allow-list, token,
pause and hold, counting) lets through to that socket:

- **Streaming.** The answer is passed on piece by piece as vLLM writes it (SSE included),
  never buffered whole (upstream.py). A client that goes away (closes its side) closes the
  connection to vLLM, which aborts the request there. If vLLM breaks off an answer, the client's
  connection is closed before the answer's end, so a cut answer never looks complete.
- **Bounded.** Each client connection is a state machine (connection.py, without IO) whose
  states carry their timeouts (head, body, idle keep-alive; none while a request is being
  answered); at most ``max_connections`` per gateway, where a connection that never sent the
  token gives way to a new one; per connection, a bounded number of requests and bytes read
  ahead (heads, bodies, and a chunked body's framing and trailers, which are never passed on), no
  new answer while the client does not take the last one, and nothing parsed after a request
  without the token.

Errors are JSON ``{"error": {"code", "message"}}``, as in the admin API and the registry.

This module is the asyncio side: :class:`Gateway` (the listener, admission, forwarding through
the policy) and :class:`ClientProtocol`, which feeds a :class:`Connection` what the socket and
the clock bring and carries out the actions it returns. It is a relay at the level of asyncio
protocols, with llhttp (``httptools``) parsing both sides: a streamed generation passes through
it once per token, so each request and each piece must cost microseconds, not the hundreds a
general HTTP client and server spend (see bench/README.md, "Gateway cost"). One request per
client connection is answered at a time, in order (pipelined requests wait their turn); requests
to vLLM go over kept-alive connections to its socket (upstream.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

from rolloutd.config import Gateway as GatewaySettings
from rolloutd.gateway.connection import LINGER_S, Action, Connection, Do
from rolloutd.gateway.exchange import Exchange
from rolloutd.gateway.policy import Policy, Unavailable
from rolloutd.gateway.upstream import UpstreamPool
from rolloutd.metrics import Metrics
from rolloutd.wire.states import ServerState

log = logging.getLogger("rolloutd.gateway.relay")


class GatewayError(OSError):
    """The gateway cannot listen (address in use, not available)."""


class Gateway:
    """One server's public listener: client connections in, kept-alive connections to vLLM out
    (:class:`UpstreamPool`), and between them the server's :class:`Policy`."""

    def __init__(self, name: str, upstream: Path, port: int, settings: GatewaySettings, token: str | None,
                 metrics: Metrics):
        self.name, self.port, self.settings, self.metrics = name, port, settings, metrics
        self.policy = Policy(name, settings, token, metrics)
        self.upstream = str(upstream)  # vLLM's UNIX socket
        self.upstreams = UpstreamPool(upstream, self)
        self._server: asyncio.Server | None = None
        self._clients: set[ClientProtocol] = set()
        # Connections that have sent no request with the token yet, oldest first: when the
        # gateway is full, a new connection takes the place of the oldest of them, so clients
        # without the token can never keep a trainer out.
        self._strangers: dict[ClientProtocol, None] = {}
        self.max_connections = settings.max_connections
        self.refused = metrics.gateway_refused_connections.labels(server=name)

    # -- life: what the daemon and the update sequence call ---------------------------------------
    async def start(self) -> None:
        """Listen on ``gateway.host:port``; GatewayError with the reason when that fails."""
        loop = asyncio.get_running_loop()
        self.upstreams.open()
        try:
            self._server = await loop.create_server(lambda: ClientProtocol(self), self.settings.host, self.port,
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
        self.upstreams.close()
        await asyncio.sleep(0)  # let the transports' close callbacks run

    def on_state(self, new: ServerState) -> None:
        """Follow the server's lifecycle (a listener of its Lifecycle)."""
        self.policy.on_state(new)

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
        return await self.upstreams.quiet(timeout_s)

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
        return await self.upstreams.recall_unanswered(grace_s)

    def buffered(self) -> dict[str, int]:
        """What the gateway holds for its client connections now: connections, requests read and
        not yet answered, request bytes held (heads and bodies, and what waits unparsed), and
        bytes waiting to be written to clients."""
        out = {"connections": 0, "queued": 0, "request_bytes": 0, "write_bytes": 0}
        for client in list(self._clients):
            for key, value in client.buffered().items():
                out[key] += value
        return out

    # -- client connections -----------------------------------------------------------------------
    def admit(self, client: ClientProtocol) -> bool:
        """Take ``client`` on, as a stranger until it sends the token; when the gateway is full,
        by ending the oldest stranger's connection. False when every connection has sent the
        token: ``client`` is refused."""
        if len(self._clients) >= self.max_connections:
            oldest = next(iter(self._strangers), None)
            if oldest is None:
                return False
            self.drop(oldest)
            oldest.abort()  # (no answer: it never showed the token)
            self.refused.inc()
        self._clients.add(client)
        self._strangers[client] = None
        return True

    def trust(self, client: ClientProtocol) -> None:
        """``client`` has sent the token: it keeps its place when the gateway is full."""
        self._strangers.pop(client, None)

    def drop(self, client: ClientProtocol) -> None:
        """``client``'s connection has ended (or is being ended): its place is free."""
        self._clients.discard(client)
        self._strangers.pop(client, None)

    # -- forwarding -----------------------------------------------------------------------------
    def forward(self, exchange: Exchange) -> None:
        """Send a request on to vLLM: at once on a kept-alive connection while serving (the
        common case, no task at all), else through the policy and a new connection."""
        if self.policy.serving:
            up = self.upstreams.take()
            if up is not None:
                up.send(exchange, reused=True)
                return
        exchange.task = asyncio.get_running_loop().create_task(self._forward_later(exchange))

    async def _forward_later(self, exchange: Exchange) -> None:
        try:
            while True:
                await self.policy.ready(exchange.deadline)
                if (refusal := self.policy.behind(exchange.min_version)) is not None:
                    exchange.client.answer_error(exchange, *refusal)
                    return
                up = reused = self.upstreams.take()
                if up is None:
                    try:
                        up = await self.upstreams.connect()
                    except OSError as e:
                        if not self.policy.serving:
                            continue  # the server left SERVING meanwhile: the policy decides
                        why = e.strerror or type(e).__name__
                        exchange.client.answer_error(exchange, 502, "upstream",
                                                     f"server {self.name} did not answer: {why}", ())
                        return
                    if not self.policy.serving:  # it left SERVING while connecting: never send then
                        self.upstreams.give_back(up)
                        continue
                up.send(exchange, reused=reused is not None)
                return
        except Unavailable as e:
            exchange.client.answer_error(exchange, *self.policy.unavailable(str(e)))
        finally:
            exchange.task = None

    def held_again(self, status: int) -> bool:
        """vLLM answered ``status`` as it paused: hold the request and send it again."""
        return self.policy.held_again(status)

    def resend(self, exchange: Exchange) -> None:
        """Send a request again: through the policy, on another connection."""
        exchange.task = asyncio.get_running_loop().create_task(self._forward_later(exchange))

    def failed(self, exchange: Exchange, why: str) -> None:
        """vLLM dropped a request: the policy decides again when it is no longer serving (it
        paused or stopped); while it is serving, that is its failure (502)."""
        if self.policy.serving:
            exchange.client.answer_error(exchange, 502, "upstream", f"server {self.name} {why}", ())
        else:
            self.resend(exchange)


class ClientProtocol(asyncio.Protocol):
    """One connection from a client, on asyncio: feeds its :class:`Connection` what the socket
    and the clock bring, and carries out the actions it returns."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.conn = Connection(gateway.policy, gateway.settings, self)
        self.transport: asyncio.Transport | None = None
        self.write = None  # the transport's write, for the answer's pieces (upstream.py)
        self.timer: asyncio.TimerHandle | None = None  # fires at or before conn.deadline
        self.loop = asyncio.get_running_loop()

    @property
    def closing(self) -> bool:
        """Nothing more is written to this client (its connection is closing or gone)."""
        return self.transport.is_closing()

    @property
    def write_paused(self) -> bool:
        return self.conn.write_paused

    # -- the transport's callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport, self.write = transport, transport.write
        gw = self.gw
        if not gw.admit(self):  # full of clients with the token: refused at once, the others untouched
            gw.refused.inc()
            self._do(self.conn.refuse(f"gateway {gw.name}: too many connections"))
            return
        _nodelay(transport)
        self._do(self.conn.start(self.loop.time()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.gw.drop(self)
        if self.timer is not None:
            self.timer.cancel()
        self._do(self.conn.lost())

    def eof_received(self) -> bool:
        # A client that closes its side has left (as nginx takes it): what it asked for is ended
        # (connection_lost follows), which for a generation aborts it in vLLM.
        return False

    def pause_writing(self) -> None:  # the client reads slower than we write: stop reading vLLM
        self._do(self.conn.writing_paused())
        if (up := self._answering()) is not None:
            up.pause()

    def resume_writing(self) -> None:
        if (up := self._answering()) is not None:
            up.resume()
        self._sync()
        self._do(self.conn.writing_resumed(self.loop.time()))

    def data_received(self, data: bytes) -> None:
        self._do(self.conn.receive(data, self.loop.time()))

    # -- what the answer's side calls -------------------------------------------------------------
    def answered(self, ex: Exchange, status: int) -> None:
        """``ex`` has its whole answer: on to the next request, or close."""
        self._sync()
        self._do(self.conn.answered(ex, status, self.loop.time()))

    def answer_error(self, ex: Exchange, status: int, code: str, message: str, extra: tuple) -> None:
        self._sync()
        self._do(self.conn.answer_error(ex, status, code, message, extra, self.loop.time()))

    def close(self) -> None:
        if self.transport is not None:
            self.conn.closing = True
            self.transport.close()

    def abort(self) -> None:
        self.conn.closing = True
        self.transport.abort()

    def buffered(self) -> dict[str, int]:
        conn = self.conn
        exchanges = list(conn.queue) + ([conn.reading] if conn.reading is not None else [])
        write = 0 if self.transport is None or self.transport.is_closing() else self.transport.get_write_buffer_size()
        return {"connections": 1, "queued": len(conn.queue),
                "request_bytes": sum(len(ex.target) + len(ex.body) + sum(len(n) + len(v) for n, v in ex.headers)
                                     for ex in exchanges) + len(conn.stash or b""),
                "write_bytes": write}

    # -- carrying out -----------------------------------------------------------------------------
    def _answering(self):
        queue = self.conn.queue
        return queue[0].upstream if queue else None

    def _sync(self) -> None:
        """The transport may have been closed from outside (a write error, the peer): the core
        writes nothing more then."""
        if self.transport.is_closing():
            self.conn.closing = True

    def _do(self, actions: list[Action]) -> None:
        transport = self.transport
        for do, arg in actions:
            if do is Do.WRITE:
                transport.write(arg)
            elif do is Do.FORWARD:
                self.gw.forward(arg)
            elif do is Do.RESUME_READING:
                transport.resume_reading()
            elif do is Do.PAUSE_READING:
                transport.pause_reading()
            elif do is Do.CLOSE:
                transport.close()
            elif do is Do.LINGER:
                if transport.can_write_eof():
                    transport.write_eof()
                self.loop.call_later(LINGER_S, transport.close)
            elif do is Do.TRUST:
                self.gw.trust(self)
            elif do is Do.ABANDON:
                _abandon(arg)
        deadline = self.conn.deadline
        # The timer moves only when the deadline comes earlier: most deadlines move later (a
        # body's at each read), and the timer then looks again when it fires.
        if deadline is not None and (self.timer is None or self.timer.when() > deadline):
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        self._sync()
        self._do(self.conn.expire(self.loop.time()))


def _abandon(exchange: Exchange) -> None:
    """The client left: stop waiting for the server, or close the connection to it, which
    makes vLLM abort the request."""
    if exchange.task is not None:
        exchange.task.cancel()
    if exchange.upstream is not None:
        exchange.upstream.abandon()


def _nodelay(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
