"""The tests of test_fleet_ui.py that run one at a time in the slow tier (slow by this folder): a real
headless Chromium showing the replicas of a running daemon (the fake vLLM), a state change within
seconds, nothing at all for a wrong token, and 10,000 replicas paged; the rest is in
tests/integration/registry/test_fleet_ui.py."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.messages import Heartbeat, PullReport
from tests.support import fleet_page
from tests.support.browser import chromium, full_screenshot, wait_for
from tests.support.fleet_page import TOKEN

# the registry of these tests, with the page's token
reg = fleet_page.reg
RESULTS = Path(__file__).parents[2] / "bench" / "results"


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


@pytest.mark.timeout(240)
def test_chromium_shows_a_running_daemon_live_and_nothing_for_a_wrong_token(tmp_path, daemons):
    from rolloutd.demo.tinymodel import llama_state_dict

    (tmp_path / "token").write_text(TOKEN)
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token") as reg:
        daemon = daemons(servers=2, registry_url=reg.url, registry={"token_file": str(tmp_path / "token")},
                         restart={"start_timeout_s": 10, "backoff_initial_s": 0.2, "backoff_max_s": 0.4,
                                  "max_retries": 2})
        daemon.wait(lambda st: all(s["state"] == "SERVING" for s in st["servers"]), 60, "both servers serving")
        reg.publish(1, llama_state_dict(1, hidden=64, layers=1, vocab=64, intermediate=64), chunk_bytes=4096)
        daemon.wait_versions({"s0": 1, "s1": 1}, timeout_s=60)

        with chromium(tmp_path / "profile") as driver:
            driver.get(f"{reg.url}/ui")
            wait_for(driver, lambda: driver.find_element("id", "login").is_displayed(), 15, "asking for the token")
            driver.find_element("id", "token").send_keys(TOKEN)
            driver.find_element("css selector", "#login-form button").click()
            wait_for(driver, lambda: shown_states(driver) == {"node-a.s0": "SERVING", "node-a.s1": "SERVING"},
                     15, "showing both replicas serving")
            wait_for(driver, lambda: driver.find_elements("css selector", "#chart g[data-version='1']"), 15,
                     "charting version 1's publish-to-serving time")
            text = driver.find_element("tag name", "body").text
            assert "node-a" in text and "v1" in text
            # The node's pull of v1, through its heartbeats: the whole version (there was no base).
            wait_for(driver, lambda: pull_cells(driver, "node-a.s0")[0] == "full", 15, "showing the pull of v1 as full")
            assert pull_cells(driver, "node-a.s0") == ("full", "–")

            # The state change: s1's new config makes every start fail; the daemon gives up (FATAL).
            cfg = yaml.safe_load(daemon.path.read_text())
            cfg["servers"][1]["env"] = {"FAKE_VLLM_FAULTS": "exit_at_start=3"}
            daemon.write(cfg)
            assert daemon.action("/reload").status_code == 200
            seen = shown_at = None
            deadline = time.monotonic() + 60
            while shown_at is None:
                assert time.monotonic() < deadline, f"the page never showed s1 leave SERVING; daemon: {seen}"
                if seen is None and status_state(daemon, "s1") not in (None, "SERVING"):
                    seen = time.monotonic()  # the daemon's own view changed
                if shown_states(driver).get("node-a.s1") != "SERVING":
                    shown_at = time.monotonic()
                time.sleep(0.05)
            delay_s = shown_at - (seen or shown_at)
            assert delay_s < 5, f"the page showed the change {delay_s:.1f} s after the daemon's status"
            wait_for(driver, lambda: shown_states(driver).get("node-a.s1") == "FATAL", 60, "showing s1 FATAL")
            row = driver.find_element("css selector", "tr[data-replica='node-a.s1']")
            assert "problem" in row.get_attribute("class") and "exit" in row.text.lower(), row.text
            assert shown_states(driver)["node-a.s0"] == "SERVING"
            shot = full_screenshot(driver, tmp_path / "fleet.png")
            RESULTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, RESULTS / "fleet_ui.png")
            render = driver.execute_script("return window.rolloutdFleet")
            print(f"fleet page: state change shown {delay_s:.2f} s after the daemon's status; "
                  f"{render['renders']} renders, last {render['lastRenderMs']:.1f} ms; screenshot {shot}")
            driver.find_element("id", "signout").click()  # forgetting the token takes the data away
            wait_for(driver, lambda: driver.find_element("id", "login").is_displayed(), 10, "asking for a token")
            time.sleep(2.5)
            assert shown_states(driver) == {} and "node-a" not in driver.page_source
            assert driver.execute_script("return sessionStorage.length") == 0

        with chromium(tmp_path / "profile-wrong") as driver:  # a fresh profile: no token kept anywhere
            driver.get(f"{reg.url}/ui#token=wrong-token")
            wait_for(driver, lambda: "refused" in driver.find_element("id", "login-error").text, 15,
                     "saying the token was refused")
            time.sleep(2.5)  # one more poll period: nothing arrives later either
            assert shown_states(driver) == {}
            assert "node-a" not in driver.page_source and not driver.find_element("id", "fleet").is_displayed()
            status = driver.execute_async_script(
                "const done = arguments[0];"
                "fetch('/v1/fleet', {headers: {Authorization: 'Bearer wrong-token'}}).then(r => done(r.status));")
            assert status == 401


@pytest.mark.timeout(120)
def test_chromium_shows_how_each_nodes_last_pull_came_and_what_it_fetched(tmp_path, reg):
    import asyncio

    delta = PullReport(version=7, kind="delta", base=6, bytes_fetched=21_000, version_bytes=1_000_000, seconds=0.5,
                       reconstruct_s=0.125)
    pulls = {"delta": delta,
             "fellback": PullReport(version=7, kind="full", bytes_fetched=1_000_000, version_bytes=1_000_000,
                                    seconds=2.0, delta_error="version 7: delta file m.delta: chunk 0 differs"),
             "resumed": PullReport(version=7, kind="full", bytes_fetched=400_000, version_bytes=1_000_000, seconds=1),
             "held": PullReport(version=7, kind="full", bytes_fetched=0, version_bytes=1_000_000, seconds=0.01),
             "none": None}

    async def fill() -> None:  # on the registry's loop: the store is only ever touched there
        for node, pull in pulls.items():
            reg.service.store.heartbeat(f"{node}.s0", Heartbeat(node=node, server="s0", state="SERVING",
                                                                last_pull=pull))
    asyncio.run_coroutine_threadsafe(fill(), reg._thread.loop).result(10)
    with chromium(tmp_path / "profile") as driver:
        driver.get(f"{reg.url}/ui#token={TOKEN}")
        wait_for(driver, lambda: len(shown_states(driver)) == len(pulls), 30, "every replica")
        shown = {node: pull_cells(driver, f"{node}.s0") for node in pulls}
        tip = driver.find_elements("css selector", "tr[data-replica='fellback.s0'] td")[7].get_attribute("title")
        delta_tip = driver.find_elements("css selector", "tr[data-replica='delta.s0'] td")[7].get_attribute("title")
    assert shown == {"delta": ("delta 2.1% on v6", "125 ms"), "fellback": ("full (delta failed)", "–"),
                     "resumed": ("full 40%", "–"), "held": ("held", "–"), "none": ("–", "–")}
    assert tip.endswith("the delta failed: version 7: delta file m.delta: chunk 0 differs"), tip
    assert delta_tip == "v7 as a delta on v6: 20.5 KiB fetched of 976.6 KiB in 500 ms; rebuilt from the base in 125 ms"


@pytest.mark.timeout(180)
def test_chromium_pages_and_filters_a_fleet_of_10000_replicas(tmp_path, clock):

    (tmp_path / "token").write_text(TOKEN)
    # The fake clock stands still: these replicas never beat again, and must not turn silent while
    # a loaded machine runs the test.
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token", clock=clock) as reg:
        render = _page_through_10000(tmp_path, reg)
    print(f"fleet page at 10,000 replicas: {render['renders']} renders, slowest {render['maxRenderMs']:.0f} ms")
    assert render["maxRenderMs"] < 2000  # 400 rows: usable, even on a loaded machine
