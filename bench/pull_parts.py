"""A pull worker's parts in place: the real source and sink against a real registry, one part left out at a time.

``rolloutd registry`` (bytes in memory) on CPU 0 serves one ``--size-mib`` safetensors file; this
process, on CPU 1, fetches it as a pull worker does (``HttpRangeSource``, 16 MiB requests, 64 MiB
chunks, ``ChunkWriter`` over a tmpfs file whose pages exist, as a recycled file's do), on
``--streams`` threads, in these modes, interleaved, ``--repeats`` times (medians):

- ``full``: as shipped into a recycled file (read, xxh3, ``pwrite``; no ``posix_fallocate``, as
  the pages exist);
- ``falloc``: with a ``posix_fallocate`` of each chunk all the same (the build before);
- ``nowrite``: read and hash, nothing written;
- ``nothing``: read and dropped;
- ``full:1``: as shipped on one thread.

The differences between modes are what each part costs inside a pull, where caches are shared
with the rest (``bench/pull_floor.py`` measures each step alone). From the repo root::

    .venv/bin/python bench/pull_parts.py      # 2 GiB, 3 repeats, about 1 minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import xxhash
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from registry_load import free_port, pinned, stop  # noqa: E402
from registry_serve import wait_up  # noqa: E402

from rolloutd.rollout.fetch_worker import ChunkWriter  # noqa: E402
from rolloutd.rollout.sources import SourceSpec  # noqa: E402

MiB = 1 << 20
CHUNK, REQUEST, PIECE = 64 * MiB, 16 * MiB, MiB
MODES = ("full", "falloc", "nowrite", "nothing", "full:1")


class _Hash:
    def __init__(self, hasher):
        self.hasher = hasher

    def write(self, piece) -> None:
        self.hasher.update(piece)


class _Drop:
    def write(self, piece) -> None:
        pass


def one_pull(mode: str, streams: int, size: int, fd: int, spec: SourceSpec) -> tuple[float, float]:
    chunks, lock = list(range(0, size, CHUNK)), threading.Lock()

    def stream() -> None:
        source = spec.open(PIECE)
        try:
            while True:
                with lock:
                    if not chunks:
                        return
                    start = chunks.pop(0)
                end, hasher = min(size, start + CHUNK), xxhash.xxh3_128()
                if mode in ("full", "falloc"):
                    if mode == "falloc":
                        os.posix_fallocate(fd, start, end - start)
                    with ChunkWriter(fd, start, end, hasher, lambda n: None, 8 * MiB) as sink:
                        fetch(source, start, end, sink)
                else:
                    fetch(source, start, end, _Hash(hasher) if mode == "nowrite" else _Drop())
        finally:
            source.close()

    def fetch(source, start: int, end: int, sink) -> None:
        for r in range(start, end, REQUEST):
            source.fetch(1, "f.safetensors", r, min(end, r + REQUEST), sink)

    t0, c0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=stream) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return size / seconds / 1e9, cpu / (size / 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=2, help="threads, as a worker's streams (default: 2)")
    p.add_argument("--tmp-dir", default="/dev/shm")
    args = p.parse_args()
    rolloutd = str(Path(sys.executable).with_name("rolloutd"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(dir=args.tmp_dir, prefix="rolloutd-parts-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        save_file({"w": np.frombuffer(os.urandom(args.size_mib * MiB - 4096), dtype=np.uint8)},
                  str(src / "f.safetensors"))
        size = (src / "f.safetensors").stat().st_size
        log_path = Path(tmp) / "registry.log"
        with open(log_path, "wb") as log:
            registry = subprocess.Popen(pinned(0, [rolloutd, "registry", "--host", "127.0.0.1", "--port", str(port)]),
                                        stdout=log, stderr=subprocess.STDOUT)
        try:
            os.sched_setaffinity(0, {1 % (os.cpu_count() or 1)})
            wait_up(registry, f"{url}/healthz", log_path)
            subprocess.run([rolloutd, "publish", "1", str(src), "--registry", url, "--chunk-bytes", str(CHUNK)],
                           check=True, capture_output=True)
            fd = os.open(Path(tmp) / "dest", os.O_RDWR | os.O_CREAT, 0o600)
            spec = SourceSpec("registry", url)
            one_pull("falloc", args.streams, size, fd, spec)  # allocates the destination's pages, untimed
            runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for m in MODES:
                    name, _, threads = m.partition(":")
                    runs[m].append(one_pull(name, int(threads or args.streams), size, fd, spec))
            os.close(fd)
        finally:
            stop(registry)
    print(f"# bench/pull_parts.py: {size / MiB:.0f} MiB, {args.streams} streams, median of {args.repeats}\n")
    print("| mode | GB/s | client s/GB |\n|---|---|---|")
    for m, rs in runs.items():
        print(f"| {m} | {statistics.median(r[0] for r in rs):.2f} | {statistics.median(r[1] for r in rs):.3f} |")


if __name__ == "__main__":
    main()
