"""Where a version's bytes come from, seen from a pull worker: one small interface.

A :class:`Source` does one thing: fetch bytes ``[start, end)`` of one file of the version,
handing them to the caller's sink piece by piece. The registry's ``Range`` route is the source
today; peers and object stores plug in beside it by implementing the same method (and a
:class:`SourceSpec` kind that builds them), and the rest of the pull (leases, chunk digests,
retries, the mirror) does not change.

Runs inside the pull workers (``fetch_worker``): blocking, one source per thread, standard
library only. A failure is a :class:`SourceError` whose ``kind`` says whether another attempt
can help (``unavailable``: the network, a timeout, a 5xx) or what the registry answered
(``http``: its status and JSON body, which the daemon turns back into the typed error).
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, urlsplit

Sink = Callable[[memoryview], None]  # takes each piece as it arrives; the view is reused afterwards


class SourceError(Exception):
    """A fetch failed. ``kind``: ``unavailable`` (transport, timeout, a 5xx without a JSON
    error) or ``http`` (the source answered an error, or other bytes than asked for:
    ``status`` and ``body``)."""

    def __init__(self, kind: str, message: str, status: int | None = None, body: object = None):
        super().__init__(message)
        self.kind, self.status, self.body = kind, status, body

    def as_json(self) -> dict:
        return {"kind": self.kind, "message": str(self), "status": self.status, "body": self.body}


class Source(Protocol):
    def fetch(self, name: str, start: int, end: int, sink: Sink) -> None:
        """Bytes [start, end) of file ``name``, handed to ``sink`` in order; raises
        :class:`SourceError`. Returns only once every byte was handed over."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class SourceSpec:
    """What a worker needs to build its sources; sent over the worker's stdin, never in its
    arguments (the token)."""

    kind: str                    # "registry"
    url: str                     # the registry's base URL
    version: int
    token: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0  # longest silence while bytes come

    def as_json(self) -> dict:
        return {"kind": self.kind, "url": self.url, "version": self.version, "token": self.token,
                "connect_timeout_s": self.connect_timeout_s, "read_timeout_s": self.read_timeout_s}

    @classmethod
    def from_json(cls, data: dict) -> SourceSpec:
        return cls(**data)

    def open(self, piece_bytes: int) -> Source:
        if self.kind == "registry":
            return RegistrySource(self, piece_bytes)
        raise ValueError(f"unknown source kind {self.kind!r}")

    def __repr__(self) -> str:  # never show the token
        return f"SourceSpec({self.kind!r}, {self.url!r}, version={self.version})"


class RegistrySource:
    """``GET /v1/versions/{v}/files/{name}`` with ``Range`` over one kept-alive connection
    (``http.client``). Each body is read with ``readinto`` straight into one reused buffer:
    one copy out of the kernel, no allocation per read."""

    def __init__(self, spec: SourceSpec, piece_bytes: int):
        parts = urlsplit(spec.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._base = parts.path.rstrip("/")
        self._spec = spec
        self._headers = {"authorization": f"Bearer {spec.token}"} if spec.token else {}
        self._buffer = memoryview(bytearray(piece_bytes))
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._spec.connect_timeout_s)
        if self._conn.sock is None:  # new, or closed after a reply that said "connection: close"
            self._conn.connect()
            # From here on the timeout bounds each silence while reading, not the whole body.
            self._conn.sock.settimeout(self._spec.read_timeout_s)
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._conn

    def fetch(self, name: str, start: int, end: int, sink: Sink) -> None:
        path = f"{self._base}/v1/versions/{self._spec.version}/files/{quote(name)}"
        headers = {**self._headers, "range": f"bytes={start}-{end - 1}"}
        response = self._request(path, headers)
        try:
            self._check(response, name, start, end)
            self._read_body(response, end - start, sink)
        except BaseException:
            self.close()  # a body not read to its end leaves the connection unusable
            raise

    def _request(self, path: str, headers: dict) -> http.client.HTTPResponse:
        """Send the request; a kept-alive connection the server closed while idle is tried
        once more on a fresh one (nothing was read from it yet)."""
        for attempt in (1, 2):
            fresh = self._conn is None or self._conn.sock is None
            try:
                conn = self._connection()
                conn.request("GET", path, headers=headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self.close()
                if attempt == 2 or fresh:
                    raise SourceError("unavailable", f"GET {self._spec.url}{path}: {_describe(e)}") from None
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise SourceError("unavailable", f"GET {self._spec.url}{path}: {_describe(e)}") from None
        raise AssertionError("unreachable")

    def _check(self, response: http.client.HTTPResponse, name: str, start: int, end: int) -> None:
        if response.status >= 400:
            try:
                body = json.loads(response.read(1 << 16) or b"null")
            except (ValueError, OSError, http.client.HTTPException):
                body = None
            kind = "unavailable" if response.status >= 500 and not isinstance(body, dict) else "http"
            raise SourceError(kind, f"HTTP {response.status} for bytes {start}-{end - 1} of {name}",
                              status=response.status, body=body)
        if response.status != 206 or response.length != end - start:
            raise SourceError("http", f"asked bytes {start}-{end - 1} of {name}, got HTTP {response.status} "
                              f"with {response.length} bytes", status=502)

    def _read_body(self, response: http.client.HTTPResponse, length: int, sink: Sink) -> None:
        buffer, done = self._buffer, 0
        try:
            while done < length:
                want = min(len(buffer), length - done)
                got = response.readinto(buffer[:want])  # loops in C until ``want`` bytes or the end
                if got <= 0:
                    raise SourceError("unavailable", f"the body ended after {done} of {length} bytes")
                sink(buffer[:got])
                done += got
        except (OSError, http.client.HTTPException) as e:
            raise SourceError("unavailable", f"reading the body: {_describe(e)} after {done} of "
                              f"{length} bytes") from None


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
