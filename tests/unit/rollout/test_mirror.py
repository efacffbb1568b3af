"""The node mirror: complete versions only under a version's name, partials, gc and room."""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import typing
from pathlib import Path

import pytest

from rolloutd.config import Config
from rolloutd.metrics import Metrics
from rolloutd.rollout import mirror as mirror_mod
from rolloutd.rollout.mirror import MANIFEST_NAME, Mirror, MirrorFull
from rolloutd.rollout.updater import Updater
from rolloutd.wire.manifest import Delta, DeltaEncoding, DeltaFile, Manifest, hash_chunks
from tests.conftest import free_port
from tests.support.loop_probe import where_rmtree_runs
from tests.support.mirror_versions import CHUNK, make_manifest, payload, put, write
from tests.support.waiting import until


@pytest.fixture
def mirror(tmp_path) -> Mirror:
    return Mirror(tmp_path / "mirror", max_bytes=1 << 20)


def test_commit_makes_a_complete_version_appear_at_once(mirror):
    files = payload(3)
    manifest = make_manifest(3, files)
    partial = mirror.begin(manifest)
    assert partial.dir == mirror.dir / ".3.partial"
    # preallocated at full size, hidden from versions() while written
    assert {p.name: p.stat().st_size for p in partial.dir.iterdir()} == {n: len(d) for n, d in files.items()}
    assert mirror.versions() == [] and not mirror.path(3).exists()
    for name, data in files.items():
        write(partial, name, data)
    assert mirror.commit(partial) == mirror.path(3)
    assert mirror.versions() == [3] and mirror.newest() == 3
    assert sorted(os.listdir(mirror.dir)) == ["3"]
    for name, data in files.items():
        assert (mirror.path(3) / name).read_bytes() == data
    assert (mirror.path(3) / MANIFEST_NAME).read_text() == manifest.model_dump_json()
    assert mirror.manifest(3) == manifest and mirror.has(3, manifest.digest)
    assert not mirror.has(3, "0" * 32) and not mirror.has(4, manifest.digest)


def test_discard_leaves_nothing(mirror):
    partial = mirror.begin(make_manifest(2, payload(2)))
    mirror.discard(partial)
    assert os.listdir(mirror.dir) == [] and mirror.versions() == []


def test_begin_replaces_a_leftover_partial_of_the_same_version(mirror):
    stale = mirror.dir / ".5.partial"
    stale.mkdir()
    (stale / "junk").write_bytes(b"x" * 100)
    partial = mirror.begin(make_manifest(5, payload(5)))
    assert not (partial.dir / "junk").exists()
    mirror.discard(partial)


def test_clean_partials_removes_what_a_crash_left_and_nothing_else(mirror):
    put(mirror, 1)
    for leftover in (".2.partial", ".3.partial", ".1.0badc0de.trash"):
        (mirror.dir / leftover).mkdir()
        (mirror.dir / leftover / "model.safetensors").write_bytes(b"\0" * 1000)
    (mirror.dir / "notes.txt").write_text("keep me")
    (mirror.dir / ".hidden").mkdir()
    removed = mirror.clean_partials()
    assert sorted(p.name for p in removed) == [".1.0badc0de.trash", ".2.partial", ".3.partial"]
    assert sorted(os.listdir(mirror.dir)) == [".hidden", "1", "notes.txt"]
    assert mirror.versions() == [1]


def test_versions_ignore_other_names_and_broken_directories(mirror, caplog):
    put(mirror, 1)
    m2 = put(mirror, 2)
    put(mirror, 3)
    put(mirror, 4)
    for name in ("latest", "07", "0", "-1", "x5"):
        (mirror.dir / name).mkdir()
    (mirror.dir / "9").write_text("a file, not a directory")
    (mirror.path(1) / MANIFEST_NAME).write_text('{"version": 1, "files": [')       # unreadable
    (mirror.path(2) / m2.files[1].name).unlink()                                    # a file missing
    (mirror.path(3) / MANIFEST_NAME).write_text(m2.model_dump_json())              # another version's
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.mirror"):
        assert mirror.versions() == [4]
        assert mirror.versions() == [4]
    assert mirror.manifest(1) is None and mirror.manifest(2) is None and mirror.manifest(3) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings  # once per directory, not on every look
    assert any("1: manifest.json unreadable" in w for w in warnings)
    assert any("is missing" in w for w in warnings)
    assert any("is for version 2" in w for w in warnings)


