"""One request from a client, and the bytes of the messages the gateway makes for it.

:class:`Exchange` is a request as the connection (connection.py) read it and as it travels to
vLLM (upstream.py): :meth:`Exchange.request_bytes` is what vLLM is sent; :func:`error_bytes` is the
gateway's own JSON answer. Per-connection headers are never passed on, in either direction.
"""

from __future__ import annotations

import http
import json
from typing import Any

from rolloutd.wire import version_contract

# Per-connection headers (RFC 9110 7.6.1), framing (set by the relay itself), the client's token,
# and what must not pass: the relay answers ``Expect`` itself and names no server.
HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
                 b"te", b"trailer", b"transfer-encoding", b"upgrade", b"content-length"})
MIN_VERSION = version_contract.MIN_VERSION_HEADER.lower().encode()
_DROP_REQUEST = HOP | {b"host", b"authorization", b"expect", MIN_VERSION}


class Exchange:
    """One request from a client and what the gateway does with it."""

    __slots__ = ("client", "method", "target", "path", "headers", "authorization", "length", "expect", "body",
                 "dropped", "refusal", "keep_alive", "http10", "deadline", "task", "upstream", "min_version")

    def __init__(self, client: Any):
        self.client = client  # the adapter of the connection it came on (relay.py), for its answer
        self.method = ""
        self.path = ""
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
        self.deadline = 0.0  # the longest it is held while the server is paused (the clock given to the core)
        self.task: Any = None  # the adapter's: the task that waits to forward it
        self.upstream: Any = None  # the adapter's: the connection to vLLM answering it
        self.min_version: int | None = None  # X-Rolloutd-Min-Version (-1: not a version)

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

    def held_bytes(self) -> int:
        """What this request holds of the connection's read-ahead bound."""
        return len(self.target) + len(self.body) + sum(len(n) + len(v) + 4 for n, v in self.headers)


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names a ``Connection`` header declares per-connection (RFC 9110 7.6.1)."""
    tokens = [t.strip().lower() for name, value in headers if name.lower() == b"connection" for t in value.split(b",")]
    return frozenset(tokens)


def error_bytes(status: int, code: str, message: str, extra: tuple, exchange: Exchange | None) -> bytes:
    """The gateway's own answer: a JSON ``{"error": {"code", "message"}}``."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    lines = [b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
             % (status, http.HTTPStatus(status).phrase.encode(), len(body))]
    lines += [b"%s: %s\r\n" % header for header in extra]
    lines.append(connection_header(exchange))
    return b"".join(lines) + b"\r\n" + body


def connection_header(exchange: Exchange | None) -> bytes:
    if exchange is None or not exchange.keep_alive:
        return b"Connection: close\r\n"
    return b"Connection: keep-alive\r\n" if exchange.http10 else b""
