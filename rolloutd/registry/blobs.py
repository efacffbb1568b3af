"""Where a registry keeps version bytes: in memory, or in a directory on disk.

Both stores follow one rule: bytes are *staged* per version while they arrive, and only
``commit`` makes them part of a version, in one atomic step. On disk::

    <root>/staging/<v>/<name>          uploaded files (each written as .<name>.<rand>.part, then renamed;
                                       a file name never starts with '.', so the two never meet)
    <root>/versions/<v>/<name>         committed files
    <root>/versions/<v>/manifest.json  written before the rename, so a version dir is always complete
    <root>/trash/                      versions and dropped staging being deleted (renamed away
                                       first, never half-visible)

A disk store reloads its committed versions at start; staging and trash are cleared. A commit
whose staged files are not all there (dropped before or while it runs) raises
:class:`StagingDropped`: a version without its bytes is never made.
``reclaim`` and ``discard_staging`` are called on the service's event loop: they only rename
(one quick step, the bytes gone from view at once); the store's own worker thread deletes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from rolloutd.wire.manifest import FileEntry, Manifest, bad_chunks, verify_file

log = logging.getLogger("rolloutd.registry")

# Letting go of memory takes time in proportion to its size (docs/data-path.md, "Memory let go
# of off the loop"): a large version reclaimed on the event loop would hold every heartbeat past
# its timeout. A memory store's bytes are let go of on this thread instead.
_FREER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-free")


def let_go(held: dict | list) -> None:
    """Drop what ``held`` holds (the last references to blobs, memory files or mappings) on the
    freeing thread, not the caller's."""
    _on_freer(held.clear)


def _on_freer(fn: Callable[..., object], *args) -> None:
    try:
        _FREER.submit(fn, *args)
    except RuntimeError:  # the interpreter is shutting down: no new thread work, do it here
        fn(*args)


# One read per streamed piece: larger pieces cost less per byte served, up to a size past which
# they were slower again (bench/README.md, "What made it faster, and what would next").
READ_BYTES = 4 << 20
IOV_MAX = os.sysconf("SC_IOV_MAX")


class Blob(Protocol):
    size: int

    def open_reader(self) -> BlobReader: ...


class BlobReader(Protocol):
    blocking: bool  # reads may wait on a disk: run them off the event loop

    def read(self, offset: int, length: int) -> bytes | memoryview: ...
    def close(self) -> None: ...


class Upload(Protocol):
    """One file arriving for a staged version; invisible until ``finish``. ``sync`` makes the
    bytes durable (the slow part); ``finish`` then puts the file in place in one quick step, or
    raises :class:`StagingDropped`."""

    def write(self, pieces: Sequence[bytes]) -> None: ...  # in order, after the bytes before
    def sync(self) -> None: ...
    def finish(self) -> int: ...
    def abort(self) -> None: ...


class Staged(Protocol):
    """A file of a staged version written in place (the trainer's own process publishing):
    ``view`` is the whole file, writable; ``finish`` makes the bytes durable and puts the file
    in place, or raises :class:`StagingDropped`; ``abort`` throws it away."""

    view: memoryview

    def finish(self) -> None: ...
    def abort(self) -> None: ...


class StagingDropped(Exception):
    """The version's staged files were dropped while a file was arriving for it."""


async def stream_range(blob: Blob, start: int, end: int, piece: int = READ_BYTES
                       ) -> AsyncIterator[bytes | memoryview]:
    """Bytes [start, end) of ``blob`` in pieces, for a response body. Memory is served as
    views without a copy; disk reads run in a thread, so a cold disk never stalls the loop.
    The reader stays open for the whole range: a version reclaimed meanwhile still finishes
    streaming to this reader."""
    reader = blob.open_reader()
    try:
        pos = start
        while pos < end:
            n = min(piece, end - pos)
            data = await asyncio.to_thread(reader.read, pos, n) if reader.blocking else reader.read(pos, n)
            if not data:
                raise OSError(f"short read at offset {pos}")
            pos += len(data)
            yield data
    finally:
        reader.close()


