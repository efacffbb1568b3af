"""The pull's worker processes on their own: a start that fails, a source that cannot be built,
a daemon that dies under them (its workers must not outlive it); and the faults a source or a
worker can show: an error reply of any size, a peer that trickles bytes, a worker that stops
or writes more than the daemon reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from rolloutd.rollout.fetch_pool import (
    EVENT_LINE_LIMIT,
    ApplyJob,
    ChunkJob,
    DeltaRejected,
    FetchPool,
    TargetDiffers,
    WorkerCrashed,
    cpu_times,
)
from rolloutd.rollout.sources import MESSAGE_CHARS, SourceSpec
from rolloutd.wire import errors
from rolloutd.wire.delta import encode_file
from rolloutd.wire.manifest import hash_chunks
from tests.support.processes import gone
from tests.support.pulled_versions import publish
from tests.support.waiting import until

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


def test_cpu_times_tell_a_process_kept_waiting_for_a_cpu_from_one_that_sleeps():
    """Two processes that spin on one CPU each wait for it about as long as they run; one that
    sleeps does neither; a process that is gone counts for nothing. What the kernel accounted,
    read back: the figures a progress line uses to say that a pull is starved."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(2)]
    procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        cpu = min(os.sched_getaffinity(0))
        for p in procs[:2]:
            os.sched_setaffinity(p.pid, {cpu})
        time.sleep(0.3)  # past the interpreters' start
        t0 = time.monotonic()
        before = [cpu_times([p.pid]) for p in procs]
        time.sleep(1.5)
        after = [cpu_times([p.pid]) for p in procs]
        window = time.monotonic() - t0  # every reading's interval lies within it
        (ran0, waited0), (ran1, waited1), (ran_nap, waited_nap) = (
            (a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True))
        assert ran0 > 0.15 and waited0 > 0.15, (ran0, waited0)
        assert ran1 > 0.15 and waited1 > 0.15, (ran1, waited1)
        assert ran0 + ran1 < window + 0.05, (ran0, ran1, window)  # one CPU's time, shared
        assert ran_nap < 0.05 and waited_nap < 0.05, (ran_nap, waited_nap)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert cpu_times([procs[0].pid]) == (0.0, 0.0)


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


# -- what a source or a worker can do to the pool ------------------------------------------------------------

@contextlib.asynccontextmanager
async def fake_source(handler):
    """A FAKE registry or peer on loopback: ``handler`` answers every byte range."""
    app = web.Application()
    app.router.add_get("/v1/versions/{v}/files/{name}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def a_chunk(tmp_path: Path, source: SourceSpec, size: int = 64 << 10, **kw) -> ChunkJob:
    part = tmp_path / "f"
    part.write_bytes(b"\0" * size)
    return ChunkJob(source, 1, "f", part, 0, size, "xxh3-128", "0" * 32, **kw)


# 60 KB of JSON as the source sends it (UTF-8); the worker's JSON escapes it to about 180 KB.
BIG_ERROR = json.dumps({"error": {"code": "file_unknown", "message": "é" * 30_000}}, ensure_ascii=False).encode()


async def test_an_error_reply_of_60_kb_reaches_the_pull_as_its_typed_error_cut_short(tmp_path):
    """Such a reply used to make a worker line over the pool's reader limit: the reader died,
    the chunk waited for pull.timeout_s, and closing the pool raised."""
    async def refuse(request):
        return web.Response(status=404, body=BIG_ERROR, content_type="application/json")
    async with fake_source(refuse) as url, FetchPool(workers=1, streams=1) as pool:
        [pid] = pool.pids
        job = a_chunk(tmp_path, SourceSpec("registry", url))
        with pytest.raises(errors.FileUnknown) as got:
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 10)
        assert str(got.value) == "é" * MESSAGE_CHARS  # the code kept, the message cut
        with pytest.raises(errors.FileUnknown):  # the same worker, still reading and read
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 10)
        assert pool.pids == [pid] and pool.restarts == 0
    assert gone(pid)  # and the pool closed without an error


FAKE_WORKER = """
import sys
sys.stdin.readline()
print('{"ready": 1}', flush=True)
for line in sys.stdin:  # every job answered with one line far over the daemon's limit
    print('{"id": 0, "junk": "' + "x" * %d + '"}', flush=True)
"""


async def test_a_worker_line_over_the_readers_limit_fails_its_chunk_and_the_worker_is_replaced(
        tmp_path, monkeypatch):
    """A FAKE worker (the real one bounds its lines) that answers a job with a line over the
    limit: the chunk fails at once, the worker is killed and another started."""
    fake_python(tmp_path, monkeypatch, FAKE_WORKER % (2 * EVENT_LINE_LIMIT))
    async with FetchPool(workers=1, streams=1, restart_initial_s=0.01) as pool:
        [pid] = pool.pids
        job = a_chunk(tmp_path, SourceSpec("registry", "http://127.0.0.1:9"))
        with pytest.raises(WorkerCrashed, match=f"pull worker {pid} wrote a line over {EVENT_LINE_LIMIT} bytes"):
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 10)
        await until(lambda: gone(pid) and pool.restarts == 1 and len(pool.pids) == 1, 10, "a new worker")


