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
import resource
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rolloutd.registry.service import RegistryService  # noqa: E402
from rolloutd.registry.settings import RegistrySettings  # noqa: E402
from rolloutd.wire.chunkmap import full, to_hex  # noqa: E402
from rolloutd.wire.manifest import FileEntry, Manifest  # noqa: E402


def version(chunks: int) -> Manifest:
    per_file = -(-chunks // 30)
    files, left = [], chunks
    for i in range(30):
        n = min(per_file, left)
        if n <= 0:
            break
        files.append(FileEntry(name=f"model-{i:05d}.safetensors", size=n * (64 << 20), chunks=["ab" * 16] * n))
        left -= n
    return Manifest(version=1, files=files).sealed()


def simulate(service: RegistryService, manifest: Manifest, nodes: int, rounds: int, rng: random.Random,
             times: list[float] | None = None, sizes: list[tuple[int, int]] | None = None) -> list[int]:
    """Every node announces each round and follows the reply (its origin chunks, a few from peers)."""
    held = [0] * nodes
    for _ in range(rounds):
        for i in range(nodes):
            body = json.dumps({"url": f"http://10.0.{i // 250}.{i % 250}:9300", "versions": {
                "1": {"digest": manifest.digest, "chunks": to_hex(held[i]), "pulling": True}}}).encode()
            t = time.perf_counter()
            answer = service.announce(f"node{i}", body)
            reply = json.dumps(answer).encode()
            if times is not None:
                times.append(time.perf_counter() - t)
                sizes.append((len(body), len(reply)))
            view = answer["versions"].get("1")
            if view is not None:
                held[i] |= int(view["origin"], 16)
                for peer in view["peers"][:2]:
                    have = int(peer["chunks"], 16) & ~held[i]
                    for _k in range(rng.randrange(1, 8)):
                        if have:
                            low = have & -have
                            held[i] |= low
                            have ^= low
    return held


def fresh(manifest: Manifest) -> RegistryService:
    service = RegistryService(RegistrySettings())
    service.store.publish(manifest, {})
    return service


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--chunks", type=int, default=2086)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    manifest = version(args.chunks)
    times: list[float] = []
    sizes: list[tuple[int, int]] = []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    held = simulate(fresh(manifest), manifest, args.nodes, args.rounds, random.Random(0), times, sizes)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    # CPU of the whole loop per announcement: an upper bound (it also counts this script making the
    # bodies and following the replies), and unlike wall time, not inflated by a busy machine.
    cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / len(times)
    tracemalloc.start()  # a second run, for memory only: tracing slows every allocation
    base = tracemalloc.take_snapshot()
    service = fresh(manifest)
    simulate(service, manifest, args.nodes, 2, random.Random(0))
    mem = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    tracemalloc.stop()
    times.sort()
    out = {"nodes": args.nodes, "chunks": args.chunks, "announcements": len(times),
           "cpu_us_per_announce_at_most": round(cpu * 1e6, 1),
           "wall_us_per_announce_p50": round(times[len(times) // 2] * 1e6, 1),
           "wall_us_per_announce_p99": round(times[int(len(times) * 0.99)] * 1e6, 1),
           "request_bytes": max(s[0] for s in sizes), "reply_bytes_max": max(s[1] for s in sizes),
           "registry_memory_bytes": mem, "complete_nodes": sum(h == full(args.chunks) for h in held)}
    out["core_share_at_2_per_node_per_s"] = round(cpu * 2 * args.nodes, 3)  # of one core, at most
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
