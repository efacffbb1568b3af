"""Where a pull's bytes come from: one small interface, three kinds of source.

The daemon names a source with a :class:`SourceSpec`: the chunk plan
(:mod:`~rolloutd.rollout.swarm`) hands one out with every chunk, and the pull worker that
fetches the chunk opens it (:meth:`SourceSpec.open`) and keeps it for the next chunk from the
same place. A :class:`Source` does one thing: fetch bytes ``[start, end)`` of one file of a
version into the caller's :class:`Sink`, piece by piece. Every source is untrusted: the worker
checks each chunk against the manifest whatever gave it.

- ``registry``: the registry's ``GET /v1/versions/{v}/files/{name}`` with ``Range`` (the origin of
  a version published to the registry);
- ``peer``: another node's peer listener, which serves what its mirror holds with the same
  route, ``Range`` semantics and a bearer token (:class:`HttpRangeSource` for both);
- ``s3``: an S3 bucket, the origin of a version whose manifest names a ``source``
  (:class:`ObjectSource`, obstore); credentials from the node's ``object_store`` settings.

Runs inside the pull workers (``fetch_worker``): blocking, each source used by one thread. A
failure is a :class:`SourceError` whose ``kind`` says whether another attempt can help
(``unavailable``: the network, a timeout, a 5xx) or what the source answered (``http``: its
status and JSON body, which the daemon turns back into the typed error; the body is cut to
its error code and the first ``MESSAGE_CHARS`` of its message, whatever the source sent).
Whether another source may help is the daemon's call: a failed peer is dropped and its chunk
fetched elsewhere. A fetch given a ``deadline`` ends at it whatever it is waiting for (a
connection, the reply's head, the next byte of a body that trickles in).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, urlsplit

MiB = 1 << 20
ERROR_BODY_BYTES = 64 << 10  # of an error reply's body: read at most this much
MESSAGE_CHARS = 1000         # of an error message: kept at most this many characters


class Sink(Protocol):
    """Where fetched bytes go, in order, from the first byte of the range: ``write`` takes
    each piece (the view is reused afterwards)."""

    def write(self, piece: memoryview) -> None: ...


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
    def fetch(self, version: int, name: str, start: int, end: int, sink: Sink, deadline: float | None = None) -> None:
        """Bytes [start, end) of file ``name`` of ``version`` into ``sink``, in order; raises
        :class:`SourceError`. Returns only once every byte was handed over, or raises an
        ``unavailable`` error by ``deadline`` (``time.monotonic()``) if given."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class SourceSpec:
    """A source as the daemon names it and a worker opens it; sent over the worker's stdin with
    each chunk, never in its arguments (the token)."""

    kind: str                    # "registry", "peer" or "s3"
    url: str                     # the registry's or the peer listener's base URL; s3: the version's source
    token: str | None = None
    node: str | None = None      # a peer's node name
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0  # longest silence while bytes come
    store: str | None = None      # s3: the node's object_store settings as JSON (endpoint, region, credentials file)

    @property
    def is_peer(self) -> bool:
        return self.kind == "peer"

    @property
    def label(self) -> str:
        """For logs and status: "registry", "s3", "peer node-7"."""
        return f"peer {self.node}" if self.is_peer else self.kind

    def as_json(self) -> dict:
        return {"kind": self.kind, "url": self.url, "token": self.token, "node": self.node,
                "connect_timeout_s": self.connect_timeout_s, "read_timeout_s": self.read_timeout_s,
                "store": self.store}

    @classmethod
    def from_json(cls, data: dict) -> SourceSpec:
        return cls(**data)

    def open(self, piece_bytes: int) -> Source:
        if self.kind in ("registry", "peer"):
            return HttpRangeSource(self, piece_bytes)
        if self.kind == "s3":
            return ObjectSource(self, piece_bytes)
        raise ValueError(f"unknown source kind {self.kind!r}")

    def __repr__(self) -> str:  # never show the token
        return f"SourceSpec({self.kind!r}, {self.url!r}" + (f", node={self.node!r})" if self.node else ")")


