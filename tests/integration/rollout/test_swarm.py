"""The chunk swarm over real HTTP on loopback, in one process: a real registry (its tracker),
nodes made of the daemon's own parts (mirror, puller, peer listener, announcer). Nodes pull
one version together; the registry sends about one copy; a peer serving bad bytes (a fake, named
so) or one that is gone is dropped and every mirror still ends complete and checked. Versions are
published with blake3 chunk digests, which peers may carry; an xxh3 version never goes near one."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web

from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.peerserve import PeerServer, PeerServerError
from rolloutd.rollout.puller import Puller, PullSettings
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.swarm import ChunkPlan, Pick, Swarm, SwarmSettings, peer_token
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.manifest import verify_file
from tests.conftest import free_port

TOKEN = "swarm-token-5e1"
PEER_TOKEN = peer_token(TOKEN)  # what nodes present to each other: never the registry's
CHUNK = 64 << 10


def served(reg: EmbeddedRegistry) -> int:
    return int(reg.service.metrics.bytes_served._value.get())


def publish(reg: EmbeddedRegistry, tmp_path, version: int = 1, mib: int = 4, hash_name: str = "blake3") -> None:
    d = tmp_path / f"v{version}"
    d.mkdir()
    for i in range(2):
        (d / f"model-{i}.safetensors").write_bytes(os.urandom(mib << 19))
    reg.publish_dir(version, d, chunk_bytes=CHUNK, hash_name=hash_name)


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
    swarm = Swarm(SwarmSettings(enabled=True, url=f"http://127.0.0.1:{port}", token=PEER_TOKEN, **settings),
                  client, mirror, node=name)
    server = PeerServer(mirror, swarm.ledger, "127.0.0.1", port, PEER_TOKEN).start()
    puller = Puller(client, mirror, PullSettings(holder=name, streams=4, request_bytes=CHUNK), swarm=swarm)
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
        auth = {"authorization": f"Bearer {PEER_TOKEN}"}
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
            wrong = {"authorization": f"Bearer {TOKEN}", "range": f"bytes={CHUNK}-{2 * CHUNK - 1}"}
            r = await http.get(url, headers=wrong)
            assert r.status_code == 401  # the registry's token is not the peer token
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
    from rolloutd.rollout.registry_client import Timeouts
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
    manifest = Manifest.model_validate({"version": 1, "hash": "blake3", "chunk_bytes": 4096, "files": [
        {"name": "a", "size": 8192, "chunks": ["0" * 64, "1" * 64]}]}).sealed()
    plan = swarm.plan(manifest, tmp_path)
    plan.update(SwarmView(peers=[{"node": "liar", "url": "http://127.0.0.1:2", "chunks": "3"}], origin="0"))
    pick = await plan.next()
    assert pick.source.is_peer and pick.source.node == "liar"
    plan.failed(pick, "bad bytes")
    await swarm.announce()
    await swarm.announce()
    assert sent == [["liar"], ["liar"]]


# -- a version peers may not carry ----------------------------------------------------------------

async def test_an_xxh3_version_is_never_taken_from_a_peer(reg, tmp_path, caplog):
    """xxh3 guards against a damaged disk, not against a peer that crafts bytes to match: a version
    with xxh3 chunk digests comes from its origin only, whoever claims to hold it (logged once)."""
    from rolloutd.wire.messages import Announce, HeldVersion
    publish(reg, tmp_path, hash_name="xxh3-128")
    digest = reg.manifest(1).digest
    asked = []

    async def handler(request: web.Request) -> web.StreamResponse:  # a FAKE peer: counts who asks it
        asked.append(request.path)
        return web.Response(status=500)
    app = web.Application()
    app.router.add_get("/v1/versions/{v}/files/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    liar = RegistryClient(reg.url, TOKEN)
    try:
        claim = Announce(url=f"http://127.0.0.1:{port}", versions={"1": HeldVersion(digest=digest)})
        await liar.announce("liar", claim)
        node = make_node("honest", reg, tmp_path)
        try:
            await asyncio.wait_for(node.puller.pull("latest"), 60)
            node.check(1)
            assert asked == []
            assert node.puller.last_plan.bytes_from.get("peers", 0) == 0
            assert node.swarm.ledger.held() == {}  # nor offered to other nodes
            await node.puller.pull("latest")
            assert [r.message for r in caplog.records if "without peers" in r.message] == [
                "pull version 1 from the registry only, without peers: its chunk digests are xxh3-128, which a "
                "hostile peer could forge (publish with a cryptographic hash: blake3, sha256)"]
        finally:
            await node.close()
    finally:
        await liar.close()
        await runner.cleanup()


def test_the_registry_token_is_never_the_peer_token(tmp_path):
    """Every announced peer URL receives the peer token: it must not open the registry."""
    from rolloutd.node.daemon import swarm_settings
    from tests.support.supervisor_fakes import config

    cfg = config(peers={"enabled": True}, node={"advertise_host": "10.0.0.7"})
    derived = swarm_settings(cfg, TOKEN).token
    assert derived == PEER_TOKEN and TOKEN not in derived
    # the same file for both (an old config): still derived, the same on every node
    same = tmp_path / "same.token"
    same.write_text(TOKEN)
    cfg = config(peers={"enabled": True, "token_file": str(same)}, node={"advertise_host": "10.0.0.7"})
    assert swarm_settings(cfg, TOKEN).token == PEER_TOKEN
    own = tmp_path / "peers.token"
    own.write_text("a-fleet-peer-token")
    cfg = config(peers={"enabled": True, "token_file": str(own)}, node={"advertise_host": "10.0.0.7"})
    assert swarm_settings(cfg, TOKEN).token == "a-fleet-peer-token"


async def test_the_registry_refuses_the_peer_token(reg):
    async with httpx.AsyncClient() as http:
        r = await http.get(reg.url + "/v1/holders", headers={"authorization": f"Bearer {PEER_TOKEN}"})
        assert r.status_code == 401
        r = await http.get(reg.url + "/v1/holders", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


class RecordingClient:  # a FAKE registry client: records what would be announced, answers nothing
    from rolloutd.rollout.registry_client import Timeouts

    url, token, timeouts = "http://127.0.0.1:9", None, Timeouts()

    def __init__(self):
        self.sent = []

    async def announce(self, node, body):
        from rolloutd.wire.messages import AnnounceReply
        self.sent.append(body)
        return AnnounceReply(instance="x", versions={})


async def test_a_version_with_more_chunks_than_a_map_holds_is_pulled_from_the_origin(tmp_path):
    """The chunk map on the wire holds 16,384 chunks, a manifest any number: such a version is not
    announced chunk by chunk (the announcer once crash-looped on it) and comes from the origin."""
    from rolloutd.wire.chunkmap import MAX_CHUNKS
    from rolloutd.wire.manifest import Manifest
    count = MAX_CHUNKS + 1
    manifest = Manifest.model_validate({"version": 1, "hash": "blake3", "chunk_bytes": 4096, "files": [
        {"name": "a", "size": 4096 * count, "chunks": ["0" * 64] * count}]}).sealed()
    client = RecordingClient()
    swarm = Swarm(SwarmSettings(enabled=True, url="http://127.0.0.1:1"), client, Mirror(tmp_path / "m", 1 << 30),
                  node="me")
    plan = swarm.plan(manifest, tmp_path)
    picks = [await plan.next() for _ in range(3)]
    assert [p.source.kind for p in picks] == ["registry"] * 3  # every chunk given to the origin at once
    last = plan.chunks[-1]
    from rolloutd.rollout.swarm import Pick
    swarm.landed(Pick(count - 1, last[0], last[1], plan.origin))  # a chunk past the map's reach lands
    assert await swarm.announce() is not None
    assert client.sent[-1].versions == {}


# -- the ledger reads a manifest once ------------------------------------------------------------------

async def test_announcements_and_peer_requests_parse_a_manifest_once(reg, tmp_path, monkeypatch):
    """A large manifest takes tens of milliseconds to parse and check: announcements (several a
    second while pulling) and peer requests use the one parsed when the version was first seen,
    until its manifest.json is another file."""
    from rolloutd.wire.manifest import Manifest
    publish(reg, tmp_path)
    node = make_node("n", reg, tmp_path)
    try:
        await node.puller.pull(1)
        parsed = []
        real = Manifest.model_validate_json.__func__

        def counting(cls, data, *a, **kw):
            parsed.append(1)
            return real(cls, data, *a, **kw)
        monkeypatch.setattr(Manifest, "model_validate_json", classmethod(counting))
        manifest = node.mirror.manifest(1)
        parsed.clear()
        url = node.swarm.settings.url + "/v1/versions/1/files/" + manifest.files[0].name
        auth = {"authorization": f"Bearer {PEER_TOKEN}", "range": "bytes=0-9"}
        async with httpx.AsyncClient() as http:
            for _ in range(5):
                assert set(node.swarm.ledger.held()) == {"1"}
                assert (await http.get(url, headers=auth)).status_code == 206
        assert len(parsed) <= 1
        node.mirror.remove(1, "test")  # gone: neither announced nor served
        assert node.swarm.ledger.held() == {}
        async with httpx.AsyncClient() as http:
            assert (await http.get(url, headers=auth)).status_code == 404
        await node.puller.pull(1)  # back, as another file: read again
        assert set(node.swarm.ledger.held()) == {"1"}
        (node.mirror.path(1) / "manifest.json").write_text("{}")  # another file in place: read again
        assert node.swarm.ledger.held() == {}
    finally:
        await node.close()


# -- the listener before the token -----------------------------------------------------------------

def _closed_by_server(sock, timeout_s: float) -> bool:
    """True once the server closed ``sock`` (EOF or reset) within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def test_the_peer_listener_closes_a_connection_that_sends_half_a_head(tmp_path):
    """Before the token is checked, a client has sent only bytes: a head that never ends must not
    hold one of the daemon's file descriptors for long."""
    import socket
    mirror = Mirror(tmp_path / "m", 1 << 20)
    from rolloutd.rollout.swarm import Ledger
    server = PeerServer(mirror, Ledger(mirror), "127.0.0.1", 0, PEER_TOKEN, head_timeout_s=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /v1/versions/1/files/a HTTP/1.1\r\nHost: x\r\n")
            loop = asyncio.get_running_loop()
            started = loop.time()
            for _ in range(3):  # bytes keep coming, the head never ends: no extension
                await asyncio.sleep(0.1)
                sock.sendall(b"X-Slow: 1\r\n")
            assert await asyncio.to_thread(_closed_by_server, sock, 5.0)
            assert loop.time() - started < 2.0
        with socket.create_connection(("127.0.0.1", server.port)) as sock:  # nothing at all: the same
            assert await asyncio.to_thread(_closed_by_server, sock, 5.0)
    finally:
        server.stop()


async def test_the_peer_listener_caps_its_connections(tmp_path):
    import socket
    mirror = Mirror(tmp_path / "m", 1 << 20)
    from rolloutd.rollout.swarm import Ledger
    from tests.support.waiting import until
    server = PeerServer(mirror, Ledger(mirror), "127.0.0.1", 0, PEER_TOKEN, max_connections=4).start()
    socks = []
    try:
        for _ in range(4):
            socks.append(socket.create_connection(("127.0.0.1", server.port)))
        await until(lambda: len(server._runner.server.connections) == 4, what="4 connections open")
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert await asyncio.to_thread(_closed_by_server, extra, 5.0)
        extra.close()
        assert server.refused_connections == 1
        socks.pop().close()  # room again: served
        await until(lambda: len(server._runner.server.connections) == 3, what="one connection gone")
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{server.port}/healthz")).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.stop()


def test_a_tracker_reply_is_bounded_like_a_request():
    """A node parses the registry's replies on its event loop: a reply naming more peers than any
    registry sends, or a chunk map longer than a version's, is refused (the pull goes on from the
    origin), not parsed whatever its size."""
    from pydantic import ValidationError

    from rolloutd.wire.chunkmap import MAX_HEX_CHARS
    from rolloutd.wire.messages import AnnounceReply
    peer = {"node": "p", "url": "http://10.0.0.1:9300", "chunks": "f"}
    AnnounceReply.model_validate({"instance": "i", "versions": {"1": {"peers": [peer] * 64, "origin": "0"}}})
    for view in ({"peers": [peer] * 65, "origin": "0"},
                 {"peers": [], "origin": "f" * (MAX_HEX_CHARS + 1)},
                 {"peers": [{**peer, "chunks": "f" * (MAX_HEX_CHARS + 1)}], "origin": "0"}):
        with pytest.raises(ValidationError):
            AnnounceReply.model_validate({"instance": "i", "versions": {"1": view}})
    with pytest.raises(ValidationError):
        AnnounceReply.model_validate({"instance": "i", "versions": {str(v): {"peers": [], "origin": "0"}
                                                                    for v in range(1, 18)}})


# -- delta versions: peers carry the delta files ------------------------------------------------------

def bf16_like(seed: int, tensors: int = 4, elements: int = 1 << 19) -> dict:
    """16-bit tensors with the bit patterns of bf16 weights (the high half of float32 normals)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.mlp.weight": (rng.standard_normal(elements, dtype=np.float32).view(np.uint32)
                                             >> 16).astype(np.uint16) for i in range(tensors)}


def rl_step(sd: dict, seed: int, fraction: float = 0.02) -> dict:
    """A copy of ``sd`` with ``fraction`` of each tensor's elements one bf16 step away, as an RL
    step leaves a bf16 policy."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in sd.items():
        t = t.copy()
        idx = rng.choice(t.size, int(t.size * fraction), replace=False)
        t[idx] += 1
        out[name] = t
    return out


def publish_sd(reg: EmbeddedRegistry, version: int, sd: dict, hash_name: str = "blake3") -> None:
    reg.publish(version, sd, chunk_bytes=4096, shard_bytes=2 << 20, hash_name=hash_name)


async def delta_fleet(reg, tmp_path, count: int, hash_name: str = "blake3"):
    """``count`` nodes holding version 1; version 2 published as a delta on it. -> (nodes, v2 manifest)"""
    v1 = bf16_like(0)
    publish_sd(reg, 1, v1, hash_name)
    nodes = [make_node(f"n{i}", reg, tmp_path) for i in range(count)]
    try:
        await asyncio.wait_for(asyncio.gather(*(n.puller.pull(1) for n in nodes)), 60)
        publish_sd(reg, 2, rl_step(v1, 1), hash_name)
        m2 = await nodes[0].client.manifest(2)
        assert m2.delta is not None and m2.delta.base_version == 1
    except BaseException:
        for n in nodes:
            await n.close()
        raise
    return nodes, m2


@pytest.mark.slow  # models made, published as deltas and rebuilt: 7-14 s
@pytest.mark.parallel
async def test_nodes_pulling_a_delta_together_take_about_one_copy_of_the_delta_from_the_registry(reg, tmp_path):
    nodes, m2 = await delta_fleet(reg, tmp_path, 4)
    delta_bytes = m2.delta.total_bytes
    assert sum(len(f.chunks) for f in m2.delta.files) >= 8  # enough chunks to spread over the nodes
    try:
        before, peers_before = served(reg), sum(n.server.served_bytes for n in nodes)
        results = await asyncio.wait_for(asyncio.gather(*(n.puller.pull(2) for n in nodes)), 60)
        assert {(r.kind, r.base) for r in results} == {("delta", 1)}
        for n in nodes:
            n.check(2)
        ratio = (served(reg) - before) / delta_bytes
        from_peer_servers = sum(n.server.served_bytes for n in nodes) - peers_before
        # Each node fetched the delta once, from the registry or a peer; a node that committed
        # first goes on serving its delta files, so the registry sends about one copy however
        # fast the rebuilds end (4 without peers carrying them; 2.0-3.1 when the delta files
        # were served only until each node's own rebuild ended).
        assert abs(ratio + from_peer_servers / delta_bytes - len(nodes)) < 0.01, (ratio, from_peer_servers)
        assert ratio <= 1.5, f"registry sent {ratio:.2f} copies of the delta"
        assert from_peer_servers >= 2 * delta_bytes
        # what /status pull_sources says: the delta pull's own plan, its bytes by source
        from_peers = sum(n.swarm.last_plan.bytes_from.get("peers", 0) for n in nodes)
        assert from_peers == sum(n.server.served_bytes for n in nodes) - peers_before
    finally:
        for n in nodes:
            await n.close()


async def holders(reg: EmbeddedRegistry) -> dict:
    """The tracker's summary (``GET /v1/holders``): swarm name -> holders, complete, pulling, given."""
    async with httpx.AsyncClient() as http:
        r = await http.get(reg.url + "/v1/holders", headers={"authorization": f"Bearer {TOKEN}"})
    return r.json()["versions"]


@pytest.mark.slow  # models made, published as deltas and rebuilt: 7-14 s
@pytest.mark.parallel
async def test_a_node_pulling_a_delta_after_another_committed_it_takes_every_delta_chunk_from_that_node(reg, tmp_path):
    """No overlap at all, so no timing: node "first" pulls version 2 from its delta and commits;
    only then "late" pulls it, and takes every delta chunk from "first" (the registry sends it
    no delta byte). "first" drops the delta files of version 2 once it commits version 3."""
    from rolloutd.wire.messages import HeldVersion
    nodes, m2 = await delta_fleet(reg, tmp_path, 2)
    first, late = nodes
    delta_bytes = m2.delta.total_bytes
    try:
        assert (await asyncio.wait_for(first.puller.pull(2), 60)).kind == "delta"
        assert sorted(os.listdir(first.mirror.dir)) == [".2.delta", "1", "2"]
        assert sorted(os.listdir(first.mirror.delta_dir(2))) == sorted(f.name for f in m2.delta.files)
        assert first.mirror.kept_delta_bytes() == delta_bytes  # in the mirror's usage, like any file
        assert first.swarm.ledger.held()["2"] == HeldVersion(digest=m2.digest, delta=m2.delta.digest)
        await first.swarm.announce()  # as its announcer does at rest
        assert (await holders(reg))["2.delta"] == {"holders": 1, "complete": 1, "pulling": 0, "given": 0}
        before, first_before = served(reg), first.server.served_bytes
        result = await asyncio.wait_for(late.puller.pull(2), 60)
        assert (result.kind, result.bytes_fetched) == ("delta", delta_bytes)
        assert served(reg) == before, "the registry sent delta bytes to the late node"
        assert late.swarm.last_plan.bytes_from == {"peers": delta_bytes}
        assert first.server.served_bytes - first_before == delta_bytes
        late.check(2)
        await late.swarm.announce()
        assert (await holders(reg))["2.delta"]["complete"] == 2  # the late node keeps them in turn

        publish_sd(reg, 3, rl_step(rl_step(bf16_like(0), 1), 2))  # a delta on version 2
        assert (await asyncio.wait_for(first.puller.pull(3), 60)).kind == "delta"
        assert sorted(os.listdir(first.mirror.dir)) == [".3.delta", "1", "2", "3"]  # version 2's are gone
        assert first.swarm.ledger.held()["2"] == HeldVersion(digest=m2.digest)
        await first.swarm.announce()
        assert (await holders(reg))["2.delta"]["complete"] == 1  # the late node only
        first.check(3)
    finally:
        for n in nodes:
            await n.close()


@pytest.mark.slow  # models made, published as deltas and rebuilt: 7-14 s
@pytest.mark.parallel
async def test_a_delta_pull_that_falls_back_to_the_whole_version_keeps_no_delta_file(reg, tmp_path, caplog):
    """With peers on, a rebuild that fails (the base changed on disk after it was checked: every
    rebuilt chunk of that file differs) removes the delta files with the partial directory, as
    it always did: the node serves and announces only the version it then pulled whole."""
    from rolloutd.wire.messages import HeldVersion
    nodes, m2 = await delta_fleet(reg, tmp_path, 1)
    node = nodes[0]
    try:
        base = node.mirror.path(1) / node.mirror.manifest(1).files[0].name
        with open(base, "r+b") as f:  # the tensors' bytes, past the header
            f.seek(base.stat().st_size // 2)
            f.write(b"\x55" * 4096)
        result = await asyncio.wait_for(node.puller.pull(2), 60)
        assert result.kind == "full" and "differ from the version's digests" in node.puller.progress.delta_error
        node.check(2)
        assert sorted(os.listdir(node.mirror.dir)) == ["1", "2"]
        assert node.swarm.ledger.held()["2"] == HeldVersion(digest=m2.digest)
        assert node.swarm.ledger.kept_delta(2) is None
    finally:
        for n in nodes:
            await n.close()


@pytest.mark.slow  # models made, published as deltas and rebuilt: 7-14 s
@pytest.mark.parallel
async def test_a_peer_serving_bad_delta_bytes_is_dropped_and_the_delta_pull_still_succeeds(reg, tmp_path):
    """The liar claims every delta chunk of version 2: its bytes fail the delta files' chunk
    digests, it is dropped, and the pull ends from the delta all the same (no fall back)."""
    from rolloutd.wire.messages import Announce, HeldVersion
    nodes, m2 = await delta_fleet(reg, tmp_path, 1)
    runner, port = await bad_peer(corrupt=True)
    liar = RegistryClient(reg.url, TOKEN)
    try:
        claim = Announce(url=f"http://127.0.0.1:{port}", versions={"2": HeldVersion(digest=m2.delta.digest)})
        await liar.announce("liar", claim)
        result = await asyncio.wait_for(nodes[0].puller.pull(2), 60)
        assert (result.kind, nodes[0].puller.progress.delta_error) == ("delta", None)
        assert result.retries >= 1  # a chunk the liar gave was fetched again from the registry
        assert result.bytes_fetched == m2.delta.total_bytes  # the liar's bytes were never kept
        nodes[0].check(2)
    finally:
        for n in nodes:
            await n.close()
        await liar.close()
        await runner.cleanup()


async def test_the_delta_files_of_an_xxh3_version_are_never_taken_from_a_peer(reg, tmp_path, caplog):
    from rolloutd.wire.messages import Announce, HeldVersion
    nodes, m2 = await delta_fleet(reg, tmp_path, 1, hash_name="xxh3-128")
    runner, port = await bad_peer(corrupt=True)
    liar = RegistryClient(reg.url, TOKEN)
    try:
        claim = Announce(url=f"http://127.0.0.1:{port}", versions={"2": HeldVersion(digest=m2.delta.digest)})
        await liar.announce("liar", claim)
        result = await asyncio.wait_for(nodes[0].puller.pull(2), 60)
        assert (result.kind, result.retries) == ("delta", 0)  # the liar was never asked
        assert "2" not in nodes[0].swarm.ledger.held()
        assert sorted(os.listdir(nodes[0].mirror.dir)) == ["1", "2"]  # no delta file kept for peers
        assert [r.message for r in caplog.records if "without peers" in r.message][1:] == [
            "pull the delta files of version 2 from the registry only, without peers: its chunk digests are "
            "xxh3-128, which a hostile peer could forge (publish with a cryptographic hash: blake3, sha256)"]
    finally:
        for n in nodes:
            await n.close()
        await liar.close()
        await runner.cleanup()


def staged_delta(tmp_path, port: int, client, content: bytes):
    """A node serving peers on ``port`` whose pull of version 2 (one file ``a``, 8 KiB) from its
    delta staged the delta file ``a.delta`` with ``content``: the mirror, the swarm, the
    started peer server, the target manifest, the manifest with its delta, the delta files'
    manifest, the partial directory and the staged delta files."""
    from rolloutd.wire.manifest import Delta, DeltaFile, Manifest
    mirror = Mirror(tmp_path / "m", 1 << 30)
    swarm = Swarm(SwarmSettings(enabled=True, url=f"http://127.0.0.1:{port}", token=PEER_TOKEN), client, mirror,
                  node="me")
    server = PeerServer(mirror, swarm.ledger, "127.0.0.1", port, PEER_TOKEN).start()
    target = Manifest.model_validate({"version": 2, "hash": "blake3", "chunk_bytes": 4096, "files": [
        {"name": "a", "size": 8192, "chunks": ["0" * 64, "1" * 64]}]}).sealed()
    manifest = target.with_delta(Delta(base_version=1, base_digest="e" * 64, encoding="xor-planes-zstd", files=[
        DeltaFile(name="a.delta", size=8192, chunks=["2" * 64, "3" * 64], target="a")]))
    files = Manifest(version=2, hash="blake3", chunk_bytes=4096, files=[
        {"name": "a.delta", "size": 8192, "chunks": ["2" * 64, "3" * 64]}]).sealed()
    partial = mirror.begin(target)
    staged = mirror.stage(partial, files)
    staged.path("a.delta").write_bytes(content)
    return mirror, swarm, server, target, manifest, files, partial, staged


async def test_a_delta_pull_announces_and_serves_its_checked_delta_chunks_only_while_it_runs(tmp_path):
    """Under the delta section's digest, with a map over the delta files; a landed chunk of another
    plan is not announced; once the pull ends without a commit (it failed, or falls back to the
    whole version) no delta byte is served."""
    from rolloutd.rollout.registry_client import Timeouts
    from rolloutd.wire.messages import AnnounceReply

    class SilentClient:  # a FAKE registry client: the announcer's replies do not matter here
        url, token, timeouts = "http://127.0.0.1:9", None, Timeouts()

        async def announce(self, node, body):
            return AnnounceReply(instance="x", versions={})

    port = free_port()
    mirror, swarm, server, target, manifest, files, partial, staged = staged_delta(tmp_path, port, SilentClient(),
                                                                                  b"d" * 8192)
    url = f"http://127.0.0.1:{port}/v1/versions/2/files/a.delta"
    auth = {"authorization": f"Bearer {PEER_TOKEN}"}
    try:
        plan = swarm.plan_delta(manifest, files, staged.dir)
        assert swarm.ledger.held()["2"].model_dump() == {"digest": manifest.delta.digest, "chunks": "0",
                                                         "pulling": True}
        other = ChunkPlan(files, swarm.registry)
        swarm.landed(Pick(1, files.files[0], 1, swarm.registry), other)  # not the pull in progress
        assert swarm.ledger.held()["2"].chunks == "0"
        swarm.landed(Pick(0, files.files[0], 0, swarm.registry), plan)
        assert swarm.ledger.held()["2"].chunks == "1"
        async with httpx.AsyncClient() as http:
            r = await http.get(url, headers={**auth, "range": "bytes=0-4095"})
            assert r.status_code == 206 and r.content == b"d" * 4096
            r = await http.get(url, headers={**auth, "range": "bytes=4096-8191"})
            assert r.status_code == 416  # not checked yet
            swarm.finish(plan)
            assert swarm.ledger.held() == {}
            r = await http.get(url, headers={**auth, "range": "bytes=0-4095"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "version_unknown"
    finally:
        server.stop()
        mirror.discard(partial)


async def test_a_committed_delta_pulls_delta_files_stay_served_whole_until_the_mirror_drops_them(tmp_path):
    """From the pull's staged view to the commit (the files move meanwhile) to the kept files,
    no request falls between; once the next commit drops them they are neither served nor announced."""
    from rolloutd.wire.messages import HeldVersion
    port = free_port()
    mirror, swarm, server, target, manifest, files, partial, staged = staged_delta(
        tmp_path, port, RegistryClient("http://127.0.0.1:9"), b"d" * 4096 + b"D" * 4096)
    url = f"http://127.0.0.1:{port}/v1/versions/2/files"
    auth = {"authorization": f"Bearer {PEER_TOKEN}"}
    async with httpx.AsyncClient() as http:
        async def get(name: str, first: int, last: int) -> httpx.Response:
            return await http.get(f"{url}/{name}", headers={**auth, "range": f"bytes={first}-{last}"})
        try:
            plan = swarm.plan_delta(manifest, files, staged.dir)
            for bit in (0, 1):
                swarm.landed(Pick(bit, files.files[0], bit, swarm.registry), plan)
            mirror.commit(partial, keep_delta=True)  # the files moved; the pull's view is still up
            r = await get("a.delta", 0, 8191)
            assert (r.status_code, r.content) == (206, b"d" * 4096 + b"D" * 4096)
            assert swarm.keep_delta(plan, manifest, mirror.delta_dir(2))
            assert swarm.ledger.partial(2) is None
            assert swarm.ledger.held() == {"2": HeldVersion(digest=target.digest, delta=manifest.delta.digest)}
            r = await get("a.delta", 4096, 8191)
            assert (r.status_code, r.content) == (206, b"D" * 4096)
            assert (await get("a", 0, 4095)).status_code == 206  # and the version, as any complete one
            assert (await get("b.delta", 0, 1)).status_code == 404  # nothing else
            mirror.commit(mirror.begin(target.model_copy(update={"version": 3, "digest": None}).sealed()))  # the next
            r = await get("a.delta", 0, 4095)
            assert r.status_code == 404 and r.json()["error"]["code"] == "file_unknown"
            assert swarm.ledger.held()["2"] == HeldVersion(digest=target.digest)
        finally:
            server.stop()


async def test_a_delta_chunk_checked_before_a_fall_back_is_not_served_by_the_whole_versions_pull(tmp_path):
    """A request judged against the delta pull's view, answered after the same version's whole
    pull began (the delta failed): the delta files are not the version's, nothing is served."""
    from rolloutd.wire.manifest import Manifest
    mirror = Mirror(tmp_path / "m", 1 << 30)
    from rolloutd.rollout.swarm import Ledger
    ledger = Ledger(mirror)
    server = PeerServer(mirror, ledger, "127.0.0.1", free_port(), PEER_TOKEN)
    files = Manifest(version=2, hash="blake3", chunk_bytes=4096, files=[
        {"name": "a.delta", "size": 8192, "chunks": ["2" * 64, "3" * 64]}]).sealed()
    target = Manifest(version=2, hash="blake3", chunk_bytes=4096, files=[
        {"name": "a.delta", "size": 8192, "chunks": ["0" * 64, "1" * 64]}]).sealed()  # a file of that name
    ledger.begin(files, tmp_path, 0b01, digest="d" * 64)
    _, _, allowed = server._locate(2, "a.delta")
    assert allowed(0, 4096)
    ledger.begin(target, tmp_path, 0b01)  # the whole version's pull, with its own chunk 0 checked
    assert not allowed(0, 4096)