def test_a_tampered_manifest_is_refused(mirror):
    m = put(mirror, 1)
    raw = (mirror.path(1) / MANIFEST_NAME).read_text()
    (mirror.path(1) / MANIFEST_NAME).write_text(raw.replace(m.files[0].chunks[0], "0" * 32))
    assert mirror.versions() == []  # the manifest's own digest no longer matches


def test_commit_replaces_a_broken_directory_of_the_same_version(mirror):
    mirror.path(6).mkdir()
    (mirror.path(6) / "half.safetensors").write_bytes(b"\0")
    manifest = put(mirror, 6)
    assert mirror.versions() == [6] and mirror.has(6, manifest.digest)
    assert not (mirror.path(6) / "half.safetensors").exists()
    assert sorted(os.listdir(mirror.dir)) == ["6"]


def test_gc_keeps_versions_in_use_and_the_newest(mirror):
    for v in (1, 2, 3, 4, 5):
        put(mirror, v)
    (mirror.dir / "6").mkdir()  # broken (no manifest), newer than all: not "the newest complete"
    assert mirror.gc(in_use={2}) == [1, 3, 4, 6]
    assert mirror.versions() == [2, 5]
    assert sorted(os.listdir(mirror.dir)) == [".spare", "2", "5"]  # no trash left behind
    assert mirror.gc(in_use={2}) == []
    assert mirror.gc(in_use=set()) == [2]
    assert mirror.versions() == [5]


def test_a_pinned_version_is_kept_by_gc_and_ensure_room_until_unpinned(tmp_path):
    mirror = Mirror(tmp_path / "m", max_bytes=60_000)
    for v in (1, 2, 3):
        put(mirror, v)
    per_version = mirror.usage_bytes() // 3
    mirror.pin(1)
    mirror.pin(1)  # two holders: the first unpin leaves it pinned
    assert mirror.gc(in_use=set()) == [2]
    put(mirror, 4)
    with pytest.raises(MirrorFull):
        mirror.ensure_room(2 * per_version, in_use=set())  # it would fit without version 1
    mirror.unpin(1)
    assert mirror.gc(in_use=set()) == [3]
    mirror.unpin(1)
    assert mirror.gc(in_use=set()) == [1]
    assert mirror.versions() == [4]
    assert mirror.remove(4, "damaged") is True  # an explicit removal is not held back by a pin
    mirror.unpin(7)  # never pinned: nothing


def test_delta_files_staged_in_a_partial_count_and_never_reach_the_version(mirror):
    files = payload(2)
    manifest = make_manifest(2, files)
    partial = mirror.begin(manifest)
    deltas = make_manifest(2, {"model-00001-of-00002.safetensors.delta": b"d" * 3000,
                               "model-00002-of-00002.safetensors.delta": b"e" * 100})
    staged = mirror.stage(partial, deltas)
    assert staged.dir == partial.dir / ".delta" and staged.manifest == deltas
    assert {p.name: p.stat().st_size for p in staged.dir.iterdir()} == {
        "model-00001-of-00002.safetensors.delta": 3000, "model-00002-of-00002.safetensors.delta": 100}
    assert mirror.usage_bytes() == manifest.total_bytes + 3100
    for name, data in files.items():
        write(partial, name, data)
    mirror.unstage(partial)
    assert not staged.dir.exists() and mirror.usage_bytes() == manifest.total_bytes
    mirror.stage(partial, deltas)  # and if a caller forgot: the commit drops them
    mirror.commit(partial)
    assert sorted(os.listdir(mirror.path(2))) == sorted([*files, MANIFEST_NAME, mirror_mod.RECORD_NAME])
    partial = mirror.begin(make_manifest(3, payload(3)))
    mirror.stage(partial, deltas)
    mirror.discard(partial)  # a discarded partial takes its staged files with it
    assert sorted(os.listdir(mirror.dir)) == ["2"]


DELTAS = {"model-00001-of-00002.safetensors.delta": b"d" * 3000, "model-00002-of-00002.safetensors.delta": b"e" * 100}


def put_from_delta(mirror: Mirror, version: int, *, keep_delta: bool = True) -> Manifest:
    """A version committed as a delta pull does: the delta files staged, the version written, commit."""
    files = payload(version)
    manifest = make_manifest(version, files)
    partial = mirror.begin(manifest)
    staged = mirror.stage(partial, make_manifest(version, DELTAS))
    for name, data in {**files, **DELTAS}.items():
        write(partial if name in files else staged, name, data)
    mirror.commit(partial, keep_delta=keep_delta)
    return manifest


