"""The gateway's policy: which requests reach a server, and when (the transport is relay.py).

- **Allow-list.** The raw request path must equal one of ``ROUTES`` exactly (no decoding, no
  normalisation: ``/v1/../pause`` and ``/%70ause`` are not ``/pause``); anything else is 404,
  whether vLLM has such a route or not. A listed path with another method is 405.
- **Token.** With ``gateway.token_file`` set, every request needs ``Authorization: Bearer
  <token>`` (:func:`rolloutd.wire.auth.bearer_ok`, constant time), else 401. The relay does not
  forward the header to vLLM.
- **Server state.** Requests are forwarded while the server is SERVING. While it is UPDATING
  (paused to load a version), ``gateway.while_paused`` decides: ``hold`` keeps new requests at
  the gateway until the server serves again (at most ``hold_max_s``, then 503), ``reject``
  answers 503 at once. In any other state (starting, syncing, restarting, stopped) it is 503.
  Every 503 has ``Retry-After``. Because requests are held *before* they reach vLLM, the
  behaviour is the same whether vLLM queues requests during a pause (0.32) or refuses them
  (0.33); a request that reached vLLM just as it paused and came back 503 is held and sent
  again (:meth:`Policy.held_again`).
- **Version contract.** A request with ``X-Rolloutd-Min-Version: N`` is forwarded only while the
  server holds version ``N`` or newer; else ``409 version_behind`` with ``Retry-After`` and
  ``X-Rolloutd-Version`` (what it holds), so a client in any language can ask for fresh
  weights (``rolloutd.wire.version_contract``). A held request is judged once it is released.
- **Counting.** Every answer in ``gateway_requests_total{server,route,code}`` (``route="other"``
  for a path not on the list), every held request in ``gateway_held_total{server}``.

A refusal is a tuple ``(status, code, message, extra headers)`` the relay writes as a JSON
error ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import asyncio

from rolloutd.config import Gateway as GatewaySettings
from rolloutd.metrics import Metrics
from rolloutd.wire import version_contract
from rolloutd.wire.auth import bearer_ok
from rolloutd.wire.states import ServerState

# path -> methods: what a trainer needs for generation, and nothing that changes the server.
ROUTES: dict[str, frozenset[str]] = {
    "/inference/v1/generate": frozenset({"POST"}),
    "/inference/v1/abort_requests": frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
    "/health": frozenset({"GET"}),
}


class Unavailable(Exception):
    """The server is not serving: answered 503 with Retry-After."""


class Policy:
    """One server's gateway policy; follows the server's lifecycle through :meth:`on_state`."""

    def __init__(self, name: str, settings: GatewaySettings, token: str | None, metrics: Metrics):
        self.name, self.settings, self.metrics = name, settings, metrics
        self._token = token.encode() if token else None
        self.state = ServerState.STOPPED
        self.version: int | None = None  # the version the server holds (None: its start model)
        self._serving = asyncio.Event()
        self._counters: dict[tuple[str, int], object] = {}

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    def on_state(self, new: ServerState) -> None:
        """Follow the server's lifecycle (a listener of its Lifecycle)."""
        self.state = new
        if new is ServerState.SERVING:
            self._serving.set()
        else:
            self._serving.clear()

    def on_version(self, version: int | None) -> None:
        """The version the server holds now (set by its supervisor before it serves it)."""
        self.version = version

    # -- what a request gets --------------------------------------------------------------------
    def refusal(self, method: str, path: str, authorization: bytes | None) -> tuple | None:
        """The gateway's own answer to a request, or None when it is forwarded."""
        methods = ROUTES.get(path)
        if methods is None:
            return 404, "not_found", "no such route on this gateway", ()
        if self._token is not None and not bearer_ok(authorization, self._token):
            return 401, "unauthorized", "missing or wrong bearer token", ((b"WWW-Authenticate", b"Bearer"),)
        if method not in methods:
            allow = ", ".join(sorted(methods))
            return 405, "method_not_allowed", f"{path} takes {allow}", ((b"Allow", allow.encode()),)
        return None

    def authorized(self, authorization: bytes | None) -> bool:
        """The request carries the token (always, when the gateway has none)."""
        return self._token is None or bearer_ok(authorization, self._token)

    def behind(self, min_version: int | None) -> tuple | None:
        """The refusal of a request that asks for a newer version than the serving server holds
        (None: it may go on; a server not serving yet is judged once it serves)."""
        if min_version is None or not self._serving.is_set() or (self.version or 0) >= min_version:
            return None
        held = version_contract.held_text(self.version)
        return (version_contract.BEHIND_STATUS, version_contract.BEHIND_CODE,
                f"server {self.name} holds version {held}; the request wants {min_version} or newer",
                ((b"Retry-After", str(self.settings.retry_after_s).encode()),
                 (version_contract.VERSION_HEADER.encode(), held.encode())))

    def unavailable(self, message: str) -> tuple:
        return 503, "unavailable", message, ((b"Retry-After", str(self.settings.retry_after_s).encode()),)

    def count(self, path: str, status: int) -> None:
        key = (path if path in ROUTES else "other", status)
        counter = self._counters.get(key)
        if counter is None:  # labels() costs more than the count: keep each child
            counter = self._counters[key] = self.metrics.gateway_requests.labels(
                server=self.name, route=key[0], code=str(status))
        counter.inc()

    # -- when it is forwarded -------------------------------------------------------------------
    async def ready(self, deadline: float) -> None:
        """Return once the server serves; Unavailable when it will not by ``deadline`` (the
        event loop's clock)."""
        if self._serving.is_set():
            return
        if self.state is not ServerState.UPDATING or self.settings.while_paused == "reject":
            raise Unavailable(f"server {self.name} is {self.state.name}")
        self.metrics.gateway_held.labels(server=self.name).inc()
        try:
            async with asyncio.timeout(max(0.0, deadline - asyncio.get_running_loop().time())):
                await self._serving.wait()
        except TimeoutError:
            raise Unavailable(f"server {self.name} still {self.state.name} after "
                              f"{self.settings.hold_max_s:g} s") from None

    def held_again(self, status: int) -> bool:
        """A 503 from a server that has paused since: hold the request and send it again."""
        return status == 503 and not self._serving.is_set() and self.settings.while_paused == "hold"
