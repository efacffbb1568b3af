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
status and JSON body, which the daemon turns back into the typed error). Whether another
source may help is the daemon's call: a failed peer is dropped and its chunk fetched elsewhere.
"""

from __future__ import annotations

import errno
import fcntl
import http.client
import json
import os
import select
import socket
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, urlsplit

MiB = 1 << 20
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named only from Python 3.10 on some builds


class Sink(Protocol):
    """Where fetched bytes go, in order, from the first byte of the range.

    ``write`` takes a piece through memory (the view is reused afterwards). A sink that is a
    file region also gives ``fd`` and ``offset`` (where the next byte goes): a source may then
    move bytes into the file itself, without them passing through the process (``splice``),
    and report each such run with ``spliced(n)``."""

    fd: int | None
    offset: int

    def write(self, piece: memoryview) -> None: ...
    def spliced(self, n: int) -> None: ...


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
    def fetch(self, version: int, name: str, start: int, end: int, sink: Sink) -> None:
        """Bytes [start, end) of file ``name`` of ``version`` into ``sink``, in order; raises
        :class:`SourceError`. Returns only once every byte was handed over."""

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

    def open(self, piece_bytes: int, zero_copy: bool = True) -> Source:
        if self.kind in ("registry", "peer"):
            return HttpRangeSource(self, piece_bytes, zero_copy)
        if self.kind == "s3":
            return ObjectSource(self, piece_bytes)
        raise ValueError(f"unknown source kind {self.kind!r}")

    def __repr__(self) -> str:  # never show the token
        return f"SourceSpec({self.kind!r}, {self.url!r}" + (f", node={self.node!r})" if self.node else ")")


class HttpRangeSource:
    """``GET /v1/versions/{v}/files/{name}`` with ``Range`` over one kept-alive connection, from
    the registry or a peer
    (``http.client`` sends the request and parses the reply's head).

    The body goes into the sink's file with ``splice`` (socket -> pipe -> file: the bytes are
    copied once, by the kernel, into the file's pages, and never pass through this process)
    when the connection is plain TCP and the sink is a file; otherwise, or where the kernel
    refuses ``splice``, it is read with ``readinto`` into one reused buffer (one copy out of
    the kernel, one into the file)."""

    def __init__(self, spec: SourceSpec, piece_bytes: int, zero_copy: bool = True):
        parts = urlsplit(spec.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._base = parts.path.rstrip("/")
        self._spec = spec
        self._headers = {"authorization": f"Bearer {spec.token}"} if spec.token else {}
        self._piece_bytes = piece_bytes
        self._buffer = memoryview(bytearray(piece_bytes))
        self._conn: http.client.HTTPConnection | None = None
        self._pipe = _pipe(piece_bytes) if zero_copy and not self._https and hasattr(os, "splice") else None

    def close(self) -> None:
        """Drop the connection (the next fetch opens another); the pipe stays."""
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

    def fetch(self, version: int, name: str, start: int, end: int, sink: Sink) -> None:
        self.fetch_path(f"{self._base}/v1/versions/{version}/files/{quote(name)}", name, start, end, sink)

    def fetch_path(self, path: str, name: str, start: int, end: int, sink: Sink) -> None:
        """:meth:`fetch` for any path of the same server (``name`` only names it in errors)."""
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
        done = 0
        try:
            if self._pipe is not None and sink.fd is not None:
                # What the reply's head arrived with is already in the reader's buffer: hand it
                # over first; from then on the socket holds the rest of the body, and only it.
                head = response.read1(length)
                sink.write(memoryview(head))
                done = len(head)
                try:
                    done += self._splice(sink, length - done)
                except _NoSplice:
                    self._close_pipe()  # refused here (a sandbox, an old kernel): copy from now on
                response.length = length - done
                if not response.length:
                    response.close()  # read to its end: the connection can be used again
            buffer = self._buffer
            while done < length:
                want = min(len(buffer), length - done)
                got = response.readinto(buffer[:want])  # loops in C until ``want`` bytes or the end
                if got <= 0:
                    raise SourceError("unavailable", f"the body ended after {done} of {length} bytes")
                sink.write(buffer[:got])
                done += got
        except (OSError, http.client.HTTPException) as e:
            raise SourceError("unavailable", f"reading the body: {_describe(e)} after {done} of "
                              f"{length} bytes") from None

    def _splice(self, sink: Sink, length: int) -> int:
        """Move ``length`` bytes from the socket into the sink's file; returns how many moved
        (all of them, unless it raises). Waits at most ``read_timeout_s`` for each piece."""
        sock, (pipe_r, pipe_w) = self._conn.sock.fileno(), self._pipe
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        timeout_ms = int(self._spec.read_timeout_s * 1000)
        moved = 0
        try:
            while moved < length:
                moved += self._splice_once(sock, pipe_r, pipe_w, poll, timeout_ms, sink, length - moved)
        except BaseException as e:
            if not isinstance(e, _NoSplice):  # bytes may be left in the pipe: never let them out
                self._close_pipe()
                self._pipe = _pipe(self._piece_bytes)
            raise
        return moved

    def _splice_once(self, sock: int, pipe_r: int, pipe_w: int, poll, timeout_ms: int, sink: Sink,
                     length: int) -> int:
        """Fill the pipe from the socket (up to a piece), then empty it into the file in one
        go: one hash update and few system calls per piece, however small the socket's reads."""
        want, filled = min(self._piece_bytes, length), 0
        while filled < want:
            try:  # the socket is non-blocking (it has a timeout): wait for bytes ourselves
                n = os.splice(sock, pipe_w, want - filled, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                if filled:
                    break  # the socket has nothing more right now, or the pipe is full: write what came
                if not poll.poll(timeout_ms):
                    raise TimeoutError("no bytes within read_timeout_s") from None
                continue
            except OSError as e:
                if not filled and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
                    raise _NoSplice() from None  # nothing moved yet: the copy path takes over
                raise
            if n == 0:
                if filled:
                    break
                raise SourceError("unavailable", f"the body ended {length} bytes short")
            filled += n
        offset, left = sink.offset, filled
        while left:  # empty the pipe into the file before the next read
            left -= os.splice(pipe_r, sink.fd, left, offset_dst=offset + filled - left, flags=os.SPLICE_F_MOVE)
        sink.spliced(filled)
        return filled

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None


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

    def fetch(self, version: int, name: str, start: int, end: int, sink: Sink) -> None:
        import obstore

        from rolloutd.objstore import ObjectStoreError, object_key, open_bucket

        where = f"{self._spec.url}/{name}"
        done = 0
        try:
            if self._store is None:
                self._store = open_bucket(self._bucket_name, self._settings, timeout_s=self._spec.read_timeout_s)
            result = obstore.get(self._store, object_key(self._prefix, name), options={"range": (start, end)})
            for piece in result.stream(min_chunk_size=self._piece_bytes):
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


class _NoSplice(Exception):
    """The kernel refused splice for this socket or file."""


def _pipe(size: int) -> tuple[int, int] | None:
    """A pipe for splice, as large as the pieces (None where pipes cannot be sized)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        fcntl.fcntl(w, _F_SETPIPE_SZ, size)
    except OSError:  # over /proc/sys/fs/pipe-max-size: the default size still works, in more steps
        pass
    return r, w


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
