"""Trainer-side library: publish versions, demand them, and watch the replicas.

``RegistryHTTP`` talks to any registry over HTTP (a non-Python trainer can do the same with
the documented routes). ``EmbeddedRegistry`` runs the registry inside the trainer's process
and publishes by writing straight into its store, without a round trip over HTTP.
torch is imported only by :func:`save_shards`, when a state dict holds torch tensors.
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from rolloutd.objstore import ObjectStoreSettings, publish_files, version_source
from rolloutd.wire import errors
from rolloutd.wire.manifest import (
    DEFAULT_CHUNK_BYTES,
    MAX_VERSION,
    Canary,
    FileEntry,
    Manifest,
    build_manifest,
    hash_chunks,
    safetensors_files,
)

log = logging.getLogger("rolloutd.publish")

DEFAULT_SHARD_BYTES = 5 << 30  # Hugging Face's usual shard size
UPLOAD_PIECE_BYTES = 4 << 20
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


# -- state dicts to safetensors files, in layer order ---------------------------------------------

_LAYER_RE = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


def layer_key(name: str) -> tuple[int, int, str]:
    """Sort key that puts embeddings first, then layers by index, then everything else."""
    m = _LAYER_RE.search(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0, 0, name) if "embed" in name else (2, 0, name)


def shard_plan(sizes: Mapping[str, int], shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in layer order, into shards of at most ``shard_bytes`` (a bigger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes, key=layer_key):
        if shards[-1] and used + sizes[name] > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if hasattr(t, "element_size") else t.nbytes


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _serialize(tensors: dict[str, Any]) -> bytes:
    first = next(iter(tensors.values()))
    if _is_torch(first):
        from safetensors.torch import save  # the only place the trainer side touches torch
        return save(_own_storage(tensors))
    from safetensors.numpy import save as np_save
    return np_save({k: _np_contiguous(v) for k, v in tensors.items()})


def _own_storage(tensors: dict[str, Any]) -> dict[str, Any]:
    """Detached CPU tensors that safetensors can write: non-contiguous ones made contiguous, and
    views sharing storage with an earlier tensor (q/k/v sliced from one fused weight) copied,
    since safetensors refuses tensors that share memory."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _np_contiguous(a: Any) -> Any:
    import numpy as np
    return np.ascontiguousarray(a)


