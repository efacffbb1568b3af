"""The registry's byte stores: letting go of a version's bytes (deleting its files, unmapping
its memory) never runs on the event loop."""

from __future__ import annotations

import os
import threading
import weakref

import pytest

from rolloutd.registry.blobs import DiskStore, MemoryStore, StagingDropped
from rolloutd.wire.manifest import FileEntry, Manifest, hash_chunks
from tests.support.loop_probe import where_rmtree_runs
from tests.support.waiting import until

CHUNK = 4096


def stage(store: DiskStore, version: int, data: bytes = b"w" * 10_000) -> Manifest:
    store.stage_bytes(version, "model.safetensors", data)
    entry = FileEntry(name="model.safetensors", size=len(data), chunks=hash_chunks(data, CHUNK, "xxh3-128"))
    return Manifest(version=version, chunk_bytes=CHUNK, files=[entry]).sealed()


async def test_reclaim_is_at_once_and_deletes_off_the_event_loop(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    blobs = store.commit(stage(store, 1))
    store.commit(stage(store, 2))
    where = where_rmtree_runs(monkeypatch)
    store.reclaim(1, blobs)  # on the loop, as the Store calls it
    assert os.listdir(tmp_path / "versions") == ["2"]  # gone from versions/ before this returns
    await until(lambda: os.listdir(tmp_path / "trash") == [])
    assert where == ["thread"], f"rmtree ran on: {where}"
    store.reclaim(1, {})  # again: nothing there, nothing done
    store.close()
    assert os.listdir(tmp_path / "trash") == [] and where == ["thread"]


async def test_dropping_staged_files_deletes_off_the_event_loop(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    stage(store, 3)
    where = where_rmtree_runs(monkeypatch)
    store.discard_staging(3)  # DELETE /v1/uploads/3 runs this on the loop
    assert store.staged_sizes(3) == {} and not (tmp_path / "staging" / "3").exists()
    await until(lambda: os.listdir(tmp_path / "trash") == [])
    assert where == ["thread"], f"rmtree ran on: {where}"
    store.close()


def test_pending_deletions_finish_on_close(tmp_path):
    store = DiskStore(tmp_path)
    for v in (1, 2, 3):
        store.reclaim(v, store.commit(stage(store, v)))
    store.close()
    assert os.listdir(tmp_path / "versions") == [] and os.listdir(tmp_path / "trash") == []


def freed_on(obj) -> list[str]:
    """The name of the thread ``obj`` is freed on, once it is."""
    where: list[str] = []
    weakref.finalize(obj, lambda: where.append(threading.current_thread().name))
    return where


async def test_a_memory_store_unmaps_reclaimed_and_dropped_versions_off_the_event_loop():
    """A reclaimed version's memory and staged files dropped by ``DELETE /v1/uploads`` are
    freed on the store's freeing thread (0.16 s per GiB here: a version of many gigabytes
    freed on the loop held heartbeats past their timeout)."""
    store = MemoryStore()
    for v in (1, 2):
        up = store.upload(v, "model.safetensors", 1 << 20)
        up.write([b"w" * (1 << 20)])
        up.finish()
    blobs = store.commit(stage_manifest(1, 1 << 20))
    reclaimed = freed_on(blobs["model.safetensors"].data)  # the memory file's mapping
    store.reclaim(1, blobs)
    del blobs
    dropped = freed_on(store._staging[2]["model.safetensors"])
    store.discard_staging(2)  # DELETE /v1/uploads/2 runs this on the loop
    assert store.staged_sizes(2) == {}
    await until(lambda: reclaimed and dropped)
    assert reclaimed == dropped == ["registry-free_0"], (reclaimed, dropped)


def stage_manifest(version: int, size: int) -> Manifest:
    data = b"w" * size
    entry = FileEntry(name="model.safetensors", size=size, chunks=hash_chunks(data, CHUNK, "xxh3-128"))
    return Manifest(version=version, chunk_bytes=CHUNK, files=[entry]).sealed()


def test_memory_is_let_go_of_at_once_when_the_freeing_thread_takes_no_more_work(monkeypatch):
    """At interpreter exit (an embedded registry stopped by an exit handler) the freeing
    thread takes no new work: memory is then let go of by the caller, without an error."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from rolloutd.registry import blobs
    gone = ThreadPoolExecutor(max_workers=1)
    gone.shutdown()
    monkeypatch.setattr(blobs, "_FREER", gone)
    held = {"model.safetensors": mmap.mmap(-1, 1 << 20)}
    where = freed_on(held["model.safetensors"])
    blobs.let_go(held)
    assert where == [threading.current_thread().name]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_version_whose_staged_files_were_dropped_is_never_committed(tmp_path, kind):
    """Staged files dropped (``DELETE /v1/uploads``, a cancelled embedded publish) before the
    commit: the commit refuses, and no version appears, not even an empty one."""
    store = DiskStore(tmp_path) if kind == "disk" else MemoryStore()
    manifest = stage(store, 1)
    assert store.verify_staged(manifest) == {}
    store.discard_staging(1)
    with pytest.raises(StagingDropped):
        store.verify_staged(manifest)
    with pytest.raises(StagingDropped):
        store.commit(manifest)
    if kind == "disk":
        assert os.listdir(tmp_path / "versions") == []
        assert store.load_committed() == []
        store.close()