def fake_python(tmp_path: Path, monkeypatch, code: str) -> None:
    """The pool's workers become ``code`` (a FAKE worker), whatever module they are asked to run."""
    script = tmp_path / "fake_pull_worker.py"
    script.write_text(code)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))


BEATING = """
import sys, threading, time
sys.stdin.readline()
print('{"ready": 1}', flush=True)
def beat():
    while True:
        time.sleep(0.2)
        print('{"beat": 1}', flush=True)
threading.Thread(target=beat, daemon=True).start()
"""  # a FAKE worker's start: ready, then a beat every 0.2 s, whatever else it does

STUCK_WORKER = BEATING + """
for line in sys.stdin:  # jobs taken, never ended: a stream stuck where its own deadline does not reach
    pass
"""


async def test_a_worker_that_beats_but_never_ends_a_peer_chunk_is_replaced_past_the_chunks_deadline(
        tmp_path, monkeypatch):
    """A FAKE worker whose beat goes on while the stream holding the chunk is stuck (in the
    kernel, say, where the worker's own deadline cannot reach it): ``silence_s`` after the
    chunk's deadline the chunk fails and the worker is replaced."""
    fake_python(tmp_path, monkeypatch, STUCK_WORKER)
    async with FetchPool(workers=1, streams=1, beat_s=0.2, silence_s=1.5, restart_initial_s=0.01) as pool:
        [pid] = pool.pids
        job = a_chunk(tmp_path, SourceSpec("peer", "http://127.0.0.1:9", node="n"), timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashed, match=f"pull worker {pid} did not end a chunk 2 s after it began"):
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 20)
        assert time.monotonic() - t0 < 4
        await until(lambda: gone(pid) and pool.restarts == 1 and len(pool.pids) == 1, 10, "a new worker")


BUSY_THEN_STUCK_WORKER = BEATING + """
def spin():  # wants a CPU until past the chunk's limit, then stuck for good
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass
for line in sys.stdin:
    threading.Thread(target=spin, daemon=True).start()
"""


async def test_a_worker_runnable_at_the_chunks_limit_and_stuck_after_it_is_still_replaced(
        tmp_path, monkeypatch):
    """A FAKE worker that wants a CPU when the chunk's limit (2 s) passes, and is stuck from 3 s
    on: one look at the limit would wait on it for ever; the pool looks again until it is not
    runnable."""
    fake_python(tmp_path, monkeypatch, BUSY_THEN_STUCK_WORKER)
    async with FetchPool(workers=1, streams=1, beat_s=0.2, silence_s=1.5, restart_initial_s=0.01) as pool:
        [pid] = pool.pids
        job = a_chunk(tmp_path, SourceSpec("peer", "http://127.0.0.1:9", node="n"), timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashed, match=f"pull worker {pid} did not end a chunk 2 s after it began"):
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 20)
        assert 2.9 < time.monotonic() - t0 < 6
        await until(lambda: gone(pid) and pool.restarts == 1, 10, "a new worker")


async def test_a_stopped_worker_is_noticed_its_chunk_fails_and_a_new_worker_fetches_it(registry, tmp_path):
    """SIGSTOP: the worker neither dies nor answers. Within ``silence_s`` (plus a beat) its
    chunk fails, it is killed, and the worker started in its place fetches the chunk."""
    manifest, files = publish(registry, 1)
    entry = manifest.files[0]
    start, end = manifest.chunk_span(entry, 1)
    part = tmp_path / entry.name
    part.write_bytes(b"\0" * entry.size)
    job = ChunkJob(SourceSpec("registry", registry.url), 1, entry.name, part, start, end, manifest.hash,
                   entry.chunks[1])
    async with FetchPool(workers=1, streams=1, beat_s=0.2, silence_s=1.5, restart_initial_s=0.01) as pool:
        [pid] = pool.pids
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashed, match=f"pull worker {pid} wrote nothing for 1.5 s"):
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 20)
        assert time.monotonic() - t0 < 4  # 1.5 s of silence, and at most as much again if a beat was due
        await until(lambda: gone(pid) and len(pool.pids) == 1, 10, "the stopped worker replaced")
        await asyncio.wait_for(pool.fetch(job, lambda n: None), 20)
    assert part.read_bytes()[start:end] == files[entry.name][start:end]


