"""The daemon's async registry client: typed errors, timeouts, idle keep-alive closes."""

from __future__ import annotations

import asyncio
import time

import pytest

from rolloutd.demo.tinymodel import llama_state_dict
from rolloutd.rollout.registry_client import RegistryClient, Timeouts
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire import errors
from rolloutd.wire.messages import Heartbeat

HB = Heartbeat(node="n1", server="s0", state="SERVING", version=1)


def publish(reg, version):
    return reg.publish(version, llama_state_dict(version, hidden=64, layers=2, vocab=128,
                                                 intermediate=96), chunk_bytes=4096)


async def test_typed_errors_for_leases_and_versions(registry, clock):
    async with RegistryClient(registry.url) as c:
        with pytest.raises(errors.NoVersions):
            await c.lease("n1")
        publish(registry, 1)
        lease = await c.lease("n1", "latest", ttl_s=5)
        assert lease.version == 1 and lease.digest == (await c.manifest(1)).digest
        clock.advance(6)
        with pytest.raises(errors.LeaseExpired):
            await c.renew(lease.lease_id)
        with pytest.raises(errors.LeaseUnknown):
            await c.release("nope")
        with pytest.raises(errors.VersionUnknown):
            await c.manifest(3)
        registry.retire(1)
        with pytest.raises(errors.VersionRetired):
            await c.lease("n1", 1)


async def test_heartbeat_latest_and_ranges(registry):
    m = publish(registry, 1)
    async with RegistryClient(registry.url) as c:
        reply = await c.heartbeat("n1.s0", HB)
        assert reply.latest == 1 and reply.demand.min_version is None
        assert (await c.replicas())[0]["replica_id"] == "n1.s0"
        info = await c.latest()
        assert (info.version, info.digest) == (1, m.digest)
        f = m.files[0]
        whole = await c.read_range(1, f.name, 0, f.size)
        assert len(whole) == f.size
        assert await c.read_range(1, f.name, 100, 200) == whole[100:200]
        await c.deregister("n1.s0")
        assert await c.replicas() == []


async def test_long_poll_through_the_client(registry):
    publish(registry, 1)
    async with RegistryClient(registry.url) as c:
        task = asyncio.create_task(c.latest(after=1, wait_s=10))
        await asyncio.sleep(0.3)
        assert not task.done()
        await asyncio.to_thread(publish, registry, 2)
        assert (await asyncio.wait_for(task, 2)).version == 2


async def test_survives_server_closing_idle_keepalive_connections(clock):
    with EmbeddedRegistry(port=0, clock=clock, keep_alive_s=0.15) as reg:
        async with RegistryClient(reg.url) as c:
            for _ in range(3):
                await c.heartbeat("n1.s0", HB)
                await asyncio.sleep(0.3)  # twice the server's keep-alive


class FakeRacingServer:
    """FAKE: answers the first request on a connection with keep-alive, then closes the
    connection when the next request arrives on it, without answering. That is the race a
    real server's idle timeout can hit; a real one cannot be made to show it on demand.
    (aiohttp itself retries idempotent methods; POST, as for a lease, is the case to cover.)"""

    BODY = (b'{"lease_id":"L1","holder":"n1","version":1,"ttl_s":60.0,"expires_in_s":60.0,'
            b'"digest":null}')

    def __init__(self):
        self.connections = 0

    async def handle(self, reader, writer):
        self.connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))
        await writer.drain()
        await _read_request(reader)  # the client reused the pooled connection
        writer.close()


async def _read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))


async def test_pooled_connection_closed_by_server_is_retried_not_fatal():
    fake = FakeRacingServer()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        async with RegistryClient(f"http://127.0.0.1:{port}") as c:
            for _ in range(4):
                lease = await c.lease("n1", "latest")
                assert lease.lease_id == "L1"
    assert fake.connections >= 4  # each stale connection was replaced by a fresh one


async def test_a_registry_that_hangs_times_out_as_unavailable():
    async def hang(reader, writer):  # FAKE: accepts, never answers
        await asyncio.sleep(30)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        async with RegistryClient(f"http://127.0.0.1:{port}", timeouts=Timeouts(request_s=0.5)) as c:
            t0 = time.monotonic()
            with pytest.raises(errors.RegistryUnavailable, match="timed out"):
                await c.heartbeat("n1.s0", HB)
            assert time.monotonic() - t0 < 2


async def test_registry_down_is_unavailable_not_a_crash():
    async with RegistryClient("http://127.0.0.1:9", timeouts=Timeouts(connect_s=1)) as c:
        with pytest.raises(errors.RegistryUnavailable):
            await c.latest()


async def test_token_is_sent_and_never_shown(tmp_path):
    (tmp_path / "t").write_text("tok-123")
    with EmbeddedRegistry(port=0, token_file=tmp_path / "t") as reg:
        async with RegistryClient(reg.url) as c:
            with pytest.raises(errors.Unauthorized):
                await c.latest()
        async with RegistryClient(reg.url, "tok-123") as c:
            assert (await c.latest()).version is None
            assert "tok-123" not in repr(c)
