"""The puller against a real embedded registry over HTTP, with a fake proxy in front of it for
the faults a healthy registry never shows (corrupt bytes, stalls at a chosen request)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import mmap
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from rolloutd.registry.blobs import MemoryBlob
from rolloutd.rollout.fetch_pool import FetchPool
from rolloutd.rollout.mirror import MANIFEST_NAME, RECORD_NAME, Mirror
from rolloutd.rollout.puller import Puller, PullError, PullSettings, PullState
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.trainer.publish import serialize_shards
from rolloutd.wire import errors
from rolloutd.wire.delta import DEFAULT_ENCODING, delta_file_name, encode_file
from rolloutd.wire.manifest import Delta, DeltaFile, Manifest, hash_chunks
from tests.support.processes import gone
from tests.support.pulled_versions import CHUNK, SHARD, publish, state_dict
from tests.support.registry_proxy import InLoopProxy
from tests.support.waiting import until


class FlippingProxy(InLoopProxy):
    """A fake registry front: forwards every request to the real registry. Byte requests can
    be corrupted (one byte flipped in the body of the response whose range starts at a chosen
    offset) or cut (half the body sent, then the connection closed), and ``on_bytes`` runs
    before each byte request is forwarded (to stall it, advance the registry's clock, retire a
    version...)."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.flips: dict[tuple[str, int], int | None] = {}  # (file, range start) -> times left; None: always
        self.flipped = 0
        self.cuts: dict[tuple[str, int], int] = {}  # (file, range start) -> times left
        self.cut_count = 0
        self.byte_requests: list[tuple[str, int, int]] = []
        self.on_bytes: Callable[[int], Awaitable[None]] | None = None  # gets the request's number

    def flip(self, name: str, start: int, times: int | None = 1) -> None:
        self.flips[(name, start)] = times

    def cut(self, name: str, start: int, times: int = 1) -> None:
        self.cuts[(name, start)] = times

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        parts = request.path.split("/")
        is_bytes = len(parts) == 6 and parts[4] == "files" and request.method == "GET"
        start = 0
        if is_bytes:
            name = parts[5]
            start, end = (int(x) for x in request.headers["range"].removeprefix("bytes=").split("-"))
            self.byte_requests.append((name, start, end + 1))
            if self.on_bytes is not None:
                await self.on_bytes(len(self.byte_requests))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("range", "content-type")}
        async with self._session.request(request.method, request.path_qs, headers=headers,
                                         data=await request.read()) as r:
            body = bytearray(await r.read())
            keep = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "content-range")}
        if is_bytes and r.status == 206 and (name, start) in self.flips:
            left = self.flips[(name, start)]
            if left is None or left > 0:
                body[0] ^= 0xFF
                self.flipped += 1
                if left is not None:
                    self.flips[(name, start)] = left - 1
        if is_bytes and r.status == 206 and self.cuts.get((name, start), 0) > 0:
            self.cuts[(name, start)] -= 1
            self.cut_count += 1
            resp = web.StreamResponse(status=206, headers=keep)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(bytes(body[:len(body) // 2]))
            request.transport.close()  # the rest never comes
            return resp
        return web.Response(status=r.status, body=bytes(body), headers=keep)


@pytest.fixture
async def proxy(registry):
    async with FlippingProxy(registry.url) as p:
        yield p


@pytest.fixture
async def client(proxy):
    async with RegistryClient(proxy.url) as c:
        yield c


@pytest.fixture
def mirror(tmp_path) -> Mirror:
    return Mirror(tmp_path / "mirror", max_bytes=1 << 30)


def make_puller(client, mirror, **kw) -> Puller:
    kw = {"holder": "node-7", "streams": 4, "request_bytes": 16 << 10, "retry_delay_s": 0.0, **kw}
    parts = {k: kw.pop(k) for k in ("swarm", "in_use", "on_worker_restart", "clock") if k in kw}  # collaborators
    return Puller(client, mirror, PullSettings(**kw), **parts)


def assert_pulled(mirror: Mirror, version: int, files: dict[str, bytes], manifest) -> None:
    vdir = mirror.path(version)
    assert sorted(os.listdir(vdir)) == sorted([*files, MANIFEST_NAME, RECORD_NAME])
    for name, data in files.items():
        assert (vdir / name).read_bytes() == data, name
    assert (vdir / MANIFEST_NAME).read_text() == manifest.model_dump_json()
    assert sorted(os.listdir(mirror.dir)) == [str(v) for v in sorted(mirror.versions())]  # no partial


def nothing_left(mirror: Mirror, registry) -> None:
    assert os.listdir(mirror.dir) == []
    assert registry.service.store.lease_count() == 0


# -- pulls that work ----------------------------------------------------------------------------------------

async def test_pull_is_byte_identical_and_complete(registry, proxy, client, mirror):
    manifest, files = publish(registry, 1)
    assert len(files) >= 3 and sum(len(f.chunks) for f in manifest.files) >= 40
    puller = make_puller(client, mirror, streams=1, request_bytes=1 << 30)
    result = await puller.pull(1)
    assert (result.version, result.path, result.digest) == (1, mirror.path(1), manifest.digest)
    assert result.bytes == manifest.total_bytes and result.retries == 0 and not result.reused
    assert_pulled(mirror, 1, files, manifest)
    assert registry.service.store.lease_count() == 0
    # one request per chunk when request_bytes is at least a chunk
    assert len(proxy.byte_requests) == sum(len(f.chunks) for f in manifest.files)
    p = puller.progress
    assert (p.state, p.version, p.bytes_done, p.bytes_total, p.eta_s) == (
        PullState.DONE, 1, manifest.total_bytes, manifest.total_bytes, 0.0)
    assert p.as_dict()["state"] == "done"


async def test_several_streams_with_requests_smaller_than_a_chunk(registry, proxy, client, mirror):
    publish(registry, 1)
    manifest, files = publish(registry, 2)
    puller = make_puller(client, mirror, streams=6, request_bytes=20_000)
    in_flight, most = 0, 0
    all_in = asyncio.Event()

    async def count(_n: int) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        if most == 6:
            all_in.set()
        with contextlib.suppress(TimeoutError):  # hold the first requests until the other streams' came
            await asyncio.wait_for(all_in.wait(), 5)
        in_flight -= 1
    proxy.on_bytes = count
    result = await puller.pull("latest")
    assert result.version == 2
    assert_pulled(mirror, 2, files, manifest)
    assert most == 6
    spans = sorted((n, s, e) for n, s, e in proxy.byte_requests)
    assert all(e - s <= 20_000 for _, s, e in spans)
    chunks = sum(len(f.chunks) for f in manifest.files)
    assert len(spans) == sum(-(-(e - s) // 20_000) for f in manifest.files
                             for s, e in (manifest.chunk_span(f, i) for i in range(len(f.chunks))))
    assert len(spans) > 3 * chunks


def scheduling(pid: int) -> tuple[int, int]:
    """(policy, niceness) of a process: SCHED_IDLE is 5."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[38]), int(fields[16])


async def test_pull_work_runs_in_worker_processes_that_are_reaped(registry, proxy, client, mirror):
    manifest, files = publish(registry, 1)
    puller = make_puller(client, mirror, workers=2, streams=4, priority="idle")
    seen: dict[int, tuple[int, int]] = {}

    async def look(n: int) -> None:
        if n == 10:
            seen.update({pid: scheduling(pid) for pid in puller.progress.worker_pids})
    proxy.on_bytes = look
    result = await puller.pull(1)
    assert result.bytes == manifest.total_bytes
    assert_pulled(mirror, 1, files, manifest)
    assert len(seen) == 2 and os.getpid() not in seen  # two processes of their own
    assert set(seen.values()) == {(os.SCHED_IDLE, 19)}   # behind generation when the CPU is contended
    assert puller.progress.worker_pids == [] and all(gone(pid) for pid in seen)
    assert puller.progress.as_dict()["worker_restarts"] == 0


async def test_a_worker_killed_mid_pull_is_restarted_and_its_chunks_fetched_again(registry, proxy, client, mirror,
                                                                                   caplog):
    manifest, files = publish(registry, 1)
    restarts = []
    puller = make_puller(client, mirror, workers=2, streams=2, on_worker_restart=lambda: restarts.append(1))
    killed = []

    async def kill(n: int) -> None:
        if n == 12:
            killed.append(puller.progress.worker_pids[0])
            os.kill(killed[0], signal.SIGKILL)
    proxy.on_bytes = kill
    with caplog.at_level(logging.WARNING):
        result = await puller.pull(1)
    assert_pulled(mirror, 1, files, manifest)
    assert result.bytes == manifest.total_bytes  # the lost chunk's bytes are not counted twice
    assert restarts == [1] and puller.progress.worker_restarts == 1 and result.retries >= 1
    assert f"pid {killed[0]} exited (killed by SIGKILL - out of memory?)" in caplog.text
    assert "WorkerCrashed: pull worker" in caplog.text


async def test_a_version_already_in_the_mirror_is_not_pulled_again(registry, proxy, client, mirror):
    manifest, files = publish(registry, 1)
    await make_puller(client, mirror).pull(1)
    before = len(proxy.byte_requests)
    again = await make_puller(client, mirror).pull("latest")
    assert again.reused and again.bytes == 0 and again.digest == manifest.digest
    assert len(proxy.byte_requests) == before
    assert registry.service.store.lease_count() == 0  # released on the short path too


async def test_progress_is_readable_while_pulling(registry, proxy, client, mirror):
    manifest, _ = publish(registry, 1)
    puller = make_puller(client, mirror, streams=1)
    seen = []

    async def look(n: int) -> None:
        if n in (20, 60):
            await asyncio.sleep(0.01)
            seen.append(puller.progress.as_dict())
    proxy.on_bytes = look
    await puller.pull(1)
    first, later = seen
    assert first["state"] == "pulling" and first["version"] == 1 and first["bytes_total"] == manifest.total_bytes
    assert 0 < first["bytes_done"] < later["bytes_done"] < manifest.total_bytes
    assert later["rate_bytes_per_s"] > 0 and later["eta_s"] > 0


async def test_the_rate_never_reads_negative_after_a_chunk_retry(client, mirror, clock):
    """A chunk that reported 8 MiB and then failed (its bytes are fetched again) once made the
    rate read -1.3 MiB/s: its bytes left the progress, but not the rate's samples."""
    from rolloutd.rollout.fetch_pool import ChunkCorrupt
    from rolloutd.rollout.puller import PullProgress

    class fake_failing_pool:  # a chunk that moves its bytes slowly, then fails its digest
        async def fetch(self, job, progress):
            clock.advance(0.5)
            progress(8 << 20)
            clock.advance(6.0)  # the rate's window moves past the start of the pull
            progress(1)
            raise ChunkCorrupt("digest")
    puller = make_puller(client, mirror, clock=clock)
    puller.progress = PullProgress(target=1, clock=clock, state=PullState.PULLING, bytes_total=64 << 20)
    with pytest.raises(ChunkCorrupt):
        await puller._attempt(fake_failing_pool(), None)
    seen = puller.progress.as_dict()
    assert seen["bytes_done"] == 0  # fetched again: not done
    assert seen["rate_bytes_per_s"] >= 0 and (seen["eta_s"] is None or seen["eta_s"] >= 0), seen


# -- corruption -----------------------------------------------------------------------------------------------

async def test_a_chunk_corrupted_once_is_fetched_again(registry, proxy, client, mirror, caplog):
    manifest, files = publish(registry, 1)
    entry = manifest.files[1]
    proxy.flip(entry.name, 2 * CHUNK)
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.puller"):
        result = await make_puller(client, mirror).pull(1)
    assert proxy.flipped == 1 and result.retries == 1
    assert result.bytes == manifest.total_bytes  # the bad attempt's bytes are not counted twice
    assert_pulled(mirror, 1, files, manifest)
    assert f"retry version 1 file {entry.name} chunk 2 (attempt 1 of 4 failed): " in caplog.text
    assert "does not match the manifest" in caplog.text


async def test_a_transfer_cut_halfway_is_fetched_again(registry, proxy, client, mirror):
    manifest, files = publish(registry, 1)
    entry = manifest.files[0]
    proxy.cut(entry.name, CHUNK)
    result = await make_puller(client, mirror).pull(1)
    assert proxy.cut_count == 1 and result.retries == 1
    assert result.bytes == manifest.total_bytes
    assert_pulled(mirror, 1, files, manifest)


def requested(proxy, since: int) -> set[tuple[str, int]]:
    """(file, chunk index) of every byte request the proxy forwarded after the first ``since``."""
    return {(name, start // CHUNK) for name, start, _ in proxy.byte_requests[since:]}


def chunks_of(manifest, bits: int) -> set[tuple[str, int]]:
    every = [(e.name, i) for e in manifest.files for i in range(len(e.chunks))]
    return {c for bit, c in enumerate(every) if bits >> bit & 1}


async def test_a_chunk_corrupted_every_time_fails_the_pull_and_the_next_try_fetches_only_the_rest(
        registry, proxy, client, mirror, caplog):
    manifest, files = publish(registry, 1)
    entry = manifest.files[0]
    proxy.flip(entry.name, 3 * CHUNK, times=None)
    puller = make_puller(client, mirror, max_chunk_retries=2)
    with pytest.raises(PullError, match=rf"version 1 file {entry.name} chunk 3: failed 3 times; last: "
                                        r"ChunkCorrupt: digest [0-9a-f]{32} does not match") as err:
        await puller.pull(1)
    assert proxy.flipped == 3
    assert puller.progress.state is PullState.FAILED and puller.progress.error == str(err.value)
    assert puller.progress.retries == 2
    # Nothing visible, the lease released; the chunks it checked are kept, hidden, for a next try.
    assert mirror.versions() == [] and registry.service.store.lease_count() == 0
    kept = puller.kept
    assert kept is not None and os.listdir(mirror.dir) == [".1.partial"]
    kept_chunks = chunks_of(manifest, kept.done_bits)
    assert (entry.name, 3) not in kept_chunks and len(kept_chunks) >= 3
    sizes = {e.name: e.size for e in manifest.files}
    assert kept.bytes == sum(min(CHUNK, sizes[name] - i * CHUNK) for name, i in kept_chunks)

    proxy.flips.clear()  # the origin serves good bytes again
    before = len(proxy.byte_requests)
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.puller"):
        result = await puller.pull(1)
    fetched = requested(proxy, before)
    assert fetched.isdisjoint(kept_chunks) and (entry.name, 3) in fetched
    assert fetched | kept_chunks == chunks_of(manifest, (1 << sum(len(e.chunks) for e in manifest.files)) - 1)
    assert result.bytes == manifest.total_bytes - kept.bytes
    assert puller.progress.bytes_resumed == kept.bytes and puller.progress.bytes_done == manifest.total_bytes
    assert puller.kept is None
    assert_pulled(mirror, 1, files, manifest)  # byte for byte the serialized state dict
    assert f"{len(kept_chunks)} chunks ({kept.bytes} bytes) checked by the last try" in caplog.text


async def test_a_failed_pull_leaves_its_task_not_cancelled_and_a_later_crash_is_not_taken_for_a_stop(
        registry, proxy, client, mirror):
    """Python 3.11's task groups left the task of a pull that failed reading as cancelled. The
    daemon's crash policy (``keep``) then took a later crash of the updater for a stop and ended
    it for good: a node that never updated again."""
    from rolloutd.metrics import Metrics
    from rolloutd.node.daemon import keep

    manifest, _ = publish(registry, 1)
    proxy.flip(manifest.files[0].name, 0, times=None)
    runs = []

    async def updater_like() -> None:
        runs.append(1)
        if len(runs) == 1:
            with pytest.raises(PullError):
                await make_puller(client, mirror, max_chunk_retries=0).pull(1)
            assert asyncio.current_task().cancelling() == 0
            raise RuntimeError("a bug after a failed pull")
        await asyncio.sleep(3600)
    task = asyncio.create_task(keep("updater", updater_like, Metrics(), initial_s=0.01))
    try:
        await until(lambda: len(runs) == 2 or task.done(), 30, "the loop started again")
        assert not task.done(), task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_pull_of_another_version_removes_what_a_failed_pull_kept(registry, proxy, client, mirror):
    manifest, _ = publish(registry, 1)
    # the second file's first chunk: taken once every chunk of the first is done or in flight
    proxy.flip(manifest.files[1].name, 0, times=None)
    puller = make_puller(client, mirror, max_chunk_retries=0)
    with pytest.raises(PullError, match=f"{manifest.files[1].name} chunk 0: failed 1 times"):
        await puller.pull(1)
    assert puller.kept is not None and os.listdir(mirror.dir) == [".1.partial"]
    proxy.flips.clear()  # the file names of version 2 are the same
    manifest2, files2 = publish(registry, 2)
    result = await puller.pull(2)
    assert result.bytes == manifest2.total_bytes and puller.progress.bytes_resumed == 0
    assert_pulled(mirror, 2, files2, manifest2)  # and no partial of version 1 left
    assert puller.kept is None


async def test_a_kept_partial_whose_file_went_missing_is_not_taken_up(registry, proxy, client, mirror):
    manifest, files = publish(registry, 1)
    proxy.flip(manifest.files[1].name, 0, times=None)  # as above: the first file's chunks are checked
    puller = make_puller(client, mirror, max_chunk_retries=0)
    with pytest.raises(PullError):
        await puller.pull(1)
    assert puller.kept is not None
    (mirror.dir / ".1.partial" / manifest.files[-1].name).unlink()
    proxy.flips.clear()
    result = await puller.pull(1)
    assert result.bytes == manifest.total_bytes and puller.progress.bytes_resumed == 0  # all fetched again
    assert_pulled(mirror, 1, files, manifest)


# -- leases ---------------------------------------------------------------------------------------------------

async def test_a_lease_that_expired_mid_pull_is_taken_again(registry, proxy, client, mirror, clock, caplog):
    manifest, files = publish(registry, 1)
    puller = make_puller(client, mirror, lease_ttl_s=30, renew_every_s=0.01, streams=2)
    first_lease = None

    async def expire(n: int) -> None:
        nonlocal first_lease
        if n == 10:
            first_lease = puller.lease.lease_id
            clock.advance(31)  # the registry's clock: the lease ran out between two renewals
            for _ in range(500):
                if puller.lease.lease_id != first_lease:
                    return
                await asyncio.sleep(0.01)
    proxy.on_bytes = expire
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.puller"):
        result = await puller.pull(1)
    assert result.version == 1 and first_lease is not None
    assert_pulled(mirror, 1, files, manifest)
    assert f"lost lease {first_lease} on version 1 (LeaseExpired: " in caplog.text
    assert "lease version 1 again as node-7" in caplog.text
    assert registry.service.store.lease_count() == 0  # the new lease is released too


async def test_a_version_retired_mid_pull_is_finished_under_the_lease(registry, proxy, client, mirror):
    manifest, files = publish(registry, 1)

    async def retire(n: int) -> None:
        if n == 5:
            await asyncio.to_thread(registry.retire, 1)
    proxy.on_bytes = retire
    result = await make_puller(client, mirror, renew_every_s=0.01).pull(1)
    assert result.version == 1
    assert_pulled(mirror, 1, files, manifest)
    with pytest.raises(errors.VersionRetired):  # released: the registry reclaimed it
        await client.manifest(1)


async def test_a_retired_version_whose_lease_expired_fails_clearly(registry, proxy, client, mirror, clock):
    publish(registry, 1)

    async def retire_and_expire(n: int) -> None:
        if n == 5:
            await asyncio.to_thread(registry.retire, 1)
            clock.advance(120)  # lease gone, so the retired version's bytes are reclaimed
    proxy.on_bytes = retire_and_expire
    puller = make_puller(client, mirror, lease_ttl_s=60, renew_every_s=0.01)
    # whichever notices first: a byte request (410) or the renewal that tries to lease it again
    with pytest.raises(PullError, match=r"^version 1.*VersionRetired: version 1 was retired and its bytes reclaimed"):
        await puller.pull(1)
    nothing_left(mirror, registry)


async def test_chunks_checked_of_a_version_that_is_gone_are_not_kept(registry, proxy, client, mirror, clock):
    """One request per chunk: by the fifth byte request a stream has checked a chunk and moved
    on, so the pull has something it would keep for a next try. A version retired and reclaimed
    can never be fetched again, so nothing is kept."""
    publish(registry, 1)

    async def retire_and_expire(n: int) -> None:
        if n == 5:
            await asyncio.to_thread(registry.retire, 1)
            clock.advance(120)
    proxy.on_bytes = retire_and_expire
    puller = make_puller(client, mirror, request_bytes=CHUNK, lease_ttl_s=60, renew_every_s=0.01)
    with pytest.raises(PullError, match="VersionRetired"):
        await puller.pull(1)
    assert puller.kept is None
    nothing_left(mirror, registry)


async def test_nothing_to_lease_fails_clearly(registry, client, mirror):
    with pytest.raises(PullError, match="cannot lease version latest: NoVersions"):
        await make_puller(client, mirror).pull()
    publish(registry, 1)
    with pytest.raises(PullError, match="cannot lease version 7: VersionUnknown"):
        await make_puller(client, mirror).pull(7)


# -- cancellation and room -------------------------------------------------------------------------------------

async def test_a_cancelled_pull_releases_the_lease_reaps_its_workers_and_a_next_try_resumes(
        registry, proxy, client, mirror):
    """Cancelled as pull.timeout_s cancels it: the chunks checked by then are kept, so the
    next pull of the version fetches only the others; discard_kept (the daemon's stop)
    removes them."""
    manifest, files = publish(registry, 1)
    reached, unstall = asyncio.Event(), asyncio.Event()

    async def stall(n: int) -> None:
        if n == 8:
            reached.set()
            await unstall.wait()
    proxy.on_bytes = stall
    puller = make_puller(client, mirror, streams=3)
    task = asyncio.create_task(puller.pull(1))
    await asyncio.wait_for(reached.wait(), 10)
    assert (mirror.dir / ".1.partial").is_dir() and registry.service.store.lease_count() == 1
    workers = puller.progress.worker_pids
    assert workers
    with pytest.raises(RuntimeError, match="one at a time"):
        await puller.pull(1)
    for _ in range(1000):  # the other streams check some chunks while one request is held
        if puller.last_plan is not None and puller.last_plan.done_bits.bit_count() >= 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert puller.progress.state is PullState.CANCELLED
    assert all(gone(pid) for pid in workers)  # reaped before the pull ended
    assert registry.service.store.lease_count() == 0 and mirror.versions() == []
    kept = puller.kept
    assert kept is not None and kept.done_bits.bit_count() >= 2 and os.listdir(mirror.dir) == [".1.partial"]
    unstall.set()

    before = len(proxy.byte_requests)
    result = await puller.pull(1)
    assert requested(proxy, before).isdisjoint(chunks_of(manifest, kept.done_bits))
    assert result.bytes == manifest.total_bytes - kept.bytes
    assert_pulled(mirror, 1, files, manifest)


async def test_what_a_cancelled_pull_kept_is_removed_by_discard_kept(registry, proxy, client, mirror):
    publish(registry, 1)
    reached = asyncio.Event()

    async def stall(n: int) -> None:
        if n == 8:
            reached.set()
            await asyncio.Event().wait()  # held until the pull is cancelled
    proxy.on_bytes = stall
    puller = make_puller(client, mirror, streams=3)
    task = asyncio.create_task(puller.pull(1))
    await asyncio.wait_for(reached.wait(), 10)
    for _ in range(1000):
        if puller.last_plan.done_bits:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert puller.kept is not None and os.listdir(mirror.dir) == [".1.partial"]
    puller.discard_kept()
    assert puller.kept is None
    nothing_left(mirror, registry)


async def test_a_pull_that_cannot_fit_fails_before_fetching(registry, proxy, client, tmp_path):
    manifest, _ = publish(registry, 1)
    small = Mirror(tmp_path / "small", max_bytes=manifest.total_bytes // 2)
    with pytest.raises(PullError, match=r"pull of version 1 failed: MirrorFull: mirror .* cannot take"):
        await make_puller(client, small).pull(1)
    assert proxy.byte_requests == []
    nothing_left(small, registry)


async def test_room_is_made_from_versions_no_server_uses(registry, proxy, client, tmp_path):
    m1, _ = publish(registry, 1)
    mirror = Mirror(tmp_path / "m", max_bytes=int(2.5 * m1.total_bytes))
    await make_puller(client, mirror).pull(1)
    publish(registry, 2)
    await make_puller(client, mirror, in_use=lambda: {1}).pull(2)
    m3, files3 = publish(registry, 3)
    await make_puller(client, mirror, in_use=lambda: {2}).pull(3)  # 1 goes; 2 in use
    assert mirror.versions() == [2, 3]
    assert_pulled(mirror, 3, files3, m3)


async def test_each_pull_overwrites_the_files_of_the_version_removed_before_it(registry, monkeypatch):
    """Pull workers write into recycled tmpfs files (the mirror's default) and every version
    comes out byte for byte as published: 1, 2, 3, 4, each pull making room from the one two
    back, with a server still mapping one file of a removed version. A recycled file's chunks
    are not allocated again; a new file's are."""
    from rolloutd.rollout.fetch_pool import FetchPool

    allocate: dict[int, dict[str, set[bool]]] = {}  # version -> file -> the chunks' allocate flags
    real_fetch = FetchPool.fetch

    async def fetch(self, job, progress):
        allocate.setdefault(job.version, {}).setdefault(job.name, set()).add(job.allocate)
        if not job.allocate:  # only over pages that exist: written bytes, no hole
            fd = os.open(job.path, os.O_RDONLY)
            try:
                assert os.lseek(fd, job.start, os.SEEK_HOLE) >= job.end, job
            finally:
                os.close(fd)
        return await real_fetch(self, job, progress)
    monkeypatch.setattr(FetchPool, "fetch", fetch)
    shm = Path(tempfile.mkdtemp(prefix="rolloutd-test-pull-", dir="/dev/shm"))
    try:
        published = {1: publish(registry, 1)}
        mirror = Mirror(shm / "m", max_bytes=int(2.5 * published[1][0].total_bytes))
        async with RegistryClient(registry.url) as client:
            await make_puller(client, mirror, workers=2).pull(1)
            assert allocate[1] == {name: {True} for name in published[1][1]}  # a first pull: every page new
            published[2] = publish(registry, 2)
            await make_puller(client, mirror, workers=2, in_use=lambda: {1}).pull(2)
            seen = {p.stat().st_ino for p in mirror.path(1).iterdir()}
            seen2 = {p.stat().st_ino for p in mirror.path(2).iterdir()}
            kept_name = sorted(published[1][1])[0]
            with open(mirror.path(2) / kept_name, "rb") as f:  # a server still on 2 maps this file
                mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                mapped_ino = os.fstat(f.fileno()).st_ino
            try:
                for v in (3, 4):
                    published[v] = publish(registry, v)
                    await make_puller(client, mirror, workers=2, in_use=lambda v=v: {v - 1}).pull(v)
                    manifest, files = published[v]
                    assert_pulled(mirror, v, files, manifest)
                    assert mirror.versions() == [v - 1, v]
                    now = {p.stat().st_ino for p in mirror.path(v).iterdir()
                           if p.name not in (MANIFEST_NAME, RECORD_NAME)}
                    if v == 3:  # the pages of version 1, overwritten
                        assert now <= seen, "version 3 was not written into version 1's files"
                        assert allocate[3] == {name: {False} for name in files}, allocate[3]
                    else:  # version 2's files, but the one still mapped
                        assert mapped_ino not in now and len(now & seen2) == len(now) - 1
                        assert any(False in flags for flags in allocate[4].values()), allocate[4]
                        new = [p.name for p in mirror.path(4).iterdir() if p.name not in (MANIFEST_NAME, RECORD_NAME)
                               and p.stat().st_ino not in seen2]
                        assert new and all(allocate[4][name] == {True} for name in new), (new, allocate[4])
                assert mapped[:] == published[2][1][kept_name]
            finally:
                mapped.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# -- workers kept between pulls ---------------------------------------------------------------------------------

def started(pid: int) -> int:
    """A process's start time in clock ticks: a pid reused by a new process has another."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def watch_workers(proxy, puller) -> dict[int, set[int]]:
    """version -> pids of the workers that moved its bytes, seen at each byte request."""
    seen: dict[int, set[int]] = {}

    async def look(n: int) -> None:
        seen.setdefault(puller.progress.version, set()).update(puller.progress.worker_pids)
    proxy.on_bytes = look
    return seen


async def test_the_workers_are_kept_for_the_next_pull_and_close_stops_them(registry, proxy, client, mirror):
    """Versions 1, 2, 3 pulled by one set of workers, started once: the later pulls start no
    process, and each version comes out byte for byte as published. close() reaps them."""
    puller = make_puller(client, mirror, workers=2, streams=4, keep_workers_s=60)
    seen = watch_workers(proxy, puller)
    try:
        for version in (1, 2, 3):
            manifest, files = publish(registry, version)
            result = await puller.pull(version)
            assert result.bytes == manifest.total_bytes
            assert_pulled(mirror, version, files, manifest)
            kept = puller.kept_worker_pids
            assert len(kept) == 2 and set(kept) == seen[version] and not any(gone(p) for p in kept)
            assert puller.progress.worker_pids == []  # the pull's own list ends with it
            if version == 1:
                first = {pid: started(pid) for pid in kept}
        assert seen[1] == seen[2] == seen[3] and {pid: started(pid) for pid in seen[3]} == first
        assert puller.progress.worker_restarts == 0 and registry.service.store.lease_count() == 0
    finally:
        await puller.close()
    assert puller.kept_worker_pids == [] and all(gone(pid) for pid in first)
    await puller.close()  # twice is fine


async def test_kept_workers_that_idle_keep_workers_s_are_stopped(registry, proxy, client, mirror):
    puller = make_puller(client, mirror, workers=1, streams=2, keep_workers_s=0.3)
    seen = watch_workers(proxy, puller)
    try:
        publish(registry, 1)
        await puller.pull(1)
        kept = puller.kept_worker_pids
        assert kept and not any(gone(p) for p in kept)
        await until(lambda: all(gone(p) for p in kept), 10, "idle workers stopped")
        assert puller.kept_worker_pids == []
        manifest, files = publish(registry, 2)
        await puller.pull(2)  # with new workers
        assert_pulled(mirror, 2, files, manifest)
        assert seen[2] and seen[2].isdisjoint(kept)
    finally:
        await puller.close()


async def test_a_pull_that_fails_or_is_cancelled_stops_the_kept_workers(registry, proxy, client, mirror):
    """Workers that served a failed pull are not trusted with the next: it starts fresh ones."""
    puller = make_puller(client, mirror, workers=1, streams=2, keep_workers_s=60, max_chunk_retries=0)
    seen = watch_workers(proxy, puller)
    try:
        publish(registry, 1)
        await puller.pull(1)
        kept = puller.kept_worker_pids
        manifest, files = publish(registry, 2)
        proxy.flip(manifest.files[0].name, 0, times=None)  # every time: the pull fails
        with pytest.raises(PullError, match="digest"):
            await puller.pull(2)
        assert seen.pop(2) == set(kept) and puller.kept_worker_pids == [] and all(gone(p) for p in kept)

        proxy.flips.clear()
        reached = asyncio.Event()

        async def stall(n: int) -> None:
            reached.set()
            await asyncio.Event().wait()  # held until the pull is cancelled
        await puller.pull(2)  # fresh workers, kept again
        assert_pulled(mirror, 2, files, manifest)
        kept = puller.kept_worker_pids
        assert kept and seen[2] == set(kept) and set(kept).isdisjoint(seen[1])  # new processes
        publish(registry, 3)
        proxy.on_bytes = stall
        task = asyncio.create_task(puller.pull(3))
        await asyncio.wait_for(reached.wait(), 10)
        assert puller.progress.worker_pids == kept  # the kept workers took the pull up
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert puller.kept_worker_pids == [] and all(gone(p) for p in kept)
    finally:
        await puller.close()


async def test_a_kept_worker_that_dies_between_pulls_is_started_again(registry, proxy, client, mirror, caplog):
    restarts = []
    puller = make_puller(client, mirror, workers=1, streams=2, keep_workers_s=60,
                         on_worker_restart=lambda: restarts.append(1))
    seen = watch_workers(proxy, puller)
    try:
        publish(registry, 1)
        await puller.pull(1)
        [old] = puller.kept_worker_pids
        with caplog.at_level(logging.WARNING):
            os.kill(old, signal.SIGKILL)
            await until(lambda: restarts == [1], 10, "the worker started again")
        assert f"pid {old} exited (killed by SIGKILL" in caplog.text
        [new] = puller.kept_worker_pids
        assert new != old and not gone(new)
        manifest, files = publish(registry, 2)
        result = await puller.pull(2)
        assert_pulled(mirror, 2, files, manifest)
        assert seen[2] == {new} and result.retries == 0
    finally:
        await puller.close()


# -- delta versions -----------------------------------------------------------------------------------------

def stepped(sd: dict, step: int, fraction: float = 0.01) -> dict:
    """``sd`` after an RL-like step: ``fraction`` of the elements of every other tensor changed."""
    rng = np.random.default_rng(1000 + step)
    out = {}
    for i, (name, t) in enumerate(sd.items()):
        t = t.copy()
        if i % 2 == 0:
            flat = t.reshape(-1)
            at = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
            flat[at] += np.float32(1e-3)
        out[name] = t
    return out


def encode_delta(base_files: dict[str, bytes], target_files: dict[str, bytes], manifest: Manifest, base: Manifest,
                 ) -> tuple[Delta, dict[str, bytes]]:
    """The delta section of ``manifest`` on ``base``, and its delta files, made here with the codec."""
    blobs, entries, taken = {}, [], {f.name for f in manifest.files}
    for f in manifest.files:
        out = io.BytesIO()
        encode_file(base_files, target_files[f.name], out, target_name=f.name)
        name = delta_file_name(f.name, taken)
        taken.add(name)
        blobs[name] = out.getvalue()
        entries.append(DeltaFile(name=name, size=len(blobs[name]), target=f.name,
                                 chunks=hash_chunks(blobs[name], manifest.chunk_bytes, manifest.hash)))
    delta = Delta(base_version=base.version, base_digest=base.digest, encoding=DEFAULT_ENCODING, files=entries)
    return delta, blobs


def attach_delta(registry, version: int, delta: Delta, blobs: dict[str, bytes]) -> Manifest:
    """Give a published version this delta section and these delta files, whatever the registry
    published itself: the registry serves them as it serves its own."""
    v = registry.service.store.get(version)
    v.manifest = v.manifest.target().with_delta(delta)
    v.blobs = {**{f.name: v.blobs[f.name] for f in v.manifest.files},
               **{name: MemoryBlob(bytearray(data)) for name, data in blobs.items()}}
    return v.manifest


def publish_sd(registry, version: int, sd: dict) -> tuple[Manifest, dict[str, bytes]]:
    manifest = registry.publish(version, sd, shard_bytes=SHARD, chunk_bytes=CHUNK)
    return manifest.target(), dict(serialize_shards(sd, SHARD))


async def delta_setup(registry, client, mirror) -> tuple:
    """Version 1 published and pulled; version 2, one RL-like step on, published with a delta on 1.
    Returns (v1 manifest, v1 files, v2 manifest, v2 files, delta blobs)."""
    sd1 = state_dict(1)
    m1, f1 = publish_sd(registry, 1, sd1)
    await make_puller(client, mirror).pull(1)
    m2, f2 = publish_sd(registry, 2, stepped(sd1, 2))
    delta, blobs = encode_delta(f1, f2, m2, m1)
    return m1, f1, attach_delta(registry, 2, delta, blobs), f2, blobs


def base_untouched(mirror: Mirror, m1: Manifest, f1: dict[str, bytes], stats: dict) -> None:
    assert mirror.manifest(1) == m1
    for name, data in f1.items():
        path = mirror.path(1) / name
        assert path.read_bytes() == data
        st = path.stat()
        assert (st.st_ino, st.st_mtime_ns) == stats[name], name  # never written, never replaced


def stat_of(mirror: Mirror, f1: dict[str, bytes]) -> dict:
    return {name: ((p := mirror.path(1) / name).stat().st_ino, p.stat().st_mtime_ns) for name in f1}


async def test_a_delta_pull_rebuilds_the_exact_version_fetching_only_the_delta(registry, proxy, client, mirror, caplog):
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    before, stats = len(proxy.byte_requests), stat_of(mirror, f1)
    puller = make_puller(client, mirror, workers=2, streams=4)
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    delta_bytes = sum(len(b) for b in blobs.values())
    assert delta_bytes < m2.total_bytes / 5  # a step that changed 1 % of half the tensors
    assert (result.kind, result.base, result.digest) == ("delta", 1, m2.digest)
    assert result.bytes == result.bytes_fetched == delta_bytes and result.version_bytes == m2.total_bytes
    assert result.reconstruct_s is not None and result.reconstruct_s > 0
    assert {name for name, _, _ in proxy.byte_requests[before:]} == set(blobs)  # the delta files only
    for name, data in f2.items():  # the bytes the trainer published, compared here, not by the system
        assert (mirror.path(2) / name).read_bytes() == data, name
    assert_pulled(mirror, 2, f2, m2.target())  # its manifest is the target's: no delta section, same digest
    assert mirror.manifest(2).delta is None
    base_untouched(mirror, m1, f1, stats)
    assert sorted(os.listdir(mirror.dir)) == ["1", "2"]  # no partial, no staged delta file left
    p = puller.progress.as_dict()
    assert {k: p[k] for k in ("state", "kind", "base", "bytes_fetched", "version_bytes", "delta_error")} == {
        "state": "done", "kind": "delta", "base": 1, "bytes_fetched": delta_bytes, "version_bytes": m2.total_bytes,
        "delta_error": None}
    assert p["reconstruct_s"] > 0 and p["bytes_done"] == p["bytes_total"] == delta_bytes + m2.total_bytes
    assert f"pulled version 2 from its delta on version 1: {delta_bytes} bytes fetched for {m2.total_bytes}" \
        in caplog.text
    assert registry.service.store.lease_count() == 0 and puller.progress.worker_pids == []


async def test_a_delta_pull_runs_in_the_pull_workers_and_they_are_reaped(registry, proxy, client, mirror):
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    puller = make_puller(client, mirror, workers=2, streams=2)
    seen: set[int] = set()
    real = FetchPool.apply

    async def watch(pool, job, progress):
        seen.update(pool.pids)
        await real(pool, job, progress)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FetchPool, "apply", watch)
        result = await puller.pull(2)
    assert result.kind == "delta" and len(seen) == 2 and os.getpid() not in seen
    assert puller.progress.worker_pids == [] and all(gone(pid) for pid in seen)


async def test_a_node_without_the_base_pulls_the_whole_version(registry, proxy, client, tmp_path, caplog):
    first = Mirror(tmp_path / "first", max_bytes=1 << 30)
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, first)
    mirror = Mirror(tmp_path / "second", max_bytes=1 << 30)
    before = len(proxy.byte_requests)
    puller = make_puller(client, mirror)
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    assert (result.kind, result.base, result.bytes, result.version_bytes) == ("full", None, m2.total_bytes,
                                                                              m2.total_bytes)
    assert puller.progress.delta_error is None
    assert {name for name, _, _ in proxy.byte_requests[before:]} == set(f2)  # no delta file asked for
    assert_pulled(mirror, 2, f2, m2.target())
    assert "pull version 2 whole, not from its delta: the mirror holds its base, version 1, not" in caplog.text
    assert puller_warnings(caplog) == []


def puller_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "rolloutd.rollout.puller" and r.levelno >= logging.WARNING]


async def test_a_delta_on_a_base_digest_the_mirror_does_not_hold_pulls_the_whole_version(
        registry, proxy, client, mirror, caplog):
    """The mirror's version 1 was pulled for another registry instance (a registry that
    restarted numbers its versions again): the delta is never applied to it, and that is no
    failure, the node simply lacks that base."""
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    mirror.follow("another-instance")  # version 1's copy was pulled while the node followed none
    wrong = m2.delta.model_copy(update={"base_digest": "ab" * 32, "digest": None})
    attach_delta(registry, 2, wrong, blobs)
    before = len(proxy.byte_requests)
    puller = make_puller(client, mirror)
    with caplog.at_level(logging.INFO, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    assert (result.kind, result.bytes) == ("full", m2.total_bytes)
    assert {name for name, _, _ in proxy.byte_requests[before:]} == set(f2)
    assert_pulled(mirror, 2, f2, m2.target())
    assert (f"the mirror holds its base, version 1, with digest {m1.digest[:12]}... (pulled from another registry "
            "instance), not abababababab...") in caplog.text
    assert puller.progress.delta_error is None


async def test_a_delta_naming_a_wrong_base_digest_of_this_registry_is_refused_with_its_reason(
        registry, proxy, client, mirror, caplog):
    """The registry the node follows gave it version 1 with one digest and now names another as
    the delta's base: a clear error (WARNING, ``delta_error``), the delta never applied, the
    version pulled whole."""
    instance = registry.service.store.instance
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    mirror.follow(instance)
    mirror.claim(1, m1.digest, instance)  # the copy is this registry's, as the updater records it
    wrong = m2.delta.model_copy(update={"base_digest": "ab" * 32, "digest": None})
    attach_delta(registry, 2, wrong, blobs)
    before = len(proxy.byte_requests)
    puller = make_puller(client, mirror)
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    assert (result.kind, result.bytes) == ("full", m2.total_bytes)
    assert {name for name, _, _ in proxy.byte_requests[before:]} == set(f2)  # not a byte of the delta
    assert_pulled(mirror, 2, f2, m2.target())
    error = puller.progress.delta_error
    assert error == (f"version 2: its delta names base version 1 with digest abababababab..., but this registry's "
                     f"version 1 in the mirror has digest {m1.digest[:12]}..."), error
    assert f"pull version 2 whole: its delta pull failed: {error}" in puller_warnings(caplog)


async def test_a_delta_file_corrupted_on_the_registry_falls_back_to_the_whole_version(
        registry, proxy, client, mirror, caplog):
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    name = sorted(blobs)[0]
    registry.service.store.get(2).blobs[name].data[100] ^= 0xFF  # the registry's copy itself
    stats = stat_of(mirror, f1)
    puller = make_puller(client, mirror, max_chunk_retries=1)
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    assert result.kind == "full" and result.digest == m2.digest and result.reconstruct_s is None
    for fname, data in f2.items():
        assert (mirror.path(2) / fname).read_bytes() == data, fname
    assert_pulled(mirror, 2, f2, m2.target())
    base_untouched(mirror, m1, f1, stats)
    error = puller.progress.delta_error
    assert error.startswith(f"version 2 file {name} chunk 0: failed 2 times; last: ChunkCorrupt: digest"), error
    assert f"pull version 2 whole: its delta pull failed: {error}" in puller_warnings(caplog)
    p = puller.progress.as_dict()
    assert (p["kind"], p["base"], p["delta_error"], p["bytes_total"]) == ("full", None, error, m2.total_bytes)
    # The corrupt file's chunk is never counted. The other delta files' chunks count as far as they
    # had landed when the failure cancelled the delta pull (a cancelled attempt takes its bytes
    # back), so the extra is the size of some whole set of them: all of them on a quick machine.
    others = [len(b) for n, b in blobs.items() if n != name]
    assert all(len(b) <= CHUNK for b in blobs.values())  # one chunk per delta file
    assert result.bytes - m2.total_bytes in subset_sums(others)
    assert sorted(os.listdir(mirror.dir)) == ["1", "2"]


def subset_sums(sizes: list[int]) -> set[int]:
    sums = {0}
    for size in sizes:
        sums |= {s + size for s in sums}
    return sums


async def test_a_delta_file_that_cannot_be_applied_falls_back_to_the_whole_version(
        registry, proxy, client, mirror, caplog):
    """A delta file whose chunk digests are right (sealed with it) but whose bytes are no delta."""
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    name = sorted(blobs)[-1]
    bad = {**blobs, name: b"RDELTA1\n" + os.urandom(len(blobs[name]) - 8)}
    delta = m2.delta.model_copy(update={"digest": None, "files": [
        f if f.name != name else f.model_copy(update={"size": len(bad[name]), "chunks": hash_chunks(
            bad[name], CHUNK, m2.hash)}) for f in m2.delta.files]})
    attach_delta(registry, 2, delta, bad)
    puller = make_puller(client, mirror)
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    target = next(f.target for f in m2.delta.files if f.name == name)
    assert result.kind == "full"
    assert_pulled(mirror, 2, f2, m2.target())
    assert puller.progress.delta_error.startswith(f"version 2 file {target} (from delta file {name}): DeltaRejected: ")
    assert len(puller_warnings(caplog)) == 1


async def test_a_delta_whose_rebuild_differs_from_the_version_is_refused_and_the_whole_version_pulled(
        registry, proxy, client, mirror, caplog):
    """Version 3's section carries version 2's delta files, sealed anew: every chunk and file
    digest of the section is right, the base is right, the bytes rebuilt are version 2's. The
    target digests catch it."""
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    m3, f3 = publish_sd(registry, 3, stepped(stepped(state_dict(1), 2), 3))
    attach_delta(registry, 3, m2.delta.model_copy(update={"digest": None}), blobs)
    stats = stat_of(mirror, f1)
    puller = make_puller(client, mirror)
    seen: set[int] = set()

    async def look(_n: int) -> None:
        seen.update(puller.progress.worker_pids)  # the delta pull's workers, then the full pull's
    proxy.on_bytes = look
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.puller"):
        result = await puller.pull(3)
    assert len(seen) >= 2 and all(gone(pid) for pid in seen)  # the failed delta pull's were reaped too
    assert (result.kind, result.digest) == ("full", m3.digest)
    for name, data in f3.items():
        assert (mirror.path(3) / name).read_bytes() == data, name
    assert_pulled(mirror, 3, f3, m3.target())
    base_untouched(mirror, m1, f1, stats)
    error = puller.progress.delta_error
    assert re.match(r"version 3 file \S+ \(from delta file \S+\.delta\): the rebuilt bytes differ from the "
                    r"version's digests: ", error), error
    assert f"pull version 3 whole: its delta pull failed: {error}" in puller_warnings(caplog)
    assert sorted(os.listdir(mirror.dir)) == ["1", "3"]


async def test_a_damaged_base_is_not_rebuilt_from(registry, proxy, client, mirror, caplog):
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    name = m1.files[0].name
    with open(mirror.path(1) / name, "r+b") as f:  # a bit flipped in the mirror, not by a pull
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    fresh = Mirror(mirror.dir, max_bytes=1 << 30)  # its checks are not the last run's
    puller = make_puller(client, fresh)
    before = len(proxy.byte_requests)
    with caplog.at_level(logging.WARNING, logger="rolloutd.rollout.puller"):
        result = await puller.pull(2)
    assert result.kind == "full"
    assert {n for n, _, _ in proxy.byte_requests[before:]} == set(f2)
    for fname, data in f2.items():
        assert (fresh.path(2) / fname).read_bytes() == data
    assert puller.progress.delta_error.startswith(f"version 2: its base, version 1, is damaged in the mirror ({name}")


async def test_gc_during_a_delta_pull_keeps_its_base(registry, proxy, client, tmp_path):
    """The base need not be the mirror's newest: gc (the daemon's, at any time) and room making
    keep it while the rebuild reads it."""
    mirror = Mirror(tmp_path / "mirror", max_bytes=1 << 30)
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    m3, f3 = publish_sd(registry, 3, stepped(state_dict(1), 3))
    delta, blobs3 = encode_delta(f1, f3, m3, m1)  # version 3 on version 1, while the node holds 1 and 2
    m3 = attach_delta(registry, 3, delta, blobs3)
    await make_puller(client, mirror).pull(2)
    assert mirror.versions() == [1, 2] and mirror.newest() == 2
    removed: list[int] = []
    first = len(proxy.byte_requests) + 1

    async def collect(n: int) -> None:
        if n == first:  # the delta pull's first request: the base is pinned, the rebuild yet to come
            removed.extend(await asyncio.to_thread(mirror.gc, set()))
    proxy.on_bytes = collect
    result = await make_puller(client, mirror).pull(3)
    assert removed == [] and result.kind == "delta"
    for name, data in f3.items():
        assert (mirror.path(3) / name).read_bytes() == data
    assert mirror.gc(set()) == [1, 2]  # unpinned once the pull ended


async def test_a_cancelled_delta_pull_keeps_nothing_and_a_kept_full_partial_is_resumed_whole(
        registry, proxy, client, mirror):
    """A delta pull's partial is never kept for a next try (it would be taken up as a full
    one's); a full pull's kept partial of the version is resumed whole, not by its delta."""
    m1, f1, m2, f2, blobs = await delta_setup(registry, client, mirror)
    reached, unstall = asyncio.Event(), asyncio.Event()

    async def stall(n: int) -> None:
        reached.set()
        await unstall.wait()
    proxy.on_bytes = stall
    puller = make_puller(client, mirror)
    task = asyncio.create_task(puller.pull(2))
    await asyncio.wait_for(reached.wait(), 10)
    assert (mirror.dir / ".2.partial" / ".delta").is_dir()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    unstall.set()
    proxy.on_bytes = None
    assert puller.kept is None and sorted(os.listdir(mirror.dir)) == ["1"]
    # a full pull of version 2 that fails part way (its delta corrupt, a chunk of it corrupt every time)
    registry.service.store.get(2).blobs[sorted(blobs)[0]].data[5] ^= 0xFF
    entry = m2.files[0]
    proxy.flip(entry.name, CHUNK, times=None)
    with pytest.raises(PullError, match=f"version 2 file {entry.name} chunk 1: failed"):
        await puller.pull(2)
    kept = puller.kept
    assert kept is not None and kept.done_bits
    proxy.flips.clear()
    registry.service.store.get(2).blobs[sorted(blobs)[0]].data[5] ^= 0xFF  # the delta is sound again
    before = len(proxy.byte_requests)
    result = await puller.pull(2)
    assert result.kind == "full" and result.bytes == m2.total_bytes - kept.bytes
    assert requested(proxy, before).isdisjoint(chunks_of(m2, kept.done_bits))
    assert {n for n, _, _ in proxy.byte_requests[before:]} <= set(f2)
    assert_pulled(mirror, 2, f2, m2.target())


async def test_a_delta_the_registry_made_at_publish_is_pulled_and_rebuilt(registry, proxy, client, mirror):
    sd1 = state_dict(1)
    m1, f1 = publish_sd(registry, 1, sd1)
    await make_puller(client, mirror).pull(1)
    sd2 = stepped(sd1, 2)
    published = registry.publish(2, sd2, shard_bytes=SHARD, chunk_bytes=CHUNK)
    served = await client.manifest(2)
    assert served.delta is not None and served.delta.base_version == 1 and served.digest == published.digest
    result = await make_puller(client, mirror).pull(2)
    assert (result.kind, result.base, result.bytes_fetched) == ("delta", 1, served.delta.total_bytes)
    for name, data in serialize_shards(sd2, SHARD):
        assert (mirror.path(2) / name).read_bytes() == data, name
    assert mirror.manifest(2) == served.target()
