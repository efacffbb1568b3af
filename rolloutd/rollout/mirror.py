"""The node mirror: complete weight versions in a local directory (tmpfs), one pull per node.

Layout (contract; docs/plugin.md, "The mirror")::

    <dir>/<version>/                 the version's files and manifest.json; exists only when complete
    <dir>/<version>/manifest.json    the sealed manifest (``Manifest.model_dump_json()``)
    <dir>/<version>/.registry.json   where this copy came from: the registry instance, an id of the copy
    <dir>/.<version>.partial/        a pull in progress: files at full size (allocated as they are written)
    <dir>/.<version>.partial/.delta/ a delta pull's delta files while it runs
    <dir>/.<version>.delta/          the delta files a version was rebuilt from, kept for peers (below)
    <dir>/.<version>.<rand>.trash/   a version being removed (renamed away first)
    <dir>/.spare/                    files of removed versions, kept for the next pull to overwrite

A pull writes into the hidden ``.partial`` directory; :meth:`Mirror.commit` fsyncs every file,
writes ``manifest.json`` and ``.registry.json``, fsyncs the directory and renames it into place
with one ``os.rename``, then fsyncs ``<dir>``. Removal renames a version away before deleting it. So a
directory under a version's name is complete, never half-written nor half-deleted; one whose
manifest is unreadable or disagrees with the files beside it is treated as not there.

Registry instances: a registry that restarts numbers its versions again (a trainer that crashed
and resumed publishes 1, 2, 3 anew), so a number alone does not name a version. Each committed
copy records the instance it was pulled from (``.registry.json``, written before the rename, and
rewritten by :meth:`Mirror.claim` when a copy is reused for another instance); the updater says
which instance the node follows (:meth:`Mirror.follow`). "The newest" (what gc keeps as a
fallback, what serves while the registry is down at start) is the highest number **of the
instance followed**; before the node has heard from any registry, of the instance recorded last.
Versions of other instances are kept only while a server uses them, and are removed first.

Owners: the directory must be a directory of the daemon's user (made mode 0700 when missing;
one another user owns, a symbolic link, or a path through a directory other users may write
without the sticky bit is refused with :class:`MirrorDirError`). A version directory or file
another user owns is never read as a version nor recycled: it is not there.

One owner for every change: each mutation (``begin``, ``commit``, ``discard``, ``remove``,
``gc``, ``ensure_room``, ``clean_partials``) holds the mirror's lock from its first look to its
last rename, whatever thread calls it, so none sees another half done: gc decides on one
listing no commit can change under it, and a version is removed once (removing one that is not
there does nothing). Mutations block (fsync, deleting gigabytes): call them from a
thread, never on the event loop; :meth:`Mirror.collect_soon` runs gc on the mirror's own worker
thread for callers that cannot wait. Reading takes no lock: renames are atomic, so a reader sees
a version whole or not at all.

Recycling (``recycle``, on by default): a removed version's files are not deleted but moved to
``.spare`` (at most one version's worth), and :meth:`Mirror.begin` gives them to the next pull,
which overwrites every byte. A fresh tmpfs page costs its allocation and zeroing on the pull
worker's core, as much as the copy into it (bench/README.md, "Recycled pages"); an old page
costs nothing. A file is recycled only if nothing else can see it: one name (no hard link) and,
under a write lease, no other open file or mapping of it anywhere (a server still mapping a
removed version keeps its bytes: that file is deleted as before). Spares not taken by the next
``begin`` are deleted then, and count as free room meanwhile.

Delta files kept for peers: a delta pull whose delta files peers may take from this node
commits with ``keep_delta`` (:meth:`Mirror.commit`): its staged delta files move to
``.<version>.delta`` instead of being removed, so that nodes pulling the same delta after this
one committed still take it from here (docs/peers.md). They are dropped when the mirror commits
any other version, when their version is removed, when room is short (before any version:
:meth:`Mirror.ensure_room`), and at start (:meth:`Mirror.clean_partials`). So at most one
version's delta files are kept, and they count in the mirror's usage like any file under it.

The mirror does no I/O over the network and never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from rolloutd.filelease import under_write_lease
from rolloutd.units import size
from rolloutd.wire.manifest import Manifest, ManifestError, verify_file

log = logging.getLogger("rolloutd.rollout.mirror")

MANIFEST_NAME = "manifest.json"
RECORD_NAME = ".registry.json"  # hidden: no manifest can name a file so (FILE_NAME_RE)
_VERSION_RE = re.compile(r"^[1-9][0-9]{0,15}$")
_PARTIAL_RE = re.compile(r"^\.[1-9][0-9]{0,15}\.partial$")
_TRASH_RE = re.compile(r"^\.[1-9][0-9]{0,15}\.[0-9a-f]+\.trash$")
_KEPT_DELTA_RE = re.compile(r"^\.([1-9][0-9]{0,15})\.delta$")
SPARE_NAME = ".spare"
STAGE_NAME = ".delta"  # inside a partial directory: no manifest can name a file so (FILE_NAME_RE)


class MirrorFull(Exception):
    """A version does not fit in ``max_bytes`` even after removing every version not kept."""


class MirrorDirError(OSError):
    """The mirror directory cannot be used safely as it is (another user could change it)."""


@dataclass(frozen=True)
class Record:
    """Where a complete copy came from: the registry ``instance`` it was pulled for (None: not
    known, a copy committed by an older rolloutd), ``copy`` an id drawn at each commit (a copy
    pulled again is another copy, even of the same bytes), ``recorded_at`` (unix time) when
    the node last took it for ``instance``."""

    instance: str | None
    copy: str | None
    recorded_at: float = 0.0


@dataclass(frozen=True)
class Partial:
    """A version being written: its hidden directory, every file already at full size.
    ``allocated``: per file, how many of its first bytes already have pages (a recycled file's:
    a complete version's, every byte written), which its writer need not allocate again."""

    manifest: Manifest
    dir: Path
    allocated: dict[str, int] = field(default_factory=dict)
    instance: str | None = None  # the registry instance the node followed when the pull began

    def path(self, name: str) -> Path:
        return self.dir / name

    def has_pages(self, name: str, end: int) -> bool:
        """Whether the first ``end`` bytes of file ``name`` have pages already (no need to allocate them)."""
        return end <= self.allocated.get(name, 0)

    def open(self, name: str) -> int:
        """A descriptor to ``os.pwrite`` into file ``name``; the caller closes it. Files are
        opened per use, not held: a version may have thousands of them."""
        return os.open(self.dir / name, os.O_WRONLY | os.O_CLOEXEC)


def _mutation(method):
    """Run ``method`` holding the mirror's lock (re-entrant: gc inside ensure_room)."""
    @functools.wraps(method)
    def locked(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)
    return locked


class Mirror:
    def __init__(self, directory: Path, max_bytes: int, *, recycle: bool = True):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.recycle = recycle  # removed versions' files are overwritten by the next pull
        prepare_mirror_dir(self.dir)
        self.following: str | None = None  # the registry instance the node follows (None: none heard yet)
        self._reported: set[tuple[str, int]] = set()  # broken version dirs already logged
        self._verified: set[tuple[int, str]] = set()  # (version, digest) read back whole, or pulled here
        self._lock = threading.RLock()  # held by every mutation: the one owner of the directory
        self._commits = 0  # commits so far, and the count at which each version was committed:
        self._committed_at: dict[int, int] = {}  # a deferred gc keeps what came after its request
        self._pinned: dict[int, int] = {}  # version -> holds: gc and ensure_room never remove it
        # Runs what collect_soon asks for, one at a time (its thread starts at the first).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutd-mirror")

    # -- reading ----------------------------------------------------------------------------------
    def path(self, version: int) -> Path:
        return self.dir / str(version)

    def versions(self) -> list[int]:
        """Complete versions, oldest first (anything else in the directory is ignored)."""
        return [v for v in self._named_versions() if self.manifest(v) is not None]

    def newest(self) -> int | None:
        """The newest complete version of the registry instance the node follows; before it
        follows one (no registry heard since the start), of the instance recorded last."""
        return self._newest_of(self.versions())[0]

    def follow(self, instance: str | None) -> None:
        """The registry instance the node follows now: its versions are the ones worth keeping,
        and the next pulls are recorded as its."""
        self.following = instance

    def record(self, version: int) -> Record:
        """Where the copy of ``version`` came from; ``Record(None, None)`` when it does not say."""
        try:
            data = json.loads((self.path(version) / RECORD_NAME).read_bytes())
            return Record(data["instance"], data["copy"], float(data["recorded_at"]))
        except (OSError, ValueError, KeyError, TypeError):
            return Record(None, None)

    def manifest(self, version: int) -> Manifest | None:
        """The manifest of a complete version; None if there is none, or if its directory does
        not hold what its manifest says (logged once: someone tampered with the mirror)."""
        vdir = self.path(version)
        if not vdir.is_dir():
            return None
        try:
            manifest, problem = None, _foreign(vdir) or _foreign(vdir / MANIFEST_NAME)
            if problem is None:  # another user's directory or file is not a version, whatever it holds
                manifest = Manifest.model_validate_json((vdir / MANIFEST_NAME).read_bytes()).sealed()
                problem = _mismatch(vdir, version, manifest)
        except (OSError, ValidationError, ManifestError) as e:
            if not vdir.exists():
                return None  # removed while we looked (renamed away whole): simply not there
            manifest, problem = None, f"{MANIFEST_NAME} unreadable: {_short(e)}"
        if problem is None:
            return manifest
        key = (problem, version)
        if key not in self._reported:
            self._reported.add(key)
            log.warning("ignore mirror directory %s: %s", vdir, problem)
        return None

    def has(self, version: int, digest: str | None) -> bool:
        """True if ``version`` is complete here with manifest ``digest``."""
        manifest = self.manifest(version)
        return manifest is not None and manifest.digest == digest

    def damage(self, version: int, digest: str, *, recheck: bool = False) -> list[str]:
        """Read every chunk of a complete version back and check it against its manifest; one
        line per damaged file (none: sound). A version this object committed or checked
        before is not read again, unless ``recheck`` (a server failed to load it)."""
        if (version, digest) in self._verified and not recheck:
            return []
        manifest = self.manifest(version)
        if manifest is None or manifest.digest != digest:
            return [f"version {version} with digest {digest[:12]}... is not complete in the mirror"]
        problems = []
        for entry in manifest.files:
            if bad := verify_file(self.path(version) / entry.name, entry, manifest):
                problems.append(f"{entry.name}: chunks {bad[:5]}{'...' if len(bad) > 5 else ''} differ")
        if not problems:
            self._verified.add((version, digest))
        return problems

    def usage_bytes(self) -> int:
        """Apparent size of everything under the mirror (partials, spares, delta files kept for
        peers and leftovers included)."""
        return _tree_bytes(self.dir)

    def spare_bytes(self) -> int:
        """Bytes of removed versions' files kept for the next pull to overwrite."""
        return sum(self._spares().values())

    # -- writing (each holds the lock) -------------------------------------------------------------
    @_mutation
    def begin(self, manifest: Manifest) -> Partial:
        """Create ``.<v>.partial`` with every file at full size (a leftover partial of the same
        version is removed first), taking spare files of removed versions where there are any.
        A filesystem without room for the version fails here, with the figures, and not halfway
        through a pull. The pages of new files are allocated by whoever writes them (the pull
        workers allocate a chunk's range before they fill it): allocating gigabytes here would
        be the daemon's own CPU time, beside its event loop."""
        manifest = manifest.sealed().target()  # a delta section names files a version never holds
        spares = self._spares()
        free = _free_bytes(self.dir) + sum(spares.values())
        if free < manifest.total_bytes:
            raise OSError(errno.ENOSPC, f"{self.dir} has {size(free)} free, version {manifest.version} needs "
                          f"{size(manifest.total_bytes)}")
        pdir = self.dir / f".{manifest.version}.partial"
        _remove_tree(pdir)
        pdir.mkdir()
        partial = Partial(manifest, pdir, instance=self.following)
        recycled = 0
        try:
            for entry in manifest.files:
                path = pdir / entry.name
                if (spare := _best_fit(spares, entry.size)) is not None and (
                        fd := _take_spare(spare, path)) is not None:
                    partial.allocated[entry.name] = min(spares.pop(spare), entry.size)
                    recycled += partial.allocated[entry.name]
                else:
                    if spare is not None:
                        spares.pop(spare)  # not ours to overwrite: deleted with the rest below
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    os.ftruncate(fd, entry.size)  # a recycled file's tail beyond the size is freed
                finally:
                    os.close(fd)
        except BaseException:
            self.discard(partial)
            raise
        finally:
            _remove_tree(self.dir / SPARE_NAME)  # what this version did not take: give it back
        log.info("begin version %d in %s (%d files, %d bytes, %d of them in recycled pages)", manifest.version,
                 pdir, len(manifest.files), manifest.total_bytes, recycled)
        return partial

    @_mutation
    def commit(self, partial: Partial, *, keep_delta: bool = False) -> Path:
        """Make the partial version complete: fsync, write the manifest, rename into place. The
        delta files staged in it are removed, or with ``keep_delta`` moved to
        :meth:`delta_dir` for peers; every other version's kept delta files are dropped."""
        version = partial.manifest.version
        staged = partial.dir / STAGE_NAME
        if not keep_delta:
            _remove_tree(staged)  # a delta pull's files: never part of the version
        for entry in partial.manifest.files:
            _fsync_file(partial.path(entry.name))
        _write_synced(partial.dir / MANIFEST_NAME, partial.manifest.model_dump_json().encode())
        record = Record(partial.instance, secrets.token_hex(8), time.time())
        _write_synced(partial.dir / RECORD_NAME, _record_json(record))
        _fsync_dir(partial.dir)
        final = self.path(version)
        if final.exists():
            # Only a broken directory can be in the way (the puller returns early for a
            # complete one): move it away so the rename below stays one atomic step.
            self.remove(version, "replaced by a fresh pull")
        self._drop_deltas(f"version {version} is committed")
        if keep_delta and staged.is_dir():
            # Before the version's own rename: a crash between the two leaves only hidden
            # leftovers, which the next start removes.
            os.rename(staged, self.delta_dir(version))
        os.rename(partial.dir, final)
        _fsync_dir(self.dir)
        self._commits += 1
        self._committed_at[version] = self._commits
        self._verified.add((version, partial.manifest.digest))  # every chunk was checked as it arrived
        log.info("commit version %d to %s (digest %s, registry instance %s)", version, final,
                 partial.manifest.digest, partial.instance)
        return final

    @_mutation
    def claim(self, version: int, digest: str, instance: str | None) -> Record | None:
        """Record that the complete copy of ``version`` with ``digest`` is now the node's for
        registry ``instance`` (a copy reused after a restart, or committed while the node's view
        of the registry changed): its record says so, atomically; the copy's id stays. None
        if no such copy is complete here."""
        manifest = self.manifest(version)
        if manifest is None or manifest.digest != digest:
            return None
        old = self.record(version)
        if old.instance == instance and old.copy is not None:
            return old
        new = Record(instance, old.copy or secrets.token_hex(8), time.time())
        vdir = self.path(version)
        _write_synced(vdir / f"{RECORD_NAME}.tmp", _record_json(new))
        os.rename(vdir / f"{RECORD_NAME}.tmp", vdir / RECORD_NAME)
        _fsync_dir(vdir)
        log.info("claim version %d for registry instance %s (was %s)", version, instance, old.instance)
        return new

    @_mutation
    def stage(self, partial: Partial, files: Manifest) -> Partial:
        """A place inside ``partial`` for the delta files ``files`` describes (its files at full
        size, allocated by whoever writes them), so that a delta pull's bytes live and go with
        its partial directory. Fails with the figures if the filesystem lacks the room."""
        free = _free_bytes(self.dir)
        if free < files.total_bytes:
            raise OSError(errno.ENOSPC, f"{self.dir} has {size(free)} free, the delta files of version "
                          f"{files.version} need {size(files.total_bytes)}")
        sdir = partial.dir / STAGE_NAME
        _remove_tree(sdir)
        sdir.mkdir()
        for entry in files.files:
            fd = os.open(sdir / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, entry.size)
            finally:
                os.close(fd)
        return Partial(files, sdir, instance=partial.instance)

    def delta_dir(self, version: int) -> Path:
        """Where the delta files ``version`` was rebuilt from are kept for peers after its commit."""
        return self.dir / f".{version}.delta"

    def kept_delta_bytes(self) -> int:
        """Bytes of the delta files kept for peers."""
        return sum(_tree_bytes(path) for path in self._kept_deltas().values())

    def _kept_deltas(self) -> dict[int, Path]:
        found = {}
        for entry in os.scandir(self.dir):
            if (m := _KEPT_DELTA_RE.match(entry.name)) and entry.is_dir(follow_symlinks=False):
                found[int(m.group(1))] = Path(entry.path)
        return found

    @_mutation
    def _drop_deltas(self, why: str, version: int | None = None) -> int:
        """Remove the kept delta files (of ``version`` only, if given); the bytes freed."""
        freed = 0
        for v, path in self._kept_deltas().items():
            if version is None or v == version:
                freed += _tree_bytes(path)
                _remove_tree(path)
                log.info("drop the delta files of version %d kept for peers (%s)", v, why)
        return freed

    @_mutation
    def unstage(self, partial: Partial) -> None:
        """Remove the delta files staged in ``partial`` (nothing if there are none)."""
        _remove_tree(partial.dir / STAGE_NAME)

    @_mutation
    def pin(self, version: int) -> None:
        """Keep ``version`` from gc and ensure_room until :meth:`unpin` (a delta pull reads it as
        its base). Under the lock: once this returns, no removal decided before it is under way.
        An explicit :meth:`remove` (a damaged or refused copy) still removes it."""
        self._pinned[version] = self._pinned.get(version, 0) + 1

    @_mutation
    def unpin(self, version: int) -> None:
        if (left := self._pinned.pop(version, 0) - 1) > 0:
            self._pinned[version] = left

    @_mutation
    def discard(self, partial: Partial) -> None:
        _remove_tree(partial.dir)
        log.info("discard partial version %d", partial.manifest.version)

    @_mutation
    def clean_partials(self) -> list[Path]:
        """Remove what a crashed run left: ``.*.partial``, ``.*.trash``, ``.spare`` and kept
        ``.*.delta`` directories (a spare file is recycled only straight after the check that
        nothing else sees it; the ledger that served kept delta files to peers is gone). Call at
        start, before any pull."""
        removed = []
        for entry in os.scandir(self.dir):
            if (_PARTIAL_RE.match(entry.name) or _TRASH_RE.match(entry.name) or _KEPT_DELTA_RE.match(entry.name)
                    or entry.name == SPARE_NAME):
                _remove_tree(Path(entry.path))
                removed.append(Path(entry.path))
                log.info("remove leftover %s", entry.path)
        return removed

    # -- room -------------------------------------------------------------------------------------
    @_mutation
    def gc(self, in_use: set[int], *, asked_at: int | None = None) -> list[int]:
        """Remove every version not in ``in_use`` except the newest complete one (a fallback
        for servers that start before the next pull ends), oldest first. Directories under a
        version name that are not complete go too, unless in use. Decided on one listing, under
        the lock. ``asked_at`` (the commit count when the caller chose ``in_use``): versions
        committed since are kept, the caller could not know them. Returns what was removed."""
        named = self._named_versions()
        newest, followed = self._newest_of([v for v in named if self.manifest(v) is not None])
        keep = set(in_use) | ({newest} - {None}) | set(self._pinned)
        if asked_at is not None:
            keep |= {v for v, n in self._committed_at.items() if n > asked_at}
        removed = []
        # Other instances' versions first: numbers that mean nothing to the registry followed.
        for version in sorted(named, key=lambda v: (self.record(v).instance == followed, v)):
            if version not in keep and self.remove(version, "not in use and not the newest"):
                removed.append(version)
        return removed

    def collect_soon(self, in_use: set[int], done: Callable[[int, int], None] | None = None) -> Future[list[int]]:
        """Run :meth:`gc` on the mirror's worker thread and return at once (for the event loop:
        deleting a version takes seconds on a large model). Logs what it removed, then calls
        ``done`` with the mirror's usage and spare bytes, in the worker thread. A failure is logged,
        not raised; the future gives the versions removed."""
        return self._worker.submit(self._collect, set(in_use), self._commits, done)

    def _collect(self, in_use: set[int], asked_at: int, done: Callable[[int, int], None] | None) -> list[int]:
        removed: list[int] = []
        try:
            removed = self.gc(in_use, asked_at=asked_at)
        except OSError as e:
            log.warning("gc mirror failed: %s", _short(e))
        if removed:
            log.info("gc mirror: removed versions %s", removed)
        if done is not None:
            done(self.usage_bytes(), self.spare_bytes())
        return removed

    def close(self) -> None:
        """Wait for the gc asked for with :meth:`collect_soon`, then stop the worker."""
        self._worker.shutdown(wait=True)

    @_mutation  # the figures and the removals on one view of the directory
    def ensure_room(self, needed_bytes: int, in_use: set[int]) -> list[int]:
        """Make room for ``needed_bytes`` more within ``max_bytes``, dropping the delta files
        kept for peers first, then removing versions with :meth:`gc` only if it must. Returns
        the versions removed; raises ``MirrorFull`` with the figures when even that is not
        enough (no version is removed then)."""
        usage = self.usage_bytes() - self.spare_bytes()  # the next begin takes or frees them
        if usage + needed_bytes <= self.max_bytes:
            return []
        # Delta files kept for peers go first: a saving for other nodes, never worth a version here.
        if (freed := self._drop_deltas(f"room for {size(needed_bytes)} more")) and (
                usage := usage - freed) + needed_bytes <= self.max_bytes:
            return []
        keep = set(in_use) | ({self.newest()} - {None}) | set(self._pinned)
        sizes = {v: _tree_bytes(self.path(v)) for v in self._named_versions()}
        after = usage - sum(b for v, b in sizes.items() if v not in keep)  # once gc has run
        if after + needed_bytes > self.max_bytes:
            kept = {v: b for v, b in sizes.items() if v in keep}
            held = ", ".join(f"v{v} {size(b)}" for v, b in sorted(kept.items())) or "none"
            raise MirrorFull(
                f"mirror {self.dir} cannot take {size(needed_bytes)} more: max_bytes is "
                f"{size(self.max_bytes)} and {size(after)} stays after removing every version "
                f"not kept (kept: {held}; in use: {sorted(in_use) or 'none'}; other files: "
                f"{size(after - sum(kept.values()))})")
        return self.gc(in_use)

    # -- helpers ----------------------------------------------------------------------------------
    def _newest_of(self, complete: list[int]) -> tuple[int | None, str | None]:
        """Of the complete versions (oldest first): the newest of the instance followed, and
        that instance (with none followed yet: the instance recorded last, by the time of its
        record)."""
        records = {v: self.record(v) for v in complete}
        followed = self.following
        if followed is None and records:
            followed = max(records.items(), key=lambda item: (item[1].recorded_at, item[0]))[1].instance
        ours = [v for v in complete if records[v].instance == followed]
        return (ours[-1] if ours else None), followed

    def _named_versions(self) -> list[int]:
        """Every directory named like a version, complete or not, oldest first."""
        found = []
        for entry in os.scandir(self.dir):
            if _VERSION_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                found.append(int(entry.name))
        return sorted(found)

    @_mutation
    def remove(self, version: int, why: str, *, digest: str | None = None) -> bool:
        """Rename away first, then delete: a half-deleted version is never visible. False (and
        nothing logged) if no directory has that version's name: removed already; or, with
        ``digest``, if the version there is complete with another digest (another copy)."""
        if digest is not None and (manifest := self.manifest(version)) is not None and manifest.digest != digest:
            return False
        self._verified = {(v, d) for v, d in self._verified if v != version}
        self._committed_at.pop(version, None)
        complete = self.recycle and self.manifest(version) is not None  # a broken directory's files go
        trash = self.dir / f".{version}.{secrets.token_hex(4)}.trash"
        try:
            os.rename(self.path(version), trash)
        except FileNotFoundError:
            return False
        self._drop_deltas(f"version {version} is removed", version)
        _fsync_dir(self.dir)
        kept = self._keep_spares(trash) if complete else 0
        _remove_tree(trash)  # under the lock: ensure_room counts the bytes as free once it returns
        log.info("remove version %d from the mirror (%s)%s", version, why,
                 f", {size(kept)} of its files kept to be overwritten by the next pull" if kept else "")
        return True

    def _spares(self) -> dict[Path, int]:
        """Spare files and their sizes."""
        found = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir / SPARE_NAME):
                with contextlib.suppress(FileNotFoundError):
                    found[Path(entry.path)] = entry.stat(follow_symlinks=False).st_size
        return found

    def _keep_spares(self, trash: Path) -> int:
        """Move the files of a removed version (renamed to ``trash``) that nothing else sees
        into ``.spare``, up to the size of the newest complete version (what the next pull
        will most likely need), or of the removed one if it was the last. Returns the bytes kept."""
        newest = self.newest()
        room = _tree_bytes(trash) if newest is None else self.manifest(newest).total_bytes
        room -= self.spare_bytes()
        kept = 0
        for entry in sorted(os.scandir(trash), key=lambda e: e.name):
            if entry.name == MANIFEST_NAME or entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            if st.st_size == 0 or st.st_size > room - kept or _unreusable(st) is not None:
                continue
            spare_dir = self.dir / SPARE_NAME
            spare_dir.mkdir(exist_ok=True)
            if _move_if_unshared(Path(entry.path), spare_dir / f"{trash.name}{entry.name}"):
                kept += st.st_size
        return kept


