"""The trainer's writes to an object store (S3 API): a version's files put under a ``to``, the
objects of versions done with deleted, and the last version put under each ``to`` kept on local
disk as the base of the next one's delta. The settings, sources and buckets are
:mod:`rolloutd.objstore`'s, which the nodes share.

Contract:

- :func:`publish_files` puts version ``v`` under ``<to>/<v>`` (:func:`version_source`), so one
  ``to`` serves every version.
- The registry holds no credentials, so the trainer deletes what it put there:
  :func:`prune_versions` removes the ``<to>/<n>/`` prefixes it is told are done with (a delta
  version's delta files with the rest: they are objects under the same prefix); any other key
  under ``to`` is left alone.
- Delta versions (docs/deltas.md): the registry holds none of these bytes, so the trainer's
  publisher encodes. :class:`KeptVersions` keeps on local disk the files of the last version it
  put under each ``to`` (one version per ``to``); :func:`encode_delta_files` writes the next
  version's delta files against them, which go to the bucket beside the target's files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rolloutd.objstore import ObjectStoreError, ObjectStoreSettings, object_key, open_bucket, parse_source, short_error
from rolloutd.units import size
from rolloutd.wire.manifest import Delta, DeltaFile, Manifest, hash_chunks

log = logging.getLogger("rolloutd.objstore")

UPLOAD_PART_BYTES = 64 << 20  # multipart upload part size (S3 takes 5 MiB .. 5 GiB)


def version_source(to: str, version: int) -> str:
    """The source of ``version`` published under ``to``: ``<to>/<version>``."""
    parse_source(to)
    return f"{to.rstrip('/')}/{version}"


def publish_files(source: str, files: Iterable[Path], settings: ObjectStoreSettings,
                  progress: Callable[[int], None] | None = None) -> None:
    """Upload every file to ``source`` (multipart for large ones). ``progress(n)`` gets the
    bytes of each file once it is stored."""
    import obstore

    bucket, prefix = parse_source(source)
    store = open_bucket(bucket, settings)
    for path in files:
        key = object_key(prefix, path.name)
        try:
            with open(path, "rb") as f:
                obstore.put(store, key, f, chunk_size=UPLOAD_PART_BYTES)
        except Exception as e:  # obstore raises its own classes (PermissionDeniedError, GenericError, ...)
            raise ObjectStoreError(f"upload {path.name} to {source}: {short_error(e)}") from None
        log.info("upload %s to %s/%s (%d bytes)", path.name, source, path.name, path.stat().st_size)
        if progress is not None:
            progress(path.stat().st_size)


def delete_objects(source: str, names: Iterable[str], settings: ObjectStoreSettings) -> None:
    """Delete the objects ``<prefix>/<name>`` of ``source`` (absent ones are no error)."""
    import obstore

    bucket, prefix = parse_source(source)
    keys = [object_key(prefix, name) for name in names]
    try:
        obstore.delete(open_bucket(bucket, settings), keys)
    except Exception as e:  # obstore's own classes
        raise ObjectStoreError(f"delete {len(keys)} objects under {source}: {short_error(e)}") from None


def prune_versions(to: str, doomed: Callable[[int], bool], settings: ObjectStoreSettings) -> list[int]:
    """Delete the objects under ``<to>/<n>/`` for every version ``n`` that has some and for
    which ``doomed(n)`` is true; returns those versions. Keys under ``to`` that are not in a
    ``<n>/`` prefix are left alone. One listing of ``to`` (objects, not directories: some
    S3 services keep a prefix listed after its last object is gone)."""
    import obstore

    bucket, prefix = parse_source(to)
    store = open_bucket(bucket, settings)
    by_version: dict[int, list[dict]] = {}
    try:
        for batch in obstore.list(store, prefix or None, chunk_size=1000):
            for meta in batch:
                name, inside, _ = meta["path"][len(prefix):].lstrip("/").partition("/")
                if inside and name.isdigit() and name == str(int(name)) and doomed(int(name)):
                    by_version.setdefault(int(name), []).append(meta)
        for version, metas in sorted(by_version.items()):
            obstore.delete(store, [m["path"] for m in metas])
            n = len(metas)
            log.info("delete %s/%d (%d object%s, %s)", to.rstrip("/"), version, n, "" if n == 1 else "s",
                     size(sum(m["size"] for m in metas)))
    except Exception as e:  # obstore's own classes
        raise ObjectStoreError(f"prune {to}: {short_error(e)}") from None
    return sorted(by_version)




# -- delta versions: the publisher encodes ---------------------------------------------------------

@dataclass(frozen=True)
class Kept:
    """A version published under a ``to``, its files in ``directory`` (the target's, as hashed)."""

    manifest: Manifest
    directory: Path


class KeptVersions:
    """The files of the last version this publisher put under each ``to``, on local disk: the
    base its next version there is encoded against (one version per ``to``: its full size on
    disk, plus the next one's while that is published). The files are those the object store's
    client uploaded from (``workdir``); they go with :meth:`close`, the object, or the
    interpreter's exit. A publisher without one (a new process) publishes its next version full."""

    def __init__(self) -> None:
        self._kept: dict[str, Kept] = {}
        self._lock = threading.Lock()
        # A trainer that never calls close() must not leave a version per run in TMPDIR.
        self._finalizer = weakref.finalize(self, _remove_kept, self._kept, self._lock)

    @staticmethod
    def workdir(version: int) -> Path:
        """A new private directory for the files of ``version`` (in ``TMPDIR``)."""
        return Path(tempfile.mkdtemp(prefix=f"rolloutd-v{version}-"))

    def base(self, to: str, version: int | None, digest: str | None) -> Kept | None:
        """The version kept for ``to`` if it is ``version`` with ``digest`` (the registry's newest)."""
        with self._lock:
            kept = self._kept.get(_to_key(to))
        if kept is None or (kept.manifest.version, kept.manifest.digest) != (version, digest):
            return None
        return kept

    def keep(self, to: str, manifest: Manifest, directory: Path) -> None:
        """``manifest`` (its files in ``directory``, which this now owns) is the version kept for
        ``to``; the one kept before is deleted."""
        with self._lock:
            old = self._kept.get(_to_key(to))
            self._kept[_to_key(to)] = Kept(manifest.target(), directory)
        if old is not None and old.directory != directory:
            shutil.rmtree(old.directory, ignore_errors=True)

    def close(self) -> None:
        _remove_kept(self._kept, self._lock)


def _remove_kept(kept: dict[str, Kept], lock: threading.Lock) -> None:
    with lock:
        gone = list(kept.values())
        kept.clear()
    for k in gone:
        shutil.rmtree(k.directory, ignore_errors=True)


def _to_key(to: str) -> str:
    return to.rstrip("/")


def encode_delta_files(base: Kept, manifest: Manifest, directory: Path, *, encoding: str | None = None,
                       threads: int | None = None) -> Delta:
    """Write the delta files of ``manifest`` (its files in ``directory``) against ``base`` into
    ``directory`` and return the delta section. The byte work runs in threads (zstandard and
    numpy let go of the interpreter lock)."""
    from rolloutd.registry.blobs import map_file
    from rolloutd.wire.delta import DEFAULT_ENCODING, delta_file_name, encode_file, removed_tensors

    encoding = encoding or DEFAULT_ENCODING
    workers = threads or max(2, min(8, os.cpu_count() or 2))
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="publish-delta"))
        bases = {f.name: stack.enter_context(map_file(base.directory / f.name)) for f in base.manifest.files}
        targets = {f.name: stack.enter_context(map_file(directory / f.name)) for f in manifest.files}
        taken, files = set(targets), []
        try:
            for f in manifest.files:
                name = delta_file_name(f.name, taken)
                taken.add(name)
                with open(directory / name, "wb") as out:
                    encode_file(bases, targets[f.name], out, encoding=encoding, pool=pool, target_name=f.name)
                with map_file(directory / name) as view:
                    files.append(DeltaFile(name=name, size=len(view), target=f.name,
                                           chunks=hash_chunks(view, manifest.chunk_bytes, manifest.hash, pool)))
        except BaseException:  # none left beside the target's files, which may be kept as a base
            for name in taken - set(targets):
                (directory / name).unlink(missing_ok=True)
            raise
        removed = removed_tensors(bases, targets)
    return Delta(base_version=base.manifest.version, base_digest=base.manifest.digest, encoding=encoding,
                 files=files, removed=removed)