def _alias_key(t: Any) -> tuple | None:
    """What makes two torch tensors one tensor under two names (tied embeddings)."""
    if not _is_torch(t) or t.device.type == "meta":
        return None
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def drop_aliases(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each tensor once: a model with tied embeddings lists one tensor as
    ``model.embed_tokens.weight`` and ``lm_head.weight``; the name first in layer order stays,
    as in Hugging Face's own checkpoints (the plugin loads it under both names)."""
    first: dict[tuple, str] = {}
    out = {}
    for name in sorted(state_dict, key=layer_key):
        key = _alias_key(state_dict[name])
        if key is not None and key in first:
            log.debug("publish: %s is %s (tied): written once", name, first[key])
            continue
        if key is not None:
            first[key] = name
        out[name] = state_dict[name]
    return out


def checkpoint_tensors(source: Any) -> Mapping[str, Any]:
    """The tensors to publish, by checkpoint name. A mapping is taken as it is. A model (anything
    with ``state_dict()``) gives its state dict in the layout its checkpoints have: transformers
    >= 5 keeps some weights fused in memory (a mixture-of-experts layer's experts as one
    tensor, ``mlp.experts.gate_up_proj``) that ``save_pretrained`` splits back into the
    per-expert tensors that checkpoints, and vLLM's loaders, know."""
    if isinstance(source, Mapping):
        return source
    state_dict = dict(source.state_dict())
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # not a transformers model, or a transformers without in-memory layouts
        return state_dict
    return revert_weight_conversion(source, state_dict)


def serialize_shards(state_dict: Mapping[str, Any] | Any, shard_bytes: int = DEFAULT_SHARD_BYTES
                     ) -> Iterator[tuple[str, bytes]]:
    """(file name, safetensors bytes) per shard; torch tensors (any dtype, strides or device;
    tied ones written once) or numpy arrays, or a model (:func:`checkpoint_tensors`)."""
    state_dict = drop_aliases(checkpoint_tensors(state_dict))
    if not state_dict:
        raise ValueError("state_dict is empty")
    plan = shard_plan({k: _nbytes(v) for k, v in state_dict.items()}, shard_bytes)
    for fname, names in zip(shard_names(len(plan)), plan, strict=True):
        yield fname, _serialize({n: state_dict[n] for n in names})


def save_shards(state_dict: Mapping[str, Any], directory: Path,
                shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for fname, data in serialize_shards(state_dict, shard_bytes):
        (directory / fname).write_bytes(data)
        paths.append(directory / fname)
    return paths


# -- over HTTP ----------------------------------------------------------------------------------------

class RegistryHTTP:
    """A synchronous client for the trainer (the daemon uses the async ``client``)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw) -> Any:
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
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None

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
                          poll_s: float = 0.5, state: str = "SERVING", max_age_s: float = 30.0) -> list[dict]:
        """Block until ``n`` replicas heard from within ``max_age_s`` report ``state`` at
        ``min_version`` or newer; returns them. Polls the counts, not the whole directory,
        so a large fleet costs the registry next to nothing while the trainer waits."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.replica_counts(max_age_s)
            ready = sum(c["count"] for c in counts if c["state"] == state and (c["version"] or 0) >= min_version)
            if ready >= n:
                return [r for r in self.replicas() if r["state"] == state and (r["version"] or 0) >= min_version
                        and r["age_s"] <= max_age_s]
            if time.monotonic() >= deadline:
                seen = ", ".join(f"{c['count']} {c['state']}@{c['version']}" for c in counts) or "none"
                raise TimeoutError(f"{ready} of {n} replicas {state} at version >= {min_version} "
                                   f"after {timeout_s} s (seen: {seen})")
            time.sleep(poll_s)

    # -- publishing --------------------------------------------------------------------------------
    def publish(self, version: int, state_dict: Mapping[str, Any], *,
                shard_bytes: int = DEFAULT_SHARD_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                metadata: dict[str, str] | None = None, progress: Progress | None = None,
                canary: Canary | None = None, partial: bool = False, to: str | None = None,
                store: ObjectStoreSettings | None = None) -> Manifest:
        """Publish a state dict (torch tensors or numpy arrays, HF names) as ``version``; or a
        model, whose weights are taken in checkpoint layout (:func:`checkpoint_tensors`).
        ``to`` and ``store``: as for :meth:`publish_dir`."""
        with tempfile.TemporaryDirectory(prefix=f"rolloutd-v{version}-") as tmp:
            save_shards(state_dict, Path(tmp), shard_bytes)
            return RegistryHTTP.publish_dir(self, version, Path(tmp), chunk_bytes=chunk_bytes,
                                            metadata=metadata, progress=progress, canary=canary,
                                            partial=partial, to=to, store=store)

    def publish_dir(self, version: int, path: Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    metadata: dict[str, str] | None = None, progress: Progress | None = None,
                    canary: Canary | None = None, partial: bool = False, to: str | None = None,
                    store: ObjectStoreSettings | None = None) -> Manifest:
        """Publish the ``*.safetensors`` files of ``path``: upload each, then the manifest.
        Publishing the same bytes again is a no-op, so a retry after a lost reply is safe.
        ``canary`` (:func:`~rolloutd.registry.canary.make_canary`) is checked by every server
        that loads the version before it takes traffic again. ``partial``: the files carry only
        some of the model's tensors on purpose; the rest keeps its weights (without it, a version
        that lacks a tensor of the served model fails to load, naming it).

        ``to="s3://bucket/prefix"``: the files go to the object store under ``<prefix>/<version>/``
        instead of the registry, which keeps the manifest (naming that source), the leases and
        the version's lifecycle; ``store`` says where the S3 service is and which file holds
        the credentials (:class:`~rolloutd.objstore.ObjectStoreSettings`). The registry never
        deletes objects: a bucket lifecycle rule, or the trainer, removes retired versions."""
        files = safetensors_files(path)
        source = version_source(to, version) if to is not None else None
        manifest = build_manifest(version, files, chunk_bytes=chunk_bytes, metadata=metadata, canary=canary,
                                  partial=partial, source=source)
        try:
            if self.manifest(version).digest == manifest.digest:
                return manifest
        except (errors.VersionUnknown, errors.VersionRetired):
            pass
        if source is not None:
            return self._publish_to_store(manifest, files, store or ObjectStoreSettings(), progress)
        total, done = manifest.total_bytes, 0
        for p in files:
            def body(p=p) -> Iterator[bytes]:
                nonlocal done
                with open(p, "rb") as f:
                    while piece := f.read(UPLOAD_PIECE_BYTES):
                        done += len(piece)
                        if progress:
                            progress(done, total)
                        yield piece
            self._call("PUT", f"/v1/uploads/{version}/files/{p.name}", content=body(),
                       headers={"content-length": str(p.stat().st_size)})
        self._call("POST", "/v1/versions", content=manifest.model_dump_json(),
                   headers={"content-type": "application/json"})
        return manifest

    def _publish_to_store(self, manifest: Manifest, files: list[Path], store: ObjectStoreSettings,
                          progress: Progress | None) -> Manifest:
        """Files to the object store first, then the manifest: a version is never visible before
        its bytes are where it says."""
        self._call("GET", "/v1/versions/latest")  # fail on a wrong token before uploading gigabytes
        done = 0

        def stored(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, manifest.total_bytes)
        publish_files(manifest.source, files, store, stored)
        self._call("POST", "/v1/versions", content=manifest.model_dump_json(),
                   headers={"content-type": "application/json"})
        return manifest


# -- in the trainer's process ----------------------------------------------------------------------

class EmbeddedRegistry(RegistryHTTP):
    """A registry served from a thread of the trainer's process.

    >>> with EmbeddedRegistry(host="0.0.0.0", port=8700) as reg:
    ...     reg.publish(1, model.state_dict())
    ...     reg.wait_for_replicas(4, min_version=1)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8700, *,
                 clock: Callable[[], float] | None = None, **settings: Any):
        from rolloutd.httpserver import ServerThread
        from rolloutd.registry.server.app import create_app
        from rolloutd.registry.server.service import RegistryService
        from rolloutd.registry.server.settings import RegistrySettings

        self.settings = RegistrySettings(host=host, port=port, **settings)
        self.service = RegistryService(self.settings, **({"clock": clock} if clock else {}))
        self._thread = ServerThread(create_app(self.service), host, port,
                                    before_shutdown=[self.service.close],
                                    timeout_keep_alive=self.settings.keep_alive_s)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        super().__init__(f"http://{shown}:{self._thread.port}", self.service.token)

    @property
    def port(self) -> int:
        return self._thread.port

    def start(self) -> EmbeddedRegistry:
        self._thread.start()
        log.info("serve registry on %s:%d (bytes in %s)", self.settings.host, self.port,
                 self.service.blobs.describe())
        return self

    def stop(self) -> None:
        self.close()
        self._thread.stop()

    def __enter__(self) -> EmbeddedRegistry:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def publish(self, version: int, state_dict: Mapping[str, Any], *,
                shard_bytes: int = DEFAULT_SHARD_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                metadata: dict[str, str] | None = None, progress: Progress | None = None,
                canary: Canary | None = None, partial: bool = False, to: str | None = None,
                store: ObjectStoreSettings | None = None) -> Manifest:
        """Serialize, hash and stage shard by shard in the caller's thread (one shard in
        memory at a time), then publish on the registry's loop. With ``to``, the files go to
        the object store (:meth:`RegistryHTTP.publish_dir`)."""
        if to is not None:
            return super().publish(version, state_dict, shard_bytes=shard_bytes, chunk_bytes=chunk_bytes,
                                   metadata=metadata, progress=progress, canary=canary, partial=partial,
                                   to=to, store=store)
        state_dict = drop_aliases(checkpoint_tensors(state_dict))
        total = sum(_nbytes(t) for t in state_dict.values())  # tensor bytes; headers come on top
        entries: list[FileEntry] = []
        with self._staging(version):
            for name, data in serialize_shards(state_dict, shard_bytes):
                entries.append(FileEntry(name=name, size=len(data),
                                         chunks=hash_chunks(data, chunk_bytes, "xxh3-128")))
                self.service.blobs.stage_bytes(version, name, data)
                if progress:
                    progress(min(total, sum(e.size for e in entries)), total)
            manifest = Manifest(version=version, chunk_bytes=chunk_bytes, files=entries,
                                metadata=metadata or {}, canary=canary,
                                partial=partial or None).sealed()
            self._commit(manifest)  # hashed from these very bytes
        return manifest

    def publish_dir(self, version: int, path: Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    metadata: dict[str, str] | None = None, progress: Progress | None = None,
                    canary: Canary | None = None, partial: bool = False, to: str | None = None,
                    store: ObjectStoreSettings | None = None) -> Manifest:
        if to is not None:
            return super().publish_dir(version, path, chunk_bytes=chunk_bytes, metadata=metadata,
                                       progress=progress, canary=canary, partial=partial, to=to, store=store)
        files = safetensors_files(path)
        with self._staging(version):
            manifest = build_manifest(version, files, chunk_bytes=chunk_bytes, metadata=metadata, canary=canary,
                                  partial=partial)
            done = 0
            for p in files:
                self.service.blobs.stage_file(version, p)
                done += p.stat().st_size
                if progress:
                    progress(done, manifest.total_bytes)
            self._commit(manifest, verify=True)  # the copies are checked, not trusted
        return manifest

    @contextlib.contextmanager
    def _staging(self, version: int) -> Iterator[None]:
        """Stage a version's bytes; on any failure nothing of it is left behind."""
        self._check_new(version)
        try:
            yield
        except BaseException:
            self.service.blobs.discard_staging(version)
            raise

    def _check_new(self, version: int) -> None:
        """Fail before any work for a number that can never be published (an existing
        number may still be an identical, no-op re-publish: that is decided on commit)."""
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
            raise errors.InvalidRequest(f"version must be an integer from 1 to {MAX_VERSION}, got {version!r:.100}")
        try:
            self.service.store.check_new_number(version)
        except errors.VersionConflict:
            pass

    def _commit(self, manifest: Manifest, verify: bool = False) -> None:
        service = self.service

        async def publish_staged() -> None:
            if service.store.check_publishable(manifest):
                service.blobs.discard_staging(manifest.version)  # the same bytes are published already
                return
            await service.publish(manifest, verify=verify)

        self._thread.call(publish_staged())