def test_delta_files_kept_for_peers_sit_beside_the_version_until_another_version_is_committed(mirror, caplog):
    put(mirror, 1)
    manifest = put_from_delta(mirror, 2)
    assert sorted(os.listdir(mirror.dir)) == [".2.delta", "1", "2"]
    assert mirror.delta_dir(2) == mirror.dir / ".2.delta"
    assert {p.name: p.read_bytes() for p in mirror.delta_dir(2).iterdir()} == DELTAS  # moved, not rewritten
    assert sorted(os.listdir(mirror.path(2))) == sorted([*payload(2), MANIFEST_NAME, mirror_mod.RECORD_NAME])
    assert mirror.manifest(2) == manifest and mirror.versions() == [1, 2]
    assert mirror.kept_delta_bytes() == 3100
    assert mirror.usage_bytes() == sum(mirror_mod._tree_bytes(mirror.path(v)) for v in (1, 2)) + 3100
    assert mirror.gc(set()) == [1] and mirror.delta_dir(2).is_dir()  # gc keeps the newest, and them
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.mirror"):
        put(mirror, 3)  # any next commit drops them
    assert sorted(os.listdir(mirror.dir)) == ["2", "3"]
    assert "drop the delta files of version 2 kept for peers (version 3 is committed)" in caplog.messages
    put_from_delta(mirror, 4)
    put_from_delta(mirror, 5)  # at most one version's delta files
    assert sorted(os.listdir(mirror.dir)) == [".5.delta", "2", "3", "4", "5"]
    put_from_delta(mirror, 6, keep_delta=False)  # a delta pull without peers: staged files removed
    assert sorted(os.listdir(mirror.dir)) == ["2", "3", "4", "5", "6"]


def test_kept_delta_files_go_with_their_version_and_at_a_restart(mirror):
    put_from_delta(mirror, 2)
    assert mirror.remove(2, "refused") and sorted(os.listdir(mirror.dir)) == [".spare"]  # its files, recycled
    put_from_delta(mirror, 3)
    (mirror.dir / ".7.delta").mkdir()  # what a crash between the two renames of a commit leaves
    (mirror.dir / ".7.partial").mkdir()
    removed = Mirror(mirror.dir, max_bytes=1 << 20).clean_partials()  # the daemon's next start
    assert sorted(p.name for p in removed) == [".3.delta", ".7.delta", ".7.partial"]
    assert sorted(os.listdir(mirror.dir)) == ["3"]


def test_ensure_room_drops_kept_delta_files_before_any_version(tmp_path):
    mirror = Mirror(tmp_path / "m", max_bytes=50_000, recycle=False)
    put(mirror, 1)
    put_from_delta(mirror, 2)  # about 15 kB each, and 3,100 bytes of delta files
    room = mirror.max_bytes - mirror.usage_bytes()
    assert mirror.ensure_room(room, in_use=set()) == [] and mirror.delta_dir(2).is_dir()  # fits as it is
    assert mirror.ensure_room(room + 3000, in_use=set()) == [] and mirror.versions() == [1, 2]
    assert sorted(os.listdir(mirror.dir)) == ["1", "2"]  # the delta files made the room
    put_from_delta(mirror, 3)
    # Short by more than they hold: they go, then the versions gc may remove.
    assert mirror.ensure_room(mirror.max_bytes - mirror.usage_bytes() + 10_000, in_use=set()) == [1, 2]
    assert sorted(os.listdir(mirror.dir)) == ["3"]


def test_delta_files_that_do_not_fit_fail_the_stage_with_the_figures(mirror, monkeypatch):
    partial = mirror.begin(make_manifest(2, payload(2)))
    monkeypatch.setattr(mirror_mod, "_free_bytes", lambda path: 1000)
    with pytest.raises(OSError, match=r"has 1000 B free, the delta files of version 2 need 2\.9 KiB"):
        mirror.stage(partial, make_manifest(2, {"a.delta": b"d" * 3000}))
    mirror.discard(partial)


