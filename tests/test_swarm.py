"""The chunk swarm over real HTTP on loopback, in one process: a real registry (its tracker),
nodes made of the daemon's own parts (mirror, puller, peer listener, announcer). Nodes pull
one version together; the registry sends about one copy; a peer serving bad bytes (a fake, named
so) or one that is gone is dropped and every mirror still ends complete and checked."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web

from rolloutd.registry import EmbeddedRegistry
from rolloutd.registry.client import RegistryClient
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.peerserve import PeerServer, PeerServerError
from rolloutd.rollout.puller import Puller
from rolloutd.rollout.swarm import Swarm, SwarmSettings
from rolloutd.wire.manifest import verify_file

from .conftest import free_port

TOKEN = "swarm-token-5e1"
CHUNK = 64 << 10


def served(reg: EmbeddedRegistry) -> int:
    return int(reg.service.metrics.bytes_served._value.get())


def publish(reg: EmbeddedRegistry, tmp_path, version: int = 1, mib: int = 4) -> None:
    d = tmp_path / f"v{version}"
    d.mkdir()
    for i in range(2):
        (d / f"model-{i}.safetensors").write_bytes(os.urandom(mib << 19))
    reg.publish_dir(version, d, chunk_bytes=CHUNK)


@dataclass
class Node:
    name: str
    mirror: Mirror
    client: RegistryClient
    swarm: Swarm
    server: PeerServer
    puller: Puller
    announcer: asyncio.Task | None = None

    async def close(self) -> None:
        if self.announcer is not None:
            self.announcer.cancel()
            await asyncio.gather(self.announcer, return_exceptions=True)
        self.server.stop()
        await self.client.close()

    def check(self, version: int) -> None:
        manifest = self.mirror.manifest(version)
        assert manifest is not None, f"{self.name}: version {version} not in its mirror"
        for entry in manifest.files:
            assert verify_file(self.mirror.path(version) / entry.name, entry, manifest) == []


def make_node(name: str, reg: EmbeddedRegistry, tmp_path, **settings) -> Node:
    port = free_port()
    mirror = Mirror(tmp_path / name, 1 << 30)
    client = RegistryClient(reg.url, reg.service.token)
    settings = {"announce_every_s": 0.1, "announce_idle_s": 0.5, "origin_wait_s": 2.0, **settings}
    swarm = Swarm(SwarmSettings(enabled=True, url=f"http://127.0.0.1:{port}", token=TOKEN, **settings), client,
                  mirror, node=name)
    server = PeerServer(mirror, swarm.ledger, "127.0.0.1", port, TOKEN).start()
    puller = Puller(client, mirror, holder=name, streams=4, request_bytes=CHUNK, swarm=swarm)
    node = Node(name, mirror, client, swarm, server, puller)
    node.announcer = asyncio.ensure_future(swarm.run_announcer())
    return node


@pytest.fixture
def reg(tmp_path, clock):
    token = tmp_path / "registry.token"
    token.write_text(TOKEN)
    with EmbeddedRegistry(port=0, token_file=token, holder_ttl_s=3, assign_ttl_s=5) as r:
        yield r


async def test_nodes_pulling_together_take_about_one_copy_from_the_registry(reg, tmp_path):
    publish(reg, tmp_path)
    size = reg.manifest(1).total_bytes
    nodes = [make_node(f"n{i}", reg, tmp_path) for i in range(4)]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(n.puller.pull("latest") for n in nodes)), 60)
        assert {r.version for r in results} == {1}
        for n in nodes:
            n.check(1)
        ratio = served(reg) / size
        from_peers = sum(n.puller.last_plan.bytes_from.get("peers", 0) for n in nodes)
        assert ratio <= 1.5, f"registry sent {ratio:.2f} copies"  # 4 without the swarm
        assert from_peers >= 2 * size
        assert sum(n.server.served_bytes for n in nodes) == from_peers
    finally:
        for n in nodes:
            await n.close()


async def test_a_late_node_takes_everything_from_peers(reg, tmp_path):
    publish(reg, tmp_path)
    first = make_node("first", reg, tmp_path)
    try:
        await asyncio.wait_for(first.puller.pull("latest"), 60)
        await first.swarm.announce()  # the complete version, as at rest
        before = served(reg)
        late = make_node("late", reg, tmp_path)
        try:
            await asyncio.wait_for(late.puller.pull("latest"), 60)
            late.check(1)
            assert served(reg) == before  # not one byte more from the registry
        finally:
            await late.close()
    finally:
        await first.close()


async def bad_peer(corrupt: bool) -> tuple[web.AppRunner, int]:
    """A FAKE peer listener: answers every range with the right length and wrong bytes (or cuts
    the connection): the faults a real peer with a damaged disk or a crash shows."""
    async def handler(request: web.Request) -> web.StreamResponse:
        first, last = request.headers["range"].split("=")[1].split("-")
        n = int(last) - int(first) + 1
        if not corrupt:
            request.transport.close()
            return web.Response(status=500)
        return web.Response(status=206, body=b"\xee" * n, headers={"content-range": f"bytes {first}-{last}/*"})
    app = web.Application()
    app.router.add_get("/v1/versions/{v}/files/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


@pytest.mark.parametrize("corrupt", [True, False], ids=["bad-bytes", "gone"])
async def test_a_peer_that_fails_is_dropped_and_the_chunks_come_from_elsewhere(reg, tmp_path, corrupt):
    from rolloutd.wire.messages import Announce, HeldVersion
    publish(reg, tmp_path)
    digest = reg.manifest(1).digest
    runner, port = await bad_peer(corrupt)
    liar = RegistryClient(reg.url, TOKEN)
    try:  # the fake claims every chunk of version 1
        claim = Announce(url=f"http://127.0.0.1:{port}", versions={"1": HeldVersion(digest=digest)})
        await liar.announce("liar", claim)
        node = make_node("honest", reg, tmp_path)
        try:
            result = await asyncio.wait_for(node.puller.pull("latest"), 60)
            node.check(1)
            assert result.retries >= 1  # the liar's chunk was fetched again elsewhere
            holders = httpx.get(reg.url + "/v1/holders", headers={"authorization": f"Bearer {TOKEN}"}).json()
            assert holders["versions"]["1"]["holders"] >= 1
        finally:
            await node.close()
    finally:
        await liar.close()
        await runner.cleanup()


async def test_the_peer_listener_serves_only_checked_chunks_with_a_token(reg, tmp_path):
    publish(reg, tmp_path)
    node = make_node("n", reg, tmp_path)
    try:
        manifest = await node.client.manifest(1)
        url = node.swarm.settings.url + "/v1/versions/1/files/" + manifest.files[0].name
        auth = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient() as http:
            assert (await http.get(url, headers=auth)).json()["error"]["code"] == "version_unknown"
            partial = node.mirror.begin(manifest)
            node.swarm.ledger.begin(manifest, partial.dir)
            node.swarm.ledger.add(1)  # chunk 1 only
            r = await http.get(url, headers={**auth, "range": f"bytes={CHUNK}-{2 * CHUNK - 1}"})
            assert r.status_code == 206 and len(r.content) == CHUNK
            r = await http.get(url, headers={**auth, "range": f"bytes=0-{CHUNK}"})
            assert r.status_code == 416 and r.json()["error"]["code"] == "range_not_satisfiable"
            r = await http.get(url, headers={"range": f"bytes={CHUNK}-{2 * CHUNK - 1}"})
            assert r.status_code == 401
            r = await http.get(node.swarm.settings.url + "/v1/versions/1/files/..%2Fetc", headers=auth)
            assert r.status_code == 404
            assert (await http.get(node.swarm.settings.url + "/status", headers=auth)).status_code == 404
            node.swarm.ledger.end()
            node.mirror.discard(partial)
            await node.puller.pull(1)
            r = await http.get(url, headers={**auth, "range": "bytes=-10"})
            whole = (node.mirror.path(1) / manifest.files[0].name).read_bytes()
            assert r.status_code == 206 and r.content == whole[-10:]
    finally:
        await node.close()


def test_a_listener_off_loopback_needs_a_token(tmp_path):
    mirror = Mirror(tmp_path / "m", 1 << 20)
    from rolloutd.rollout.swarm import Ledger
    with pytest.raises(PeerServerError, match="needs a token"):
        PeerServer(mirror, Ledger(mirror), "0.0.0.0", free_port(), None)


async def test_a_dropped_peer_stays_out_of_the_count_for_the_whole_pull(tmp_path):
    """A liar claiming every chunk, forgotten by the tracker's suspicion after a moment unless the
    pullers keep naming it: the pull must not wait on chunks only the liar claims to hold."""
    from rolloutd.wire.messages import Announce, HeldVersion
    token = tmp_path / "registry.token"
    token.write_text(TOKEN)
    with EmbeddedRegistry(port=0, token_file=token, holder_ttl_s=0.3, assign_ttl_s=5) as reg:
        publish(reg, tmp_path, mib=8)
        digest = reg.manifest(1).digest
        runner, port = await bad_peer(corrupt=True)
        liar = RegistryClient(reg.url, TOKEN)
        claim = Announce(url=f"http://127.0.0.1:{port}", versions={"1": HeldVersion(digest=digest)})

        async def keep_claiming():
            while True:
                await liar.announce("liar", claim)
                await asyncio.sleep(0.1)
        claimer = asyncio.ensure_future(keep_claiming())
        node = make_node("honest", reg, tmp_path, origin_wait_s=30.0)  # no fallback in this test's time
        try:
            await asyncio.sleep(0.3)
            await asyncio.wait_for(node.puller.pull("latest"), 20)
            node.check(1)
        finally:
            claimer.cancel()
            await node.close()
            await liar.close()
            await runner.cleanup()


async def test_every_announcement_of_a_pull_names_the_peers_it_dropped(tmp_path):
    """Named once, a dropped peer would count as a holder again once the tracker's suspicion
    lapsed, and chunks only it claims would never be handed out of the origin."""
    from rolloutd.registry.client import Timeouts
    from rolloutd.wire.manifest import Manifest
    from rolloutd.wire.messages import AnnounceReply, SwarmView

    sent = []

    class RecordingClient:  # a FAKE registry client: records what would be announced
        url, token, timeouts = "http://127.0.0.1:9", None, Timeouts()

        async def announce(self, node, body):
            sent.append(body.failed)
            return AnnounceReply(instance="x", versions={})

    mirror = Mirror(tmp_path / "m", 1 << 30)
    swarm = Swarm(SwarmSettings(enabled=True, url="http://127.0.0.1:1"), RecordingClient(), mirror, node="me")
    manifest = Manifest.model_validate({"version": 1, "chunk_bytes": 4096, "files": [
        {"name": "a", "size": 8192, "chunks": ["0" * 32, "1" * 32]}]}).sealed()
    plan = swarm.plan(manifest, tmp_path)
    plan.update(SwarmView(peers=[{"node": "liar", "url": "http://127.0.0.1:2", "chunks": "3"}], origin="0"))
    pick = await plan.next()
    assert pick.source.is_peer and pick.source.node == "liar"
    plan.failed(pick, "bad bytes")
    await swarm.announce()
    await swarm.announce()
    assert sent == [["liar"], ["liar"]]
