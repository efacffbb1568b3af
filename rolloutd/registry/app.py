"""The registry's HTTP API v1 (docs/registry-api.md) over FastAPI.

Every error is JSON ``{"error": {"code", "message"}}`` with a stable code (see ``errors``);
an ``invalid_request`` names the body fields at fault in ``fields``.
A pure-ASGI guard in front of the app checks the bearer token, bounds request bodies and
records metrics, cheaply enough for thousands of heartbeats a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from rolloutd.registry import direct
from rolloutd.registry.blobs import Blob, Upload, stream_range
from rolloutd.registry.guard import HEARTBEAT_ROUTE, Guard, error_response
from rolloutd.registry.publishes import Publishes, prefers_async
from rolloutd.registry.service import RegistryService
from rolloutd.registry.ui import add_ui_routes
from rolloutd.wire import errors
from rolloutd.wire.manifest import FILE_NAME_RE, MAX_VERSION, Manifest, valid_file_name
from rolloutd.wire.messages import (
    REPLICA_ID_RE,
    Announce,
    DemandRequest,
    Heartbeat,
    LeaseRequest,
    RenewRequest,
)
from rolloutd.wire.ranges import parse_range

log = logging.getLogger("rolloutd.registry")

UPLOAD_WRITE_BYTES = 4 << 20  # buffer an upload into writes of this size, off the event loop
SWEEP_INTERVAL_S = 1.0

VersionPath = Path(ge=1, le=MAX_VERSION, description="version number")
ReplicaIdPath = Path(pattern=REPLICA_ID_RE.pattern, description="node-unique server id, e.g. node7.gpu0-3")


_REF = "#/components/schemas/{model}"
_BODY_DEFS: dict[str, dict] = {}  # nested models of the bodies below, for the OpenAPI components


def body_schema(model: type[BaseModel], required: bool = True) -> dict:
    """OpenAPI for a JSON body the route parses itself (any Content-Type is accepted)."""
    schema = model.model_json_schema(ref_template=_REF)
    _BODY_DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


class ErrorBody(BaseModel):
    class Detail(BaseModel):
        code: str = Field(description="stable error code, see errors.py")
        message: str
        fields: list[str] | None = Field(None, description="invalid_request only: the top-level body "
                                         "fields at fault (absent: none named)")
    error: Detail


ERROR_RESPONSES = {"4XX": {"model": ErrorBody, "description": "refused; the code says why"},
                   "5XX": {"model": ErrorBody, "description": "a bug in the registry"}}


def _with_body_defs(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(_BODY_DEFS)
        return schema
    app.openapi = openapi


# -- the app ------------------------------------------------------------------------------------------

def create_app(service: RegistryService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = asyncio.create_task(_sweep_forever(service), name="registry-sweep")
        try:
            yield
        finally:
            sweeper.cancel()
            service.close()

    app = FastAPI(title="rolloutd registry", version="1", lifespan=lifespan,
                  docs_url=None, redoc_url=None, responses=ERROR_RESPONSES)
    app.state.service = service
    _install_error_handlers(app)
    _add_version_routes(app, service)
    _add_lease_routes(app, service)
    _add_replica_routes(app, service)
    add_ui_routes(app, service)
    _with_body_defs(app)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "instance": service.store.instance}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}})
    async def metrics():
        service.metrics.refresh(service.store)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Guard(app, service)


async def _sweep_forever(service: RegistryService) -> None:
    # Expiry also runs lazily on every lease and version call; this catches idle periods.
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        service.store.sweep()
        service.tracker.sweep()


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.RegistryError)
    async def registry_error(request: Request, exc: errors.RegistryError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(errors.InvalidRequest.of(exc.errors(), request_parts=True))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:
            err = errors.MethodNotAllowed(f"{request.method} not allowed here")
            err.headers = {"allow": ", ".join(_allowed_methods(app, request))}
            return error_response(err)
        if exc.status_code == 404:
            return error_response(errors.RouteNotFound(f"no route {request.url.path[:200]}"))
        return error_response(errors.RegistryError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        if isinstance(exc, ClientDisconnect):  # the client left, or was cut off mid-body: nobody to answer
            log.info("drop %s %s: the client disconnected before its body ended", request.method,
                     request.url.path[:200])
            return error_response(errors.InvalidRequest("client disconnected before sending its body"))
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(errors.Internal(f"{type(exc).__name__} (see the registry's log)"))


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's 405 names only one route's)."""
    methods: set[str] = set()
    for route in app.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE:
            methods |= getattr(route, "methods", set())
    return sorted(methods)