# -- memory ------------------------------------------------------------------------------------

@dataclass
class MemoryBlob:
    data: bytes | bytearray | mmap.mmap

    @property
    def size(self) -> int:
        return len(self.data)

    def open_reader(self) -> _MemoryReader:
        return _MemoryReader(memoryview(self.data))


class _MemoryReader:
    blocking = False

    def __init__(self, view: memoryview):
        self._view = view

    def read(self, offset: int, length: int) -> memoryview:
        return self._view[offset:offset + length]

    def close(self) -> None:
        pass  # slices may still be queued for sending: they keep the bytes alive


def _anonymous(size: int) -> mmap.mmap | bytearray:
    """Memory for a file of ``size`` bytes: mapped pages the kernel zero-fills on first write
    (no pass over them now), never moved as a growing buffer would be."""
    return mmap.mmap(-1, size) if size else bytearray()


class _MemoryFile:
    """An upload's ``size`` bytes in an anonymous in-memory file (memfd), written by ``pwritev``:
    no interpreter lock held, and cheaper than faulting in fresh mapped pages (docs/data-path.md,
    "Memory store: a memory file"); ``done`` maps it for the version's blob to read from."""

    def __init__(self, size: int):
        self.size = size
        self._fd = os.memfd_create("rolloutd-blob", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise

    def pwritev(self, pieces: Sequence[bytes], offset: int) -> int:
        return _write_pieces(lambda batch, done: os.pwritev(self._fd, batch, offset + done), pieces)

    def done(self) -> mmap.mmap | bytearray:
        """The bytes, mapped; this descriptor is closed (Python's mmap holds one of its own until
        the mapping is closed or collected: one per blob held)."""
        try:
            return mmap.mmap(self._fd, self.size) if self.size else bytearray()
        finally:
            os.close(self._fd)  # quick: the mapping holds the pages
            self._fd = -1

    def drop(self) -> None:
        """Close the memory file, its pages with it: on the freeing thread."""
        if self._fd >= 0:
            _on_freer(os.close, self._fd)
            self._fd = -1


def _write_pieces(write: Callable[[Sequence[bytes], int], int], pieces: Sequence[bytes]) -> int:
    """Every byte of ``pieces``, in order, through ``write(batch, bytes done so far) -> n``
    (``writev``, ``pwritev``): one system call per ``IOV_MAX`` pieces, no copy to join them,
    resumed after a short write."""
    done, i, skip = 0, 0, 0
    while i < len(pieces):
        batch = [memoryview(pieces[i])[skip:], *pieces[i + 1:i + IOV_MAX]] if skip else pieces[i:i + IOV_MAX]
        n = write(batch, done)
        done += n
        n += skip
        while i < len(pieces) and n >= len(pieces[i]):
            n -= len(pieces[i])
            i += 1
        skip = n
    return done


class _MemoryUpload:
    """An upload into memory: with its size known, written in place into a memory file of that
    size; without (a chunked body), gathered in a growing buffer."""

    def __init__(self, staging: dict[int, dict[str, bytearray]], version: int, name: str, size: int | None):
        self._staging, self._version, self._name = staging, version, name
        self._slot = staging.setdefault(version, {})
        self._size, self._at = size, 0
        self._file = _MemoryFile(size) if size is not None else None
        self._buf = bytearray()

    def write(self, pieces: Sequence[bytes]) -> None:
        n = sum(len(p) for p in pieces)
        if self._file is None:
            for p in pieces:
                self._buf += p
        elif self._at + n > self._size:
            raise StagingDropped(f"{self._name}: more bytes than the {self._size} declared")
        else:
            self._file.pwritev(pieces, self._at)
        self._at += n

    def sync(self) -> None:
        pass

    def finish(self) -> int:
        if self._staging.get(self._version) is not self._slot:
            raise StagingDropped(f"the staged files of version {self._version} were dropped meanwhile")
        if self._size is not None and self._at != self._size:
            raise StagingDropped(f"{self._name}: {self._at} bytes of the {self._size} declared")
        self._slot[self._name] = self._file.done() if self._file is not None else self._buf
        return self._at

    def abort(self) -> None:
        if self._file is not None:
            self._file.drop()
        self._buf = bytearray()


class _MemoryStaged:
    """A file the trainer's own process writes in place, in anonymous memory: a memory file, as
    uploads use, was not clearly faster for a copy through a mapping (within this machine's
    noise, bench/publish.py) and would hold a descriptor per blob."""

    def __init__(self, staging: dict[int, dict[str, bytearray]], version: int, name: str, size: int):
        self._staging, self._version, self._name = staging, version, name
        self._slot = staging.setdefault(version, {})
        self._buf = _anonymous(size)
        self.view = memoryview(self._buf)

    def finish(self) -> None:
        self.view.release()
        if self._staging.get(self._version) is not self._slot:
            raise StagingDropped(f"the staged files of version {self._version} were dropped meanwhile")
        self._slot[self._name] = self._buf

    def abort(self) -> None:
        self.view.release()
        self._buf = bytearray()


class MemoryStore:
    """Bytes held in this process's memory (embedded registries, tests, small models)."""

    def __init__(self) -> None:
        self._staging: dict[int, dict[str, bytearray]] = {}

    def describe(self) -> str:
        return "memory"

    def upload(self, version: int, name: str, size: int | None = None) -> Upload:
        return _MemoryUpload(self._staging, version, name, size)

    def stage_view(self, version: int, name: str, size: int) -> Staged:
        return _MemoryStaged(self._staging, version, name, size)

    def read_staged(self, version: int, name: str, offset: int, length: int) -> bytes:
        try:
            return bytes(self._staging[version][name][offset:offset + length])
        except KeyError:
            raise StagingDropped(f"version {version}: {name} no longer staged") from None

    def stage_bytes(self, version: int, name: str, data: bytes | bytearray) -> None:
        self._staging.setdefault(version, {})[name] = bytearray(data) if isinstance(data, bytes) else data

    @contextlib.contextmanager
    def staged_view(self, version: int, name: str) -> Iterator[memoryview]:
        """A staged file's bytes, read-only, without a copy."""
        try:
            data = self._staging[version][name]
        except KeyError:
            raise StagingDropped(f"version {version}: {name} no longer staged") from None
        yield memoryview(data).toreadonly()

    def stage_output(self, version: int, name: str) -> StagedOutput:
        return _MemoryOutput(self._staging, version, name)

    def stage_file(self, version: int, path: Path) -> None:
        self.stage_bytes(version, path.name, path.read_bytes())

    def staged_sizes(self, version: int) -> dict[str, int]:
        return {n: len(b) for n, b in self._staging.get(version, {}).items()}

    def verify_staged(self, manifest: Manifest) -> dict[str, list[int]]:
        staged = self._staged_files(manifest)
        return {f.name: bad for f in manifest.files
                if (bad := bad_chunks(memoryview(staged[f.name]), f, manifest))}

    def commit(self, manifest: Manifest) -> dict[str, Blob]:
        if manifest.source is not None:  # bytes in an object store: nothing of them here
            self._staging.pop(manifest.version, None)
            return {}
        staged = self._staged_files(manifest)
        self._staging.pop(manifest.version, None)
        return {f.name: MemoryBlob(staged[f.name]) for f in keep_entries(manifest)}

    def _staged_files(self, manifest: Manifest) -> dict[str, bytearray]:
        """The version's staged files; StagingDropped when one the manifest lists is gone."""
        staged = self._staging.get(manifest.version, {})
        if missing := [f.name for f in keep_entries(manifest) if f.name not in staged]:
            raise StagingDropped(f"version {manifest.version}: {', '.join(missing[:5])} no longer staged")
        return staged

    def discard_staging(self, version: int) -> None:
        let_go(self._staging.pop(version, {}))

    def reclaim(self, version: int, blobs: dict[str, Blob]) -> None:
        let_go(blobs)  # readers still streaming keep theirs until they end

    def load_committed(self) -> list[tuple[Manifest, dict[str, Blob]]]:
        return []


# -- disk --------------------------------------------------------------------------------------

@dataclass
class DiskBlob:
    path: Path
    size: int

    def open_reader(self) -> _DiskReader:
        return _DiskReader(os.open(self.path, os.O_RDONLY))


class _DiskReader:
    blocking = True

    def __init__(self, fd: int):
        self._fd = fd

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def close(self) -> None:
        os.close(self._fd)


def _part_path(final: Path) -> Path:
    """Where ``final`` is written first: hidden, so never taken for a staged file of that name."""
    return final.with_name(f".{final.name}.{secrets.token_hex(4)}.part")


class _DiskUpload:
    def __init__(self, final: Path):
        self._final = final
        self._part = _part_path(final)
        self._f = open(self._part, "wb", buffering=0)

    def write(self, pieces: Sequence[bytes]) -> None:
        _write_pieces(lambda batch, _: os.writev(self._f.fileno(), batch), pieces)

    def sync(self) -> None:
        if not self._f.closed:
            os.fsync(self._f.fileno())  # a committed version must survive a crash of the host
            self._f.close()

    def finish(self) -> int:
        self.sync()
        try:
            os.replace(self._part, self._final)
        except FileNotFoundError:  # the staging directory was removed or committed meanwhile
            raise StagingDropped(f"the staged files of version {self._final.parent.name} were dropped "
                                 "meanwhile") from None
        return self._final.stat().st_size

    def abort(self) -> None:
        self._f.close()
        self._part.unlink(missing_ok=True)


class _DiskStaged:
    """A staged file written through a shared mapping: the bytes go straight into its pages."""

    def __init__(self, final: Path, size: int):
        self._final, self._part = final, _part_path(final)
        self._fd = os.open(self._part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size) if size else None
        except BaseException:
            self.abort()
            raise
        self.view = memoryview(self._map) if self._map is not None else memoryview(bytearray())

    def _close(self) -> None:
        if self._fd < 0:
            return
        if hasattr(self, "view"):
            self.view.release()
        if getattr(self, "_map", None) is not None:
            self._map.close()
        os.close(self._fd)
        self._fd = -1

    def finish(self) -> None:
        os.fsync(self._fd)  # a committed version must survive a crash of the host
        self._close()
        _put_in_place(self._part, self._final)

    def abort(self) -> None:
        self._close()
        self._part.unlink(missing_ok=True)


class DiskStore:
    """Bytes in files under ``root``; committed versions survive a registry restart."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._staging, self._versions, self._trash = (self.root / d for d in ("staging", "versions", "trash"))
        for d in (self._staging, self._trash):
            shutil.rmtree(d, ignore_errors=True)  # leftovers of an earlier run were never published
        for d in (self._staging, self._versions, self._trash):
            d.mkdir(parents=True, exist_ok=True)
        # Deletes the trash, one tree at a time (its thread starts at the first deletion).
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-reclaim")

    def close(self) -> None:
        """Wait for the deletions under way, then stop the worker (what is left of the trash
        goes at the next start anyway)."""
        self._deleter.shutdown(wait=True)

    def describe(self) -> str:
        return str(self.root)

    def staging_dir(self, version: int) -> Path:
        d = self._staging / str(version)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def upload(self, version: int, name: str, size: int | None = None) -> Upload:
        return _DiskUpload(self.staging_dir(version) / name)

    def stage_view(self, version: int, name: str, size: int) -> Staged:
        return _DiskStaged(self.staging_dir(version) / name, size)

    def stage_bytes(self, version: int, name: str, data: bytes | bytearray) -> None:
        up = self.upload(version, name)
        try:
            up.write([data])
            up.finish()
        except BaseException:
            up.abort()
            raise

    def staged_view(self, version: int, name: str) -> contextlib.AbstractContextManager[memoryview]:
        """A staged file's bytes, mapped read-only."""
        try:
            return map_file(self._staging / str(version) / name)
        except FileNotFoundError:
            raise StagingDropped(f"version {version}: {name} no longer staged") from None

    def stage_output(self, version: int, name: str) -> StagedOutput:
        return _DiskOutput(self.staging_dir(version) / name)

    def stage_file(self, version: int, path: Path) -> None:
        """Stage a copy (a hard link would change with the trainer's file if it were rewritten)."""
        final = self.staging_dir(version) / path.name
        part = _part_path(final)
        shutil.copyfile(path, part)
        os.replace(part, final)

    def staged_sizes(self, version: int) -> dict[str, int]:
        d = self._staging / str(version)
        if not d.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in d.iterdir() if not p.name.startswith(".")}

    def read_staged(self, version: int, name: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self._staging / str(version) / name, os.O_RDONLY)
        except FileNotFoundError:
            raise StagingDropped(f"version {version}: {name} no longer staged") from None
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def verify_staged(self, manifest: Manifest) -> dict[str, list[int]]:
        d = self._staging / str(manifest.version)
        if missing := [f.name for f in manifest.files if not (d / f.name).is_file()]:
            raise StagingDropped(f"version {manifest.version}: {', '.join(missing[:5])} no longer staged")
        try:
            return {f.name: bad for f in manifest.files if (bad := verify_file(d / f.name, f, manifest))}
        except FileNotFoundError:  # dropped while being read
            raise StagingDropped(f"the staged files of version {manifest.version} were dropped") from None

    def commit(self, manifest: Manifest) -> dict[str, Blob]:
        """Make the staged files the version, in one rename; StagingDropped when a file it lists
        is not staged (dropped before or during the commit): an empty directory is never a version."""
        # A version whose bytes are in an object store keeps only its manifest here.
        keep = {f.name for f in keep_entries(manifest)}
        src = self.staging_dir(manifest.version) if not keep else self._staging / str(manifest.version)
        try:
            present = {p.name for p in src.iterdir()}
            if missing := sorted(keep - present):
                raise StagingDropped(f"version {manifest.version}: {', '.join(missing[:5])} not staged")
            for name in present - keep:  # uploads the manifest does not list are not part of the version
                (src / name).unlink()
            (src / "manifest.json").write_text(manifest.model_dump_json(indent=1))
            _fsync_dir(src)
            dst = self._versions / str(manifest.version)
            os.rename(src, dst)  # a drop renames src away first, or finds it gone: never both
        except FileNotFoundError:
            raise StagingDropped(f"the staged files of version {manifest.version} were dropped") from None
        _fsync_dir(self._versions)
        return {f.name: DiskBlob(dst / f.name, f.size) for f in keep_entries(manifest)}

    def discard_staging(self, version: int) -> None:
        # An upload still arriving for it finds its directory gone: StagingDropped, as before.
        self._throw_away(self._staging / str(version), f"staging.{version}")

    def reclaim(self, version: int, blobs: dict[str, Blob]) -> None:
        self._throw_away(self._versions / str(version), str(version))

    def _throw_away(self, src: Path, label: str) -> None:
        """Rename ``src`` into the trash (gone from view at once) and delete it in the worker:
        deleting gigabytes on the loop would stall every request the registry serves."""
        dst = self._trash / f"{label}.{secrets.token_hex(4)}"
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return
        self._deleter.submit(shutil.rmtree, dst, ignore_errors=True)

    def load_committed(self) -> list[tuple[Manifest, dict[str, Blob]]]:
        found = []
        for d in sorted(self._versions.iterdir(), key=lambda p: (len(p.name), p.name)):
            try:
                manifest = Manifest.model_validate_json((d / "manifest.json").read_bytes()).sealed()
                if manifest.version != int(d.name):
                    raise ValueError(f"manifest says version {manifest.version}")
                blobs = _disk_blobs(d, keep_entries(manifest.target()))
            except (OSError, ValueError) as e:
                log.warning("skip %s: not a complete version (%s)", d, e)
                continue
            if manifest.delta is not None and manifest.source is None:
                try:
                    blobs.update(_disk_blobs(d, manifest.delta.files))
                except (OSError, ValueError) as e:  # the target is whole: it is still a version, a full one
                    log.warning("load version %d without its delta section: %s", manifest.version, e)
                    manifest = manifest.target()
            found.append((manifest, blobs))
        return found