def test_a_version_is_kept_without_its_delta_section(mirror):
    """Whatever manifest a pull begins with, the mirror holds the version a full publish has:
    a delta section names delta files the version's directory never holds."""
    files = payload(2)
    plain = make_manifest(2, files)
    delta = Delta(base_version=1, base_digest="ab" * 32, encoding=typing.get_args(DeltaEncoding)[0],
                  files=[DeltaFile(name=f"{e.name}.delta", target=e.name, size=10,
                                   chunks=hash_chunks(b"d" * 10, CHUNK, "xxh3-128")) for e in plain.files])
    partial = mirror.begin(plain.with_delta(delta))
    assert partial.manifest == plain and partial.manifest.delta is None
    for name, data in files.items():
        write(partial, name, data)
    mirror.commit(partial)
    assert mirror.manifest(2) == plain
    assert json.loads((mirror.path(2) / MANIFEST_NAME).read_bytes()).keys() == json.loads(
        plain.model_dump_json()).keys()


def test_usage_counts_versions_and_partials(mirror):
    m = put(mirror, 1)
    one = m.total_bytes + len(m.model_dump_json()) + (mirror.path(1) / mirror_mod.RECORD_NAME).stat().st_size
    assert mirror.usage_bytes() == one
    partial = mirror.begin(make_manifest(2, payload(2)))
    assert mirror.usage_bytes() == one + sum(len(d) for d in payload(2).values())
    mirror.discard(partial)


def test_ensure_room_removes_only_what_it_must(tmp_path):
    mirror = Mirror(tmp_path / "m", max_bytes=60_000)
    for v in (1, 2, 3):
        put(mirror, v)  # about 15 kB each
    per_version = mirror.usage_bytes() // 3
    assert mirror.ensure_room(5_000, in_use={1}) == []  # fits as it is
    assert mirror.versions() == [1, 2, 3]
    assert mirror.ensure_room(per_version, in_use={1}) == [2]  # version 3 is the newest: kept
    assert mirror.versions() == [1, 3]


def test_ensure_room_says_why_it_cannot(tmp_path):
    mirror = Mirror(tmp_path / "m", max_bytes=40_000)
    put(mirror, 1)
    put(mirror, 2)
    with pytest.raises(MirrorFull) as err:
        mirror.ensure_room(30_000, in_use={1})
    text = str(err.value)
    assert "cannot take 29.3 KiB more: max_bytes is 39.1 KiB" in text, text
    assert ("30.4 KiB stays after removing every version not kept "
            "(kept: v1 15.2 KiB, v2 15.2 KiB; in use: [1]") in text, text
    assert mirror.versions() == [1, 2]  # nothing removed when it cannot fit anyway


def test_mirror_full_names_the_figures(tmp_path):
    mirror = Mirror(tmp_path / "m", max_bytes=3 << 20)
    with pytest.raises(MirrorFull, match=r"cannot take 4\.0 MiB more: max_bytes is 3\.0 MiB and 0 B stays"):
        mirror.ensure_room(4 << 20, in_use=set())


def test_begin_fails_cleanly_when_the_filesystem_is_full(tmp_path, monkeypatch):
    mirror = Mirror(tmp_path / "m", max_bytes=1 << 30)

    real = os.statvfs

    def full(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, *st[5:]))
    monkeypatch.setattr(os, "statvfs", full)
    with pytest.raises(OSError, match=r"has 0 B free, version 1 needs 14\.6 KiB"):
        mirror.begin(make_manifest(1, payload(1)))
    assert os.listdir(mirror.dir) == []


def test_rejects_a_nonsensical_limit(tmp_path: Path):
    with pytest.raises(ValueError):
        Mirror(tmp_path, max_bytes=0)


# -- one owner for every change; removal off the event loop ---------------------------------------
# The interleavings below are forced: a hook runs a rival mutation in another thread at the worst
# moment and waits for it (up to JOIN_S). Before the mirror had one owner the rival ran through
# and broke the first; now it waits for the first to end, and the hook's wait simply times out.
JOIN_S = 0.5


def two_versions_and_a_third_written(mirror: Mirror):
    """Versions 1 and 2 complete, and version 3 written in full but not yet committed."""
    put(mirror, 1)
    put(mirror, 2)
    files = payload(3)
    partial = mirror.begin(make_manifest(3, files))
    for name, data in files.items():
        write(partial, name, data)
    return partial


