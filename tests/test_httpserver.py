"""The embedded HTTP server (rolloutd/httpserver.py): a stop lets requests in flight finish, closes
idle kept-alive connections, and is prompt when nothing is open (uvicorn alone takes 0.2 s); an
idle server wakes once a second, not ten times, and its Date header stays fresh."""

from __future__ import annotations

import asyncio
import threading
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx

from rolloutd.httpserver import ServerThread


async def app(scope, receive, send):
    """An ASGI app: ``/slow`` takes 0.3 s, anything else is answered at once."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_stop_lets_a_request_in_flight_finish_then_refuses_new_ones():
    server = ServerThread(app).start()
    url = f"http://127.0.0.1:{server.port}/slow"
    answers = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(url, timeout=10)))
    client.start()
    while not server.server.server_state.tasks:  # the request is being answered
        time.sleep(0.005)
    server.stop()
    client.join(10)
    assert [(r.status_code, r.text) for r in answers] == [(200, "ok")]
    try:
        httpx.get(url, timeout=2)
        raise AssertionError("a stopped server answered")
    except httpx.ConnectError:
        pass


def test_an_idle_server_stops_at_once_even_with_a_kept_alive_connection():
    took = []
    for _ in range(3):
        server = ServerThread(app).start()
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as c:
            assert c.get("/").text == "ok"  # the connection stays open, idle
            t0 = time.perf_counter()
            server.stop()
            took.append(time.perf_counter() - t0)
    assert min(took) < 0.1, f"{took}: as slow as uvicorn's 0.1 s tick plus its 0.1 s shutdown sleep"


def wakeups(tid: int) -> int:
    """Times the thread ``tid`` of this process was put on a CPU."""
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[2])


def test_an_idle_server_wakes_about_once_a_second_and_its_date_header_stays_fresh():
    server = ServerThread(app).start()
    try:
        thread = next(t for t in threading.enumerate() if t.name == f"http-{server.port}")
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as c:
            first = parsedate_to_datetime(c.get("/").headers["date"])
            before = wakeups(thread.native_id)
            time.sleep(3.0)
            woke = wakeups(thread.native_id) - before
            second = parsedate_to_datetime(c.get("/").headers["date"])
    finally:
        server.stop()
    assert woke <= 8, f"{woke} wake-ups in 3 s of idling (uvicorn's own tick: 30)"
    assert (second - first).total_seconds() >= 2, f"Date went from {first} to {second} over 3 s"
