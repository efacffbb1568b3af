"""The peer listener: this node's chunks for other nodes, read-only, with a bearer token.

``GET``/``HEAD /v1/versions/{v}/files/{name}`` with the registry's ``Range`` semantics
(``rolloutd.wire.ranges``) and error bodies (``{"error": {"code", "message"}}``): a complete
version in the mirror whole; the pull in progress only inside chunks already checked (a range
that touches another chunk is ``416``): a version's files, or, while it is pulled from its delta,
its delta files (:meth:`Swarm.plan_delta`), from where the pull staged them; and, once a version
pulled from its delta is committed, its delta files whole from where the mirror keeps them for
peers (:meth:`Ledger.kept_delta`), until it drops them. ``GET /healthz``
needs no token. Nothing else is served: no vLLM route, no admin action, no directory listing.

It runs on its own thread with its own event loop (aiohttp, ``sendfile``): serving peers is pull
work, and pull work never shares a loop with generation traffic. A listener on an
address other than loopback refuses to start without a token (fail closed).

Before the token is checked a client has sent nothing but bytes: each connection must send a
whole request head within ``head_timeout_s`` of connecting or of its last response (else it is
closed), and at most ``max_connections`` are open at once (more are closed as they come), so
that nobody without the token holds the daemon's file descriptors. A complete version's
manifest is read once (:meth:`Ledger.complete`), not at every request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from aiohttp import web

from rolloutd.config import is_loopback
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.swarm import Ledger
from rolloutd.wire import errors
from rolloutd.wire.auth import bearer_ok
from rolloutd.wire.manifest import valid_file_name
from rolloutd.wire.ranges import parse_range

log = logging.getLogger("rolloutd.rollout.peerserve")

HEAD_TIMEOUT_S = 10.0  # peers.head_timeout_s: a request head within this long, or the connection is closed
MAX_CONNECTIONS = 256  # peers.max_connections: a fleet's pullers each keep a few connections to a peer they use


class PeerServerError(Exception):
    """The listener cannot start (address in use, or no token off loopback)."""


def _error(err: errors.RegistryError) -> web.Response:
    return web.json_response(err.to_json(), status=err.status, headers=err.headers)


class PeerServer:
    def __init__(self, mirror: Mirror, ledger: Ledger, host: str, port: int, token: str | None, *,
                 head_timeout_s: float = HEAD_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        if token is None and not is_loopback(host):
            raise PeerServerError(f"peers: a listener on {host} needs a token (peers.token_file or "
                                  "registry.token_file)")
        self.mirror, self.ledger, self.host, self.port = mirror, ledger, host, port
        self._token = token.encode() if token else None
        self.head_timeout_s, self.max_connections = head_timeout_s, max_connections
        self.served_bytes = 0
        self.requests = 0
        self.refused_connections = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> PeerServer:
        self._thread = threading.Thread(target=self._run, name="rolloutd-peers", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise PeerServerError(f"peers: cannot listen on {self.host}:{self.port}: {self._error}") from None
        log.info("serve chunks to peers on %s:%d", self.host, self.port)
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()
            self._error = e
            self._started.set()
            return
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=4096)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_route("GET", "/v1/versions/{version:[1-9][0-9]{0,15}}/files/{name}", self._file)
        app.router.add_route("HEAD", "/v1/versions/{version:[1-9][0-9]{0,15}}/files/{name}", self._file)
        # aiohttp closes a connection whose next request head is not complete when its keep-alive
        # time runs out (partial bytes do not extend it): that time is the head deadline.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     keepalive_timeout=self.head_timeout_s)
        await self._runner.setup()
        self._cap_connections(self._runner.server)
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()

    def _cap_connections(self, server: web.Server) -> None:
        """Close each connection past ``max_connections`` as it is made. aiohttp has no such
        bound; its server object hears of every connection first (then the handler starts)."""
        made = server.connection_made

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            if len(server.connections) > self.max_connections:
                self.refused_connections += 1
                if self.refused_connections & (self.refused_connections - 1) == 0:  # 1, 2, 4, 8...
                    log.warning("refuse a peer connection: %d open already (%d refused so far)",
                                self.max_connections, self.refused_connections)
                transport.abort()
        server.connection_made = connection_made

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # -- routes -------------------------------------------------------------------------------------
    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _file(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self._token is not None and not bearer_ok(request.headers.get("authorization"), self._token):
            err = errors.Unauthorized("missing or wrong bearer token")
            err.headers = {"www-authenticate": "Bearer"}
            return _error(err)
        version, name = int(request.match_info["version"]), request.match_info["name"]
        try:
            paths, size, allowed = self._locate(version, name)
            span = parse_range(request.headers.get("range"), size)
            start, end = span or (0, size)
            if not allowed(start, end):
                raise errors.RangeNotSatisfiable(f"bytes {start}-{end - 1} of {name} are not all checked here yet")
        except errors.RegistryError as e:
            return _error(e)
        headers = {"accept-ranges": "bytes", "content-length": str(end - start)}
        status = 200 if span is None else 206
        if span is not None:
            headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        response = _Slice(paths, start, end, status, headers)
        self.served_bytes += end - start
        return response

    def _locate(self, version: int, name: str):
        """(paths, size, allowed(start, end)) of a file this node may serve (the first of the
        paths that opens is sent), or a RegistryError."""
        if not valid_file_name(name):
            raise errors.FileUnknown(f"no file {name[:200]!r}")
        manifest = self.ledger.complete(version)
        if manifest is not None:
            if (entry := manifest.file(name)) is not None:
                return [self.mirror.path(version) / name], entry.size, lambda a, b: True
            kept = self.ledger.kept_delta(version)  # a delta file's name is never a version file's
            if kept is not None and (entry := kept.files.file(name)) is not None:
                return [kept.dir / name], entry.size, lambda a, b: True
            # Or committed while its delta pull's view is still up: that view decides below.
        partial = self.ledger.partial(version)
        if partial is None and manifest is not None:
            raise errors.FileUnknown(f"version {version} has no file {name[:200]!r}")
        if partial is None:
            raise errors.VersionUnknown(f"version {version} is not held here")
        entry = partial.manifest.file(name)
        if entry is None:
            raise errors.FileUnknown(f"version {version} has no file {name[:200]!r}")
        first_bit = partial.first_bit[name]
        chunk_bytes = partial.manifest.chunk_bytes

        def checked(start: int, end: int) -> bool:
            bits = self.ledger.partial(version)
            if bits is None or bits.digest != partial.digest:
                # Committed meanwhile (or abandoned, or another pull of the version began: a delta
                # pull that fell back to the whole version): the complete copy's file, if it has one
                # (a delta file is never in it), or the delta files kept from this very pull.
                done = self.ledger.complete(version)
                kept = self.ledger.kept_delta(version)
                return ((done is not None and done.file(name) is not None)
                        or (kept is not None and kept.digest == partial.digest and kept.files.file(name) is not None))
            lo, hi = start // chunk_bytes, (end - 1) // chunk_bytes
            want = ((1 << (hi - lo + 1)) - 1) << (first_bit + lo)
            return bits.bits & want == want
        # The pull may commit meanwhile: its file is then the complete version's, or, for a delta
        # file, where the mirror keeps it for peers (moved there by the commit, bytes unchanged).
        return ([partial.dir / name, self.mirror.path(version) / name, self.mirror.delta_dir(version) / name],
                entry.size, checked)


class _Slice(web.StreamResponse):
    """Bytes [start, end) of a file, sent with ``sendfile`` (no copy through Python)."""

    def __init__(self, paths: list[Path], start: int, end: int, status: int, headers: dict[str, str]):
        super().__init__(status=status, headers={**headers, "content-type": "application/octet-stream"})
        self._file_paths, self._from, self._to = paths, start, end

    async def prepare(self, request: web.BaseRequest):
        loop = asyncio.get_running_loop()
        f = await loop.run_in_executor(None, _open_first, self._file_paths)
        if f is None:
            self.set_status(404)
            self.content_length = 0
            return await super().prepare(request)
        try:
            writer = await super().prepare(request)
            transport = request.transport
            if transport is None or transport.is_closing():
                return writer
            await writer.drain()
            await loop.sendfile(transport, f, self._from, self._to - self._from)
            await super().write_eof()
            return writer
        finally:
            await loop.run_in_executor(None, f.close)


def _open_first(paths: list[Path]):
    for path in paths:
        try:
            return open(path, "rb")
        except OSError:
            continue
    return None