def test_gc_never_removes_a_version_committed_while_it_looks(mirror, monkeypatch):
    partial = two_versions_and_a_third_written(mirror)
    committer = threading.Thread(target=mirror.commit, args=(partial,))
    real = Mirror._named_versions

    def listing(self):
        found = real(self)
        if committer.ident is None:  # gc has looked once: the pull's commit lands now
            committer.start()
            committer.join(JOIN_S)
        return found
    monkeypatch.setattr(Mirror, "_named_versions", listing)
    removed = mirror.gc(in_use=set())
    committer.join(5)
    assert 3 in mirror.versions(), f"gc removed {removed}, the just-committed version 3 among them"
    assert removed == [1] and mirror.versions() == [2, 3]


def test_ensure_room_and_gc_at_once_remove_each_version_once(tmp_path, monkeypatch, caplog):
    mirror = Mirror(tmp_path / "m", max_bytes=60_000)
    for v in (1, 2, 3):
        put(mirror, v)
    rival: dict = {}

    def collect():  # the updater's gc, in another thread, while a pull makes room
        try:
            rival["removed"] = mirror.gc(in_use=set())
        except Exception as e:
            rival["error"] = e
    other = threading.Thread(target=collect)
    real = Mirror.remove

    def remove(self, version, why):
        if other.ident is None:  # the pull's gc has decided and is about to remove: the rival runs now
            other.start()
            other.join(JOIN_S)
        return real(self, version, why)
    monkeypatch.setattr(Mirror, "remove", remove)
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.mirror"):
        removed = mirror.ensure_room(mirror.usage_bytes() // 3, in_use=set())
        other.join(5)
    assert "error" not in rival, rival
    assert removed == [1, 2] and rival["removed"] == [] and mirror.versions() == [3]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("remove version")]
    assert len(lines) == 2, lines
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_two_removals_of_one_version_remove_it_once(mirror, monkeypatch, caplog):
    put(mirror, 1)
    put(mirror, 2)
    failed: list[Exception] = []

    def remove_elsewhere():
        try:
            mirror.remove(1, "second")
        except Exception as e:
            failed.append(e)
    other = threading.Thread(target=remove_elsewhere)
    real = mirror_mod._remove_tree

    def deleting(path):  # the first removal is deleting its trash when the second one starts
        if other.ident is None:
            other.start()
            other.join(JOIN_S)
        real(path)
    monkeypatch.setattr(mirror_mod, "_remove_tree", deleting)
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.mirror"):
        mirror.remove(1, "first")
        other.join(5)
    assert failed == []
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["remove version 1 from the mirror (first)"]
    assert mirror.versions() == [2] and sorted(os.listdir(mirror.dir)) == [".spare", "2"]


async def test_the_updaters_collect_deletes_off_the_event_loop(mirror, monkeypatch):
    for v in (1, 2, 3):
        put(mirror, v)
    metrics = Metrics()
    conf = Config.model_validate({"registry": {"url": "http://trainer:8700"},
                                  "servers": [{"name": "gpu0", "model": "/m", "public_port": 9001, "gpus": [0]}]})
    updater = Updater(lambda: conf, None, mirror, metrics, in_use=lambda: {1})
    where = where_rmtree_runs(monkeypatch)
    updater.collect()
    await until(lambda: mirror.versions() == [1, 3])
    await until(lambda: metrics.mirror_bytes._value.get() == mirror.usage_bytes())
    assert metrics.mirror_spare_bytes._value.get() == mirror.spare_bytes() > 0  # version 2, for the next pull
    assert where == ["thread"], f"rmtree ran on: {where}"
    mirror.close()


async def test_a_gc_asked_for_before_a_commit_keeps_that_version(mirror):
    """collect_soon decides on what the mirror held when it was asked: a version committed
    while the request waited for the worker is not the caller's to remove."""
    partial = two_versions_and_a_third_written(mirror)
    with mirror._lock:  # a pull holds the mirror: the request waits
        pending = mirror.collect_soon(set())
        mirror.commit(partial)
        put(mirror, 4)
    assert await asyncio.wrap_future(pending) == [1, 2]  # 3: neither in use nor the newest, but not known
    assert mirror.versions() == [3, 4]
    mirror.close()


