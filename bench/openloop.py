"""Open-loop HTTP/1.1 heartbeat load at a fixed rate, with latency from the *intended* send time.

Request ``i`` is due at ``t0 + i / rate`` and PUTs replica ``i % replicas``, so every replica
beats once per ``replicas / rate`` seconds, like a fleet of daemons on a timer. Replica ``k``
always uses connection ``k % connections`` (a node's daemon keeps one keep-alive connection).
A connection carries one request at a time; requests due while it is busy wait in its queue,
and that wait counts as latency: a slow server cannot slow the arrival rate down (no
coordinated omission).

Bounded: at most ``rate * (warmup_s + duration_s)`` requests, and every request still
unanswered ``drain_s`` after the last one was due is counted as a timeout.

Prints one JSON object on stdout. Run with the project's venv (uses uvloop if present)::

    python bench/openloop.py --port 8700 --rate 5000 --duration-s 20 --body-file body.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import string
import sys
import time
from array import array
from collections import Counter, deque

MAX_REQUESTS = 5_000_000  # hard cap on one run, whatever the options say
UNSET = -1.0
TICK_S = 0.001  # shortest sleep between dispatch rounds; a loop timer is no finer than this


def replica_id(k: int) -> str:
    """Replica ids shaped like a node's servers: 8 per node (same scheme as heartbeat.lua)."""
    return f"n{k // 8:04d}-s{k % 8}"


def build_requests(host: str, port: int, replicas: int, body: bytes, template: bool = False) -> list[bytes]:
    """Every request's bytes, made once up front so sending costs one write. With ``template``,
    ``$node`` and ``$server`` in the body become replica ``k``'s own (a fleet of distinct nodes)."""
    def one(k: int) -> bytes:
        b = body
        if template:
            node, server = replica_id(k).split("-")
            b = string.Template(body.decode()).substitute(node=node, server=server).encode()
        head = (f"Host: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(b)}\r\n\r\n").encode()
        return f"PUT /v1/replicas/{replica_id(k)} HTTP/1.1\r\n".encode() + head + b
    return [one(k) for k in range(replicas)]


class Run:
    """Per-request timestamps (seconds since t0), filled in by the connections."""

    def __init__(self, total: int, rate: float):
        self.total, self.rate = total, rate
        self.t0 = 0.0
        self.dispatched = array("d", [UNSET]) * total  # handed to its connection
        self.done = array("d", [UNSET]) * total        # response fully read
        self.status = array("h", [0]) * total          # HTTP status; 0: none
        self.failures: Counter[str] = Counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def due(self, i: int) -> float:
        return i / self.rate


class Connection(asyncio.Protocol):
    """One keep-alive connection: a FIFO of due requests, one on the wire at a time."""

    def __init__(self, run: Run):
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buf = bytearray()
        self.waiting: deque[tuple[int, bytes]] = deque()
        self.on_wire: int | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        lost = (self.on_wire is not None) + len(self.waiting)
        if lost:
            self.run.failures["connection_lost"] += lost
        self.on_wire, self.waiting = None, deque()

    def submit(self, i: int, request: bytes) -> None:
        self.run.dispatched[i] = self.run.now()
        if self.closed:
            self.run.failures["connection_lost"] += 1
        elif self.on_wire is None:
            self._send(i, request)
        else:
            self.waiting.append((i, request))

    def _send(self, i: int, request: bytes) -> None:
        self.on_wire = i
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.on_wire is not None:
            parsed = _response_length(self.buf)
            if parsed is None:
                return
            status, length = parsed
            if length < 0:  # no Content-Length: cannot frame the next response
                self.run.failures["unframed_response"] += 1
                self.transport.close()
                return
            del self.buf[:length]
            i, self.on_wire = self.on_wire, None
            self.run.done[i], self.run.status[i] = self.run.now(), status
            if self.waiting:
                self._send(*self.waiting.popleft())


def _response_length(buf: bytearray) -> tuple[int, int] | None:
    """(status, bytes of the whole response) once it is all in ``buf``; None while incomplete;
    length -1 if the response has no Content-Length."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    status = int(head[9:12])
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return status, -1
    stop = head.find(b"\r\n", at + 2)
    body = int(head[at + 17:stop if stop >= 0 else len(head)])
    total = end + 4 + body
    return (status, total) if len(buf) >= total else None


async def connect_all(host: str, port: int, n: int, run: Run) -> list[Connection]:
    loop = asyncio.get_running_loop()
    conns: list[Connection] = []
    for start in range(0, n, 100):  # in batches: stay inside the server's accept backlog
        batch = [loop.create_connection(lambda: Connection(run), host, port)
                 for _ in range(start, min(n, start + 100))]
        conns += [proto for _, proto in await asyncio.gather(*batch)]
    return conns


async def schedule(run: Run, conns: list[Connection], requests: list[bytes]) -> None:
    """Hand every request to its connection when it is due; batches whatever one timer tick
    let fall due, so the timer's granularity does not cap the rate."""
    n_conns, n_reps = len(conns), len(requests)
    i = 0
    while i < run.total:
        due_now = min(run.total, int(run.now() * run.rate) + 1)
        while i < due_now:
            k = i % n_reps
            conns[k % n_conns].submit(i, requests[k])
            i += 1
        await asyncio.sleep(max(TICK_S, run.due(i) - run.now()))


async def drain(run: Run, conns: list[Connection], deadline: float) -> None:
    while run.now() < deadline and any(c.on_wire is not None or c.waiting for c in conns):
        await asyncio.sleep(0.01)


def percentiles(values: list[float], points=(50, 90, 99, 99.9)) -> dict[str, float | None]:
    if not values:
        return {f"p{p:g}_ms": None for p in points}
    values = sorted(values)
    return {f"p{p:g}_ms": round(1e3 * values[min(len(values) - 1, math.ceil(p / 100 * len(values)) - 1)], 3)
            for p in points}


def summarize(run: Run, first: int, window_s: float, cpu_s: float, wall_s: float) -> dict:
    """Stats over the measured requests (index >= first); the warm-up ones are left out."""
    measured = range(first, run.total)
    t_start = run.due(first)
    latencies, statuses, unanswered = [], Counter(), 0
    completions_in_window = 0
    for i in measured:
        done = run.done[i]
        if done == UNSET:
            unanswered += 1
            continue
        statuses[run.status[i]] += 1
        if 200 <= run.status[i] < 300:
            latencies.append(done - run.due(i))
        if done <= t_start + window_s:
            completions_in_window += 1
    lag = sorted(run.dispatched[i] - run.due(i) for i in measured if run.dispatched[i] != UNSET)
    non_2xx = sum(n for s, n in statuses.items() if not 200 <= s < 300)
    return {
        "offered_rps": run.rate,
        "requests": len(measured),
        "ok": len(latencies),
        "non_2xx": non_2xx,
        "unanswered": unanswered,
        "failures": dict(run.failures),
        "errors": non_2xx + unanswered,
        "achieved_rps": round(completions_in_window / window_s, 1),
        "latency": {**percentiles(latencies),
                    "mean_ms": round(1e3 * sum(latencies) / len(latencies), 3) if latencies else None,
                    "max_ms": round(1e3 * max(latencies), 3) if latencies else None},
        "dispatch_lag_ms": {"p99": round(1e3 * lag[int(0.99 * (len(lag) - 1))], 3) if lag else None,
                            "max": round(1e3 * lag[-1], 3) if lag else None},
        "generator_cpu_share": round(cpu_s / wall_s, 3),
    }


async def main_async(args: argparse.Namespace) -> dict:
    with open(args.body_file, "rb") as f:
        body = f.read()
    requests = build_requests(args.host, args.port, args.replicas, body, args.body_template)
    total = min(MAX_REQUESTS, int(args.rate * (args.warmup_s + args.duration_s)))
    first = min(total, int(args.rate * args.warmup_s))
    run = Run(total, args.rate)
    conns = await connect_all(args.host, args.port, args.connections, run)
    usage0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run.t0 = time.perf_counter()
    await schedule(run, conns, requests)
    await drain(run, conns, deadline=run.due(total) + args.drain_s)
    usage1, wall_s = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall0
    for c in conns:
        if c.transport is not None:
            c.transport.close()
    cpu_s = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    result = summarize(run, first, args.duration_s, cpu_s, wall_s)
    result["answered_total"] = sum(1 for d in run.done if d != UNSET)  # warm-up included
    result.update(connections=args.connections, replicas=args.replicas,
                  warmup_s=args.warmup_s, duration_s=args.duration_s)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "::1"],
                   help="loopback only: this is a load generator")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=float, default=5000.0, help="requests per second")
    p.add_argument("--duration-s", type=float, default=20.0, help="measured time")
    p.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured lead-in at the same rate")
    p.add_argument("--drain-s", type=float, default=5.0, help="wait this long for late answers")
    p.add_argument("--replicas", type=int, default=10_000)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--body-file", required=True)
    p.add_argument("--body-template", action="store_true",
                   help="the body file is a template: $node and $server become each replica's own")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.duration_s <= 0 or args.replicas < 1 or args.connections < 1:
        p.error("rate, duration, replicas and connections must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop  # the generator must not be the bottleneck: use the fastest loop there is
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(json.dumps(runner(main_async(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
