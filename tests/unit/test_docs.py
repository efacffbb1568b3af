"""The docs match the code: every route and every registry setting is documented, and nothing
documented is missing from the code."""

import re
from pathlib import Path

from rolloutd.registry.app import create_app
from rolloutd.registry.service import RegistryService
from rolloutd.registry.settings import RegistrySettings

DOC = (Path(__file__).parents[2] / "docs" / "registry-api.md").read_text()


def shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def documented_routes() -> set[tuple[str, str]]:
    routes = set()
    for methods, path in re.findall(r"`((?:GET|PUT|POST|DELETE|HEAD)(?:`/`(?:GET|HEAD))?) (/[^` ?]*)", DOC):
        for m in methods.split("`/`"):
            routes.add((m, shape(path)))
    return routes


def served_routes() -> set[tuple[str, str]]:
    app = create_app(RegistryService(RegistrySettings())).app
    return {(m, shape(r.path)) for r in app.routes for m in getattr(r, "methods", ())
            if (m, r.path) != ("HEAD", "/openapi.json")}


def test_every_route_is_documented_and_exists():
    assert documented_routes() == served_routes()


def test_every_setting_is_documented():
    flags = set(re.findall(r"^\| `--([a-z-]+)` \|", DOC, re.M))
    assert flags == {name.replace("_", "-") for name in RegistrySettings.model_fields}


# -- docs/daemon.md ----------------------------------------------------------------------------------
DAEMON_DOC = (Path(__file__).parents[2] / "docs" / "daemon.md").read_text()


def test_every_admin_route_is_documented():
    from rolloutd.node.admin import create_app as admin_app

    class Nothing:
        metrics = None
    app = admin_app(Nothing(), None)
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ())
              if r.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc") and m != "HEAD"}
    documented = set(re.findall(r"^\| `(GET|POST|PUT|DELETE) (/[^`]*)` \|", DAEMON_DOC, re.M))
    assert documented == served


def test_every_metric_and_state_is_documented():
    from rolloutd.metrics import Metrics
    from rolloutd.wire.states import ServerState
    names = {m.name.removeprefix("rolloutd_") for m in Metrics().registry.collect()}
    names = {n + "_total" if n in ("pull_bytes", "pulls", "update_failures", "updates", "server_restarts",
                                   "heartbeat_failures", "gateway_requests", "gateway_held") else n
             for n in names}
    for name in names:
        assert f"`{name}" in DAEMON_DOC, name
    table = re.findall(r"^\| ([A-Z, ]+) \|", DAEMON_DOC, re.M)
    assert {s.strip() for row in table for s in row.split(",")} >= {state.name for state in ServerState}
