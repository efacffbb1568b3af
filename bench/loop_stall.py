"""The event loop's longest stall while an update removes a large version, old path vs new.

After every update the node's gc removes the versions no server holds. It used to run on the
event loop that relays every token (``Updater.collect`` -> ``Mirror.gc`` -> ``shutil.rmtree``);
the registry's ``DiskStore.reclaim`` deleted on its loop the same way. Now the mirror's gc runs on
the mirror's worker thread (``Mirror.collect_soon``) and the registry only renames on its loop.

Each mode builds a mirror (under ``--dir``, a tmpfs: ``/dev/shm``) holding a ``--gib`` version
of real bytes (random, not sparse: freeing real pages is the cost) and a small newer one, then
runs a loop-lag probe (a task that sleeps 1 ms and records how late it wakes) while the big
version is removed:

- ``idle``: nothing removed (the probe's own noise on this machine);
- ``mirror-old``: ``Mirror.gc`` called on the loop, as ``Updater.collect`` did;
- ``mirror-new``: ``Updater.collect``'s path now, ``await`` on ``Mirror.collect_soon``;
- ``registry-old``: ``DiskStore``'s old reclaim on the loop (rename, then ``shutil.rmtree``);
- ``registry-new``: ``DiskStore.reclaim`` now (rename on the loop, delete in its worker).

Free space is checked first (``shutil.disk_usage``) and the size lowered to fit. Modes run
``--repeats`` times, interleaved. The last stdout line is one JSON object. From the repo root::

    .venv/bin/python bench/loop_stall.py             # 2 GiB, 3 repeats, a minute or two
    .venv/bin/python bench/loop_stall.py --gib 0.5 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutd.registry.blobs import DiskStore  # noqa: E402
from rolloutd.rollout.mirror import Mirror  # noqa: E402
from rolloutd.wire.manifest import FileEntry, Manifest, hash_chunks  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
CHUNK = 64 * MiB  # the default chunk size; every chunk holds the same random bytes (one digest)
MODES = ("idle", "mirror-old", "mirror-new", "registry-old", "registry-new")


def manifest_for(version: int, file_bytes: list[int], block: bytes) -> Manifest:
    digest = hash_chunks(block, CHUNK, "xxh3-128")[0]
    files = [FileEntry(name=f"model-{i + 1:05d}-of-{len(file_bytes):05d}.safetensors", size=n,
                       chunks=[digest] * (n // CHUNK)) for i, n in enumerate(file_bytes)]
    return Manifest(version=version, chunk_bytes=CHUNK, files=files).sealed()


def fill(fd: int, size: int, block: bytes) -> None:
    for offset in range(0, size, len(block)):
        os.pwrite(fd, block, offset)


def put(mirror: Mirror, version: int, file_bytes: list[int], block: bytes) -> None:
    """Write a version as the puller does: begin (preallocated), pwrite, commit."""
    partial = mirror.begin(manifest_for(version, file_bytes, block))
    for entry in partial.manifest.files:
        fd = partial.open(entry.name)
        try:
            fill(fd, entry.size, block)
        finally:
            os.close(fd)
    mirror.commit(partial)


def put_registry(store: DiskStore, version: int, file_bytes: list[int], block: bytes) -> None:
    manifest = manifest_for(version, file_bytes, block)
    staging = store.staging_dir(version)
    for entry in manifest.files:
        fd = os.open(staging / entry.name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            fill(fd, entry.size, block)
        finally:
            os.close(fd)
    store.commit(manifest)


async def probed(work) -> dict:
    """Run ``work()`` (a coroutine function) with a lag probe around it; figures in ms."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t0 - 0.001) * 1e3)
    task = asyncio.ensure_future(probe())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await work()
    took = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    stop.set()
    await task
    lags.sort()
    return {"max_lag_ms": round(lags[-1], 2), "p99_lag_ms": round(lags[int(0.99 * (len(lags) - 1))], 2),
            "samples": len(lags), "removal_s": round(took, 3)}


async def one(mode: str, root: Path, file_bytes: list[int], block: bytes) -> dict:
    work_dir = Path(tempfile.mkdtemp(prefix=f"loop-stall-{mode}-", dir=root))
    try:
        if mode.startswith("registry"):
            store = DiskStore(work_dir)
            put_registry(store, 1, file_bytes, block)

            async def work() -> None:
                if mode == "registry-old":  # the reclaim before this change, inline on the loop
                    dst = work_dir / "trash" / f"1.{secrets.token_hex(4)}"
                    os.rename(work_dir / "versions" / "1", dst)
                    shutil.rmtree(dst, ignore_errors=True)
                else:
                    store.reclaim(1)
                    await asyncio.to_thread(store.close)  # only to time the deletion itself
        else:
            mirror = Mirror(work_dir, max_bytes=1 << 50)
            put(mirror, 1, file_bytes, block)
            put(mirror, 2, [CHUNK], block)

            async def work() -> None:
                if mode == "mirror-old":  # Updater.collect before this change: gc on the loop
                    mirror.gc({2})
                elif mode == "mirror-new":
                    await asyncio.wrap_future(mirror.collect_soon({2}))
                else:
                    await asyncio.sleep(0.2)
        result = await probed(work)
        if mode.startswith("mirror"):
            mirror.close()
            assert mirror.versions() == ([1, 2] if mode == "idle" else [2]), mirror.versions()
        return result
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="size of the version removed (GiB)")
    ap.add_argument("--files", type=int, default=4, help="files in that version")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="a tmpfs to build the mirror in")
    args = ap.parse_args()

    want = int(args.gib * GiB)
    free = shutil.disk_usage(args.dir).free
    room = int(free * 0.8) - 2 * CHUNK  # the newer small version, and a margin for everyone else
    size = max(CHUNK * args.files, min(want, room)) // (CHUNK * args.files) * (CHUNK * args.files)
    if size > room:
        sys.exit(f"{args.dir} has {free / GiB:.1f} GiB free: too little for even {size / GiB:.2f} GiB")
    if size < want:
        print(f"{args.dir} has {free / GiB:.1f} GiB free: using {size / GiB:.2f} GiB, not {args.gib:g}")
    file_bytes = [size // args.files] * args.files
    block = os.urandom(CHUNK)

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            res = asyncio.run(one(mode, args.dir, file_bytes, block))
            runs[mode].append(res)
            print(f"repeat {r + 1} {mode:13s} max lag {res['max_lag_ms']:8.2f} ms  p99 {res['p99_lag_ms']:6.2f} ms"
                  f"  removal {res['removal_s']:.3f} s")
    summary = {m: {"max_lag_ms": max(x["max_lag_ms"] for x in rs),
                   "median_max_lag_ms": statistics.median(x["max_lag_ms"] for x in rs),
                   "median_removal_s": statistics.median(x["removal_s"] for x in rs)} for m, rs in runs.items()}
    print(json.dumps({"bench": "loop_stall", "gib": round(size / GiB, 3), "files": args.files,
                      "repeats": args.repeats, "dir": str(args.dir), "cpus": os.cpu_count(),
                      "summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
