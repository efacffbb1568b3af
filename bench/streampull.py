"""Pull files with parallel ``Range`` requests exactly as a node's pull worker does, and
discard the bytes: a client that costs the server's peer as little as the OS allows.

``--concurrency`` threads, each with its own :class:`rolloutd.rollout.sources.HttpRangeSource`
(``http.client``, one kept-alive connection, each body read into one reused buffer) take
``--chunk-mib`` ranges in file order and drop the bytes (one copy out of the kernel, no hash,
no write), so the rate is the server's and the loopback's, not the client's work on the
bytes. Every reply must be a 206 of exactly the length asked for (the source checks it).
Several URLs (files of the same size, one server) are taken one range after another, in
order. Prints one JSON object: bytes, seconds, GB/s, this process's CPU seconds. Used by
``registry_serve.py`` (client ``streams``) and ``pull.py`` (contender ``loopback``)::

    python bench/streampull.py http://127.0.0.1:8700/v1/versions/1/files/model.safetensors \\
        --size 1073741824 --chunk-mib 64 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from registry_load import machine_busy_s  # noqa: E402

from rolloutd.rollout.sources import SourceSpec  # noqa: E402

MiB = 1 << 20


class Discard:
    """A sink that counts the bytes and drops them."""

    def __init__(self, start: int):
        self.offset = start

    def write(self, piece: memoryview) -> None:
        self.offset += len(piece)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("urls", nargs="+", metavar="url", help="files of one server, each --size bytes")
    p.add_argument("--size", type=int, required=True, help="size of each file in bytes")
    p.add_argument("--chunk-mib", type=int, default=64, help="bytes per Range request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (threads)")
    p.add_argument("--piece-kib", type=int, default=1024, help="bytes read from a reply at a time")
    p.add_argument("--rounds", type=int, default=1, help="pull the file this many times")
    args = p.parse_args()
    if min(args.size, args.chunk_mib, args.concurrency, args.piece_kib, args.rounds) < 1:
        p.error("size, chunk, concurrency, piece and rounds must be positive")
    return args


def main() -> None:
    args = parse_args()
    paths = [urlsplit(u).path for u in args.urls]
    if len({urlsplit(u).netloc for u in args.urls}) != 1:
        sys.exit("streampull: every URL must name the same server")
    parts = urlsplit(args.urls[0])
    spec = SourceSpec("registry", f"{parts.scheme}://{parts.netloc}")
    chunk = args.chunk_mib * MiB
    todo = [(path, s, min(args.size, s + chunk)) for _ in range(args.rounds) for path in paths
            for s in range(0, args.size, chunk)][::-1]
    lock, failures, done = threading.Lock(), [], [0]

    def stream() -> None:
        source = spec.open(args.piece_kib << 10)
        try:
            while True:
                with lock:
                    if not todo or failures:
                        return
                    path, start, end = todo.pop()
                sink = Discard(start)
                source.fetch_path(path, path, start, end, sink)
                if sink.offset != end:
                    raise RuntimeError(f"range {start}-{end - 1}: got {sink.offset - start} bytes")
                with lock:
                    done[0] += end - start
        except Exception as e:
            failures.append(e)
        finally:
            source.close()

    threads = [threading.Thread(target=stream) for _ in range(args.concurrency)]
    cpu0, machine0, t0 = time.process_time(), machine_busy_s(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds, cpu, machine = time.perf_counter() - t0, time.process_time() - cpu0, machine_busy_s() - machine0
    if failures:
        sys.exit(f"streampull: {failures[0]}")
    expected = args.size * args.rounds * len(paths)
    if done[0] != expected:
        sys.exit(f"streampull: pulled {done[0]} bytes, expected {expected}")
    print(json.dumps({"bytes": done[0], "seconds": round(seconds, 4), "gb_per_s": round(done[0] / seconds / 1e9, 4),
                      "client_cpu_s": round(cpu, 3), "machine_cpu_s": round(machine, 3),
                      "requests": len(range(0, args.size, chunk)) * args.rounds * len(paths)}))


if __name__ == "__main__":
    main()