def _disk_blobs(d: Path, entries: list[FileEntry]) -> dict[str, Blob]:
    """The blobs of ``entries`` in directory ``d``; ValueError or OSError when one is missing or
    has another size than its entry says."""
    blobs: dict[str, Blob] = {}
    for f in entries:
        size = (d / f.name).stat().st_size
        if size != f.size:
            raise ValueError(f"{f.name} has {size} bytes, manifest says {f.size}")
        blobs[f.name] = DiskBlob(d / f.name, f.size)
    return blobs


def keep_entries(manifest: Manifest) -> list[FileEntry]:
    """The files whose bytes the registry holds: the target's and its delta files; none when the
    manifest names a source."""
    if manifest.source is not None:
        return []
    return [*manifest.files, *(manifest.delta.files if manifest.delta is not None else ())]


# -- mapped views, for the delta encoder -----------------------------------------------------------

class _Mapped:
    """A file mapped read-only, as a memoryview; opened at once (a missing file raises here, not
    in the ``with`` body), unmapped on exit."""

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)  # the mapping holds the file
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def __enter__(self) -> memoryview:
        return self._view

    def __exit__(self, *exc) -> None:
        try:
            self._view.release()
            if self._map is not None:
                self._map.close()
        except BufferError:  # a slice of it is still referenced: unmapped when that goes
            pass


