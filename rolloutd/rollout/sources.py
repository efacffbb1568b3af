"""Where a pull's bytes come from: one small interface, three kinds of source.

A :class:`ByteSource` streams bytes ``[start, end)`` of one file of one version:
``stream(version, name, start, end, piece_bytes)`` is an async iterator of pieces. Every source is
untrusted: the puller checks each chunk against the manifest whatever gave it.

- :class:`RegistrySource`: the registry's ``GET /v1/versions/{v}/files/{name}`` with ``Range``
  (the origin of a version published to the registry).
- :class:`ObjectSource`: an S3 bucket (the origin of a version whose manifest names a
  ``source``), read with obstore; credentials from the node's ``object_store`` settings.
- :class:`PeerSource`: another node's peer listener, which serves what its mirror holds with
  the registry's ``Range`` semantics and a bearer token.

Errors: a source that fails in a way another source may not (a peer gone, slow or refusing; a
bucket not answering) raises :class:`SourceError`, a ``RegistryError`` (502) so that the puller
retries it like a failed registry transfer. A missing object is ``FileUnknown``: no retry can
help. No torch here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp

from rolloutd.objstore import ObjectStoreError, ObjectStoreSettings, object_key, open_bucket, parse_source
from rolloutd.registry.client import RegistryClient
from rolloutd.wire import errors


class SourceError(errors.RegistryError):
    """A source failed to give the bytes asked for; another source may."""

    code = "source_error"
    status = 502


class ByteSource(Protocol):
    label: str  # for logs and metrics: "registry", "s3", "peer node-7"

    def stream(self, version: int, name: str, start: int, end: int,
               piece_bytes: int = 1 << 20) -> AsyncIterator[bytes]: ...


class RegistrySource:
    label = "registry"
    is_peer = False

    def __init__(self, client: RegistryClient):
        self.client = client

    def stream(self, version: int, name: str, start: int, end: int, piece_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        return self.client.stream_range(version, name, start, end, piece_bytes=piece_bytes)


class ObjectSource:
    """A version's files in an S3 bucket: file ``name`` is the object ``<prefix>/<name>``."""

    label = "s3"
    is_peer = False

    def __init__(self, source: str, settings: ObjectStoreSettings, *, read_timeout_s: float = 30.0):
        self.source = source
        self.bucket, self.prefix = parse_source(source)
        self.settings, self.read_timeout_s = settings, read_timeout_s
        self._store = None

    def _bucket(self):
        if self._store is None:
            try:
                self._store = open_bucket(self.bucket, self.settings)
            except ObjectStoreError as e:
                raise errors.Unauthorized(f"object store {self.source}: {e}") from None
        return self._store

    async def stream(self, version: int, name: str, start: int, end: int,
                     piece_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        import obstore

        key = object_key(self.prefix, name)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                result = await obstore.get_async(self._bucket(), key, options={"range": (start, end)})
            pieces = result.stream(min_chunk_size=piece_bytes)
            while True:
                async with asyncio.timeout(self.read_timeout_s):  # longest silence, as for the registry
                    try:
                        piece = await pieces.__anext__()
                    except StopAsyncIteration:
                        return
                yield bytes(piece)
        except FileNotFoundError:
            raise errors.FileUnknown(f"{self.source}/{name}: no such object") from None
        except TimeoutError:
            raise SourceError(f"{self.source}/{name}: no bytes for {self.read_timeout_s:g} s") from None
        except errors.RegistryError:
            raise
        except Exception as e:  # obstore's errors carry a debug dump: its first line is enough
            first = (str(e).splitlines() or [type(e).__name__])[0][:300]
            raise SourceError(f"{self.source}/{name}: {type(e).__name__}: {first}") from None


class PeerSource:
    """Another node's peer listener."""

    is_peer = True

    def __init__(self, node: str, url: str, session: aiohttp.ClientSession, *, token: str | None,
                 read_timeout_s: float = 10.0):
        self.node, self.url = node, url.rstrip("/")
        self.label = f"peer {node}"
        self._session, self.read_timeout_s = session, read_timeout_s
        self._headers = {"authorization": f"Bearer {token}"} if token else {}

    def __repr__(self) -> str:  # never the token
        return f"PeerSource({self.node!r}, {self.url!r})"

    async def stream(self, version: int, name: str, start: int, end: int,
                     piece_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        url = f"{self.url}/v1/versions/{version}/files/{name}"
        timeout = aiohttp.ClientTimeout(total=None, connect=min(5.0, self.read_timeout_s),
                                        sock_read=self.read_timeout_s)
        headers = {**self._headers, "range": f"bytes={start}-{end - 1}"}
        try:
            async with self._session.get(url, headers=headers, timeout=timeout) as r:
                if r.status != 206 or r.content_length != end - start:
                    raise SourceError(f"{self.label}: asked bytes {start}-{end - 1} of {name}, got HTTP "
                                      f"{r.status} with {r.content_length} bytes")
                async for piece in r.content.iter_chunked(piece_bytes):
                    yield piece
        except SourceError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            what = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            raise SourceError(f"{self.label} ({self.url}): {what}"[:400]) from None
