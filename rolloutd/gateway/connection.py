"""One client connection of the gateway, without IO: fed what happened, it returns what to do.

:class:`Connection` is fed the bytes a client sent (:meth:`Connection.receive`), the clock
(:meth:`Connection.expire`), the socket's flow control (:meth:`Connection.writing_paused`,
:meth:`Connection.writing_resumed`) and the answers (:meth:`Connection.answered`,
:meth:`Connection.answer_error`), each with the time it happened, and hands back a list of
actions (:class:`Do`) for the adapter (relay.py) to carry out on the socket. It parses with
llhttp (``httptools``), reads no clock and touches no socket, so each arrow of its states
(:class:`Reading`, the allowed arrows in ``ARROWS``; any other raises :class:`IllegalArrow`) and
each bound is tested without sockets (tests/unit/gateway/test_connection.py).

Bounded: at most ``PIPELINE_MAX`` requests read ahead of the one being answered, and request
bytes held beyond the one being answered stay near ``max_body_bytes``; past that, the rest of
what was read waits unparsed (``stash``, at most one read) and the socket is not read. The next
answer starts only while the client takes what is written (``writing_paused``), so a client that
pipelines and reads nothing fills its own socket, not the gateway.
"""

from __future__ import annotations

import collections
import enum
from typing import Any

import httptools

from rolloutd.config import Gateway as GatewaySettings
from rolloutd.gateway.exchange import MIN_VERSION, Exchange, error_bytes
from rolloutd.gateway.policy import Policy
from rolloutd.wire import version_contract

HEAD_LIMIT = 64 * 1024  # request line and headers, as most servers allow
# Bytes of a chunked body that carry no data (size lines, extensions, and the trailer section
# after the last chunk), read in a row: llhttp passes a trailer's value to httptools in pieces it
# joins by concatenation, so an unbounded one costs memory and quadratic time on the daemon's loop.
FRAMING_LIMIT = HEAD_LIMIT
LINGER_S = 2.0  # after a refusal whose body still comes: drop it (max_body_bytes at most) this long, then close
MAX_HEADERS = 128  # header lines of one request (64 KiB of tiny ones would be thousands of objects)
PIPELINE_MAX = 16  # requests of one connection read ahead of the one being answered
FEED_BYTES = 4096  # what one read is parsed in pieces of, so that reading ahead stops near PIPELINE_MAX

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_VERSION = -1


class Reading(enum.Enum):
    """What a client connection is reading; each state has its own clock (``timeouts``), which
    runs only while no request of the connection is being answered: a generation may take
    minutes, and a pipelining client may send its next request in pieces meanwhile."""

    HEAD = "head"  # a request line and headers (or, on a new connection, their first byte): head_timeout_s in all
    BODY = "body"  # a request body: body_timeout_s of silence at most
    IDLE = "idle"  # between requests, kept alive: idle_timeout_s
    DONE = "done"  # nothing more is read (refused, timed out, upgrade asked): what comes is dropped, then closed


# The arrows between the states; any other is a bug, and raises.
ARROWS: dict[Reading, frozenset[Reading]] = {
    Reading.HEAD: frozenset({Reading.BODY, Reading.DONE}),
    Reading.BODY: frozenset({Reading.IDLE, Reading.DONE}),
    Reading.IDLE: frozenset({Reading.HEAD, Reading.DONE}),
    Reading.DONE: frozenset(),
}


class IllegalArrow(RuntimeError):
    """A connection was asked to move between two states that no arrow joins (a bug)."""


class Do(enum.Enum):
    """What the adapter does on the client's socket; an action is ``(Do.X, argument)``."""

    WRITE = "write"  # argument: the bytes
    PAUSE_READING = "pause_reading"
    RESUME_READING = "resume_reading"
    CLOSE = "close"
    LINGER = "linger"  # end our side (write_eof where it can), close LINGER_S later
    FORWARD = "forward"  # argument: the Exchange, to send on to the server; its answer comes back later
    TRUST = "trust"  # the connection has sent the token: it holds its place in a full gateway
    ABANDON = "abandon"  # argument: an Exchange whose client has left: stop what it asked for


Action = tuple[Do, Any]


