"""The guard in front of the registry's routes: bearer token, body limits, metrics, and two
fast paths: heartbeats, and version bytes moved past uvicorn's buffers (a disk store's bytes
sent with sendfile, upload bodies read from the socket: :mod:`.direct`). Pure ASGI, so that it
costs next to nothing per request.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from rolloutd.registry import direct
from rolloutd.registry.blobs import DiskBlob
from rolloutd.registry.service import RegistryService
from rolloutd.registry.ui import is_public
from rolloutd.wire import errors
from rolloutd.wire.auth import bearer_ok
from rolloutd.wire.ranges import parse_range

log = logging.getLogger("rolloutd.registry")

HEARTBEAT_PREFIX = "/v1/replicas/"
HEARTBEAT_ROUTE = HEARTBEAT_PREFIX + "{replica_id}"
FILE_ROUTE = "/v1/versions/{version:int}/files/{name}"
_FILE_PATH = re.compile(r"^/v1/versions/([1-9][0-9]{0,15})/files/([^/]+)$")


class Guard:
    """Pure ASGI middleware in front of every route; also serves heartbeats itself."""

    def __init__(self, app: FastAPI, service: RegistryService):
        self.app, self.service = app, service
        self.token = service.token.encode() if service.token else None
        self._heartbeat_route = next(r for r in app.routes if getattr(r, "path", None) == HEARTBEAT_ROUTE)
        self._file_route = next(r for r in app.routes if getattr(r, "path", None) == FILE_ROUTE
                                and "GET" in getattr(r, "methods", ()))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        limit = (self.service.settings.max_file_bytes if path.startswith("/v1/uploads/")
                 else self.service.settings.max_json_bytes)
        refusal = self._refusal(scope, limit)
        status = 500
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise errors.BodyTooLarge(f"body over {limit} bytes")
            return message

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if refusal is not None:
            async def handler(scope, receive, send):
                await _send_error(send, refusal)
        elif _is_heartbeat(scope):
            handler = self._heartbeat
        elif scope["method"] == "GET" and (blob := self._disk_blob(scope)) is not None and (
                conn := direct.connection(send)) is not None:
            async def handler(scope, receive, send):
                await self._send_file(scope, receive, send, blob, conn)
        else:
            if scope["method"] == "PUT" and path.startswith("/v1/uploads/") and (
                    conn := direct.connection(send)) is not None and direct.can_receive(conn):
                scope[direct.SCOPE_KEY] = conn  # the upload route reads a large body itself
            handler = self.app
        start = time.perf_counter()
        try:
            await handler(scope, limited_receive, send_status)
        finally:
            route = scope.get("route")
            template = route.path if route is not None else "unmatched"
            m = self.service.metrics
            m.requests.labels(template, str(status)).inc()
            m.latency.labels(template).observe(time.perf_counter() - start)

    async def _heartbeat(self, scope, receive, send) -> None:
        """``PUT /v1/replicas/{id}`` without FastAPI: its per-request machinery cost more than
        the heartbeat itself (bench/README.md, "Registry heartbeat capacity"). The
        FastAPI route of the same path documents it and runs the same ``service.heartbeat``."""
        scope["route"] = self._heartbeat_route
        try:
            body = await _read_body(receive)
            reply = self.service.heartbeat(scope["path"][len(HEARTBEAT_PREFIX):], body)
        except errors.RegistryError as e:
            return await _send_error(send, e)
        except Exception:
            log.exception("internal error on heartbeat")
            return await _send_error(send, errors.Internal("heartbeat failed (see the registry's log)"))
        body = json.dumps(reply, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _disk_blob(self, scope) -> tuple[DiskBlob, str] | None:
        """The disk blob a ``GET .../files/{name}`` asks for and its ETag; None for anything the
        route answers itself (an error, a memory blob)."""
        m = _FILE_PATH.match(scope["path"])
        if m is None:
            return None
        try:
            v = self.service.store.get(int(m.group(1)))
        except errors.RegistryError:
            return None
        blob = v.blobs.get(m.group(2)) if v.entry(m.group(2)) is not None else None
        return (blob, f'"{v.manifest.digest}-{m.group(2)}"') if isinstance(blob, DiskBlob) else None

    async def _send_file(self, scope, receive, send, found: tuple[DiskBlob, str], conn: direct.Connection) -> None:
        """The route's answer, with the body sent by the kernel (``sendfile``); a range the
        route would refuse, or a file reclaimed just now, goes to the route after all."""
        blob, etag = found
        try:
            span = parse_range(_header(scope, b"range"), blob.size)
            fd = os.open(blob.path, os.O_RDONLY | os.O_CLOEXEC)
        except (errors.RegistryError, OSError):
            return await self.app(scope, receive, send)
        scope["route"] = self._file_route
        try:
            start, end = span or (0, blob.size)
            headers = [(b"accept-ranges", b"bytes"), (b"content-length", str(end - start).encode()),
                       (b"etag", etag.encode()), (b"content-type", b"application/octet-stream")]
            if span is not None:
                headers.append((b"content-range", f"bytes {start}-{end - 1}/{blob.size}".encode()))
            await send({"type": "http.response.start", "status": 206 if span else 200, "headers": headers})
            self.service.metrics.sendfile_responses.inc()
            sent = await direct.send_range(conn, send, fd, start, end)
            self.service.metrics.bytes_served.inc(sent)
        except direct.SendfileError as e:
            log.info("abandon sending %s: %s (the client left or stalled)", scope["path"], e)
        finally:
            os.close(fd)

    def _refusal(self, scope, limit: int) -> errors.RegistryError | None:
        """Why a request is refused before any route sees it (token, declared body size)."""
        if self.token is not None and not _public(scope["path"]) and not self._authorized(scope):
            err = errors.Unauthorized("missing or wrong bearer token")
            err.headers = {"www-authenticate": "Bearer"}
            return err
        declared = _header(scope, b"content-length")
        if declared is not None and not (declared.isascii() and declared.isdigit()):
            return errors.InvalidRequest("bad Content-Length")
        if declared is not None and int(declared) > limit:
            return errors.BodyTooLarge(f"body over {limit} bytes")
        return None

    def _authorized(self, scope) -> bool:
        return bearer_ok(_header(scope, b"authorization"), self.token)


def _public(path: str) -> bool:
    """Routes without a token: liveness, and the fleet page's files (no data: the page sends the
    token with every data request it makes)."""
    return path == "/healthz" or is_public(path)


def _is_heartbeat(scope) -> bool:
    path = scope["path"]
    return (scope["method"] == "PUT" and path.startswith(HEARTBEAT_PREFIX)
            and "/" not in path[len(HEARTBEAT_PREFIX):])


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise errors.InvalidRequest("client disconnected before sending its body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_error(send, err: errors.RegistryError) -> None:
    resp = error_response(err)
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


def error_response(err: errors.RegistryError) -> JSONResponse:
    return JSONResponse(err.to_json(), status_code=err.status, headers=err.headers)
