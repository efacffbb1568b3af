"""The daemon's local admin API (FastAPI), served by an embedded uvicorn that owns no signals.

Routes: ``GET /status`` (:class:`NodeStatus`), ``GET /metrics`` (Prometheus text),
``GET /healthz`` (200 while the daemon's main loop is alive, else 503), and the actions
``POST /servers/{name}/restart``, ``POST /update`` and ``POST /reload``.

Contract:

- The daemon is reached only through :class:`AdminNode`; this module knows nothing else of it.
- Actions need ``Authorization: Bearer <token>`` (401 and ``WWW-Authenticate: Bearer``
  otherwise): ``admin.token_file``'s token, or without one a random token the daemon writes at
  every start to ``<state_dir>/admin.token``, mode 0600 (:func:`action_token`): root and
  rolloutd's user can act, other local users cannot. Only ``admin.allow_unauthenticated`` opens
  them. Reads (status, metrics, healthz) stay open: the API listens on loopback unless a token
  file is set (the config refuses another host otherwise). The token is compared in constant
  time and never written to a log or a response.
- Every error is JSON ``{"error": {"code", "message"}}``: 401 ``unauthorized``, 404
  ``not_found`` / ``unknown_server``, 405 ``method_not_allowed`` (with ``Allow``), 409
  ``reload_refused`` (the new config is bad; the running one stays), 422 ``invalid_request``.
  A 500 ``internal`` is a bug in the daemon; its traceback goes to the log, never to the client.
- Actions run one at a time: a restart never interleaves with a reload that restarts servers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from pathlib import Path as FilePath
from typing import Annotated, Protocol

from fastapi import Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from rolloutd.config import Config, read_token
from rolloutd.httpserver import QuietServer, bind, server_config
from rolloutd.metrics import Metrics
from rolloutd.wire.auth import bearer_ok
from rolloutd.wire.status import NodeStatus

log = logging.getLogger("rolloutd.node.admin")


class AdminNode(Protocol):
    """What the admin API needs of the daemon."""

    metrics: Metrics

    def status(self) -> NodeStatus: ...                    # the node's status document
    def healthz(self) -> tuple[bool, str]: ...             # (ok, reason): the main loop is alive
    async def restart_server(self, name: str) -> str: ...  # KeyError for an unknown server
    async def update_now(self) -> str: ...                 # the updater checks the registry now
    async def reload(self) -> dict: ...                    # {"ok": bool, "message": str}


# -- the actions' and errors' documents (the status document: rolloutd/wire/status.py) --------------

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Health(_Model):
    ok: bool
    reason: str = Field(description="what the daemon's main loop last did")


class ActionResult(_Model):
    ok: bool
    message: str = Field(description="what the daemon did")


class ErrorBody(_Model):
    class Detail(_Model):
        code: str = Field(description="stable error code")
        message: str
    error: Detail


# -- errors ------------------------------------------------------------------------------------------

class AdminError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _describe(problems) -> str:
    """Validation problems by location and reason, never quoting the input (it may be anything)."""
    parts = [f"{'.'.join(str(x) for x in p.get('loc', ()))}: {p.get('msg')}" for p in problems[:10]]
    return "; ".join(parts) or "invalid request"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AdminError)
    async def admin_error(request: Request, exc: AdminError):
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(422, "invalid_request", _describe(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            # The path is not echoed: whatever a client put in it (a token, say) stays out of answers.
            return error_response(404, "not_found", f"no such route; routes: {ROUTES}")
        if exc.status_code == 405:
            return error_response(405, "method_not_allowed", f"{request.method[:20]} not allowed here",
                                  exc.headers)
        return error_response(exc.status_code, "http_error", str(exc.detail)[:200], exc.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        log.exception("fail admin %s %s", request.method, request.url.path)
        return error_response(500, "internal", f"{type(exc).__name__} (see rolloutd's log)")


# auto_error off: a missing or non-Bearer header must get our JSON 401, not FastAPI's 403.
BearerToken = Annotated[HTTPAuthorizationCredentials | None,
                        Depends(HTTPBearer(auto_error=False, description="the admin token (admin.token_file)"))]


def _auth(token: str | None) -> list:
    """The dependency that guards actions when a token is set (none: admin.allow_unauthenticated)."""
    if token is None:
        return []
    async def check(request: Request, _: BearerToken) -> None:  # BearerToken: the scheme in the OpenAPI
        if not bearer_ok(request.headers.get("authorization"), token):
            raise AdminError(401, "unauthorized", "this action needs Authorization: Bearer <admin token>: "
                             "admin.token_file's, or without one <state_dir>/admin.token's, which root and "
                             "rolloutd's user can read (the rolloutd CLI sends it)", {"WWW-Authenticate": "Bearer"})
    return [Depends(check)]


# -- the actions' token ------------------------------------------------------------------------------

def action_token(cfg: Config) -> str | None:
    """The token the actions need: admin.token_file's; none with admin.allow_unauthenticated;
    else a new random one, written where only rolloutd's user and root can read it."""
    admin = cfg.admin
    if admin.token_file is not None:
        _warn_if_world_readable(FilePath(admin.token_file))
        return read_token(admin.token_file)
    if admin.allow_unauthenticated:
        log.warning("admin: allow_unauthenticated: anyone who can reach %s:%d can restart, update and reload",
                    admin.host, admin.port)
        return None
    path = cfg.admin_token_path
    try:
        return write_token(path)
    except OSError as e:
        raise OSError(f"admin: cannot write the actions' token to {path}: {e.strerror or e}; make state_dir "
                      "writable by rolloutd's user, or set admin.token_file") from None


