"""An event loop of its own in a thread, so that a synchronous test (or a benchmark) drives an
async server: the fake servers, proxies and the gateway harness of tests/support each run on one.

``serve`` starts an aiohttp application (or a bare request handler) on that loop, on a loopback
TCP port and/or a UNIX socket.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


class LoopThread:
    """``start`` runs the loop in a daemon thread; ``call`` runs a coroutine on it and waits for its
    result; ``stop`` cancels what still runs on the loop (a handler a client left hanging) and waits
    for it, then ends the loop, joins the thread and closes the loop (its selector's file)."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self) -> LoopThread:
        self._thread.start()
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 10) -> None:
        if self._thread.is_alive():
            self.call(_cancel_the_rest(), timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_the_rest() -> None:
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


async def serve(app: web.Application | Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], *,
                port: int | None = None, unix: Path | None = None, **runner: Any) -> tuple[web.BaseRunner, int | None]:
    """Serve ``app`` (an application, or a handler for every request) on the running loop: on
    127.0.0.1:``port`` (0: a free one) and/or on the UNIX socket ``unix``. Returns the runner
    (``cleanup()`` stops it) and the TCP port bound."""
    assert port is not None or unix is not None, "serve on a TCP port, a UNIX socket, or both"
    if isinstance(app, web.Application):
        made: web.BaseRunner = web.AppRunner(app, **runner)
    else:  # a web.Server is made on the loop it serves from
        made = web.ServerRunner(web.Server(app), **runner)
    await made.setup()
    bound = None
    if port is not None:
        site = web.TCPSite(made, "127.0.0.1", port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
    if unix is not None:
        await web.UnixSite(made, str(unix)).start()
    return made, bound
