"""``rolloutd demo``: the registry's whole path on one machine, in a few seconds.

A registry is embedded; two versions of a small Llama-shaped checkpoint (built here, no
model hub) are published; then a node's view: long-poll for the newest version, lease it,
pull every file with parallel Range requests checking every chunk digest, heartbeat, and
read the replica directory back.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable

from .registry.client import RegistryClient
from .registry.manifest import Manifest, bad_chunks
from .registry.publish import EmbeddedRegistry
from .registry.store import Heartbeat
from .tinymodel import llama_state_dict


async def pull(client: RegistryClient, manifest: Manifest, streams: int = 4) -> dict[str, bytes]:
    """Fetch every chunk of every file (``streams`` at a time) and check its digest."""
    sem = asyncio.Semaphore(streams)
    out = {f.name: bytearray(f.size) for f in manifest.files}

    async def fetch(entry, index: int) -> None:
        start, end = manifest.chunk_span(entry, index)
        async with sem:
            data = await client.read_range(manifest.version, entry.name, start, end)
        out[entry.name][start:end] = data

    await asyncio.gather(*(fetch(f, i) for f in manifest.files for i in range(len(f.chunks))))
    for f in manifest.files:
        if bad := bad_chunks(memoryview(out[f.name]), f, manifest):
            raise RuntimeError(f"{f.name}: chunks {bad} do not match their digests")
    return {k: bytes(v) for k, v in out.items()}


async def node_view(url: str, say: Callable[[str], None]) -> None:
    async with RegistryClient(url) as client:
        known = 0
        for _ in range(2):
            info = await client.latest(after=known, wait_s=10)
            lease = await client.lease("demo-node", "latest", ttl_s=30)
            manifest = await client.manifest(lease.version)
            t0 = time.perf_counter()
            files = await pull(client, manifest)
            dt = time.perf_counter() - t0
            size = sum(len(b) for b in files.values())
            say(f"node: version {info.version} is newest; leased {lease.lease_id[:8]}..., pulled "
                f"{size / 2**20:.1f} MiB in {len(files)} file(s) at {size / 2**20 / dt:.0f} MiB/s, "
                "every chunk digest checked")
            await client.release(lease.lease_id)
            reply = await client.heartbeat("demo-node.s0", Heartbeat(
                node="demo-node", server="s0", state="SERVING", version=lease.version,
                endpoint="http://demo-node:8000"))
            say(f"node: heartbeat -> registry latest {reply.latest}, demand {reply.demand.min_version}")
            known = info.version or 0
            if known >= 2:
                break
        for r in await client.replicas():
            say(f"registry directory: {r['replica_id']} state {r['state']} version {r['version']} "
                f"age {r['age_s']:.2f} s")


def run_demo(args: argparse.Namespace) -> int:
    def say(msg: str) -> None:
        print(msg, flush=True)

    with EmbeddedRegistry(host="127.0.0.1", port=args.port) as reg:
        say(f"registry: listening on {reg.url}")
        import threading
        node = threading.Thread(target=lambda: asyncio.run(node_view(reg.url, say)))
        node.start()
        for version, seed in ((1, 1), (2, 2)):
            time.sleep(0.5)
            m = reg.publish(version, llama_state_dict(seed), shard_bytes=8 << 20, chunk_bytes=1 << 20)
            say(f"trainer: published version {version} ({m.total_bytes / 2**20:.1f} MiB, "
                f"{len(m.files)} files, digest {m.digest[:12]}...)")
        node.join(60)
        if node.is_alive():
            say("demo: the node did not finish in 60 s")
            return 1
        say(f"registry versions: {[(v['version'], v['state']) for v in reg.versions()]}")
    say("demo: done: the node followed versions 1 -> 2, every byte checked against its manifest")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the whole path on this machine (no GPU needed)")
    p.add_argument("--port", type=int, default=0, help="registry port (0: a free one)")
    p.set_defaults(func=run_demo)


if __name__ == "__main__":
    from .cli import main
    sys.exit(main(["demo", *sys.argv[1:]]))
