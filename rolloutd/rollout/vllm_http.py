"""The daemon's client for one ``vllm serve`` on its private UNIX socket: health, the weight-update
routes, and the prompt logprobs the gate scores (``/v1/completions`` straight to the server, never
through its gateway).

Every call has its own timeout and raises :class:`VllmError` naming the route on any failure
(HTTP error, refused connection, timeout). Connections are never reused: vLLM closes the
connection after a route raised, and a pooled one would fail the next call for that reason
alone (the cost, one UNIX-socket connect per call, is a fraction of a millisecond).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from vllm_plugin.wire import RELOAD_UNSUPPORTED, VERSION_REFUSED


class VllmError(Exception):
    """``status``: the HTTP status vLLM answered (None: no answer); ``timed_out``: none came in time;
    ``reload_unsupported``: the plugin refused to load anything into this server, untouched;
    ``version_refused``: the plugin refused this version (it lacks tensors of the served model),
    the server untouched."""

    def __init__(self, route: str, message: str, *, status: int | None = None, timed_out: bool = False,
                 reload_unsupported: bool = False, version_refused: bool = False):
        super().__init__(f"{route}: {message}")
        self.route, self.status, self.timed_out = route, status, timed_out
        self.reload_unsupported, self.version_refused = reload_unsupported, version_refused

    @property
    def untouched(self) -> bool:
        """The plugin refused before touching the model: the same answer at every attempt."""
        return self.reload_unsupported or self.version_refused


class VllmClient:
    def __init__(self, socket: Path):
        self.socket = Path(socket)
        self.url = "http://localhost"  # the host only names the server in the request; the socket is the address
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(self.socket),
                                                                                  force_close=True))
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
                    text = _message(body)
                    raise VllmError(route, f"HTTP {r.status}: {text}", status=r.status,
                                    reload_unsupported=RELOAD_UNSUPPORTED in text,
                                    version_refused=VERSION_REFUSED in text)
                return body
        except VllmError:
            raise
        except TimeoutError:
            raise VllmError(route, f"no answer within {timeout_s:g} s", timed_out=True) from None
        except (aiohttp.ClientError, ValueError, OSError) as e:
            raise VllmError(route, f"{type(e).__name__}: {e}") from None

    async def healthy(self, timeout_s: float) -> bool:
        try:
            async with self._http().get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    # -- the update sequence, one route each --------------------------------------------------------
    async def pause(self, mode: str, timeout_s: float, *, clear_cache: bool = True) -> None:
        """``clear_cache`` (vLLM's default): the prefix cache is dropped, and requests frozen by
        ``keep`` are recomputed on resume; without it they keep the KV of the weights before."""
        await self.call("POST", f"/pause?mode={mode}&clear_cache={str(clear_cache).lower()}", timeout_s)

    async def resume(self, timeout_s: float) -> None:
        await self.call("POST", "/resume", timeout_s)

    async def start_weight_update(self, timeout_s: float) -> None:
        await self.call("POST", "/start_weight_update", timeout_s)

    async def update_weights(self, update_info: dict, timeout_s: float) -> None:
        await self.call("POST", "/update_weights", timeout_s, json={"update_info": update_info})

    async def finish_weight_update(self, label: str, timeout_s: float) -> None:
        await self.call("POST", "/finish_weight_update", timeout_s, json={"weight_version": label})

    async def drop_kv_cache(self, timeout_s: float) -> None:
        """Drop the prefix cache and the KV of requests frozen by a pause (they are recomputed
        on resume): nothing generated afterwards reads KV computed with older weights."""
        body = await self.call("POST", "/reset_prefix_cache?reset_running_requests=true", timeout_s)
        if not isinstance(body, dict) or body.get("success") is not True:
            raise VllmError("/reset_prefix_cache", f"the cache was not reset: {str(body)[:200]!r}")

    async def weight_version(self, timeout_s: float) -> str:
        body = await self.call("GET", "/weight_info", timeout_s)
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise VllmError("/weight_info", f"unexpected answer {str(body)[:200]!r}")
        return body["weight_version"]

    # -- the gate ------------------------------------------------------------------------------------
    async def served_model(self, timeout_s: float) -> str:
        """The name requests must give as ``model`` (``--served-model-name``, else the model path)."""
        body = await self.call("GET", "/v1/models", timeout_s)
        try:
            return str(body["data"][0]["id"])
        except (TypeError, KeyError, IndexError):
            raise VllmError("/v1/models", f"unexpected answer {str(body)[:200]!r}") from None

    async def prompt_logprobs(self, token_ids: list[int], timeout_s: float, *, model: str | None = None,
                              engine: int | None = None) -> list[float]:
        """The server's logprob of each token of ``token_ids`` after the tokens before it: one
        value per position from 1 on (``len(token_ids) - 1`` values; position 0 has no prefix).
        ``model``: :meth:`served_model`'s answer (None: asked first). ``engine``: the
        data-parallel engine that must answer (vLLM's header ``X-data-parallel-rank``; None:
        whichever its load balancer picks).

        vLLM 0.32 answers ``choices[0].prompt_logprobs`` as a list: ``null`` for position 0, then
        one object per position keyed by token id (a string), each ``{"logprob", "rank",
        "decoded_token"}``; with ``prompt_logprobs: 0`` it holds the prompt's own token (plus
        the top-1 token when that is another one). Values may be non-finite: the caller checks."""
        model = model if model is not None else await self.served_model(timeout_s)
        route = "/v1/completions"
        headers = {"X-data-parallel-rank": str(engine)} if engine is not None else None
        body = await self.call("POST", route, timeout_s, headers=headers, json={
            "model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0})
        try:
            positions = body["choices"][0]["prompt_logprobs"]
        except (TypeError, KeyError, IndexError):
            raise VllmError(route, f"no prompt_logprobs in the answer {str(body)[:200]!r}") from None
        if not isinstance(positions, list) or len(positions) != len(token_ids):
            raise VllmError(route, f"prompt_logprobs has {len(positions) if isinstance(positions, list) else '?'} "
                            f"entries for {len(token_ids)} prompt tokens")
        values = []
        for i in range(1, len(token_ids)):
            entry = positions[i]
            try:
                values.append(float(entry[str(token_ids[i])]["logprob"]))
            except (TypeError, KeyError, ValueError):
                raise VllmError(route, f"prompt_logprobs[{i}] has no logprob for token {token_ids[i]}: "
                                f"{str(entry)[:200]!r}") from None
        return values


def _message(body: Any) -> str:
    """vLLM's error text, without the noise around it."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]