# -- recycling: a removed version's files are overwritten by the next pull ------------------------
@pytest.fixture
def shm_dir():
    """A directory on tmpfs, where mirrors live (inode numbers there are never handed out twice
    while the machine runs, so an inode seen again is the same file)."""
    d = Path(tempfile.mkdtemp(prefix="rolloutd-test-mirror-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def inodes(mirror: Mirror, version: int) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in mirror.path(version).iterdir()
            if p.name not in (MANIFEST_NAME, mirror_mod.RECORD_NAME)}


def spares(mirror: Mirror) -> dict[int, bytes]:
    d = mirror.dir / mirror_mod.SPARE_NAME
    return {p.stat().st_ino: p.read_bytes() for p in d.iterdir()} if d.exists() else {}


def test_a_removed_versions_files_are_overwritten_by_the_next_version_a_b_c(shm_dir):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20)
    put(mirror, 1)
    put(mirror, 2)
    old = inodes(mirror, 1)
    assert mirror.gc(in_use={2}) == [1]
    # The files, with version 1's bytes still in them, wait in .spare: renamed, not copied.
    assert sorted(spares(mirror)) == sorted(old.values())
    assert sorted(spares(mirror).values()) == sorted(payload(1).values())
    put(mirror, 3)  # same names and sizes as 1, other bytes
    assert inodes(mirror, 3) == old  # the very files of version 1
    for name, data in payload(3).items():
        assert (mirror.path(3) / name).read_bytes() == data
    for name, data in payload(2).items():  # the version kept is untouched
        assert (mirror.path(2) / name).read_bytes() == data
    assert not (mirror.dir / mirror_mod.SPARE_NAME).exists()

    # Sizes that differ: a larger file takes the larger spare and grows, a smaller one shrinks.
    assert mirror.gc(in_use={3}) == [2]
    files4 = {"model-00001-of-00002.safetensors": b"\x04" * 12_345, "model-00002-of-00002.safetensors": b"\x05" * 77,
              "extra.json": b'{"a": 1}'}
    manifest4 = make_manifest(4, files4)
    partial = mirror.begin(manifest4)
    assert {p.name: p.stat().st_size for p in partial.dir.iterdir()} == {n: len(d) for n, d in files4.items()}
    # The larger file grew from the larger spare: only its first 10,000 bytes have pages; the
    # small one fits in the other spare whole; the new file has none.
    assert partial.allocated == {"model-00001-of-00002.safetensors": 10_000, "model-00002-of-00002.safetensors": 77}
    for name, data in files4.items():
        write(partial, name, data)
    mirror.commit(partial)
    for name, data in files4.items():
        assert (mirror.path(4) / name).read_bytes() == data
    assert mirror.damage(4, manifest4.digest, recheck=True) == []
    assert sorted(os.listdir(mirror.dir)) == ["3", "4"]


def test_a_removed_file_still_mapped_or_linked_elsewhere_keeps_its_bytes(shm_dir):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20)
    put(mirror, 1)
    put(mirror, 2)
    first, second = sorted(payload(1))
    with open(mirror.path(1) / first, "rb") as f:  # a server that still maps a removed version
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    os.link(mirror.path(1) / second, shm_dir / "elsewhere")  # another name for the same bytes
    try:
        assert mirror.gc(in_use={2}) == [1]
        assert spares(mirror) == {}  # neither is recycled: both are deleted from the mirror
        put(mirror, 3)
        assert mapped[:] == payload(1)[first]
        assert (shm_dir / "elsewhere").read_bytes() == payload(1)[second]
        for name, data in payload(3).items():
            assert (mirror.path(3) / name).read_bytes() == data
    finally:
        mapped.close()


def test_spares_count_as_room_and_never_exceed_one_version(shm_dir):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20)
    for v in (1, 2, 3, 4):
        put(mirror, v)
    one = sum(len(d) for d in payload(4).values())
    assert mirror.gc(in_use=set()) == [1, 2, 3]
    assert sum(len(b) for b in spares(mirror).values()) == one  # one version's worth kept, the rest deleted
    # A mirror that holds 4 and the spares has room for one more version of the same size.
    mirror.max_bytes = mirror.usage_bytes() + 200  # the manifest's size and a little
    assert mirror.usage_bytes() > one * 2
    assert mirror.ensure_room(one, in_use={4}) == []
    partial = mirror.begin(make_manifest(5, payload(5)))
    assert mirror.usage_bytes() <= mirror.max_bytes
    mirror.discard(partial)


def test_without_recycling_a_removed_version_is_deleted(shm_dir):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20, recycle=False)
    put(mirror, 1)
    put(mirror, 2)
    old = inodes(mirror, 1)
    assert mirror.gc(in_use={2}) == [1]
    assert sorted(os.listdir(mirror.dir)) == ["2"]
    put(mirror, 3)
    assert not set(inodes(mirror, 3).values()) & set(old.values())


