"""What the tracker costs the registry at fleet scale: CPU per announcement and memory, for
``--nodes`` nodes pulling (or holding) a version of ``--chunks`` chunks (2,086: a 70B model in
bf16, 140 GB, in 64 MiB chunks). Calls the registry service itself (body parsing, the tracker,
the reply's JSON), without HTTP: the HTTP stack's own cost per request is in
``bench/registry_load.py``.

    .venv/bin/python bench/tracker_cost.py --nodes 1000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rolloutd.registry.server.service import RegistryService  # noqa: E402
from rolloutd.registry.server.settings import RegistrySettings  # noqa: E402
from rolloutd.wire.chunkmap import full, to_hex  # noqa: E402
from rolloutd.wire.manifest import FileEntry, Manifest  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--chunks", type=int, default=2086)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    service = RegistryService(RegistrySettings())
    per_file = -(-args.chunks // 30)
    files, left = [], args.chunks
    for i in range(30):
        n = min(per_file, left)
        if n <= 0:
            break
        files.append(FileEntry(name=f"model-{i:05d}.safetensors", size=n * (64 << 20), chunks=["ab" * 16] * n))
        left -= n
    manifest = Manifest(version=1, files=files).sealed()
    service.store.publish(manifest, {})
    rng = random.Random(0)
    held = [0] * args.nodes
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    times, sizes = [], []
    for rnd in range(args.rounds):
        for i in range(args.nodes):  # each round every node gains a few random chunks
            for _ in range(rng.randrange(1, 40)):
                held[i] |= 1 << rng.randrange(args.chunks)
            body = json.dumps({"url": f"http://10.0.{i // 250}.{i % 250}:9300", "versions": {
                "1": {"digest": manifest.digest, "chunks": to_hex(held[i]), "pulling": True}}}).encode()
            t = time.perf_counter()
            reply = json.dumps(service.announce(f"node{i}", body)).encode()
            times.append(time.perf_counter() - t)
            sizes.append((len(body), len(reply)))
            if rnd == args.rounds - 1:
                continue
    mem = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    times.sort()
    out = {"nodes": args.nodes, "chunks": args.chunks, "announcements": len(times),
           "us_per_announce_p50": round(times[len(times) // 2] * 1e6, 1),
           "us_per_announce_p99": round(times[int(len(times) * 0.99)] * 1e6, 1),
           "request_bytes": max(s[0] for s in sizes), "reply_bytes_max": max(s[1] for s in sizes),
           "tracker_memory_bytes": mem, "complete_nodes": sum(h == full(args.chunks) for h in held)}
    out["cpu_share_at_2_per_node_per_s"] = round(out["us_per_announce_p50"] * 1e-6 * 2 * args.nodes, 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
