"""Round trips of one update: every request/response exchange from ``publish()`` to SERVING.

Starts ``rolloutd run`` as shipped (a subprocess, one server, the shipped timers: heartbeats and
health probes every 5 s, long-polls of 30 s) against a real registry (``EmbeddedRegistry``, in
this process) over real HTTP on loopback. The server is the fake vLLM of
``tests/support/fake_vllm.py`` (the tests' cheap path: no model, no GPU), wrapped so that it
writes every exchange it answers, with its start and end on the system's monotonic clock, to a
file. Every client of the registry goes through a counting proxy (one for the trainer, one for
the node), which records each exchange and which process made it (the daemon, a pull worker),
from the connection's peer port. Nothing in rolloutd is patched.

Once the server is SERVING version 1, the node is watched idle for ``--idle-s`` seconds (what
its timers send with no update), then the trainer publishes version 2 (``RegistryHTTP.publish``
over HTTP, a tiny state dict) and the bench polls the daemon's admin ``/status`` (not counted)
until the server is SERVING version 2. An exchange is in the window if it started in it, or
started before and ended in it (the long-poll that the publish answers). ``--updates N``
repeats it for versions 2..N+1. Each route is "timer" when the node's timers send it whatever
happens (heartbeats, health probes: seen in the idle window too), else "update".

Prints a table per update (hop, route, count, new connections, cause) and writes
``bench/results/roundtrips.json``. From the repo root::

    .venv/bin/python bench/roundtrips.py                 # about 50 s
    .venv/bin/python bench/roundtrips.py --updates 1 --idle-s 0   # smoke test

A second mode is the fake vLLM wrapper the daemon starts (``roundtrips.py fake-vllm serve ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.registry_proxy import ThreadedProxy  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VLLM_LOG_ENV = "ROUNDTRIPS_VLLM_LOG"
# Routes the node's timers send whatever happens: the supervisor's health probe (health.interval_s).
# Every other route is the update's; heartbeats too: one every heartbeat.interval_s, and one at each
# change of the server's state (UPDATING, then SERVING on the new version), which the update makes.
TIMER_ROUTES = {("daemon→vLLM", "GET /health")}
# Why each kind of exchange is there, and whether the update needs it (bench/README.md, "Round
# trips of one update"): "needed", "avoidable" (as the API is), "API change" (needed as the API is;
# another reply could carry its answer), "timer" (sent whatever happens).
VERDICTS = {
    "PUT /v1/uploads/{version}/files/{name}": ("needed", "the bytes: one PUT per shard (publish's shard_bytes)"),
    "POST /v1/versions": ("needed", "commits the manifest; it is what answers the node's long-poll"),
    "GET /v1/versions/latest (long-poll)": ("needed", "the one in flight is answered by the publish; the next "
                                            "one, left open, is the watch for the version after"),
    "GET /v1/versions/latest": ("needed", "a long-poll's expiry asked again"),
    "POST /v1/leases": ("needed", "leases 'latest' atomically: no retire can take the bytes mid-pull"),
    "GET /v1/versions/{version}": ("API change", "the manifest (files, chunk digests): the lease's reply names "
                                   "version and digest only; carrying the manifest would save this one"),
    "PUT /v1/holders/{node}": ("needed", "peers on: tells the tracker what this node holds (at the pull's "
                               "start, every peers.announce_every_s while it lasts)"),
    "DELETE /v1/leases/{lease}": ("needed", "frees the lease at once rather than after its ttl"),
    "PUT /v1/leases/{lease}": ("needed", "renewal, only in pulls longer than a third of the lease ttl"),
    "GET /v1/versions/{version}/files/{name}": ("needed", "the bytes: one Range GET per pull.request_bytes of "
                                                "each chunk"),
    "PUT /v1/replicas/{replica}": ("needed", "heartbeat: the server UPDATING, then SERVING the new version, "
                                   "told at once (and one every heartbeat.interval_s per server)"),
    "GET /health": ("timer", "health probe, every health.interval_s per server"),
    "POST /pause": ("needed", "stops generation before the weights change"),
    "POST /start_weight_update": ("needed", "vLLM's weight-update protocol"),
    "POST /update_weights": ("needed", "loads the mirror copy"),
    "POST /finish_weight_update": ("needed", "seals the load and sets the weight label"),
    "GET /weight_info": ("avoidable", "reads back the label that /finish_weight_update, which applies it only "
                         "when it succeeds, just answered 200 for"),
    "POST /reset_prefix_cache": ("needed", "drops the KV of the old weights, frozen requests' too "
                                 "(update.keep_kv_cache off)"),
    "POST /resume": ("needed", "generation goes on"),
    "GET /v1/models": ("avoidable", "the served model's name, fixed for the process's life, asked again at "
                       "every gate"),
    "POST /v1/completions": ("needed", "the gate: the canary's (or probe's) logprobs on the new weights"),
}


# -- the fake vLLM, timed ---------------------------------------------------------------------------
def fake_vllm(argv: list[str]) -> int:
    """The tests' fake vLLM, with an outer middleware that appends every exchange to the file
    ``$ROUNDTRIPS_VLLM_LOG`` (one JSON line: start, end, method, path, status)."""
    from aiohttp import web

    from tests.support import fake_vllm as fake

    out = open(os.environ[VLLM_LOG_ENV], "a", buffering=1)  # noqa: SIM115 (lives with the process)
    plain_app = fake.FakeVllm.app

    @web.middleware
    async def timed(request: web.Request, handler):
        t0 = time.monotonic()
        response = await handler(request)
        out.write(json.dumps({"t0": t0, "t1": time.monotonic(), "method": request.method,
                              "path": request.path_qs, "status": response.status}) + "\n")
        return response

    def app(self) -> web.Application:
        built = plain_app(self)
        built.middlewares.insert(0, timed)
        return built

    fake.FakeVllm.app = app
    return fake.main(argv)


# -- the counting proxy -----------------------------------------------------------------------------
@dataclass
class Exchange:
    hop: str
    route: str
    status: int
    t0: float
    t1: float | None  # None: not answered (yet)
    conn: str         # the client's end of the connection: a new one is a TCP handshake more


HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer",
              "upgrade", "proxy-connection"}


class CountingProxy(ThreadedProxy):
    """Forwards every request to ``upstream`` as it came (headers, body, query) and records one
    :class:`Exchange` per request. ``hop_of(pid)`` names the hop of the process at the other end."""

    def __init__(self, upstream: str, hop_of):
        super().__init__(upstream)
        self.hop_of = hop_of
        self.exchanges: list[Exchange] = []
        self._pids: dict[int, int | None] = {}

    def _new_session(self):
        import aiohttp
        return aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=600))

    async def _handle(self, request):
        import aiohttp
        from aiohttp import web
        t0 = time.monotonic()
        peer_port = request.transport.get_extra_info("peername")[1]
        pid = await self._pid(peer_port)
        ex = Exchange(self.hop_of(pid), route_of(request.method, request.path, request.query_string), 0, t0, None,
                      f"{pid}:{peer_port}")
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                             data=await request.read() if request.can_read_body else None) as r:
                body = await r.read()
                keep = {k: v for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP}
                ex.status, ex.t1 = r.status, time.monotonic()
                return web.Response(status=r.status, body=body, headers=keep)
        except aiohttp.ClientError:  # the proxy stops under a long-poll at the end of the run
            return web.Response(status=503)

    async def _pid(self, peer_port: int) -> int | None:
        """The process at the other end of the connection from ``peer_port`` (cached per port)."""
        if peer_port not in self._pids:
            self._pids[peer_port] = await asyncio.to_thread(_pid_of, peer_port, self.port)
        return self._pids[peer_port]


def _pid_of(local_port: int, remote_port: int) -> int | None:
    import psutil
    for c in psutil.net_connections("tcp4"):
        if c.laddr and c.raddr and c.laddr.port == local_port and c.raddr.port == remote_port:
            return c.pid
    return None


ROUTE_PATTERNS = [
    (re.compile(r"^/v1/versions/\d+/files/[^/]+$"), "/v1/versions/{version}/files/{name}"),
    (re.compile(r"^/v1/versions/\d+$"), "/v1/versions/{version}"),
    (re.compile(r"^/v1/uploads/\d+/files/[^/]+$"), "/v1/uploads/{version}/files/{name}"),
    (re.compile(r"^/v1/uploads/\d+$"), "/v1/uploads/{version}"),
    (re.compile(r"^/v1/leases/[^/]+$"), "/v1/leases/{lease}"),
    (re.compile(r"^/v1/replicas/[^/]+$"), "/v1/replicas/{replica}"),
    (re.compile(r"^/v1/holders/[^/]+$"), "/v1/holders/{node}"),
]


def route_of(method: str, path: str, query: str) -> str:
    """``GET /v1/versions/7`` -> ``GET /v1/versions/{version}``; a latest with ``wait_s > 0`` is a long-poll."""
    for pattern, template in ROUTE_PATTERNS:
        if pattern.match(path):
            path = template
            break
    route = f"{method} {path}"
    if path == "/v1/versions/latest" and float((parse_qs(query).get("wait_s") or ["0"])[0]) > 0:
        route += " (long-poll)"
    return route


def read_vllm_log(path: Path) -> list[Exchange]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        route = f"{e['method']} {e['path'].split('?')[0]}"
        out.append(Exchange("daemon→vLLM", route, e["status"], e["t0"], e["t1"], "unix socket"))
    return out


# -- the run ----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=3, help="updates measured one after another")
    p.add_argument("--idle-s", type=float, default=31.0, help="idle window before the first publish (longer "
                   "than registry.long_poll_s: every timer shows)")
    p.add_argument("--trainer", choices=["http", "embedded"], default="http", help="publish over HTTP "
                   "(RegistryHTTP, through a counting proxy) or in the registry's process (EmbeddedRegistry)")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause between two updates")
    p.add_argument("--poll-s", type=float, default=0.02, help="how often the bench asks the daemon's /status")
    p.add_argument("--shard-bytes", type=int, default=None, help="the trainer's shards (default: publish()'s)")
    p.add_argument("--chunk-bytes", type=int, default=None, help="the version's chunks (default: publish()'s)")
    p.add_argument("--request-bytes", type=int, default=None, help="the node's pull.request_bytes (default: the "
                   "shipped one)")
    p.add_argument("--servers", type=int, default=1, help="servers of the node (vLLM processes)")
    p.add_argument("--peers", action="store_true", help="peers on (one node: the tracker's traffic, no peer); "
                   "versions published with blake3, which peers may exchange")
    p.add_argument("--out", type=Path, default=RESULTS / "roundtrips.json")
    return p.parse_args(argv)


def in_window(ex: Exchange, t0: float, t1: float) -> bool:
    return t0 <= ex.t0 < t1 or (ex.t0 < t0 and ex.t1 is not None and t0 <= ex.t1 < t1)


def tally(exchanges: list[Exchange], t0: float, t1: float) -> list[dict]:
    """One row per (hop, route): exchanges, new connections, how many were still open at ``t1``."""
    rows: dict[tuple[str, str], dict] = {}
    conns: dict[tuple[str, str], set] = defaultdict(set)
    seen_before = {ex.conn for ex in exchanges if ex.t0 < t0}
    for ex in sorted(exchanges, key=lambda e: e.t0):
        if not in_window(ex, t0, t1):
            continue
        key = (ex.hop, ex.route)
        row = rows.setdefault(key, {"hop": ex.hop, "route": ex.route, "count": 0, "new_connections": 0,
                                    "open_at_end": 0, "statuses": Counter(), "t_first": ex.t0,
                                    "cause": "timer" if key in TIMER_ROUTES else "update"})
        row["count"] += 1
        row["statuses"][ex.status] += 1
        if ex.t1 is None or ex.t1 >= t1:
            row["open_at_end"] += 1
        if ex.conn != "unix socket" and ex.conn not in seen_before and ex.conn not in conns[key]:
            conns[key].add(ex.conn)
            seen_before.add(ex.conn)
            row["new_connections"] += 1
    order = ["trainer→registry", "daemon→registry", "pull worker→registry", "daemon→vLLM"]
    out = sorted(rows.values(), key=lambda r: (order.index(r["hop"]) if r["hop"] in order else 9, r["t_first"]))
    for r in out:
        r["statuses"] = {str(k): v for k, v in r["statuses"].items()}
        r["t_first"] = round(r["t_first"] - t0, 4)  # seconds into the window
    return out


def run(args: argparse.Namespace) -> dict:
    from rolloutd.demo import tinymodel
    from rolloutd.trainer import EmbeddedRegistry, RegistryHTTP
    from tests.support.daemon_harness import DaemonProcess, config

    tmp = Path(tempfile.mkdtemp(prefix="roundtrips-"))
    vllm_log = tmp / "vllm.jsonl"
    me = os.getpid()
    daemon: DaemonProcess | None = None

    def hop_of(pid: int | None) -> str:
        if pid == me:
            return "trainer→registry"
        if daemon is not None and daemon.proc is not None and pid == daemon.proc.pid:
            return "daemon→registry"
        try:
            import psutil
            if pid is not None and any("fetch_worker" in a for a in psutil.Process(pid).cmdline()):
                return "pull worker→registry"
        except Exception:  # gone already: named below by its pid
            pass
        return f"pid {pid}→registry"

    publish_kw = {k: v for k, v in (("shard_bytes", args.shard_bytes), ("chunk_bytes", args.chunk_bytes))
                  if v is not None}
    if args.peers:
        publish_kw["hash_name"] = "blake3"
    with EmbeddedRegistry(port=0) as reg:
        to_reg = CountingProxy(reg.url, hop_of).start()      # the trainer's way in
        node_reg = CountingProxy(reg.url, hop_of).start()    # the node's (daemon and pull workers)
        trainer = RegistryHTTP(to_reg.url, reg.service.token)
        try:
            trainer.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), **publish_kw)
            names = [f"s{i}" for i in range(args.servers)]
            cfg = config(tmp, node_reg.url, [{"name": n, "model": "fake-model"} for n in names], fake=True,
                         # the shipped timers, not the tests' fast ones: what a node really sends
                         registry={"long_poll_s": 30.0}, heartbeat={"interval_s": 5.0, "timeout_s": 5.0},
                         health={"interval_s": 5.0, "timeout_s": 5.0, "failures": 3})
            if args.peers:
                from tests.conftest import free_port
                cfg["peers"] = {"enabled": True, "host": "127.0.0.1", "port": free_port()}
            if args.request_bytes is not None:
                cfg["pull"] = {"request_bytes": args.request_bytes}
            cfg["vllm"]["command"] = [sys.executable, str(Path(__file__).resolve()), "fake-vllm", "serve"]
            cfg["vllm"]["env"][VLLM_LOG_ENV] = str(vllm_log)
            (tmp / "d").mkdir()
            daemon = DaemonProcess(cfg, tmp / "d").start()
            daemon.wait_versions(dict.fromkeys(names, 1), timeout_s=60)
            t_idle = time.monotonic()
            time.sleep(args.idle_s)
            idle = (t_idle, time.monotonic())
            windows = []
            for version in range(2, args.updates + 2):
                state = tinymodel.state_dict(tinymodel.TINY, version)  # built before the window opens
                t0 = time.monotonic()
                (reg if args.trainer == "embedded" else trainer).publish(version, state, **publish_kw)
                t_published = time.monotonic()
                while True:
                    if daemon.proc.poll() is not None:
                        raise RuntimeError(f"rolloutd exited\n{daemon.tail()}")
                    st = daemon.status()["servers"]
                    if all((s["state"], s["version"]) == ("SERVING", version) for s in st):
                        break
                    time.sleep(args.poll_s)
                windows.append((version, t0, t_published, time.monotonic()))
                time.sleep(args.settle_s)
            time.sleep(0.5)  # the last lines of the fake's log
            shapes = {v: version_shape(reg.manifest(v)) for v, *_ in windows}  # not through the proxies
        finally:
            if daemon is not None:
                daemon.stop()
            trainer.close()
            to_reg.stop()
            node_reg.stop()
    exchanges = to_reg.exchanges + node_reg.exchanges + read_vllm_log(vllm_log)
    return report(args, exchanges, idle, windows, shapes)


def version_shape(manifest) -> dict:
    """What sets the count of byte transfers: files (one PUT each) and chunks (a Range GET each,
    more where a chunk is larger than pull.request_bytes)."""
    return {"files": len(manifest.files), "chunks": sum(len(f.chunks) for f in manifest.files),
            "bytes": sum(f.size for f in manifest.files), "delta": manifest.delta is not None}


def report(args: argparse.Namespace, exchanges: list[Exchange], idle: tuple[float, float], windows: list,
           shapes: dict) -> dict:
    idle_rows = tally(exchanges, *idle) if args.idle_s > 0 else []
    updates = []
    for version, t0, t_published, t1 in windows:
        rows = tally(exchanges, t0, t1)
        for r in rows:
            r["verdict"], r["why"] = VERDICTS.get(r["route"], ("?", "not classified"))
        total = sum(r["count"] for r in rows)
        by_timer = sum(r["count"] for r in rows if r["cause"] == "timer")
        updates.append({"version": version, "shape": shapes[version], "window_s": round(t1 - t0, 3),
                        "publish_s": round(t_published - t0, 3),
                        "total": total, "timer": by_timer, "update": total - by_timer,
                        "avoidable": sum(r["count"] for r in rows if r["verdict"] == "avoidable"),
                        "avoidable_by_api_change": sum(r["count"] for r in rows if r["verdict"] == "API change"),
                        "new_connections": sum(r["new_connections"] for r in rows), "rows": rows})
    return {"vllm": "fake (tests/support/fake_vllm.py)", "model": "tinymodel.TINY (~1.5 MB)",
            "publish": {"shard_bytes": args.shard_bytes or "default", "chunk_bytes": args.chunk_bytes or "default"},
            "pull.request_bytes": args.request_bytes or "default", "peers": args.peers, "servers": args.servers,
            "trainer": args.trainer,
            "timers": {"heartbeat.interval_s": 5.0, "health.interval_s": 5.0, "registry.long_poll_s": 30.0},
            "idle": {"seconds": round(idle[1] - idle[0], 3), "rows": idle_rows}, "updates": updates}


def print_report(result: dict) -> None:
    idle = result["idle"]
    if idle["rows"]:
        print(f"idle, {idle['seconds']:.1f} s, SERVING version 1:")
        for r in idle["rows"]:
            print(f"  {r['hop']:22} {r['route']:44} {r['count']:3}")
    for u in result["updates"]:
        sh = u["shape"]
        print(f"\nupdate to version {u['version']} ({sh['bytes']} bytes, {sh['files']} file(s), {sh['chunks']} "
              f"chunk(s){', a delta' if sh['delta'] else ''}): {u['window_s'] * 1000:.0f} ms from publish() to "
              f"SERVING (publish() itself {u['publish_s'] * 1000:.0f} ms)")
        print(f"  {'hop':22} {'route':44} {'count':>5} {'new conn':>8}  {'cause':6} verdict")
        for r in u["rows"]:
            open_ = f" ({r['open_at_end']} open at the end)" if r["open_at_end"] else ""
            print(f"  {r['hop']:22} {r['route']:44} {r['count']:5} {r['new_connections']:8}  {r['cause']:6} "
                  f"{r['verdict']}{open_}")
        print(f"  total {u['total']} round trips ({u['update']} caused by the update, {u['timer']} by timers; "
              f"{u['avoidable']} avoidable, {u['avoidable_by_api_change']} more with an API change), "
              f"{u['new_connections']} new TCP connections")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fake-vllm"]:
        return fake_vllm(argv[1:])
    args = parse_args(argv)
    result = run(args)
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
