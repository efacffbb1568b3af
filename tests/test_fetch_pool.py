"""The pull's worker processes on their own: a start that fails, a source that cannot be built,
and a daemon that dies under them (its workers must not outlive it)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rolloutd.rollout.fetch_pool import ChunkJob, FetchPool, WorkerCrashed
from rolloutd.rollout.sources import SourceSpec

from .test_puller import gone

SPEC = SourceSpec("registry", "http://127.0.0.1:9")  # nothing listens there


async def test_a_worker_that_cannot_start_fails_the_start_and_leaves_nothing_running(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the workers' interpreter exits at once
    pool = FetchPool(workers=2, streams=2)
    with pytest.raises(WorkerCrashed, match=r"pull worker \d+ did not start \(exit status 1\)"):
        async with pool:
            pass
    assert pool.pids == []


async def test_workers_stop_when_the_pool_closes():
    async with FetchPool(workers=2, streams=3) as pool:
        pids = pool.pids
        assert len(pids) == 2
    assert all(gone(pid) for pid in pids)


def test_workers_exit_when_their_daemon_is_killed(tmp_path: Path):
    """SIGKILL leaves the daemon no chance to stop them: their stdin ends, and so do they."""
    script = tmp_path / "daemon.py"
    script.write_text(
        "import asyncio, sys\n"
        "from rolloutd.rollout.fetch_pool import FetchPool\n"
        "async def main():\n"
        "    async with FetchPool(workers=2, streams=2) as p:\n"
        "        print(*p.pids, flush=True)\n"
        "        await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n")
    daemon = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in daemon.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        daemon.kill()
        daemon.wait(10)
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"workers {pids} outlived their daemon"
            time.sleep(0.05)
    finally:
        daemon.kill()
        daemon.wait(10)


async def test_a_chunk_waits_for_a_free_stream():
    async with FetchPool(workers=1, streams=1) as pool:
        assert pool._pick() is not None
        # a job against a source that refuses connections fails as "unavailable", promptly
        from rolloutd.wire import errors
        job = ChunkJob(SPEC, 1, "x", Path("/nonexistent"), 0, 10, "xxh3-128", "0" * 32)
        with pytest.raises((errors.RegistryUnavailable, OSError)):
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 30)


async def test_a_source_that_cannot_be_built_fails_its_chunk_and_the_worker_goes_on(tmp_path: Path):
    part = tmp_path / "f"
    part.write_bytes(b"\0" * 10)
    async with FetchPool(workers=1, streams=1) as pool:
        pid = pool.pids
        bad = ChunkJob(SourceSpec("carrier-pigeon", "http://127.0.0.1:9"), 1, "f", part, 0, 10, "xxh3-128", "0" * 32)
        with pytest.raises(RuntimeError, match="unknown source kind 'carrier-pigeon'"):
            await asyncio.wait_for(pool.fetch(bad, lambda n: None), 30)
        assert pool.pids == pid  # the same worker, still there


def test_pieces_of_any_length_land_at_their_offsets_and_are_hashed_in_order(tmp_path: Path):
    """Pieces longer and shorter than a page, not aligned to one, land where they belong and
    hash like the bytes themselves; the bytes around the chunk are left alone."""
    import os

    import xxhash

    from rolloutd.rollout.fetch_worker import ChunkWriter

    data = os.urandom(3 * (1 << 20) + 12345)
    start = 4097  # not page-aligned
    path = tmp_path / "part"
    path.write_bytes(b"\xaa" * (start + len(data) + 100))
    fd = os.open(path, os.O_RDWR)
    try:
        hasher, reported = xxhash.xxh3_128(), []
        with ChunkWriter(fd, start, start + len(data), hasher, reported.append, 1 << 20) as sink:
            at = 0
            for n in (1, 4095, 1 << 20, 10, 2 << 20, len(data)):
                piece = memoryview(data)[at:at + n]
                sink.write(piece)
                at += len(piece)
        assert sink.offset == start + len(data)
    finally:
        os.close(fd)
    held = path.read_bytes()
    assert held[start:start + len(data)] == data
    assert held[:start] == b"\xaa" * start and held[start + len(data):] == b"\xaa" * 100
    assert hasher.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert sum(reported) == len(data)  # progress covers every byte, the last piece included


def test_bytes_past_the_end_of_the_chunk_are_an_error_and_are_not_written(tmp_path: Path):
    import os

    import xxhash

    from rolloutd.rollout.fetch_worker import ChunkWriter, _Corrupt

    path = tmp_path / "part"
    path.write_bytes(b"x" * 3000)
    fd = os.open(path, os.O_RDWR)
    try:
        with ChunkWriter(fd, 0, 2000, xxhash.xxh3_128(), lambda n: None, 1 << 20) as sink:
            sink.write(memoryview(b"a" * 1500))
            with pytest.raises(_Corrupt, match="more than the 2000 bytes"):
                sink.write(memoryview(b"b" * 600))  # the next chunk's bytes are not this one's to write
    finally:
        os.close(fd)
    assert path.read_bytes() == b"a" * 1500 + b"x" * 1500