async def test_a_peer_that_trickles_bytes_is_cut_at_the_chunks_deadline(tmp_path):
    """A byte every 50 ms: no read ever waits long enough for the read timeout, and a 64 KiB
    chunk would take an hour. The chunk's deadline ends it while it reads."""
    size = 64 << 10

    async def trickle(request):
        resp = web.StreamResponse(status=206, headers={"content-range": f"bytes 0-{size - 1}/{size}"})
        resp.content_length = size
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(size):
                await resp.write(b"x")
                await asyncio.sleep(0.05)
        return resp
    async with fake_source(trickle) as url, FetchPool(workers=1, streams=1) as pool:
        peer = SourceSpec("peer", url, token="t", node="slow-node", read_timeout_s=30)
        job = a_chunk(tmp_path, peer, size, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(errors.RegistryUnavailable, match="not done by the chunk's deadline"):
            await asyncio.wait_for(pool.fetch(job, lambda n: None), 20)
        assert time.monotonic() - t0 < 3


def test_a_worker_line_stays_under_the_readers_limit_whatever_the_error_it_reports():
    """Messages and bodies of any size and script are cut to what the pull needs: the kind, the
    status, the error code and the start of each message."""
    import io

    from rolloutd.rollout.fetch_pool import _error
    from rolloutd.rollout.fetch_worker import Worker

    out = io.StringIO()
    worker = Worker({"piece_bytes": 1024, "request_bytes": 1024, "streams": 0}, out=out)
    body = {"error": {"code": "file_unknown", "message": "é" * 30_000}, "detail": ["x" * 1000] * 100}
    worker.emit({"id": 7, "error": {"kind": "http", "message": "ü" * 50_000, "status": 404, "body": body}})
    worker.emit({"id": 8, "error": {"kind": "write", "message": "/mirror/" + "ж/" * 40_000}})
    worker.emit({"id": 9, "bytes": 1 << 20})
    lines = out.getvalue().splitlines(keepends=True)
    assert len(lines) == 3 and all(len(line.encode()) <= EVENT_LINE_LIMIT for line in lines)
    http, write, progress = (json.loads(line) for line in lines)
    err = _error(http["error"])
    assert isinstance(err, errors.FileUnknown) and err.status == 404 and str(err) == "é" * MESSAGE_CHARS
    assert write == {"id": 8, "error": {"kind": "write", "status": None, "body": None,
                                        "message": ("/mirror/" + "ж/" * 40_000)[:MESSAGE_CHARS]}}
    assert progress == {"id": 9, "bytes": 1 << 20}


def delta_case(tmp_path: Path) -> tuple[dict[str, Path], Path, bytes, Path]:
    """A base file, a target that differs from it in a few bytes, and the delta between them:
    (base files, delta path, target bytes, the empty target file to rebuild into)."""
    base = os.urandom(300_000)
    target = bytearray(base)
    for at in (5, 70_000, 299_999):
        target[at] ^= 0x5A
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "w.bin").write_bytes(base)
    with open(tmp_path / "w.bin.delta", "wb") as out:
        encode_file({"w.bin": base}, bytes(target), out, target_name="w.bin")
    (tmp_path / "w.bin").write_bytes(b"")
    return {"w.bin": tmp_path / "base" / "w.bin"}, tmp_path / "w.bin.delta", bytes(target), tmp_path / "w.bin"


def apply_job(base: dict[str, Path], delta: Path, into: Path, target: bytes, **kw) -> ApplyJob:
    chunk = 64 << 10
    return ApplyJob(**{"version": 2, "name": into.name, "base": base, "delta": delta, "target": into,
                       "hash": "xxh3-128", "chunk_bytes": chunk,
                       "digests": tuple(hash_chunks(target, chunk, "xxh3-128")), **kw})


async def test_a_rebuild_job_writes_the_target_in_a_worker_and_reports_its_bytes(tmp_path):
    base, delta, target, into = delta_case(tmp_path)
    reported: list[int] = []
    async with FetchPool(workers=1, streams=1, progress_bytes=100_000) as pool:
        await asyncio.wait_for(pool.apply(apply_job(base, delta, into, target), reported.append), 30)
    assert into.read_bytes() == target and sum(reported) == len(target) and reported
    assert (tmp_path / "base" / "w.bin").read_bytes() != target  # the base is read, never written


async def test_rebuild_failures_reach_the_pull_as_their_own_errors_and_the_worker_goes_on(tmp_path):
    base, delta, target, into = delta_case(tmp_path)
    wrong = bytearray(target)
    wrong[200_000] ^= 1  # the third chunk's digest is not what the delta rebuilds
    (tmp_path / "junk.delta").write_bytes(b"RDELTA1\n" + os.urandom(1000))
    async with FetchPool(workers=1, streams=1) as pool:
        with pytest.raises(TargetDiffers, match="chunk 3"):
            await asyncio.wait_for(pool.apply(apply_job(base, delta, into, bytes(wrong)), lambda n: None), 30)
        with pytest.raises(DeltaRejected) as err:
            await asyncio.wait_for(pool.apply(apply_job(base, tmp_path / "junk.delta", into, target),
                                              lambda n: None), 30)
        assert not isinstance(err.value, TargetDiffers)
        with pytest.raises(OSError, match="No such file"):
            await asyncio.wait_for(pool.apply(apply_job({"w.bin": tmp_path / "gone"}, delta, into, target),
                                              lambda n: None), 30)
        await asyncio.wait_for(pool.apply(apply_job(base, delta, into, target), lambda n: None), 30)
        assert pool.restarts == 0
    assert into.read_bytes() == target
