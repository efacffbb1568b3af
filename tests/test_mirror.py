"""The node mirror: complete versions only under a version's name, partials, gc and room."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rolloutd.mirror import MANIFEST_NAME, Mirror, MirrorFull
from rolloutd.registry.manifest import FileEntry, Manifest, hash_chunks

CHUNK = 4096


def make_manifest(version: int, files: dict[str, bytes]) -> Manifest:
    entries = [FileEntry(name=n, size=len(d), chunks=hash_chunks(d, CHUNK, "xxh3-128")) for n, d in files.items()]
    return Manifest(version=version, chunk_bytes=CHUNK, files=entries).sealed()


def payload(version: int, size: int = 10_000) -> dict[str, bytes]:
    return {"model-00001-of-00002.safetensors": bytes([version]) * size,
            "model-00002-of-00002.safetensors": bytes([version + 1]) * (size // 2)}


def put(mirror: Mirror, version: int, size: int = 10_000) -> Manifest:
    """Write a version the way the puller does: begin, pwrite every file, commit."""
    files = payload(version, size)
    manifest = make_manifest(version, files)
    partial = mirror.begin(manifest)
    for name, data in files.items():
        write(partial, name, data)
    mirror.commit(partial)
    return manifest


def write(partial, name: str, data: bytes) -> None:
    fd = partial.open(name)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


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
    with caplog.at_level(logging.WARNING, logger="rolloutd.mirror"):
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
    assert sorted(os.listdir(mirror.dir)) == ["2", "5"]  # no trash left behind
    assert mirror.gc(in_use={2}) == []
    assert mirror.gc(in_use=set()) == [2]
    assert mirror.versions() == [5]


def test_usage_counts_versions_and_partials(mirror):
    m = put(mirror, 1)
    one = m.total_bytes + len(m.model_dump_json())
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
    assert ("30.2 KiB stays after removing every version not kept "
            "(kept: v1 15.1 KiB, v2 15.1 KiB; in use: [1]") in text, text
    assert mirror.versions() == [1, 2]  # nothing removed when it cannot fit anyway


def test_mirror_full_names_the_figures(tmp_path):
    mirror = Mirror(tmp_path / "m", max_bytes=3 << 20)
    with pytest.raises(MirrorFull, match=r"cannot take 4\.0 MiB more: max_bytes is 3\.0 MiB and 0 B stays"):
        mirror.ensure_room(4 << 20, in_use=set())


def test_begin_fails_cleanly_when_the_filesystem_is_full(tmp_path, monkeypatch):
    mirror = Mirror(tmp_path / "m", max_bytes=1 << 30)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        mirror.begin(make_manifest(1, payload(1)))
    assert os.listdir(mirror.dir) == []


def test_rejects_a_nonsensical_limit(tmp_path: Path):
    with pytest.raises(ValueError):
        Mirror(tmp_path, max_bytes=0)
