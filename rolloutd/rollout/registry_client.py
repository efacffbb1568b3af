"""The async registry client the daemon uses (aiohttp).

One session per client; every call has an explicit timeout; registry errors come back as
the typed exceptions of ``errors`` and transport failures as ``RegistryUnavailable``.
A pooled connection that the server closed while it sat idle is retried once on a fresh
connection: after a long pull or a quiet night the first call must not fail for that.
A reply the client cannot use (not JSON, or not the shape this version expects: version skew,
a proxy's error page) is a ``RegistryError`` with status 502 ("unexpected reply"), never a
validation exception: callers treat it like any other failed call.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from rolloutd.wire import errors
from rolloutd.wire.manifest import Manifest
from rolloutd.wire.messages import (
    Announce,
    AnnounceReply,
    Heartbeat,
    HeartbeatReply,
    LatestInfo,
    LeaseInfo,
    Replicas,
    Reply,
)


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    request_s: float = 15.0   # a whole JSON call
    read_s: float = 30.0      # longest silence while streaming bytes


_STALE_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, None}


def _is_stale(e: Exception) -> bool:
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(e, aiohttp.ClientOSError) and not isinstance(
        e, aiohttp.ClientConnectorError) and e.errno in _STALE_ERRNOS


class RegistryClient:
    def __init__(self, url: str, token: str | None = None, *, timeouts: Timeouts = Timeouts(),
                 max_connections: int = 32):
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self._token = token
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:  # never show the token
        return f"RegistryClient({self.url!r})"

    @property
    def token(self) -> str | None:
        """The bearer token, for the pull workers that fetch bytes from the same registry."""
        return self._token

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=60)
            self._session = aiohttp.ClientSession(self.url, headers=self._headers, connector=connector)
        return self._session

    def _timeout(self, total_s: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s or self.timeouts.request_s,
                                     connect=self.timeouts.connect_s)

    async def _json(self, method: str, path: str, *, timeout_s: float | None = None, **kw) -> Any:
        """One JSON call: typed error on 4xx/5xx; one retry if a pooled connection was stale."""
        for attempt in (1, 2):
            try:
                async with self._http().request(method, path, timeout=self._timeout(timeout_s), **kw) as r:
                    if r.status >= 400:
                        raise errors.from_json(r.status, await _body(r))
                    return await _reply_json(method, path, r) if r.status != 204 else None
            except errors.RegistryError:
                raise
            except Exception as e:
                if attempt == 1 and _is_stale(e):
                    continue
                raise _unavailable(method, self.url + path, e) from None

    # -- versions --------------------------------------------------------------------------------
    async def latest(self, after: int = 0, instance: str | None = None, wait_s: float = 0.0) -> LatestInfo:
        """The newest version; with ``wait_s``, long-poll for one newer than ``after``."""
        params: dict[str, Any] = {"after": after, "wait_s": wait_s}
        if instance:
            params["instance"] = instance
        body = await self._json("GET", "/v1/versions/latest", params=params,
                                timeout_s=wait_s + self.timeouts.request_s)
        return _parse(LatestInfo, body, "GET /v1/versions/latest")

    async def manifest(self, version: int) -> Manifest:
        return Manifest.model_validate(await self._json("GET", f"/v1/versions/{version}"))

    # -- leases ----------------------------------------------------------------------------------
    async def lease(self, holder: str, version: int | str = "latest", ttl_s: float = 60.0) -> LeaseInfo:
        body = await self._json("POST", "/v1/leases",
                                json={"holder": holder, "version": version, "ttl_s": ttl_s})
        return _parse(LeaseInfo, body, "POST /v1/leases")

    async def renew(self, lease_id: str, ttl_s: float | None = None) -> LeaseInfo:
        body = await self._json("PUT", f"/v1/leases/{lease_id}",
                                json={"ttl_s": ttl_s} if ttl_s is not None else {})
        return _parse(LeaseInfo, body, f"PUT /v1/leases/{lease_id}")

    async def release(self, lease_id: str) -> None:
        await self._json("DELETE", f"/v1/leases/{lease_id}")

    # -- replicas --------------------------------------------------------------------------------
    async def heartbeat(self, replica_id: str, hb: Heartbeat, timeout_s: float | None = None) -> HeartbeatReply:
        body = await self._json("PUT", f"/v1/replicas/{replica_id}", data=hb.model_dump_json(),
                                headers={"content-type": "application/json"}, timeout_s=timeout_s)
        return _parse(HeartbeatReply, body, f"PUT /v1/replicas/{replica_id}")

    async def deregister(self, replica_id: str) -> None:
        await self._json("DELETE", f"/v1/replicas/{replica_id}")

    async def replicas(self) -> list[dict]:
        return _parse(Replicas, await self._json("GET", "/v1/replicas"), "GET /v1/replicas").replicas

    # -- the swarm's tracker ----------------------------------------------------------------------
    async def announce(self, node: str, body: Announce) -> AnnounceReply:
        reply = await self._json("PUT", f"/v1/holders/{node}", data=body.model_dump_json(),
                                 headers={"content-type": "application/json"})
        return _parse(AnnounceReply, reply, f"PUT /v1/holders/{node}")

    async def forget_holder(self, node: str) -> None:
        await self._json("DELETE", f"/v1/holders/{node}")

    async def healthz(self) -> dict:
        return await self._json("GET", "/healthz")

    # -- bytes -----------------------------------------------------------------------------------
    async def stream_range(self, version: int, name: str, start: int, end: int,
                           piece_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        """Bytes [start, end) of a file, as they arrive. Errors before the first byte are
        retried like JSON calls; a stream cut later raises ``RegistryUnavailable``."""
        path = f"/v1/versions/{version}/files/{name}"
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect_s,
                                        sock_read=self.timeouts.read_s)
        headers = {"range": f"bytes={start}-{end - 1}"}
        started = False
        for attempt in (1, 2):
            try:
                async with self._http().get(path, headers=headers, timeout=timeout) as r:
                    if r.status >= 400:
                        raise errors.from_json(r.status, await _body(r))
                    if r.status != 206 or r.content_length != end - start:
                        raise errors.RegistryError(
                            f"asked bytes {start}-{end - 1} of {name}, got HTTP {r.status} "
                            f"with {r.content_length} bytes", status=502)
                    async for piece in r.content.iter_chunked(piece_bytes):
                        started = True
                        yield piece
                    return
            except errors.RegistryError:
                raise
            except Exception as e:
                if attempt == 1 and not started and _is_stale(e):
                    continue
                raise _unavailable("GET", self.url + path, e) from None

    async def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        parts = [p async for p in self.stream_range(version, name, start, end)]
        return b"".join(parts)


async def _body(r: aiohttp.ClientResponse) -> Any:
    try:
        return await r.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        return None


async def _reply_json(method: str, path: str, r: aiohttp.ClientResponse) -> Any:
    try:  # any content type: what matters is whether the body parses
        return await r.json(content_type=None)
    except ValueError:
        raise _unexpected(f"{method} {path}", f"HTTP {r.status} {r.content_type or '-'}, not JSON") from None


def _parse(model: type[Reply], body: Any, call: str) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the body"
        raise _unexpected(call, f"{where}: {first['msg']} ({e.error_count()} problem(s))") from None


def _unexpected(call: str, why: str) -> errors.RegistryError:
    return errors.RegistryError(f"{call}: unexpected reply: {why}", status=502)


def _unavailable(method: str, url: str, e: Exception) -> errors.RegistryUnavailable:
    what = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
    return errors.RegistryUnavailable(f"{method} {url}: {what}")