def write_token(path: FilePath) -> str:
    """A new random token in ``path``, mode 0600, owned by this process's user: written to a new
    file (never through a link someone left there) and renamed into place."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return token


def _warn_if_world_readable(path: FilePath) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # read_token says what is wrong with it
    if mode & 0o004:
        log.warning("admin: token file %s can be read by every local user (mode %o): they can restart, update "
                    "and reload; make it readable by rolloutd's user only (chmod 600)", path, mode & 0o777)


# -- the app -----------------------------------------------------------------------------------------

ROUTES = "GET /status, GET /metrics, GET /healthz, POST /servers/{name}/restart, POST /update, POST /reload"
ERROR_RESPONSES = {"4XX": {"model": ErrorBody, "description": "refused; the code says why"},
                   "5XX": {"model": ErrorBody, "description": "a bug in rolloutd"}}
ServerName = Annotated[str, Path(min_length=1, max_length=200, description="a server's name in the config")]


def create_app(node: AdminNode, token: str | None) -> FastAPI:
    app = FastAPI(title="rolloutd admin", version="1", docs_url=None, redoc_url=None, responses=ERROR_RESPONSES)
    _install_error_handlers(app)
    _add_reads(app, node)
    _add_actions(app, node, _auth(token))
    return app


def _add_reads(app: FastAPI, node: AdminNode) -> None:
    @app.get("/status", response_model=NodeStatus)
    async def status() -> NodeStatus:
        return NodeStatus.model_validate(node.status())

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}})
    async def metrics() -> Response:
        body, content_type = node.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health, "description": "main loop stuck"}})
    async def healthz():
        ok, reason = node.healthz()
        return JSONResponse(Health(ok=ok, reason=reason).model_dump(), status_code=200 if ok else 503)


def _add_actions(app: FastAPI, node: AdminNode, auth: list) -> None:
    lock = asyncio.Lock()

    @app.post("/servers/{name}/restart", response_model=ActionResult, dependencies=auth)
    async def restart(name: ServerName) -> ActionResult:
        async with lock:
            try:
                message = await node.restart_server(name)
            except KeyError:
                raise AdminError(404, "unknown_server", f"no server named {name[:100]!r}") from None
        return ActionResult(ok=True, message=message)

    @app.post("/update", response_model=ActionResult, dependencies=auth)
    async def update() -> ActionResult:
        async with lock:
            return ActionResult(ok=True, message=await node.update_now())

    @app.post("/reload", response_model=ActionResult, dependencies=auth,
              responses={409: {"model": ErrorBody, "description": "the new config is bad; the running one stays"}})
    async def reload() -> ActionResult:
        async with lock:
            result = await node.reload()
        if not result["ok"]:
            raise AdminError(409, "reload_refused", result["message"])
        return ActionResult(ok=True, message=result["message"])


# -- the server --------------------------------------------------------------------------------------

class AdminServer:
    """The admin API's HTTP server: the socket is bound at construction, so an address in use
    fails at once (``OSError: cannot listen on HOST:PORT: ...``) before anything is spawned.
    :meth:`serve` may be called again after a crash (the daemon's crash policy does): it binds
    the same address again and serves on a new uvicorn server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 9100):
        self.app = app
        self.sock: socket.socket | None = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = QuietServer(server_config(app))
        self._serving = False
        self.stopped = False

    @property
    def started(self) -> bool:
        """The server accepts connections."""
        return self.server.started

    async def serve(self) -> None:
        """Serve until ``stop()``; run as a task (uvicorn's signal handling is off)."""
        if self.stopped:
            return
        if self.sock is None:  # the last serve ended (it crashed): uvicorn closed the socket with it
            self.sock = bind(self.host, self.port)
            self.server = QuietServer(server_config(self.app))
        self._serving = True
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            self.sock.close()
            self.sock = None

    def stop(self) -> None:
        self.stopped = True
        self.server.exit()
        if not self._serving and self.sock is not None:  # never served: nothing else will close the socket
            self.sock.close()
