"""The daemon's client for one ``vllm serve`` on loopback: health and the weight-update routes.

Every call has its own timeout and raises :class:`VllmError` naming the route on any failure
(HTTP error, refused connection, timeout). Connections are never reused: vLLM closes the
connection after a route raised, and a pooled one would fail the next call for that reason
alone (the cost, one loopback connect per call, is a fraction of a millisecond).
"""

from __future__ import annotations

from typing import Any

import aiohttp


class VllmError(Exception):
    def __init__(self, route: str, message: str, *, status: int | None = None):
        super().__init__(f"{route}: {message}")
        self.route, self.status = route, status


class VllmClient:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, method: str, route: str, timeout_s: float, **kw) -> Any:
        try:
            async with self._http().request(method, self.url + route, timeout=aiohttp.ClientTimeout(
                    total=timeout_s), **kw) as r:
                body = await r.json(content_type=None) if r.content_length != 0 else None
                if r.status >= 400:
                    raise VllmError(route, f"HTTP {r.status}: {_message(body)}", status=r.status)
                return body
        except VllmError:
            raise
        except TimeoutError:
            raise VllmError(route, f"no answer within {timeout_s:g} s") from None
        except (aiohttp.ClientError, ValueError, OSError) as e:
            raise VllmError(route, f"{type(e).__name__}: {e}") from None

    async def healthy(self, timeout_s: float) -> bool:
        try:
            async with self._http().get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    # -- the update sequence, one route each --------------------------------------------------------
    async def pause(self, mode: str, timeout_s: float) -> None:
        await self.call("POST", f"/pause?mode={mode}", timeout_s)

    async def resume(self, timeout_s: float) -> None:
        await self.call("POST", "/resume", timeout_s)

    async def start_weight_update(self, timeout_s: float) -> None:
        await self.call("POST", "/start_weight_update", timeout_s)

    async def update_weights(self, update_info: dict, timeout_s: float) -> None:
        await self.call("POST", "/update_weights", timeout_s, json={"update_info": update_info})

    async def finish_weight_update(self, label: str, timeout_s: float) -> None:
        await self.call("POST", "/finish_weight_update", timeout_s, json={"weight_version": label})

    async def weight_version(self, timeout_s: float) -> str:
        body = await self.call("GET", "/weight_info", timeout_s)
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise VllmError("/weight_info", f"unexpected answer {str(body)[:200]!r}")
        return body["weight_version"]


def _message(body: Any) -> str:
    """vLLM's error text, without the noise around it."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]
