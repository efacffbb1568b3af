"""A real :class:`rolloutd.gateway.relay.Gateway` on its own event loop in a thread, in front of a
server on a UNIX socket (as every vLLM child of the daemon listens), for tests and benchmarks;
the test plays the supervisor and sets the server's state. The loop is uvloop's, as in the daemon."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from pathlib import Path

import uvloop

from rolloutd.config import Gateway as GatewaySettings
from rolloutd.gateway.relay import Gateway
from rolloutd.metrics import Metrics
from rolloutd.wire.states import ServerState
from tests.support.loop_thread import LoopThread

_SOCKETS: list[Path] = []


def socket_path() -> Path:
    """A fresh path for a stand-in server's UNIX socket: short (a socket path has at most 107
    bytes), in a directory removed when the tests end."""
    if not _SOCKETS:
        _SOCKETS.append(Path(tempfile.mkdtemp(prefix="rolloutd-sock.")))
        atexit.register(shutil.rmtree, _SOCKETS[0], True)
    return _SOCKETS[0] / f"{uuid.uuid4().hex[:12]}.sock"


class GatewayThread:
    def __init__(self, upstream: Path | str, port: int, *, token: str | None = None, name: str = "gpu0",
                 **settings):
        self.metrics = Metrics()
        self.settings = GatewaySettings.model_validate({"host": "127.0.0.1", **settings})
        self.url = f"http://{self.settings.host}:{port}"
        self.gateway = Gateway(name, Path(upstream), port, self.settings, token, self.metrics)
        self._thread = LoopThread(f"gateway-{name}", uvloop.new_event_loop())

    def start(self, state: ServerState = ServerState.SERVING) -> GatewayThread:
        self._thread.start()
        self._call(self.gateway.start())
        self.set_state(state)
        return self

    def set_state(self, state: ServerState) -> None:
        """The server's new state, as its supervisor would report it (applied before returning)."""
        async def apply() -> None:
            self.gateway.on_state(state)
        self._call(apply())

    def set_version(self, version: int | None) -> None:
        """The version the server holds, as its supervisor would report it (applied before returning)."""
        async def apply() -> None:
            self.gateway.on_version(version)
        self._call(apply())

    def stop(self) -> None:
        self._call(self.gateway.stop())
        self._thread.stop()

    def _call(self, coro):
        return self._thread.call(coro)

    def buffered(self) -> dict[str, int]:
        """What the gateway holds for its client connections right now: requests read and not yet
        answered, request bytes held (heads and bodies), and bytes waiting to be written to clients."""
        async def measure() -> dict[str, int]:
            return self.gateway.buffered()
        return self._call(measure())

    def requests(self, route: str, code: int) -> float:
        return self.metrics.registry.get_sample_value(
            "rolloutd_gateway_requests_total", {"server": self.gateway.name, "route": route, "code": str(code)}) or 0
