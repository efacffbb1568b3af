"""The registry's disk store: deleting a version's bytes never runs on the event loop."""

from __future__ import annotations

import os

from rolloutd.registry.server.blobs import DiskStore
from rolloutd.wire.manifest import FileEntry, Manifest, hash_chunks

from .test_mirror import wait_until, where_rmtree_runs

CHUNK = 4096


def stage(store: DiskStore, version: int, data: bytes = b"w" * 10_000) -> Manifest:
    store.stage_bytes(version, "model.safetensors", data)
    entry = FileEntry(name="model.safetensors", size=len(data), chunks=hash_chunks(data, CHUNK, "xxh3-128"))
    return Manifest(version=version, chunk_bytes=CHUNK, files=[entry]).sealed()


async def test_reclaim_is_at_once_and_deletes_off_the_event_loop(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    store.commit(stage(store, 1))
    store.commit(stage(store, 2))
    where = where_rmtree_runs(monkeypatch)
    store.reclaim(1)  # on the loop, as the Store calls it
    assert os.listdir(tmp_path / "versions") == ["2"]  # gone from versions/ before this returns
    await wait_until(lambda: os.listdir(tmp_path / "trash") == [])
    assert where == ["thread"], f"rmtree ran on: {where}"
    store.reclaim(1)  # again: nothing there, nothing done
    store.close()
    assert os.listdir(tmp_path / "trash") == [] and where == ["thread"]


async def test_dropping_staged_files_deletes_off_the_event_loop(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    stage(store, 3)
    where = where_rmtree_runs(monkeypatch)
    store.discard_staging(3)  # DELETE /v1/uploads/3 runs this on the loop
    assert store.staged_sizes(3) == {} and not (tmp_path / "staging" / "3").exists()
    await wait_until(lambda: os.listdir(tmp_path / "trash") == [])
    assert where == ["thread"], f"rmtree ran on: {where}"
    store.close()


def test_pending_deletions_finish_on_close(tmp_path):
    store = DiskStore(tmp_path)
    for v in (1, 2, 3):
        store.commit(stage(store, v))
        store.reclaim(v)
    store.close()
    assert os.listdir(tmp_path / "versions") == [] and os.listdir(tmp_path / "trash") == []