def test_a_restart_gives_spares_back(shm_dir):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20)
    put(mirror, 1)
    put(mirror, 2)
    mirror.gc(in_use=set())
    assert spares(mirror)
    assert mirror.dir / mirror_mod.SPARE_NAME in Mirror(mirror.dir, max_bytes=1 << 20).clean_partials()
    assert sorted(os.listdir(mirror.dir)) == ["2"]


def test_the_last_version_removed_is_kept_for_the_next(shm_dir):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20)
    put(mirror, 1)
    old = inodes(mirror, 1)
    assert mirror.remove(1, "replaced")
    assert sorted(spares(mirror)) == sorted(old.values())
    put(mirror, 2)
    assert inodes(mirror, 2) == old
    for name, data in payload(2).items():
        assert (mirror.path(2) / name).read_bytes() == data


# -- registry instances: a restarted registry numbers its versions again ------------------------
def test_the_newest_is_the_followed_instances_and_other_instances_go_first(mirror):
    mirror.follow("inst-a")
    for v in (1, 2, 3):
        put(mirror, v)
    mirror.follow("inst-b")  # the trainer crashed and resumed: 1, 2, 3 again
    assert mirror.newest() is None, "no version of the instance followed yet"
    assert mirror.gc(in_use={3}) == [1, 2], "another instance's versions are kept only while in use"
    mirror.remove(3, "test")
    put(mirror, 1)
    assert mirror.record(1).instance == "inst-b"
    assert mirror.newest() == 1


def test_other_instances_versions_leave_room_for_the_followed_ones(tmp_path):
    """Sized for two versions: after a restart the old instance's top version does not hold a
    place forever (it did: MirrorFull at every pull from the second version on)."""
    mirror = Mirror(tmp_path / "m", max_bytes=2 * 15_600)
    mirror.follow("inst-a")
    for v in (4, 5):
        mirror.ensure_room(15_000, in_use=set())
        put(mirror, v)
    mirror.follow("inst-b")
    for v in (1, 2, 3):  # a server holds the previous one while the next is pulled
        assert mirror.ensure_room(15_000, in_use={v - 1} if v > 1 else {5}) is not None
        put(mirror, v)
    assert mirror.versions() == [2, 3] and {mirror.record(v).instance for v in (2, 3)} == {"inst-b"}


def test_before_any_registry_answers_the_newest_is_the_instance_recorded_last(mirror):
    mirror.follow("inst-a")
    for v in (7, 8):
        put(mirror, v)
    mirror.follow("inst-b")
    put(mirror, 2)
    restarted = Mirror(mirror.dir, max_bytes=1 << 20)  # a daemon started while the registry is down
    assert restarted.newest() == 2, "inst-b's newest, not inst-a's higher number"
    restarted.claim(8, restarted.manifest(8).digest, "inst-c")  # reused for an instance seen later still
    assert restarted.newest() == 8


def test_claim_records_another_instance_and_keeps_the_copy_id(mirror):
    mirror.follow("inst-a")
    m = put(mirror, 1)
    before = mirror.record(1)
    assert before.instance == "inst-a" and before.copy
    assert mirror.claim(1, m.digest, "inst-b") == mirror.record(1)
    assert mirror.record(1).instance == "inst-b" and mirror.record(1).copy == before.copy
    assert mirror.claim(1, "0" * 64, "inst-c") is None and mirror.record(1).instance == "inst-b"
    mirror.remove(1, "test")
    put(mirror, 1)
    assert mirror.record(1).copy != before.copy, "a copy pulled again has a new id"


