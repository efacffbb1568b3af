"""The gateway: the only way to a ``vllm serve`` from other hosts.

vLLM's pause and weight routes and ``/collective_rpc`` have no authentication, so every vLLM
child listens on loopback. For each server, the daemon listens on the node's public address
(``gateway.host``, the server's ``public_port``) and forwards an allow-list of generation
routes to the loopback vLLM:

- **Allow-list.** The raw request path must equal one of ``ROUTES`` exactly (no decoding, no
  normalisation: ``/v1/../pause`` and ``/%70ause`` are not ``/pause``); anything else is 404,
  whether vLLM has such a route or not. A listed path with another method is 405.
- **Token.** With ``gateway.token_file`` set, every request needs ``Authorization: Bearer
  <token>`` (compared in constant time), else 401. The header is not forwarded to vLLM.
- **Streaming.** The answer is passed on chunk by chunk as vLLM writes it (SSE included),
  never buffered whole. A client that goes away closes the connection to vLLM, which aborts
  the request there.
- **Server state.** Requests are forwarded while the server is SERVING. While it is UPDATING
  (paused to load a version), ``gateway.while_paused`` decides: ``hold`` keeps new requests at
  the gateway until the server serves again (at most ``hold_max_s``, then 503), ``reject``
  answers 503 at once. In any other state (starting, syncing, restarting, stopped) it is 503.
  Every 503 has ``Retry-After``. Because requests are held *before* they reach vLLM, the
  behaviour is the same whether vLLM queues requests during a pause (0.32) or refuses them
  (0.33); a request that reached vLLM just as it paused and came back 503 is held and sent
  again.

Errors are JSON ``{"error": {"code", "message"}}``, as in the admin API and the registry.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

import aiohttp
from aiohttp import web

from .config import Gateway as GatewaySettings
from .metrics import Metrics
from .states import ServerState

log = logging.getLogger("rolloutd.gateway")

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

# Per-connection headers (RFC 9110 7.6.1), the client's token, and what aiohttp sets itself.
_DROP_REQUEST = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                           "trailer", "transfer-encoding", "upgrade", "host", "authorization", "content-length"})
_DROP_RESPONSE = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                            "trailer", "transfer-encoding", "upgrade", "content-length", "date", "server"})


class GatewayError(OSError):
    """The gateway cannot listen (address in use, not available)."""


class Unavailable(Exception):
    """The server is not serving: answered 503 with Retry-After."""


class Gateway:
    def __init__(self, name: str, upstream_port: int, port: int, settings: GatewaySettings, token: str | None,
                 metrics: Metrics):
        self.name, self.port, self.settings, self.metrics = name, port, settings, metrics
        self._upstream = f"http://127.0.0.1:{upstream_port}"
        self._token = token.encode() if token else None
        self.state = ServerState.STOPPED
        self._serving = asyncio.Event()
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._counters: dict[tuple[str, int], object] = {}

    # -- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on ``gateway.host:port``; GatewayError with the reason when that fails."""
        # Only what a relay needs: no cookies, no redirects, bytes passed on as they are.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            skip_auto_headers=("User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._runner = web.ServerRunner(web.Server(self._handle), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise GatewayError(f"gateway {self.name}: cannot listen on {self.settings.host}:{self.port}: "
                               f"{e.strerror or e}") from None
        log.info("gateway %s: listening on %s:%d -> %s", self.name, self.settings.host, self.port, self._upstream)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def on_state(self, new: ServerState) -> None:
        """Follow the server's lifecycle (a listener of its Lifecycle)."""
        self.state = new
        if new is ServerState.SERVING:
            self._serving.set()
        else:
            self._serving.clear()

    # -- one request ----------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.raw_path.partition("?")[0]
        methods = ROUTES.get(path)
        if methods is None:
            return self._count(path, _error(404, "not_found", "no such route on this gateway"))
        if self._token is not None and not self._authorized(request):
            return self._count(path, _error(401, "unauthorized", "missing or wrong bearer token",
                                            {"WWW-Authenticate": "Bearer"}))
        if request.method not in methods:
            return self._count(path, _error(405, "method_not_allowed", f"{path} takes {', '.join(sorted(methods))}",
                                            {"Allow": ", ".join(sorted(methods))}))
        try:
            body = await self._read_body(request)
        except ValueError as e:
            return self._count(path, _error(413, "too_large", str(e)))
        try:
            return self._count(path, await self._forward(request, path, body))
        except Unavailable as e:
            return self._count(path, _error(503, "unavailable", str(e),
                                            {"Retry-After": str(self.settings.retry_after_s)}))

    def _authorized(self, request: web.BaseRequest) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        limit = int(self.settings.max_body_bytes)
        if request.content_length is not None and request.content_length > limit:
            raise ValueError(f"request body of {request.content_length} bytes; the limit is {limit}")
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise ValueError(f"request body above the limit of {limit} bytes")
        return bytes(body)

    async def _ready(self, deadline: float) -> None:
        """Return once the server serves; Unavailable when it will not within the policy."""
        if self._serving.is_set():
            return
        if self.state is not ServerState.UPDATING or self.settings.while_paused == "reject":
            raise Unavailable(f"server {self.name} is {self.state.name}")
        self.metrics.gateway_held.labels(server=self.name).inc()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._serving.wait()
        except TimeoutError:
            raise Unavailable(f"server {self.name} still {self.state.name} after "
                              f"{self.settings.hold_max_s:g} s") from None

    async def _forward(self, request: web.BaseRequest, path: str, body: bytes) -> web.StreamResponse:
        deadline = time.monotonic() + self.settings.hold_max_s
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        url = self._upstream + path + (f"?{request.query_string}" if request.query_string else "")
        while True:
            await self._ready(deadline)
            try:
                upstream = await self._session.request(request.method, url, headers=headers, data=body or None,
                                                       allow_redirects=False)
            except aiohttp.ClientError as e:
                if not self._serving.is_set():
                    continue  # the server left SERVING meanwhile: the policy decides
                return _error(502, "upstream", f"server {self.name} did not answer: {type(e).__name__}")
            if upstream.status == 503 and not self._serving.is_set() and self.settings.while_paused == "hold":
                upstream.release()  # refused because it paused just now: hold it and send it again
                continue
            return await self._relay(request, upstream)

    async def _relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """Pass vLLM's answer on as it comes."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in _DROP_RESPONSE:
                response.headers.add(key, value)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            upstream.close()  # the client left: closing the connection to vLLM aborts the request there
        except aiohttp.ClientError as e:
            # vLLM broke off mid-answer: break the client's connection too, so a cut answer never
            # looks complete.
            log.warning("gateway %s: %s %s: the server broke off its answer: %s", self.name, request.method,
                        request.path, type(e).__name__)
            upstream.close()
            if request.transport is not None:
                request.transport.close()
        except asyncio.CancelledError:
            upstream.close()
            raise
        finally:
            upstream.release()
        return response

    def _count(self, path: str, response: web.StreamResponse) -> web.StreamResponse:
        key = (path if path in ROUTES else "other", response.status)
        counter = self._counters.get(key)
        if counter is None:  # labels() costs more than the count: keep each child
            counter = self._counters[key] = self.metrics.gateway_requests.labels(
                server=self.name, route=key[0], code=str(key[1]))
        counter.inc()
        return response


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, headers=headers, content_type="application/json",
                        text=json.dumps({"error": {"code": code, "message": message}}))