def prepare_mirror_dir(path: Path) -> Path:
    """Make ``path`` (mode 0700) or check it: a directory of the daemon's user, reached only
    through directories no other user can change. MirrorDirError otherwise, saying what to do:
    whoever controls the directory could replace a version's files after they were checked."""
    path = Path(os.path.abspath(path))
    euid = os.geteuid()
    try:
        _refuse_unsafe_parents(path)  # before anything is made through them
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _refuse_unsafe_parents(path)  # and the ones just made
        st = path.lstat()
    except MirrorDirError:
        raise
    except OSError as e:
        raise MirrorDirError(f"mirror directory {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):  # a symbolic link included: it could point anywhere
        raise MirrorDirError(f"mirror directory {path}: not a directory (a symbolic link or a file); remove it")
    if st.st_uid != euid:
        raise MirrorDirError(f"mirror directory {path}: owned by uid {st.st_uid}, not by rolloutd's user "
                             f"(uid {euid}): another user could replace a version's files; remove it, and "
                             f"rolloutd makes it (mode 0700) at its start")
    if stat.S_IMODE(st.st_mode) != 0o700:  # ours: close it to every other user
        os.chmod(path, 0o700)
        log.info("restrict mirror directory %s to mode 0700 (was %04o)", path, stat.S_IMODE(st.st_mode))
    return path


def _refuse_unsafe_parents(path: Path) -> None:
    if (unsafe := _unsafe_ancestor(path)) is not None:
        raise MirrorDirError(f"mirror directory {path}: {unsafe}; another user could replace it: choose a "
                             f"mirror.dir whose parents only root or uid {os.geteuid()} can change")


def _unsafe_ancestor(path: Path) -> str | None:
    """Why a parent of ``path`` lets another user swap what is under it (None: none does):
    owned by someone other than root or us, or writable by others without the sticky bit.
    Symbolic links are followed, and their targets' parents checked the same way."""
    euid = os.geteuid()
    chains = [path.parents]
    real = Path(os.path.realpath(path.parent))
    if real != path.parent:
        chains.append([real, *real.parents])
    for chain in chains:
        for parent in chain:
            try:
                st = os.lstat(parent)
            except FileNotFoundError:  # not made yet: what is above it decides
                continue
            if st.st_uid not in (0, euid):
                return f"{parent} is owned by uid {st.st_uid}"
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return f"{parent} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit)"
    return None


def _foreign(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why ``path`` is not the daemon's own (another user's, or a symbolic link); None if it is."""
    st = st or os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path.name} is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"{path.name} is owned by uid {st.st_uid}, not by rolloutd's user (uid {os.geteuid()})"
    return None


def _unreusable(st: os.stat_result) -> str | None:
    """Why a spare file must not be overwritten by a pull (None: it may): only a plain file of
    the daemon's user, with one name, that no other user may write."""
    if not stat.S_ISREG(st.st_mode):
        return "not a plain file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_nlink != 1:
        return "another name links it"
    if st.st_mode & 0o022:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _take_spare(spare: Path, path: Path) -> int | None:
    """Move spare file ``spare`` to ``path`` and open it for writing, if it is the daemon's own to
    overwrite (checked on the file opened); None otherwise, and the spare is left to be deleted."""
    try:
        os.rename(spare, path)
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        log.warning("skip spare file %s: %s", spare, _short(e))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return None
    if (why := _unreusable(os.fstat(fd))) is not None:
        os.close(fd)
        os.unlink(path)
        log.warning("skip spare file %s: %s; a pull never overwrites a file it does not own alone", spare, why)
        return None
    return fd


def _record_json(record: Record) -> bytes:
    return json.dumps({"instance": record.instance, "copy": record.copy, "recorded_at": record.recorded_at}).encode()


def _mismatch(vdir: Path, version: int, manifest: Manifest) -> str | None:
    """Why a version directory does not hold what its manifest says (None: it does). Sizes
    and owners only: digests were checked chunk by chunk while pulling."""
    if manifest.version != version:
        return f"{MANIFEST_NAME} is for version {manifest.version}"
    for entry in manifest.files:
        try:
            st = os.lstat(vdir / entry.name)
        except OSError:
            return f"file {entry.name} is missing"
        if (foreign := _foreign(vdir / entry.name, st)) is not None:
            return foreign
        if (actual := st.st_size) != entry.size:
            return f"file {entry.name} has {actual} bytes, the manifest says {entry.size}"
    return None


def _best_fit(spares: dict[Path, int], needed: int) -> Path | None:
    """The smallest spare that holds ``needed`` bytes, else the largest (grown by its writer)."""
    if not spares or needed == 0:
        return None
    fits = [p for p, n in spares.items() if n >= needed]
    return min(fits, key=spares.get) if fits else max(spares, key=spares.get)


def _move_if_unshared(path: Path, to: Path) -> bool:
    """Rename ``path`` to ``to`` if nothing else can see its bytes: one name only, and no other
    open file or mapping of it in any process (the kernel's write lease, which also holds back
    any new open until the rename is done). Otherwise False, and the file stays where it was."""
    def move() -> None:
        if os.lstat(path).st_nlink != 1:
            raise OSError(errno.EMLINK, "another name links the file")
        os.rename(path, to)
    return under_write_lease(path, move)


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still put on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _tree_bytes(root: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    total += _tree_bytes(Path(entry.path))
                else:
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise OSError(f"could not remove {path}")


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