class Connection:
    """One client connection's requests, parsed, bounded and answered in order (no IO).

    Each event method takes ``now`` (the adapter's clock, in seconds) where time matters and
    returns the actions it leads to, in order. ``deadline`` is when the current state's clock
    runs out (None: no clock runs); the adapter calls :meth:`expire` at or after it."""

    def __init__(self, policy: Policy, settings: GatewaySettings, client: Any = None):
        self.policy, self.settings, self.client = policy, settings, client
        self.limit = int(settings.max_body_bytes)
        self.timeouts = {Reading.HEAD: settings.head_timeout_s, Reading.BODY: settings.body_timeout_s,
                         Reading.IDLE: settings.idle_timeout_s}
        self.parser = httptools.HttpRequestParser(self)
        self.state = Reading.HEAD
        self.now = 0.0  # the time of the event being handled
        self.closing = False  # the socket is being closed: nothing more is written
        self.reading: Exchange | None = None  # the request being read
        self.queue: collections.deque[Exchange] = collections.deque()  # read, not yet answered; [0] is in hand
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
        self.write_paused = False  # the client's socket is full: no new answer starts
        self.stalled = False  # an answer waits for the socket to drain (writing_resumed goes on)
        self.advancing = self.feeding = False  # re-entry guards of _next and _feed
        self._out: list[Action] = []

    def _actions(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    # -- events ---------------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        """The connection is open and admitted: the head's clock starts."""
        self.now = now
        self._arm()
        return self._actions()

    def refuse(self, message: str) -> list[Action]:
        """The gateway is full of clients with the token: refused at once, and closed."""
        self._set_state(Reading.DONE)
        self._write(error_bytes(503, "unavailable", message,
                                ((b"Retry-After", str(self.settings.retry_after_s).encode()),), None))
        self._close()
        return self._actions()

    def receive(self, data: bytes, now: float) -> list[Action]:
        """Bytes from the client."""
        self.now = now
        if self.state is Reading.DONE:
            # Lingering after a refusal: dropped, up to a body's worth (what a client that sends
            # its whole body before it reads may still send), then no longer read.
            self.lingered += len(data)
            if self.lingered > self.limit:
                self._out.append((Do.PAUSE_READING, None))
            return self._actions()
        if self.stash is not None:  # (reading is paused: only a read already under way lands here)
            self.stash = bytes(self.stash) + data
            return self._actions()
        self._feed(data)
        if self.state is Reading.BODY:
            self._arm()  # the body moves: its clock starts again
        return self._actions()

    def expire(self, now: float) -> list[Action]:
        """The clock: ends the connection when the current state's deadline has passed."""
        self.now = now
        if self.closing:
            self.deadline = None  # (no clock for a connection being closed)
        if self.deadline is None or now < self.deadline:
            return self._actions()
        self.deadline = None
        if self.state is Reading.IDLE or (self.state is Reading.HEAD and self.reading is None):
            self._set_state(Reading.DONE)
            self._close()  # kept alive long enough, or never said a word: closed quietly
        elif self.state is Reading.HEAD:
            self.finish(408, "timeout", f"request head not received within {self.settings.head_timeout_s:g} s")
        else:
            self.finish(408, "timeout", f"request body stalled for {self.settings.body_timeout_s:g} s",
                        exchange=self.reading)
        return self._actions()

    def writing_paused(self) -> list[Action]:
        """The client reads slower than we write: no new answer starts."""
        self.write_paused = True
        return self._actions()

    def writing_resumed(self, now: float) -> list[Action]:
        self.now = now
        self.write_paused = False
        if self.stalled:
            self.stalled = False
            self._next()
        return self._actions()

    def answered(self, ex: Exchange, status: int, now: float) -> list[Action]:
        """``ex`` (the first in the queue) has its whole answer: on to the next, or close."""
        self.now = now
        if self._done_with(ex, status):
            self._next()
        return self._actions()

    def answer_error(self, ex: Exchange, status: int, code: str, message: str, extra: tuple,
                     now: float) -> list[Action]:
        """The gateway's own answer to ``ex`` (the first in the queue), after it was forwarded."""
        if self.closing:
            return self._actions()
        self._write(error_bytes(status, code, message, extra, ex))
        return self.answered(ex, status, now)

    def lost(self) -> list[Action]:
        """The socket is gone: everything asked on it is abandoned."""
        self.closing = True
        self._set_state(Reading.DONE)
        self.deadline = None
        self._out.extend((Do.ABANDON, ex) for ex in self.queue)
        self.queue.clear()
        return self._actions()

    # -- states -----------------------------------------------------------------------------------
    def _set_state(self, new: Reading) -> None:
        old = self.state
        if new is old:
            return
        if new not in ARROWS[old]:
            raise IllegalArrow(f"connection state {old.name} -> {new.name} is not an arrow")
        self.state = new
        self._arm()

    def _arm(self) -> None:
        """Start the current state's clock, unless a request is being answered (or nothing more is
        read)."""
        if self.queue or self.state is Reading.DONE:
            self.deadline = None
            return
        self.deadline = self.now + self.timeouts[self.state]

    def _write(self, data: bytes) -> None:
        self._out.append((Do.WRITE, data))

    def _close(self) -> None:
        self.closing = True
        self._out.append((Do.CLOSE, None))

    # -- reading, within bounds -------------------------------------------------------------------
    def _full(self) -> bool:
        """No room to read ahead: enough requests wait behind the one being answered."""
        return bool(self.queue) and (len(self.queue) > PIPELINE_MAX or self.held > self.limit)

    def _feed(self, data: bytes | memoryview) -> None:
        """Parse ``data`` in pieces, until it is all parsed or there is no room for more."""
        if self.feeding:
            return
        self.feeding = True
        try:
            while len(data) and self.state is not Reading.DONE:
                if self._full():
                    self.stash = data
                    self._out.append((Do.PAUSE_READING, None))
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
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, IllegalArrow):  # (llhttp wraps what a callback raised)
                raise e.__context__ from None
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
        if self.feeding or self.state is Reading.DONE or self.closing:
            return
        if self.stash is not None:
            data, self.stash = self.stash, None
            self._feed(data)
        if self.stash is None and self.state is not Reading.DONE:
            self._out.append((Do.RESUME_READING, None))

    # -- the parser's callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.reading = Exchange(self.client)
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
        elif low == MIN_VERSION:
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
        ex, policy = self.reading, self.policy
        ex.method = self.parser.get_method().decode("ascii")
        # llhttp stops after a request that asks to upgrade (or a CONNECT): it is answered as any
        # other (never upgraded), and the connection ends with it.
        ex.keep_alive = self.parser.should_keep_alive() and not self.parser.should_upgrade()
        ex.http10 = self.parser.get_http_version() == "1.0"
        ex.path = ex.target.partition(b"?")[0].decode("latin-1")
        ex.deadline = self.now + self.settings.hold_max_s
        ex.refusal = policy.refusal(ex.method, ex.path, ex.authorization)
        if not policy.authorized(ex.authorization):
            # Without the token: its answer (401, or 404 off the list) ends the connection, and
            # nothing more of it is parsed, so a client without the token holds no place and no
            # parser for longer than one head.
            self.finish(*ex.refusal, exchange=ex)
            return
        self._out.append((Do.TRUST, None))
        if ex.refusal is None and ex.min_version == _BAD_VERSION:
            ex.refusal = (400, "bad_request", f"{version_contract.MIN_VERSION_HEADER} must be a positive integer", ())
        if ex.refusal is None and ex.length is not None and ex.length > self.limit:
            ex.refusal = (413, "too_large", f"request body of {ex.length} bytes; the limit is {self.limit}", ())
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
            if ex.dropped > self.limit:
                self.finish(*ex.refusal, exchange=ex)
            return
        ex.body += body
        self.held += len(body)
        if len(ex.body) > self.limit:
            ex.refusal = (413, "too_large", f"request body above the limit of {self.limit} bytes", ())
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
            self._write(CONTINUE)

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
                    self.stalled = True  # writing_resumed goes on
                    return
                ex = self.queue[0]
                if ex.refusal is None:
                    ex.refusal = self.policy.behind(ex.min_version)
                if ex.refusal is None:
                    self._out.append((Do.FORWARD, ex))  # its answer comes later: answered() brings us back
                    return
                if self.closing:
                    return
                self._write(error_bytes(*ex.refusal, ex))
                if not self._done_with(ex, ex.refusal[0]):
                    return
        finally:
            self.advancing = False
        if self.last is not None:
            self._write(self.last)
            self._linger()
            return
        self._continue()
        self._arm()
        self._read_on()

    def _done_with(self, ex: Exchange, status: int) -> bool:
        """Count ``ex``'s answer and take it off the queue; False when that ends the connection."""
        self.policy.count(ex.path, status)
        self.queue.popleft()
        self.held -= ex.held_bytes()
        if not ex.keep_alive:
            self._close()
            return False
        return True

    def finish(self, status: int, code: str, message: str, extra: tuple = (),
               exchange: Exchange | None = None) -> None:
        """Refuse what is being read, after any request before it, and close: the rest of it is
        read and dropped for a while first, so that the client gets the answer rather than a
        reset for the bytes it still sends."""
        if self.state is Reading.DONE:
            return
        self._set_state(Reading.DONE)
        self.stash = None
        self.policy.count(exchange.path if exchange is not None else "other", status)
        answer = error_bytes(status, code, message, extra, None)
        if self.queue:  # the requests before it are answered first; nothing more is read meanwhile
            self.last = answer
            if not self.closing:
                self._out.append((Do.PAUSE_READING, None))
            return
        self._write(answer)
        self._linger()

    def _linger(self) -> None:
        if self.lingered <= self.limit:
            self._out.append((Do.RESUME_READING, None))  # reading is what drops the rest (receive)
        self._out.append((Do.LINGER, None))