def _add_version_routes(app: FastAPI, service: RegistryService) -> None:
    store = service.store
    publishes = Publishes(service.publish)  # a publish outlives the request: verifying may take minutes

    @app.get("/v1/versions")
    async def list_versions():
        return {"instance": store.instance, "versions": [v.summary() for v in store.versions()]}

    @app.post("/v1/versions", status_code=201, openapi_extra=body_schema(Manifest),
              responses={202: {"description": "under way after the wait asked for with Prefer: ask again"}})
    async def publish(request: Request, delta: bool = Query(True, description="false: publish a full version, "
                                                            "never a delta on an earlier one")):
        manifest = errors.parse(Manifest, await request.body())
        outcome = await publishes.publish(manifest, prefers_async(request.headers.get("prefer")), delta=delta)
        if outcome is None:
            return JSONResponse({"version": manifest.version, "digest": manifest.sealed().digest,
                                 "state": "publishing"}, status_code=202,
                                headers={"preference-applied": "respond-async"})
        version, created = outcome
        body = {"version": version.number, "digest": version.manifest.digest, "created": created,
                "delta": version.delta_summary()}
        return JSONResponse(body, status_code=201 if created else 200)

    @app.get("/v1/versions/latest")
    async def latest(after: int = Query(0, ge=0), instance: str | None = Query(None, max_length=64),
                     wait_s: float = Query(0.0, ge=0)):
        return await service.wait_latest(after, instance, wait_s)

    @app.get("/v1/versions/{version:int}", responses={200: {"model": Manifest, "description": "the manifest"}})
    async def manifest(version: int = VersionPath):
        v = store.get(version)
        return Response(v.manifest.model_dump_json(), media_type="application/json",
                        headers={"x-rolloutd-version-state": v.state.value})

    @app.delete("/v1/versions/{version:int}")
    async def retire(version: int = VersionPath):
        return store.retire(version).summary()

    bytes_responses = {200: {"content": {"application/octet-stream": {}}, "description": "the file"},
                       206: {"content": {"application/octet-stream": {}}, "description": "one range"}}

    @app.head("/v1/versions/{version:int}/files/{name}", response_class=Response, responses=bytes_responses,
              operation_id="file_head")
    @app.get("/v1/versions/{version:int}/files/{name}", response_class=Response, responses=bytes_responses,
             operation_id="file_get")
    async def file_bytes(request: Request, name: str, version: int = VersionPath):
        v = store.get(version)
        entry = v.entry(name) if valid_file_name(name) else None  # a delta file is served as any other
        if entry is None:
            raise errors.FileUnknown(f"version {version} has no file {name[:200]!r}")
        if v.manifest.source is not None:  # the registry keeps the manifest, never these bytes
            raise errors.BytesElsewhere(f"version {version} is stored at {v.manifest.source}: "
                                        f"read {name} from there")
        blob = v.blobs[name]
        span = parse_range(request.headers.get("range"), blob.size)
        start, end = span or (0, blob.size)
        headers = {"accept-ranges": "bytes", "content-length": str(end - start),
                   "etag": f'"{v.manifest.digest}-{name}"'}
        if span is not None:
            headers["content-range"] = f"bytes {start}-{end - 1}/{blob.size}"
        status = 206 if span is not None else 200
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers, media_type="application/octet-stream")
        return StreamingResponse(_counted(blob, start, end, service), status_code=status,
                                 headers=headers, media_type="application/octet-stream")

    @app.put("/v1/uploads/{version:int}/files/{name}", status_code=201)
    async def upload(request: Request, name: str = Path(pattern=FILE_NAME_RE.pattern), version: int = VersionPath):
        if not valid_file_name(name):
            raise errors.InvalidRequest(f"invalid file name {name[:200]!r}")
        service.check_upload(version)
        publishes.forget_failed(version)
        size = await _receive_upload(request, service, version, name)
        return JSONResponse({"version": version, "name": name, "size": size}, status_code=201)

    @app.delete("/v1/uploads/{version:int}", status_code=204)
    async def abort_upload(version: int = VersionPath):
        service.abort_upload(version)
        publishes.forget_failed(version)
        return Response(status_code=204)


async def _counted(blob: Blob, start: int, end: int, service: RegistryService) -> AsyncIterator[bytes | memoryview]:
    # An async generator: a sync one would make Starlette hop every piece through a thread.
    async for piece in stream_range(blob, start, end):
        service.metrics.bytes_served.inc(len(piece))
        yield piece


