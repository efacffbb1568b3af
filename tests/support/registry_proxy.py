"""Fake network paths to the registry, for tests.

- ``ThreadedProxy`` is an aiohttp server on its own event loop in a thread (a
  :class:`~tests.support.loop_thread.LoopThread`, so a synchronous test or bench drives it) that
  hands every request to ``_handle``; the proxies below, and bench/roundtrips.py's counting
  proxy, are built on it.
- ``RegistryProxy`` forwards every request to the registry on ``upstream_port``, and can slow
  down byte transfers (``byte_delay_s`` before each byte range) or answer each with an error
  (``error_body``: a 404 with that body). When the registry behind it is
  down, the connection is dropped, as a dead host would. It runs on its own event loop in a
  thread, so a synchronous test drives it.
- ``InLoopProxy`` is the base of the fakes an async test runs on its own loop (``async with``),
  each with its own ``_handle`` for every path and an aiohttp session to the registry.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tests.support.loop_thread import LoopThread, serve

_FORWARD = ("authorization", "range", "content-type")


class ThreadedProxy:
    """Forwards to ``upstream`` through ``_handle`` (a subclass's), with ``self._session``, an
    aiohttp client session made by ``_new_session`` on the proxy's loop."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.port = 0
        self._thread = LoopThread(f"proxy-{type(self).__name__}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        self._thread.start().call(self._start())
        return self

    def stop(self) -> None:
        self._thread.call(self._stop())
        self._thread.stop()

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def _start(self) -> None:
        self._session = self._new_session()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.port = await serve(app, port=0, shutdown_timeout=0.5, access_log=None)

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()  # a long-poll's handler left is cancelled by the loop's stop

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


class RegistryProxy(ThreadedProxy):
    def __init__(self, upstream_port: int):
        super().__init__(f"http://127.0.0.1:{upstream_port}")
        self.byte_delay_s = 0.0
        self.byte_requests = 0
        self.error_body: bytes | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if "/files/" in request.path and request.method == "GET":
            self.byte_requests += 1
            await asyncio.sleep(self.byte_delay_s)
            if self.error_body is not None:
                return web.Response(status=404, body=self.error_body, content_type="application/json")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        try:
            async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                             data=await request.read(),
                                             timeout=aiohttp.ClientTimeout(total=120)) as r:
                body = await r.read()
                keep = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "content-range")}
                return web.Response(status=r.status, body=body, headers=keep)
        except aiohttp.ClientConnectionError:
            if request.transport is not None:
                request.transport.close()  # the registry is down: so is the path to it
            return web.Response(status=503)


class InLoopProxy:
    """Serves ``_handle`` (of a subclass) for every path on an ephemeral loopback port, with
    ``self._session`` to ``upstream``; ``url`` is set on entering."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.url = ""

    async def __aenter__(self):
        self._session = aiohttp.ClientSession(self.upstream)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)  # a stalled handler must not hold the test
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError
