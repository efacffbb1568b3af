"""Pull one file with parallel ``Range`` requests, as the node daemon does, and discard the bytes.

``--concurrency`` workers share one aiohttp session (uvloop) and take ``--chunk-mib`` ranges in
file order; each body is read with ``iter_chunked`` in pieces of ``--piece-kib``, like
``RegistryClient.stream_range``. Every reply must be a 206 with exactly the range asked for.
Prints one JSON object: bytes, seconds, GB/s, this process's CPU seconds. Used by
``registry_serve.py``::

    python bench/rangepull.py http://127.0.0.1:8700/v1/versions/1/files/model.safetensors \\
        --size 1073741824 --chunk-mib 64 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import uvloop


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--size", type=int, required=True, help="file size in bytes")
    p.add_argument("--chunk-mib", type=int, default=64, help="bytes per Range request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--piece-kib", type=int, default=1024, help="read size of the body stream")
    p.add_argument("--rounds", type=int, default=1, help="pull the file this many times (for profiling)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit for all rounds together")
    args = p.parse_args()
    if min(args.size, args.chunk_mib, args.concurrency, args.piece_kib, args.rounds) < 1:
        p.error("size, chunk, concurrency, piece and rounds must be positive")
    return args


def ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(size, start + chunk)) for start in range(0, size, chunk)]


async def fetch(session: aiohttp.ClientSession, url: str, start: int, end: int, size: int,
                piece: int) -> int:
    headers = {"range": f"bytes={start}-{end - 1}"}
    async with session.get(url, headers=headers) as r:
        expected = f"bytes {start}-{end - 1}/{size}"
        if r.status != 206 or r.headers.get("content-range") != expected:
            raise RuntimeError(f"asked {expected}, got HTTP {r.status} "
                               f"content-range {r.headers.get('content-range')!r}")
        got = 0
        async for data in r.content.iter_chunked(piece):
            got += len(data)
    if got != end - start:
        raise RuntimeError(f"range {start}-{end - 1}: {got} bytes, expected {end - start}")
    return got


async def pull(args: argparse.Namespace) -> dict:
    chunks = ranges(args.size, args.chunk_mib << 20)
    todo = [r for _ in range(args.rounds) for r in reversed(chunks)]  # pop() takes them in file order
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> int:
            done = 0
            while todo:
                start, end = todo.pop()
                done += await fetch(session, args.url, start, end, args.size, args.piece_kib << 10)
            return done

        cpu0, t0 = time.process_time(), time.perf_counter()
        done = sum(await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(args.concurrency))), args.timeout_s))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if done != args.size * args.rounds:
        raise RuntimeError(f"pulled {done} bytes, expected {args.size * args.rounds}")
    return {"bytes": done, "seconds": round(seconds, 4), "gb_per_s": round(done / seconds / 1e9, 4),
            "client_cpu_s": round(cpu, 3), "requests": len(chunks) * args.rounds}


def main() -> None:
    args = parse_args()
    print(json.dumps(uvloop.run(pull(args))))


if __name__ == "__main__":
    main()
