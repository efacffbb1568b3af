"""The loop thread under the fake servers (tests/support/loop_thread.py) serves where it is asked
and leaves nothing when stopped: no thread, no open loop, no handler still waiting."""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
from aiohttp import web

from tests.support.gateway_harness import socket_path
from tests.support.loop_thread import LoopThread, serve


def test_an_app_is_served_on_a_tcp_port_and_a_unix_socket_at_once():
    thread = LoopThread(f"test-{uuid.uuid4().hex[:6]}").start()
    async def where(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    app = web.Application()
    app.router.add_get("/where", where)
    unix = socket_path()
    runner, port = thread.call(serve(app, port=0, unix=unix))
    try:
        assert port and httpx.get(f"http://127.0.0.1:{port}/where").json() == {"path": "/where"}
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(unix))) as client:
            assert client.get("http://x/where").json() == {"path": "/where"}
    finally:
        thread.call(runner.cleanup())
        thread.stop()


def test_stop_cancels_what_still_waits_ends_the_thread_and_closes_the_loop():
    name = f"test-{uuid.uuid4().hex[:6]}"
    thread = LoopThread(name).start()
    entered, cancelled = threading.Event(), threading.Event()

    async def hang() -> None:  # as a handler whose client left it waiting
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.run_coroutine_threadsafe(hang(), thread.loop)
    assert entered.wait(10)
    thread.stop()
    assert cancelled.is_set() and waiting.cancelled()
    assert thread.loop.is_closed()
    assert name not in {t.name for t in threading.enumerate()}
