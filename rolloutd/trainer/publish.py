"""Trainer-side library: publish versions, demand them, and watch the replicas.

``RegistryHTTP`` talks to any registry over HTTP (a non-Python trainer can do the same with
the documented routes). ``EmbeddedRegistry`` has a registry service running inside the trainer's
process and publishes through its staged publish, writing each tensor straight into its store
(:mod:`~rolloutd.trainer.shards`: one copy, hashed as it lands), without a round trip over HTTP;
``publish_async`` does it on a thread of its own and returns a
:class:`~rolloutd.trainer.handle.PublishHandle` at once; its queries go over HTTP like any
client's. How a version is published is one :class:`~rolloutd.trainer.options.PublishOptions`
for every call. torch is imported only when a state dict holds torch tensors.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import shutil
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from rolloutd.objstore import ObjectStoreError, ObjectStoreSettings
from rolloutd.trainer.bucket import (
    KeptVersions,
    delete_objects,
    encode_delta_files,
    prune_versions,
    publish_files,
    version_source,
)
from rolloutd.trainer.handle import PublishHandle, PublishState, Turns
from rolloutd.trainer.options import PublishOptions
from rolloutd.trainer.shards import (  # noqa: F401 -- the trainer's names for them
    DEFAULT_SHARD_BYTES,
    Cancelled,
    ChunkHasher,
    MappedFile,
    Shard,
    checkpoint_tensors,
    drop_aliases,
    hash_shard,
    layer_key,
    nbytes,
    plan_shards,
    read_shard,
    save_shards,
    serialize_shards,
    shard_plan,
    write_shard,
)
from rolloutd.wire import errors
from rolloutd.wire.manifest import (
    Delta,
    FileEntry,
    Manifest,
    build_manifest,
    safetensors_files,
)
from rolloutd.wire.states import ServerState

log = logging.getLogger("rolloutd.publish")

UPLOAD_PIECE_BYTES = 4 << 20
# httpx (over TLS or a proxy) copies each piece it sends into a new buffer (joined with its framing): pieces
# under glibc's 128 KiB mmap threshold come from memory the process reuses, where pieces of
# megabytes were new pages each time (a page fault per 4 KiB; docs/data-path.md, "Reused buffers").
SEND_PIECE_BYTES = 120 << 10
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
# Verifying a large version takes the registry longer than any fixed timeout: it answers a
# publish still under way after this long (or a third of the client's timeout) with 202, and the
# client asks again, which waits for the same publish.
PUBLISH_WAIT_S = 10.0
# The registry answers an upload once the file is on disk (fsync): on a slow disk with the whole
# file still in the page cache that takes seconds per GiB, longer than the client's timeout for a
# shard of gigabytes. Its reply is waited for as long as writing at this rate would take.
UPLOAD_SYNC_BYTES_PER_S = 20e6


# -- over HTTP ----------------------------------------------------------------------------------------

class VersionRefused(RuntimeError):
    """Too few replicas can reach the version waited for: the nodes of ``replicas`` of them refused
    the newest version ``version`` (``reasons``: ``[{"reason", "count"}]``, the most common)."""

    def __init__(self, n: int, min_version: int, refused: dict):
        self.version, self.replicas, self.reasons = refused["version"], refused["replicas"], refused["reasons"]
        why = "; ".join(f"{r['count']} x {r['reason']}" for r in self.reasons)
        super().__init__(f"{self.replicas} replica(s) will not reach version {min_version} (for {n} wanted): "
                         f"their nodes refused version {self.version} ({why}); publish a version that fixes it")


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context per process, shared by its clients: httpx makes a new one for each client,
    reading the whole CA bundle each time (20-30 ms of CPU), and a trainer may make several (one
    per embedded registry, one per RegistryHTTP)."""
    return httpx.create_ssl_context()