# -- owners: nothing another user controls is used ---------------------------------------------------
NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_mirror_directory_another_user_owns_is_refused(tmp_path):
    planted = tmp_path / "shm" / "rolloutd"
    planted.mkdir(parents=True)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(OSError, match=rf"mirror directory {planted}: owned by uid {NOBODY}, "
                       r"not by rolloutd's user \(uid 0\): another user could replace a version's files"):
        Mirror(planted, max_bytes=1 << 20)
    assert os.listdir(planted) == []
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OSError, match="not a directory"):
        Mirror(tmp_path / "link", max_bytes=1 << 20)
    open_parent = tmp_path / "open"
    open_parent.mkdir(mode=0o777)
    os.chmod(open_parent, 0o777)  # writable by everyone, no sticky bit: anyone can swap what is in it
    with pytest.raises(OSError, match=r"open is writable by other users \(mode 0777"):
        Mirror(open_parent / "m", max_bytes=1 << 20)
    os.chmod(open_parent, 0o1777)  # as /dev/shm: sticky, so only its owner renames an entry
    assert Mirror(open_parent / "m", max_bytes=1 << 20).versions() == []
    (open_parent / "theirs").symlink_to(tmp_path / "elsewhere")  # a link another user made in it
    os.lchown(open_parent / "theirs", NOBODY, NOBODY)
    with pytest.raises(OSError, match=rf"{open_parent / 'theirs'} is owned by uid {NOBODY}"):
        Mirror(open_parent / "theirs" / "m", max_bytes=1 << 20)
    assert os.listdir(tmp_path / "elsewhere") == [], "nothing made through it"


def test_a_mirror_directory_of_ours_is_closed_to_other_users(tmp_path):
    (tmp_path / "m").mkdir(mode=0o755)
    os.chmod(tmp_path / "m", 0o755)
    Mirror(tmp_path / "m", max_bytes=1 << 20)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_version_with_a_file_another_user_owns_is_not_there(mirror, caplog):
    put(mirror, 1)
    name = sorted(payload(1))[0]
    os.chown(mirror.path(1) / name, NOBODY, NOBODY)
    assert mirror.versions() == [] and not mirror.has(1, mirror_mod.Manifest.model_validate_json(
        (mirror.path(1) / MANIFEST_NAME).read_text()).digest)
    assert f"{name} is owned by uid {NOBODY}, not by rolloutd's user" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_spare_file_another_user_owns_is_never_overwritten(shm_dir, caplog):
    mirror = Mirror(shm_dir / "m", max_bytes=1 << 20)
    put(mirror, 1)
    put(mirror, 2)
    os.chown(mirror.path(1) / sorted(payload(1))[0], NOBODY, NOBODY)
    mirror.remove(1, "test")
    assert spares(mirror) == {}, "nothing of a version holding another user's file is kept"
    mirror.remove(2, "test")
    assert len(spares(mirror)) == 2
    spare = max((mirror.dir / mirror_mod.SPARE_NAME).iterdir(), key=lambda p: p.stat().st_size)
    other = spare.stat().st_ino
    os.chown(spare, NOBODY, NOBODY)  # a spare given to another user afterwards is not taken
    put(mirror, 3)
    assert other not in inodes(mirror, 3).values(), "a fresh file, not the other user's"
    assert not (mirror.dir / mirror_mod.SPARE_NAME).exists(), "deleted, not left behind"
    assert f"owned by uid {NOBODY}; a pull never overwrites a file it does not own alone" in caplog.text
    for name, data in payload(3).items():
        st = (mirror.path(3) / name).stat()
        assert st.st_uid == os.geteuid() and (mirror.path(3) / name).read_bytes() == data


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_the_daemon_refuses_to_start_on_a_mirror_directory_another_user_made_first(tmp_path):
    """As in /dev/shm: a local user made the default mirror directory before the daemon, with a
    version in it. The daemon says why it stops, and neither reads nor changes anything there."""
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    planted = Mirror(shm / "rolloutd", max_bytes=1 << 20)
    put(planted, 1)
    for path in (planted.dir, *planted.dir.rglob("*")):
        os.chown(path, NOBODY, NOBODY)
    before = {p: p.stat() for p in (planted.dir, *planted.dir.rglob("*"))}
    config = tmp_path / "rolloutd.yaml"
    config.write_text(json.dumps({
        "registry": {"url": "http://127.0.0.1:9"}, "state_dir": str(tmp_path / "state"),
        "mirror": {"dir": str(planted.dir), "max_bytes": "1 GiB"}, "admin": {"port": free_port()},
        "servers": [{"name": "s0", "model": "/m", "public_port": free_port()}]}))
    proc = subprocess.run([sys.executable, "-m", "rolloutd.cli", "run", "-c", str(config)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert (f"rolloutd: mirror directory {planted.dir}: owned by uid {NOBODY}, not by rolloutd's user (uid 0): "
            "another user could replace a version's files; remove it") in proc.stderr
    assert {p: p.stat() for p in (planted.dir, *planted.dir.rglob("*"))} == before, "nothing read or changed there"