def map_file(path: Path) -> contextlib.AbstractContextManager[memoryview]:
    return _Mapped(path)


@contextlib.contextmanager
def blob_views(blobs: dict[str, Blob]) -> Iterator[dict[str, memoryview]]:
    """Read-only views of a version's blobs (memory as it is, disk files mapped): the base a
    delta is encoded against. A file reclaimed meanwhile stays readable through its mapping."""
    with contextlib.ExitStack() as stack:
        views = {}
        for name, blob in blobs.items():
            if isinstance(blob, DiskBlob):
                views[name] = stack.enter_context(map_file(blob.path))
            else:
                views[name] = memoryview(blob.data).toreadonly()
        yield views


class StagedOutput(Protocol):
    """A file of a staged version the registry writes itself (a delta file): ``file`` takes the
    bytes; ``finish`` puts it in place with the staged files (or raises :class:`StagingDropped`);
    ``abort`` throws it away."""

    file: BinaryIO

    def finish(self) -> None: ...
    def abort(self) -> None: ...


class _MemoryOutput:
    """Into a memory file (memfd): written by the encoder as a file, then mapped as the blob."""

    def __init__(self, staging: dict[int, dict], version: int, name: str):
        self._staging, self._version, self._name = staging, version, name
        self._slot = staging.setdefault(version, {})
        self.file = os.fdopen(os.memfd_create("rolloutd-delta", os.MFD_CLOEXEC), "w+b")

    def finish(self) -> None:
        self.file.flush()
        size = os.fstat(self.file.fileno()).st_size
        data = mmap.mmap(self.file.fileno(), size) if size else bytearray()
        self.file.close()  # the mapping holds the pages
        if self._staging.get(self._version) is not self._slot:
            raise StagingDropped(f"the staged files of version {self._version} were dropped meanwhile")
        self._slot[self._name] = data

    def abort(self) -> None:
        self.file.close()


def _put_in_place(part: Path, final: Path) -> None:
    """A synced staged file under its name; the version's staging dropped meanwhile says so."""
    try:
        os.replace(part, final)
    except FileNotFoundError:
        raise StagingDropped(f"the staged files of version {final.parent.name} were dropped meanwhile") from None


class _DiskOutput:
    def __init__(self, final: Path):
        self._final, self._part = final, _part_path(final)
        self.file = open(self._part, "wb")

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())  # part of a committed version: it must survive a crash of the host
        self.file.close()
        _put_in_place(self._part, self._final)

    def abort(self) -> None:
        self.file.close()
        self._part.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
