"""The operator's fleet page: ``GET /ui`` and its two assets, and the JSON it polls, ``GET /v1/fleet``.

Token rules: the page and its assets hold no data and are served without a token, like
``/healthz`` (a browser cannot put a bearer token on a navigation); the page asks for the token
and sends it from script in the ``Authorization`` header of every ``/v1/fleet`` request, which
the guard checks as it checks every API route. The token lives in the tab's ``sessionStorage``:
no cookie, so no other site can make the browser send it. The page is static HTML, CSS and
script shipped in the package, loads nothing from elsewhere, and its Content-Security-Policy
forbids anything else (no inline script; data is inserted as text, never as markup).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from rolloutd.registry.fleet import MAX_PER_PAGE, FleetQuery, FleetView
from rolloutd.registry.service import RegistryService
from rolloutd.wire import errors

UI_PATH = "/ui"
ASSETS = {"fleet.js": "text/javascript; charset=utf-8", "fleet.css": "text/css; charset=utf-8"}
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def is_public(path: str) -> bool:
    """The page and its files: no data, no token needed. One path component, nothing more: no
    path that the router might resolve elsewhere is let through."""
    if path == UI_PATH:
        return True
    name = path[len(UI_PATH) + 1:] if path.startswith(UI_PATH + "/") else ""
    return name in ASSETS


def _read(name: str) -> bytes:
    return resources.files("rolloutd.registry").joinpath("static", name).read_bytes()


def add_ui_routes(app: FastAPI, service: RegistryService) -> None:
    view = FleetView(service.store)
    page = _read("fleet.html")
    assets = {name: _read(name) for name in ASSETS}

    @app.get("/v1/fleet")
    async def fleet(page: int = Query(1, ge=1, le=1_000_000, description="page of nodes, from 1"),
                    per_page: int = Query(50, ge=1, le=MAX_PER_PAGE, description="nodes per page"),
                    node: str = Query("", max_length=253, description="only nodes whose name contains this"),
                    state: str = Query("", max_length=32, description="only replicas in this state"),
                    problems: bool = Query(False, description="only replicas with a problem"),
                    stale_s: float = Query(15.0, gt=0, le=86_400, description="silent this long: a problem")):
        q = FleetQuery(page=page, per_page=per_page, node=node, state=state, problems=problems, stale_s=stale_s)
        return JSONResponse(await view.document_async(q))

    html = {200: {"content": {"text/html": {}}, "description": "the fleet page"}}

    @app.get(UI_PATH, response_class=Response, responses=html)
    async def ui():
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    asset_doc = {200: {"content": {t.split(";")[0]: {} for t in ASSETS.values()}, "description": "a file of the page"}}

    @app.get(UI_PATH + "/{asset}", response_class=Response, responses=asset_doc)
    async def ui_asset(asset: str):
        if asset not in assets:
            raise errors.RouteNotFound(f"no file {asset[:100]!r} in the page")
        return Response(assets[asset], media_type=ASSETS[asset], headers=HEADERS)
