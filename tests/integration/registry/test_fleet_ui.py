"""The fleet page ``GET /ui`` and its data ``GET /v1/fleet``: token rules over real HTTP, then a real
headless Chromium showing the replicas of a running daemon (the fake vLLM), a state change
within seconds, and nothing at all for a wrong token."""

from __future__ import annotations

import http.client
import re
from pathlib import Path

import httpx
import pytest

from rolloutd.registry.ui import ASSETS
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.messages import Heartbeat
from tests.support.browser import chromium, full_screenshot, wait_for

TOKEN = "fleet-page-token"
STATIC = Path(__file__).parents[3] / "rolloutd" / "registry" / "static"
RESULTS = Path(__file__).parents[3] / "bench" / "results"


@pytest.fixture
def reg(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token") as r:
        yield r


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


# -- a real browser against a running daemon ---------------------------------------------------------

def shown_states(driver) -> dict[str, str]:
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('tr[data-replica]')]"
        ".map(r => [r.dataset.replica, r.dataset.state]))")


def pull_cells(driver, replica: str) -> tuple[str, str]:
    """A row's last pull: what it fetched, and its rebuild's time."""
    cells = driver.find_elements("css selector", f"tr[data-replica='{replica}'] td")
    return (cells[7].text, cells[8].text) if len(cells) > 8 else ("", "")


def status_state(daemon, name: str) -> str | None:
    try:
        return daemon.server(name)["state"]
    except httpx.HTTPError:
        return None


def _page_through_10000(tmp_path, reg) -> dict:
    import asyncio

    failing = {(n, s) for n in range(0, 1250, 97) for s in (3,)}  # 13 replicas in BACKOFF

    async def fill() -> None:  # on the registry's loop: the store is only ever touched there
        store = reg.service.store
        for n in range(1250):
            for s in range(8):
                state = "BACKOFF" if (n, s) in failing else "SERVING"
                store.heartbeat(f"n{n:04d}.s{s}", Heartbeat(node=f"n{n:04d}", server=f"s{s}", state=state))
    asyncio.run_coroutine_threadsafe(fill(), reg._thread.loop).result(60)

    def rows() -> list[str]:
        return driver.execute_script("return [...document.querySelectorAll('tr[data-replica]')]"
                                     ".map(r => r.dataset.replica)")

    def pageinfo() -> str:
        return driver.find_element("id", "pageinfo").text

    with chromium(tmp_path / "profile") as driver:
        driver.get(f"{reg.url}/ui#token={TOKEN}")
        wait_for(driver, lambda: pageinfo() == "nodes 1–50 of 1250 · page 1 of 25", 30, "the first page of 1250 nodes")
        assert len(rows()) == 400 and rows()[0] == "n0000.s0"
        assert "10000" in driver.find_element("id", "cards").text
        driver.find_element("id", "next").click()
        wait_for(driver, lambda: pageinfo().endswith("page 2 of 25") and rows()[0] == "n0050.s0", 15, "page 2")
        driver.find_element("id", "f-problems").click()
        wait_for(driver, lambda: len(rows()) == len(failing), 15, "only the replicas with problems")
        assert sorted(rows()) == sorted(f"n{n:04d}.s{s}" for n, s in failing)
        driver.find_element("id", "f-problems").click()
        driver.find_element("id", "f-node").send_keys("n1249")
        wait_for(driver, lambda: rows() == [f"n1249.s{s}" for s in range(8)], 15, "one node by its name")
        driver.find_element("id", "f-node").send_keys("\b" * len("n1249"))  # as typed: clear() fires no input event
        wait_for(driver, lambda: len(rows()) == 400, 15, "a whole page again")
        assert driver.find_element("css selector", "#cards .card.bad .value").text == str(len(failing))
        full_screenshot(driver, tmp_path / "fleet-10000.png")
        return driver.execute_script("return window.rolloutdFleet")