class RegistryHTTP:
    """A synchronous client for the trainer (the daemon uses the async ``client``)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0, *,
                 why_full: Callable[[Manifest], str | None] | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._why_full = why_full  # the registry's own delta rules, where it runs in this process
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, verify=_tls(),
                                  timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._kept = KeptVersions()  # per object store prefix: the last version put there, for deltas

    def close(self) -> None:
        self._http.close()
        self._kept.close()

    def _call(self, method: str, path: str, **kw) -> Any:
        r = self._send(method, path, **kw)
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None

    def _send(self, method: str, path: str, **kw) -> httpx.Response:
        """The response of a request that succeeded; the registry's error raised, typed."""
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise errors.RegistryUnavailable(f"{method} {self.url}{path}: {e!r}") from None
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = None
            raise errors.from_json(r.status_code, body)
        return r

    def _upload_timeout(self, size: int) -> httpx.Timeout:
        """The client's timeouts, but the wait for the reply once the body is sent as long as the
        registry's fsync of ``size`` bytes may take (sending is still bounded by ``timeout_s``)."""
        return httpx.Timeout(self.timeout_s, connect=5.0, read=max(self.timeout_s, size / UPLOAD_SYNC_BYTES_PER_S))

    def _post_manifest(self, manifest: Manifest, **kw: Any) -> dict:
        """Publish ``manifest`` (its files are where it says) and wait for the registry to commit
        it, however long it works on it: each request is answered within ``PUBLISH_WAIT_S`` (202
        while under way) and asked again, joining the same publish; a registry that stops
        answering fails it after the client's timeout, as any request."""
        wait_s = min(PUBLISH_WAIT_S, self.timeout_s / 3)
        headers = {"content-type": "application/json", "prefer": f"respond-async, wait={wait_s:g}"}
        body = manifest.model_dump_json()
        while True:
            r = self._send("POST", "/v1/versions", content=body, headers=headers, **kw)
            if r.status_code != 202:
                return r.json()

    # -- queries ---------------------------------------------------------------------------------
    def latest(self) -> dict:
        return self._call("GET", "/v1/versions/latest")

    def manifest(self, version: int) -> Manifest:
        return Manifest.model_validate(self._call("GET", f"/v1/versions/{version}"))

    def versions(self) -> list[dict]:
        return self._call("GET", "/v1/versions")["versions"]

    def replicas(self) -> list[dict]:
        return self._call("GET", "/v1/replicas")["replicas"]

    def fleet(self, **query: Any) -> dict:
        """One page of the fleet view (``GET /v1/fleet``; the query's keys are its parameters)."""
        return self._call("GET", "/v1/fleet", params={k: v for k, v in query.items() if v not in (None, "")})

    def demand(self, min_version: int | None) -> None:
        """Ask every replica for at least ``min_version`` (None clears it)."""
        self._call("PUT", "/v1/demand", json={"min_version": min_version})

    def retire(self, version: int) -> dict:
        return self._call("DELETE", f"/v1/versions/{version}")

    def replica_counts(self, max_age_s: float | None = None) -> list[dict]:
        """``[{"state", "version", "count"}]``; with ``max_age_s``, only replicas heard from lately."""
        params = {"max_age_s": max_age_s} if max_age_s is not None else {}
        return self._call("GET", "/v1/replica-counts", params=params)["counts"]

    def wait_for_replicas(self, n: int, min_version: int, timeout_s: float = 600.0, *,
                          poll_s: float = 0.5, state: str = ServerState.SERVING,
                          max_age_s: float = 30.0) -> list[dict]:
        """Block until ``n`` replicas heard from within ``max_age_s`` report ``state`` at
        ``min_version`` or newer; returns them. Polls the counts, not the whole directory,
        so a large fleet costs the registry next to nothing while the trainer waits.
        :class:`VersionRefused` at once when too few can get there: the others' nodes refused
        the newest version (it failed on their servers; they serve their last good version)."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self._call("GET", "/v1/replica-counts", params={"max_age_s": max_age_s, "min_version": min_version})
            counts, refused = body["counts"], body.get("refused")
            ready = sum(c["count"] for c in counts if c["state"] == state and (c["version"] or 0) >= min_version)
            if ready >= n:
                return [r for r in self.replicas() if r["state"] == state and (r["version"] or 0) >= min_version
                        and r["age_s"] <= max_age_s]
            if refused and sum(c["count"] for c in counts) - refused["replicas"] < n:
                raise VersionRefused(n, min_version, refused)
            if time.monotonic() >= deadline:
                seen = ", ".join(f"{c['count']} {c['state']}@{c['version']}" for c in counts) or "none"
                raise TimeoutError(f"{ready} of {n} replicas {state} at version >= {min_version} "
                                   f"after {timeout_s} s (seen: {seen})")
            time.sleep(poll_s)

    # -- publishing --------------------------------------------------------------------------------
    def publish(self, version: int, state_dict: Mapping[str, Any], options: PublishOptions | None = None, *,
                progress: Progress | None = None, **fields: Any) -> Manifest:
        """Publish a state dict (torch tensors or numpy arrays, HF names) as ``version``; or a
        model, whose weights are taken in checkpoint layout (:func:`checkpoint_tensors`). Each
        shard is streamed to the registry from the tensors' own memory (hashed as it goes, no
        file in between), then the manifest is published. Publishing the same tensors again is
        a no-op. How: ``options`` and the keywords ``fields`` (:class:`PublishOptions`). With
        ``to``, as for :meth:`publish_dir` (the shards are written to a local directory first,
        for the object store's client, and kept there as the base of the next version's delta)."""
        opts = PublishOptions.of(options, fields)
        shards = plan_shards(state_dict, opts.shard_bytes)
        if opts.to is not None:
            work = self._kept.workdir(version)
            try:
                entries = []
                for shard in shards:
                    with MappedFile(work / shard.name, shard.size) as dest:
                        entries.append(FileEntry(name=shard.name, size=shard.size,
                                                 chunks=write_shard(shard, dest, opts.chunk_bytes, opts.hash_name)))
                manifest = _manifest(version, entries, opts, source=version_source(opts.to, version))
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            return self._upload_to_store(manifest, work, opts, progress)

        def sealed(chunks: list[list[str]] | None) -> Manifest:
            files = [FileEntry(name=sh.name, size=sh.size if c is not None else 0, chunks=c or [])
                     for sh, c in zip(shards, chunks or [None] * len(shards), strict=True)]
            return _manifest(version, files, opts)
        sealed(None)  # every field but the digests checked before a byte is sent
        total, done = sum(sh.size for sh in shards), 0

        def sent(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)
        try:
            manifest = sealed([self._stream_shard(version, sh, opts.chunk_bytes, opts.hash_name, sent)
                               for sh in shards])
        except errors.VersionConflict:  # published already, or being published: the same tensors are a no-op
            manifest = sealed([hash_shard(sh, opts.chunk_bytes, opts.hash_name) for sh in shards])
            theirs = self._held_digest(version)
            if theirs is not None and theirs != manifest.digest:
                raise
            if theirs is None:  # waits for that publish if it is of these tensors; refused if not
                self._post_manifest(manifest, params=delta_query(opts.delta))
            return manifest
        self._post_manifest(manifest, params=delta_query(opts.delta))
        return manifest

    def _held_digest(self, version: int) -> str | None:
        """The digest of the version the registry holds under ``version`` (None: none, or one
        still being published). Publishing the same bytes again is a no-op: this is the check."""
        try:
            return self.manifest(version).digest
        except (errors.VersionUnknown, errors.VersionRetired):
            return None

    def _stream_shard(self, version: int, shard: Shard, chunk_bytes: int, hash_name: str,
                      sent: Callable[[int], None]) -> list[str]:
        """Upload one shard from the tensors' memory; returns its chunk digests."""
        hasher = ChunkHasher(chunk_bytes, hash_name, shard.size)

        def body() -> Iterator[memoryview]:
            for block in read_shard(shard):
                hasher.feed(block)
                yield block
                sent(len(block))
        self._put_body(f"/v1/uploads/{version}/files/{shard.name}", shard.size, body())
        return hasher.finish()

    def _put_body(self, path: str, size: int, pieces: Iterable[memoryview]) -> None:
        """PUT a body of ``size`` bytes given as buffers. Over plain HTTP each buffer goes to the
        socket as it is (``http.client``): httpx's HTTP/1.1 writer joins every piece into a new
        bytes object, one more copy of every byte (bench/README.md, "Publishing a state dict"). Over TLS
        (whose records are copies anyway) or a proxy: through httpx, in small pieces."""
        url = urllib.parse.urlsplit(self.url)
        timeout = self._upload_timeout(size)
        if url.scheme != "http" or _proxied(url):
            self._call("PUT", path, content=_pieces(pieces, SEND_PIECE_BYTES), timeout=timeout,
                       headers={"content-length": str(size)})
            return
        conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=self.timeout_s)
        try:
            failed = None
            try:
                conn.putrequest("PUT", url.path + path, skip_accept_encoding=True)
                for name, value in [("content-length", str(size)), *self._auth()]:
                    conn.putheader(name, value)
                conn.endheaders()
                for piece in pieces:
                    conn.send(piece)
            except OSError as e:  # the registry may have refused it before the end: its reply says why
                failed = e
            try:
                if conn.sock is None:
                    raise failed or ConnectionError("not connected")
                conn.sock.settimeout(timeout.read)
                r = conn.getresponse()
                body = r.read()
            except (OSError, http.client.HTTPException) as e:
                raise errors.RegistryUnavailable(f"PUT {self.url}{path}: {failed or e!r}") from None
        finally:
            conn.close()
        if r.status >= 400:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            raise errors.from_json(r.status, parsed)

    def _auth(self) -> list[tuple[str, str]]:
        token = self._http.headers.get("authorization")
        return [("authorization", token)] if token else []

    def publish_dir(self, version: int, path: Path, options: PublishOptions | None = None, *,
                    progress: Progress | None = None, **fields: Any) -> Manifest:
        """Publish the ``*.safetensors`` files of ``path``: upload each, then the manifest.
        Publishing the same bytes again is a no-op, so a retry after a lost reply is safe. How:
        ``options`` and the keywords ``fields`` (:class:`PublishOptions`: canary, partial, hash,
        delta, object store; each field says what it does).

        ``to="s3://bucket/prefix"``: the files go to the object store under ``<prefix>/<version>/``
        instead of the registry, which keeps the manifest (naming that source), the leases and
        the version's lifecycle; ``store`` says where the S3 service is and which file holds
        the credentials (:class:`~rolloutd.objstore.ObjectStoreSettings`). The registry holds no
        credentials; with ``prune`` (the default), once the version is published the trainer
        deletes the objects of the earlier versions under ``to`` that the registry no longer
        holds (:meth:`prune_store`), so the bucket keeps about ``keep_versions`` versions.

        ``delta`` (the default): the registry publishes the version as a delta on its newest live
        version when that is smaller, encoding it itself (docs/deltas.md); ``False``: a full
        version. The manifest returned is the target's either way (``manifest(version)`` gives
        the registry's, with its delta section). With ``to`` the publisher encodes it (the registry
        holds none of those bytes) against the last version it put under ``to``, which it keeps on
        local disk (a copy of its files: the caller may overwrite them with the next version):
        see :meth:`_upload_to_store`."""
        opts = PublishOptions.of(options, fields)
        files = safetensors_files(path)
        if opts.to is None:
            return self._upload(_built_manifest(version, files, opts), files, opts, progress)
        work = self._kept.workdir(version)
        try:
            copies = [Path(shutil.copyfile(p, work / p.name)) for p in files]  # hashed as kept and uploaded
            manifest = _built_manifest(version, copies, opts, source=version_source(opts.to, version))
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return self._upload_to_store(manifest, work, opts, progress)

    def prune_store(self, to: str, store: ObjectStoreSettings | None = None, *,
                    below: int | None = None) -> list[int]:
        """Delete the objects of every version under ``to`` that this registry will never serve
        again: numbered below ``below`` and neither live nor retired here. ``below`` defaults to
        the newest version the registry holds; one above the newest published could take an
        upload under way. Numbers only grow, and a retired version keeps its bytes until its last
        lease ends, so no node needs these any more; a number never published (an upload given
        up) goes too. Keys under ``to`` outside ``<n>/`` prefixes are left alone. Returns the
        versions deleted."""
        held = {v["version"] for v in self.versions()}
        below = max(held, default=0) if below is None else below
        return prune_versions(to, lambda n: n < below and n not in held, store or ObjectStoreSettings())

    def _upload_to_store(self, manifest: Manifest, work: Path, opts: PublishOptions,
                         progress: Progress | None) -> Manifest:
        """Publish ``manifest`` (its source under ``opts.to``, its files in ``work``) through the
        object store; once published, ``work`` is kept as the base of the next version under
        ``to`` (the one kept before is deleted), else deleted."""
        try:
            published = self._upload(manifest, [work / f.name for f in manifest.files], opts, progress)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        self._kept.keep(opts.to, manifest, work)
        return published

    def _upload(self, manifest: Manifest, files: list[Path], opts: PublishOptions,
                progress: Progress | None) -> Manifest:
        """Upload each file (to the object store when the manifest names one, under ``opts.to``),
        then publish the manifest (a no-op when the registry has it)."""
        if self._held_digest(manifest.version) == manifest.digest:
            return manifest
        if manifest.source is not None:
            return self._publish_to_store(manifest, files, opts, progress)
        version = manifest.version
        total, done = manifest.total_bytes, 0
        try:
            for p in files:
                def body(p=p) -> Iterator[memoryview]:
                    nonlocal done
                    buffer = memoryview(bytearray(UPLOAD_PIECE_BYTES))  # one buffer, each piece sent before the next
                    with open(p, "rb", buffering=0) as f:
                        while n := f.readinto(buffer):
                            done += n
                            if progress:
                                progress(done, total)
                            yield buffer[:n]
                self._put_body(f"/v1/uploads/{version}/files/{p.name}", p.stat().st_size, body())
        except errors.VersionConflict:
            pass  # published, or being published, meanwhile: the manifest's POST says whether it is this one
        self._post_manifest(manifest, params=delta_query(opts.delta))
        return manifest

    def _publish_to_store(self, manifest: Manifest, files: list[Path], opts: PublishOptions,
                          progress: Progress | None) -> Manifest:
        """Files to the object store first, then the manifest: a version is never visible before
        its bytes are where it says. A delta version's delta files are objects beside its own
        files (:meth:`_store_delta`); the target's files go too (a node without the base takes
        the whole version from the store)."""
        store, to = opts.store or ObjectStoreSettings(), opts.to
        latest = self._call("GET", "/v1/versions/latest")  # fail on a wrong token before uploading gigabytes
        section = self._store_delta(manifest, files[0].parent, latest, to) if opts.delta and to and files else None
        extra = [files[0].parent / f.name for f in section.files] if section is not None else []
        total, done = manifest.total_bytes + (section.total_bytes if section is not None else 0), 0

        def stored(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)
        try:
            publish_files(manifest.source, [*files, *extra], store, stored)
        finally:
            for p in extra:  # never a base: only the target's files are kept
                p.unlink(missing_ok=True)
        reply = self._post_manifest(manifest.with_delta(section) if section is not None else manifest)
        if section is not None and reply.get("delta") is None:
            self._drop_delta_objects(manifest, section, store)
        if opts.prune and to is not None:
            self._prune_after(to, store, manifest.version)
        return manifest

    def _store_delta(self, manifest: Manifest, work: Path, latest: dict, to: str) -> Delta | None:
        """The delta section of ``manifest`` (its files in ``work``, where its delta files are
        written) on the version kept for ``to``, when that is the registry's newest (the same
        number and digest); None: full. The registry decides whether a delta section it is sent
        is published, with the rules it applies to its own (docs/deltas.md: anchors, not worth
        it); what of them is known here first (:meth:`_refuses_delta`) keeps a delta from being
        uploaded at all."""
        base = self._kept.base(to, latest.get("version"), latest.get("digest"))
        if base is None:
            log.info("publish version %d to %s full: no version kept here is the registry's newest (%s)",
                     manifest.version, to, latest.get("version"))
            return None
        began = time.perf_counter()
        try:
            section = encode_delta_files(base, manifest, work)
            with_delta = manifest.with_delta(section)
        except Exception as e:  # a full version is always right: a failed encode costs bytes, never the publish
            log.warning("encode version %d against version %d failed: %s; publish it full", manifest.version,
                        base.manifest.version, e, exc_info=True)
            return None
        log.info("encode version %d against version %d: %d bytes for %d (%.1f%%) in %.2f s", manifest.version,
                 base.manifest.version, section.total_bytes, manifest.total_bytes,
                 100 * section.total_bytes / max(manifest.total_bytes, 1), time.perf_counter() - began)
        if why := self._refuses_delta(with_delta):
            log.info("publish version %d full: %s", manifest.version, why)
            for f in section.files:
                (work / f.name).unlink(missing_ok=True)
            return None
        return section

    def _refuses_delta(self, manifest: Manifest) -> str | None:
        """Why the registry would publish ``manifest`` (an object-store version with a delta
        section) full, when that is known before uploading: the registry's own rules where it runs
        in this process (``why_full``); over HTTP, only a delta no smaller than its version (the
        registry applies its rules to the section it is sent)."""
        if self._why_full is not None:
            return self._why_full(manifest)
        if manifest.delta.total_bytes >= manifest.total_bytes:
            return "its delta is no smaller than it"
        return None

    def _drop_delta_objects(self, manifest: Manifest, section: Delta, store: ObjectStoreSettings) -> None:
        """The registry published ``manifest`` full: its delta files' objects are of no use."""
        log.info("publish version %d: the registry took it full (see its log), so its delta objects go",
                 manifest.version)
        try:
            delete_objects(manifest.source, [f.name for f in section.files], store)
        except ObjectStoreError as e:  # they go with the version's prefix when it is pruned
            log.warning("%s; they go when version %d is pruned", e, manifest.version)

    def _prune_after(self, to: str, store: ObjectStoreSettings, version: int) -> None:
        """Prune after publishing ``version``; a failure costs a warning, never the publish."""
        try:
            self.prune_store(to, store, below=version)  # each version deleted is logged
        except (ObjectStoreError, errors.RegistryError) as e:
            log.warning("prune %s: %s; version %d is published, earlier versions' objects stay until "
                        "the next publish", to, e, version)