class HttpRangeSource:
    """``GET /v1/versions/{v}/files/{name}`` with ``Range`` over one kept-alive connection, from
    the registry or a peer
    (``http.client`` sends the request and parses the reply's head).

    The body is read with ``readinto`` into one reused buffer (one copy out of the kernel, no
    allocation per read), which the sink hashes while it is in cache and writes. Splicing the
    socket into the file instead (and reading the bytes back to hash them) was slower:
    bench/README.md, "Node pull"."""

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
        """Drop the connection (the next fetch opens another)."""
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

    def fetch(self, version: int, name: str, start: int, end: int, sink: Sink, deadline: float | None = None) -> None:
        self.fetch_path(f"{self._base}/v1/versions/{version}/files/{quote(name)}", name, start, end, sink, deadline)

    def fetch_path(self, path: str, name: str, start: int, end: int, sink: Sink,
                   deadline: float | None = None) -> None:
        """:meth:`fetch` for any path of the same server (``name`` only names it in errors)."""
        headers = {**self._headers, "range": f"bytes={start}-{end - 1}"}
        alarm = _Alarm(self, deadline)
        try:
            response = self._request(path, headers, alarm)
            try:
                self._check(response, name, start, end)
                self._read_body(response, end - start, sink, alarm)
            except BaseException:
                self.close()  # a body not read to its end leaves the connection unusable
                raise
        except SourceError as e:
            if alarm.rang:  # the socket was shut under the read: say why, not what the read saw
                raise SourceError("unavailable", f"{self._spec.label}: bytes {start}-{end - 1} of {name} not done "
                                  f"by the chunk's deadline ({e})") from None
            raise
        finally:
            alarm.cancel()

    def _cut(self) -> None:
        """End whatever the connection waits for (from the alarm's thread)."""
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing left to cut
                sock.shutdown(socket.SHUT_RDWR)

    def _request(self, path: str, headers: dict, alarm: _Alarm | None = None) -> http.client.HTTPResponse:
        """Send the request; a kept-alive connection the server closed while idle is tried
        once more on a fresh one (nothing was read from it yet), unless the deadline passed."""
        for attempt in (1, 2):
            if alarm is not None and alarm.rang:
                raise SourceError("unavailable", f"GET {self._spec.url}{path}: not sent")
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
                body = compact_body(json.loads(response.read(ERROR_BODY_BYTES) or b"null"))
            except (ValueError, OSError, http.client.HTTPException):
                body = None
            kind = "unavailable" if response.status >= 500 and not isinstance(body, dict) else "http"
            raise SourceError(kind, f"HTTP {response.status} for bytes {start}-{end - 1} of {name}",
                              status=response.status, body=body)
        if response.status != 206 or response.length != end - start:
            raise SourceError("http", f"asked bytes {start}-{end - 1} of {name}, got HTTP {response.status} "
                              f"with {response.length} bytes", status=502)

    def _read_body(self, response: http.client.HTTPResponse, length: int, sink: Sink, alarm: _Alarm) -> None:
        done, buffer = 0, self._buffer
        try:
            while done < length:
                if alarm.rang:
                    raise SourceError("unavailable", f"cut after {done} of {length} bytes")
                want = min(len(buffer), length - done)
                got = response.readinto(buffer[:want])  # loops in C until ``want`` bytes or the end
                if got <= 0:
                    raise SourceError("unavailable", f"the body ended after {done} of {length} bytes")
                sink.write(buffer[:got])
                done += got
        except (OSError, http.client.HTTPException) as e:
            raise SourceError("unavailable", f"reading the body: {_describe(e)} after {done} of "
                              f"{length} bytes") from None


class ObjectSource:
    """A version's files in an S3 bucket: file ``name`` is the object ``<prefix>/<name>`` of the
    spec's source, read with obstore (its client keeps connections; it retries by itself)."""

    def __init__(self, spec: SourceSpec, piece_bytes: int):
        from rolloutd.objstore import ObjectStoreSettings, parse_source

        self._spec, self._piece_bytes = spec, piece_bytes
        self._bucket_name, self._prefix = parse_source(spec.url)
        self._settings = ObjectStoreSettings.model_validate_json(spec.store) if spec.store else ObjectStoreSettings()
        self._store = None

    def close(self) -> None:
        self._store = None

    def fetch(self, version: int, name: str, start: int, end: int, sink: Sink, deadline: float | None = None) -> None:
        import obstore

        from rolloutd.objstore import ObjectStoreError, object_key, open_bucket

        where = f"{self._spec.url}/{name}"
        done = 0
        try:
            if self._store is None:
                self._store = open_bucket(self._bucket_name, self._settings, timeout_s=self._spec.read_timeout_s)
            result = obstore.get(self._store, object_key(self._prefix, name), options={"range": (start, end)})
            for piece in result.stream(min_chunk_size=self._piece_bytes):
                # Checked per piece: obstore's reads cannot be cut from another thread.
                if deadline is not None and time.monotonic() > deadline:
                    raise SourceError("unavailable", f"{where}: not done by the chunk's deadline after {done} bytes")
                view = memoryview(piece)
                sink.write(view)
                done += len(view)
        except SourceError:
            raise
        except FileNotFoundError:
            raise SourceError("http", f"{where}: no such object", status=404,
                              body={"error": {"code": "file_unknown", "message": f"{where}: no such object"}}) from None
        except ObjectStoreError as e:  # the credentials file: no retry can help
            raise SourceError("http", f"object store {self._spec.url}: {e}", status=401,
                              body={"error": {"code": "unauthorized", "message": f"object store: {e}"}}) from None
        except Exception as e:  # obstore's errors carry a debug dump: its first line is enough
            first = (str(e).splitlines() or [type(e).__name__])[0][:300]
            raise SourceError("unavailable", f"{where}: {type(e).__name__}: {first}") from None
        if done != end - start:
            raise SourceError("unavailable", f"{where}: got {done} of the {end - start} bytes asked for")


class _Alarm:
    """A fetch's deadline, enforced while it waits: at the deadline a timer thread shuts the
    source's socket down, which ends a blocking connect, head or body read at once. A read
    timeout alone cannot: it bounds each silence, and a peer that sends a byte now and then
    is never silent for long. No thread without a deadline."""

    def __init__(self, source: HttpRangeSource, deadline: float | None):
        self.rang = False
        self._source = source
        self._timer: threading.Timer | None = None
        if deadline is not None:
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._ring)
            self._timer.daemon = True
            self._timer.start()

    def _ring(self) -> None:
        self.rang = True
        self._source._cut()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def compact_body(body: object) -> dict | None:
    """An error reply's body as the daemon needs it: its code and the start of its message
    (a source may answer with any amount of JSON; what a worker reports stays small)."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    error = body["error"]
    return {"error": {"code": str(error.get("code", ""))[:100],
                      "message": str(error.get("message", ""))[:MESSAGE_CHARS]}}


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