async def _receive_upload(request: Request, service: RegistryService, version: int, name: str) -> int:
    """The body into a staged file; a cut-off or refused body leaves nothing behind."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None else None
    up = service.blobs.upload(version, name, size)
    conn = request.scope.get(direct.SCOPE_KEY)
    syncing: asyncio.Future | None = None
    try:
        if conn is not None and size is not None and size >= direct.RECEIVE_BYTES:
            await direct.receive_body(conn, size, up.write)
            service.metrics.direct_uploads.inc()
        else:
            await _stream_body(request, up)
        syncing = _off_loop(up.sync)
        await asyncio.shield(syncing)
        size = service.finish_upload(version, name, up)
    except BaseException as e:
        if syncing is not None:  # the thread must be done with the file before it goes
            await asyncio.wait([syncing])
        up.abort()
        if isinstance(e, ClientDisconnect):
            log.warning("abort upload of version %d file %s: the client disconnected", version, name)
            return 0
        if isinstance(e, direct.ClientGone):  # closed, or silent: if it still listens, it learns why
            log.warning("abort upload of version %d file %s: %s", version, name, e)
            raise errors.UploadIncomplete(f"{name}: {e}; upload it again") from None
        raise
    service.metrics.bytes_uploaded.inc(size)
    log.info("receive version %d file %s (%d bytes)", version, name, size)
    return size


async def _stream_body(request: Request, up: Upload) -> None:
    """The body through uvicorn's buffers (a small or chunked one, or another server): each
    batch is written on a thread while the next arrives (one write in flight, in order); it
    returns, or raises, only once no thread is writing."""
    pieces: list[bytes] = []  # written as they came: no copy to join them
    held = 0
    writing: asyncio.Future | None = None
    try:
        async for piece in request.stream():
            pieces.append(piece)
            held += len(piece)
            if held >= UPLOAD_WRITE_BYTES:
                if writing is not None:
                    await asyncio.shield(writing)  # a cancel must not leave the thread writing unseen
                writing = _off_loop(up.write, pieces)
                pieces, held = [], 0
        if writing is not None:
            await asyncio.shield(writing)
        writing = _off_loop(up.write, pieces)
        await asyncio.shield(writing)
    except BaseException:
        if writing is not None:  # the thread must be done with the file before it goes
            await asyncio.wait([writing])
            if not writing.cancelled():
                writing.exception()  # seen: its own error, if any, goes with the one raised
        raise


def _off_loop(fn, *args) -> asyncio.Future:
    return asyncio.ensure_future(asyncio.to_thread(fn, *args))


def _add_lease_routes(app: FastAPI, service: RegistryService) -> None:
    store = service.store

    @app.post("/v1/leases", status_code=201, openapi_extra=body_schema(LeaseRequest))
    async def lease(request: Request):
        req = errors.parse(LeaseRequest, await request.body())
        lease = store.lease(req.holder, req.version, req.ttl_s)
        body = lease.to_json(store.now())
        body["digest"] = store.get(lease.version).manifest.digest
        return JSONResponse(body, status_code=201)

    @app.put("/v1/leases/{lease_id}", openapi_extra=body_schema(RenewRequest, required=False))
    async def renew(request: Request, lease_id: str = Path(max_length=64)):
        body = await request.body()
        req = errors.parse(RenewRequest, body) if body.strip() else RenewRequest()
        return store.renew(lease_id, req.ttl_s).to_json(store.now())

    @app.delete("/v1/leases/{lease_id}", status_code=204)
    async def release(lease_id: str = Path(max_length=64)):
        store.release(lease_id)
        return Response(status_code=204)


def _add_replica_routes(app: FastAPI, service: RegistryService) -> None:
    store = service.store
    # Served by Guard's fast path; declared here for the OpenAPI document.
    @app.put(HEARTBEAT_ROUTE, openapi_extra=body_schema(Heartbeat))
    async def heartbeat(request: Request, replica_id: str = ReplicaIdPath):
        return JSONResponse(service.heartbeat(replica_id, await request.body()))

    @app.get("/v1/replicas")
    async def replicas():
        return JSONResponse({"instance": store.instance, "replicas": store.replicas()})

    @app.get("/v1/replica-counts")
    async def replica_counts(max_age_s: float | None = Query(None, gt=0, description="count only "
                             "replicas heard from within this many seconds"),
                             min_version: int | None = Query(None, ge=1, description="also say how many "
                             "of them will not reach this version: their node refused the newest one")):
        body = {"instance": store.instance, "total": store.replica_count(), "counts": store.replica_counts(max_age_s)}
        if min_version is not None:
            body["refused"] = store.refusals(min_version, max_age_s)
        return body

    @app.delete("/v1/replicas/{replica_id}", status_code=204)
    async def deregister(replica_id: str = ReplicaIdPath):
        store.deregister(replica_id)  # idempotent: a node may deregister after a registry restart
        return Response(status_code=204)

    @app.put("/v1/holders/{node}", openapi_extra=body_schema(Announce))
    async def announce(request: Request, node: str = Path(pattern=REPLICA_ID_RE.pattern, description="node name")):
        return JSONResponse(service.announce(node, await request.body()))

    @app.delete("/v1/holders/{node}", status_code=204)
    async def forget_holder(node: str = Path(pattern=REPLICA_ID_RE.pattern, description="node name")):
        service.tracker.forget_node(node)
        return Response(status_code=204)

    @app.get("/v1/holders")
    async def holders():
        return {"instance": store.instance,
                "versions": {str(v): s for v, s in service.tracker.summary().items()}}

    @app.put("/v1/demand", openapi_extra=body_schema(DemandRequest))
    async def set_demand(request: Request):
        req = errors.parse(DemandRequest, await request.body())
        store.set_demand(req.min_version)
        return {"min_version": store.demand}

    @app.get("/v1/demand")
    async def get_demand():
        return {"min_version": store.demand}