# -- in the trainer's process ----------------------------------------------------------------------

def _pieces(buffers: Iterable[memoryview], size: int) -> Iterator[memoryview]:
    for buffer in buffers:
        for start in range(0, len(buffer), size):
            yield buffer[start:start + size]


def _proxied(url: urllib.parse.SplitResult) -> bool:
    """Whether the environment sends requests to ``url`` through a proxy (as httpx would)."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(url.hostname or "")


def delta_query(delta: bool) -> dict[str, str]:
    """The query of ``POST /v1/versions``: ``delta=false`` asks for a full version."""
    return {} if delta else {"delta": "false"}


def _manifest(version: int, files: list[FileEntry], opts: PublishOptions, source: str | None = None) -> Manifest:
    """The sealed manifest of ``files`` published with ``opts``."""
    return Manifest(version=version, hash=opts.hash_name, chunk_bytes=opts.chunk_bytes, files=files,
                    metadata=opts.metadata or {}, canary=opts.canary, partial=opts.partial or None,
                    source=source).sealed()


def _built_manifest(version: int, paths: list[Path], opts: PublishOptions, source: str | None = None) -> Manifest:
    """The sealed manifest of the files at ``paths`` (hashed here) published with ``opts``."""
    return build_manifest(version, paths, chunk_bytes=opts.chunk_bytes, hash_name=opts.hash_name,
                          metadata=opts.metadata, canary=opts.canary, partial=opts.partial, source=source)


def _over_http(name: str) -> Callable[..., Any]:
    """The embedded registry's query ``name``: :class:`RegistryHTTP`'s, on its own service."""
    def query(self: EmbeddedRegistry, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.http, name)(*args, **kwargs)
    query.__name__ = query.__qualname__ = name
    query.__doc__ = getattr(RegistryHTTP, name).__doc__
    return query


class EmbeddedRegistry:
    """A registry service served from a thread of the trainer's process. Publishing writes the
    tensors into the service's store through its staged publish (:meth:`RegistryService.staging`,
    :meth:`RegistryService.publish_staged`); the queries, and publishing to an object store
    (``to``), go over HTTP to that same service, as any client's (:attr:`http`).

    >>> with EmbeddedRegistry(host="0.0.0.0", port=8700, token_file="/etc/rolloutd/registry.token") as reg:
    ...     reg.publish(1, model.state_dict())
    ...     reg.wait_for_replicas(4, min_version=1)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8700, *,
                 clock: Callable[[], float] | None = None, **settings: Any):
        from rolloutd.httpserver import ServerThread
        from rolloutd.registry.app import create_app
        from rolloutd.registry.service import RegistryService
        from rolloutd.registry.settings import RegistrySettings

        self.settings = RegistrySettings(host=host, port=port, **settings)
        self._turn = Turns()  # one publish at a time: versions commit in the order asked
        self._pending: set[PublishHandle] = set()  # asynchronous publishes, cancelled by stop()
        self.service = RegistryService(self.settings, **({"clock": clock} if clock else {}))
        self._thread = ServerThread(create_app(self.service), host, port,
                                    before_shutdown=[self.service.close],
                                    timeout_keep_alive=self.settings.keep_alive_s)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.http = RegistryHTTP(f"http://{shown}:{self._thread.port}", self.service.token,
                                 why_full=self._why_full)

    latest = _over_http("latest")
    manifest = _over_http("manifest")
    versions = _over_http("versions")
    replicas = _over_http("replicas")
    fleet = _over_http("fleet")
    demand = _over_http("demand")
    retire = _over_http("retire")
    replica_counts = _over_http("replica_counts")
    wait_for_replicas = _over_http("wait_for_replicas")
    prune_store = _over_http("prune_store")

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def port(self) -> int:
        return self._thread.port

    def start(self) -> EmbeddedRegistry:
        self._thread.start()
        log.info("serve registry on %s:%d (bytes in %s)", self.settings.host, self.port,
                 self.service.blobs.describe())
        return self

    def stop(self) -> None:
        for handle in list(self._pending):  # a publish under way is dropped, not left half staged
            handle.cancel(timeout_s=30)
        self.close()
        self._thread.stop()

    def close(self) -> None:
        """Close the HTTP client (the service stays up until :meth:`stop`)."""
        self.http.close()

    def __enter__(self) -> EmbeddedRegistry:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def publish(self, version: int, state_dict: Mapping[str, Any], options: PublishOptions | None = None, *,
                progress: Progress | None = None, **fields: Any) -> Manifest:
        """Write each tensor straight into the registry's store (one copy, in the caller's
        thread, hashed as it lands), then publish it on the registry's loop (the registry encodes
        a delta on its own threads). With ``to``, the files go to the object store
        (:meth:`RegistryHTTP.publish`). ``options`` and ``fields``: :class:`PublishOptions`."""
        opts = PublishOptions.of(options, fields)
        if opts.to is not None:
            return self.http.publish(version, state_dict, opts, progress=progress)
        shards = plan_shards(state_dict, opts.shard_bytes)
        with self._turn.mine():
            return self._publish_shards(version, shards, opts, progress=progress)

    def publish_async(self, version: int, state_dict: Mapping[str, Any], options: PublishOptions | None = None, *,
                      snapshot: bool = True, **fields: Any) -> PublishHandle:
        """Publish on a thread of its own; returns a :class:`PublishHandle` at once (``wait``,
        ``cancel``, ``progress``). ``snapshot`` (the default): the tensors are copied to host
        memory first, in the caller's thread (for tensors on an accelerator this is the
        device-to-host copy the publish needs anyway), so the training step may change them as
        soon as this returns. ``snapshot=False``: no copy; the caller must leave the tensors
        unchanged until the handle is done. ``options`` and ``fields``: as for :meth:`publish`,
        without ``to`` (an object store's publish runs in the caller's thread)."""
        opts = PublishOptions.of(options, fields)
        if opts.to is not None:
            raise ValueError("publish_async publishes into the registry's store; publish to an object store "
                             "(to=...) with publish")
        tensors = drop_aliases(checkpoint_tensors(state_dict))
        if snapshot:
            tensors = {name: _host_copy(t) for name, t in tensors.items()}
        shards = plan_shards(tensors, opts.shard_bytes)
        total = sum(nbytes(p.tensor) for shard in shards for p in shard.tensors)

        def run(handle: PublishHandle) -> Manifest:
            return self._publish_shards(version, shards, opts, handle=handle)
        self._pending = {h for h in self._pending if not h.done()}
        handle = PublishHandle(version, total, run, self._turn)
        self._pending.add(handle)
        return handle

    def _publish_shards(self, version: int, shards: list[Shard], opts: PublishOptions, *,
                        progress: Progress | None = None, handle: PublishHandle | None = None) -> Manifest:
        total = sum(nbytes(p.tensor) for shard in shards for p in shard.tensors)  # headers come on top
        done = 0

        def on_bytes(n: int) -> None:
            if handle is not None:
                handle.add(n)
        entries: list[FileEntry] = []
        with self.service.staging(version) as staging:
            for shard in shards:
                staged = staging.view(shard.name, shard.size)
                try:
                    chunks = write_shard(shard, staged.view, opts.chunk_bytes, opts.hash_name, on_bytes=on_bytes,
                                         cancelled=handle.cancelled if handle else None)
                    staged.finish()
                except BaseException:
                    staged.abort()
                    raise
                entries.append(FileEntry(name=shard.name, size=shard.size, chunks=chunks))
                done += sum(nbytes(p.tensor) for p in shard.tensors)
                if progress:
                    progress(min(total, done), total)
            manifest = _manifest(version, entries, opts)
            if handle is not None:
                handle.set_state(PublishState.COMMITTING)  # refused once a cancel came
            self._publish_staged(manifest, verify=False, delta=opts.delta)  # hashed from these very bytes
        return manifest

    def publish_dir(self, version: int, path: Path, options: PublishOptions | None = None, *,
                    progress: Progress | None = None, **fields: Any) -> Manifest:
        """Copy the ``*.safetensors`` files of ``path`` into the registry's store and publish them,
        each copy checked against the manifest hashed from the originals. With ``to``:
        :meth:`RegistryHTTP.publish_dir`. ``options`` and ``fields``: :class:`PublishOptions`."""
        opts = PublishOptions.of(options, fields)
        if opts.to is not None:
            return self.http.publish_dir(version, path, opts, progress=progress)
        files = safetensors_files(path)
        with self._turn.mine(), self.service.staging(version) as staging:
            manifest = _built_manifest(version, files, opts)
            done = 0
            for p in files:
                staging.copy(p)
                done += p.stat().st_size
                if progress:
                    progress(done, manifest.total_bytes)
            self._publish_staged(manifest, verify=True, delta=opts.delta)  # the copies are checked, not trusted
        return manifest

    def _publish_staged(self, manifest: Manifest, *, verify: bool, delta: bool) -> None:
        """The service's staged publish, on its loop."""
        self._thread.call(self.service.publish_staged(manifest, verify=verify, delta=delta))

    def _why_full(self, manifest: Manifest) -> str | None:
        """The registry's own delta rules, asked on its loop before the delta files are uploaded."""
        async def ask() -> str | None:
            return self.service.why_full_sent(manifest, True)
        return self._thread.call(ask())


def _host_copy(t: Any) -> Any:
    """A copy in host memory, contiguous, that the caller's later changes do not reach."""
    if type(t).__module__.startswith("torch"):
        import torch
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        out.copy_(t.detach())  # from an accelerator: the device-to-host copy
        return out
    import numpy as np
    return np.array(t, copy=True, order="C")
