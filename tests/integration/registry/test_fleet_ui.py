"""The fleet page ``GET /ui`` and its data ``GET /v1/fleet``: token rules over real HTTP (a real
headless Chromium on the page: tests/system/test_fleet_ui.py)."""

from __future__ import annotations

import http.client
import re
from pathlib import Path

import httpx
import pytest

from rolloutd.registry.ui import ASSETS
from rolloutd.wire.messages import Heartbeat
from tests.support import fleet_page
from tests.support.fleet_page import TOKEN

STATIC = Path(__file__).parents[3] / "rolloutd" / "registry" / "static"
# the registry of these tests, with the page's token
reg = fleet_page.reg


def bearer(token: str = TOKEN) -> dict:
    return {"authorization": f"Bearer {token}"}


def test_the_page_and_its_files_need_no_token_and_hold_no_data(reg):
    reg.service.store.heartbeat("secret-node.s0", Heartbeat(node="secret-node", server="s0", state="SERVING"))
    page = httpx.get(reg.url + "/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    for name, kind in ASSETS.items():
        r = httpx.get(f"{reg.url}/ui/{name}")
        assert (r.status_code, r.headers["content-type"]) == (200, kind)
        assert "secret-node" not in r.text
    assert "secret-node" not in page.text
    assert httpx.get(reg.url + "/ui/nothing.js").status_code == 401  # only the page's own files are public
    assert httpx.get(reg.url + "/ui/nothing.js", headers=bearer()).status_code == 404


def test_fleet_data_follows_the_api_token_rules(reg):
    assert httpx.get(reg.url + "/v1/fleet").status_code == 401
    wrong = httpx.get(reg.url + "/v1/fleet", headers=bearer("wrong"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    assert httpx.get(reg.url + "/v1/fleet", headers=bearer()).status_code == 200


@pytest.mark.parametrize("path", ["/ui/../v1/fleet", "/ui/..%2Fv1%2Ffleet", "/ui/x/../../v1/fleet",
                                  "/ui/fleet.js/../../v1/fleet"])
def test_no_path_through_the_page_reaches_data_without_a_token(reg, path):
    conn = http.client.HTTPConnection("127.0.0.1", reg.port, timeout=10)  # sends the path as written
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status in (401, 404) and b"summary" not in body, (resp.status, body[:200])


def test_the_page_loads_nothing_from_elsewhere_and_inserts_no_markup():
    for f in STATIC.iterdir():
        text = f.read_text()
        urls = set(re.findall(r"""(?:https?:)?//[\w.-]+[^\s"'`)]*""", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (f.name, urls)
    script = (STATIC / "fleet.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script)
    assert "<script>" not in (STATIC / "fleet.html").read_text()  # the CSP allows no inline script


def test_fleet_query_bounds_are_enforced(reg):
    for query in ("per_page=0", "per_page=1001", "page=0", "stale_s=0", "node=" + "x" * 300):
        r = httpx.get(f"{reg.url}/v1/fleet?{query}", headers=bearer())
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", query
