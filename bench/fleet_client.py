"""What ``rolloutd.fleet`` costs a trainer: its requests side by side with plain HTTP.

Servers here are fast stand-ins for ``vllm serve`` (``--serve``: an aiohttp server on uvloop in
a process of its own that answers ``/inference/v1/generate`` at once with a fixed 16-token
answer, logprobs and a version span), so that what is measured is the client, not generation;
each is listed in an embedded registry's directory as a replica. The same process measures both
paths, in turns, so that the machine's noise falls on both alike:

- **overhead**: sequential requests (one in flight) to **one** server, alternating in blocks:
  ``direct`` (one aiohttp session, a POST and JSON decode: the least a client does) and
  ``fleet`` (``Fleet.generate``: routing, the contract header, answer parsing into a
  ``Generation``). Per path: latency p50/p99 and the client process's CPU time per request;
  the fleet's overhead is the difference.
- **throughput**: ``--concurrency`` requests in flight for ``--seconds`` per block, over
  ``--servers`` servers: ``direct`` (round-robin over the servers' URLs) and ``fleet`` (its own
  routing), blocks alternating; requests/s per path and their ratio.

Goals (ratios printed against them): the client adds at most 100 us of CPU per request, and
keeps at least 0.8x the direct requests/s.

    .venv/bin/python bench/fleet_client.py            # about 1 minute
    .venv/bin/python bench/fleet_client.py --quick    # about 20 s
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from rolloutd.fleet import Fleet, Sampling  # noqa: E402
from rolloutd.trainer import EmbeddedRegistry  # noqa: E402
from tests.conftest import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROMPT = [1, 5, 9, 13, 40]
TOKENS = 16
SAMPLING = Sampling(max_tokens=TOKENS, temperature=1.0, seed=1)


# -- the stand-in server ------------------------------------------------------------------------------

def serve(port: int) -> None:
    """A server that answers generate at once (``--serve PORT``)."""
    import uvloop
    from aiohttp import web

    tokens = list(range(100, 100 + TOKENS))
    answer = json.dumps({"choices": [{
        "index": 0, "token_ids": tokens, "finish_reason": "length",
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "rank": 1, "top_logprobs": []} for t in tokens]},
        "weight_versions": [{"version": "1", "start": 0, "end": TOKENS}]}]}).encode()
    models = json.dumps({"data": [{"id": "bench", "max_model_len": 4096}]}).encode()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def list_models(request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/inference/v1/generate", generate), web.get("/v1/models", list_models)])
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_servers(n: int) -> list[tuple[subprocess.Popen, str]]:
    out = []
    for _ in range(n):
        port = free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        out.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in out:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stand-in server {url} did not start")
            time.sleep(0.05)
    return out


def list_in(reg: EmbeddedRegistry, urls: list[str]) -> None:
    """Heartbeat each server into the registry's directory, as its daemon would."""
    for i, url in enumerate(urls):
        httpx.put(f"{reg.url}/v1/replicas/bench.s{i}", json={
            "node": "bench", "server": f"s{i}", "endpoint": url, "state": "SERVING", "version": 1,
            "incarnation": 1}).raise_for_status()


async def heartbeats(reg: EmbeddedRegistry, urls: list[str]) -> None:
    """Go on heartbeating every 2 s (a replica silent for max_age_s is left out)."""
    while True:
        await asyncio.to_thread(list_in, reg, urls)
        await asyncio.sleep(2)


# -- the two paths ------------------------------------------------------------------------------------

class Direct:
    """The least a client does: POST the body, decode the JSON."""

    def __init__(self, urls: list[str]):
        self.urls = itertools.cycle([u + "/inference/v1/generate" for u in urls])
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.body = {"token_ids": PROMPT, "sampling_params": SAMPLING.params(TOKENS), "stream": False}

    async def one(self) -> None:
        async with self.session.post(next(self.urls), json=self.body) as r:
            body = await r.json()
        assert len(body["choices"][0]["token_ids"]) == TOKENS

    async def close(self) -> None:
        await self.session.close()


class ThroughFleet:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    async def one(self) -> None:
        out = await self.fleet.generate(PROMPT, SAMPLING, min_version=1)
        assert len(out.token_ids) == TOKENS

    async def close(self) -> None:
        pass


async def sequential(path, n: int) -> tuple[list[float], float]:
    """``n`` requests one after the other: latencies (s) and client CPU seconds per request."""
    lat = []
    cpu = time.process_time()
    for _ in range(n):
        t = time.perf_counter()
        await path.one()
        lat.append(time.perf_counter() - t)
    return lat, (time.process_time() - cpu) / n


async def closed_loop(path, concurrency: int, seconds: float) -> float:
    """Requests per second with ``concurrency`` in flight for ``seconds``."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await path.one()
            done += 1
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


# -- the run ------------------------------------------------------------------------------------------

async def overhead(reg: EmbeddedRegistry, url: str, args: argparse.Namespace) -> dict:
    beats = asyncio.ensure_future(heartbeats(reg, [url]))
    direct = Direct([url])
    async with Fleet(reg.url) as fleet:
        paths = {"direct": direct, "fleet": ThroughFleet(fleet)}
        for p in paths.values():
            await sequential(p, 50)  # warm: connections, caches
        lat = {k: [] for k in paths}
        cpu = {k: [] for k in paths}
        for block in range(args.blocks):
            for name in (("direct", "fleet") if block % 2 == 0 else ("fleet", "direct")):
                ls, c = await sequential(paths[name], args.requests)
                lat[name] += ls
                cpu[name].append(c)
    await direct.close()
    beats.cancel()
    return {name: {"p50_us": pct(lat[name], 0.5) * 1e6, "p99_us": pct(lat[name], 0.99) * 1e6,
                   "cpu_us_per_request": statistics.median(cpu[name]) * 1e6, "requests": len(lat[name])}
            for name in lat}


async def throughput(reg: EmbeddedRegistry, urls: list[str], args: argparse.Namespace) -> dict:
    beats = asyncio.ensure_future(heartbeats(reg, urls))
    direct = Direct(urls)
    async with Fleet(reg.url) as fleet:
        await fleet.wait_for(1, n=len(urls), timeout_s=10)
        paths = {"direct": direct, "fleet": ThroughFleet(fleet)}
        rates = {k: [] for k in paths}
        for block in range(args.blocks):
            for name in (("direct", "fleet") if block % 2 == 0 else ("fleet", "direct")):
                rates[name].append(await closed_loop(paths[name], args.concurrency, args.seconds))
        spread = {r["replica_id"]: r["answered"] for r in fleet.replicas()}
    await direct.close()
    beats.cancel()
    return {"direct_rps": statistics.median(rates["direct"]), "fleet_rps": statistics.median(rates["fleet"]),
            "blocks": rates, "fleet_answers_per_server": spread}


async def main(args: argparse.Namespace) -> dict:
    servers = start_servers(args.servers)
    load_before = os.getloadavg()
    try:
        with EmbeddedRegistry(port=0) as reg:
            over = await overhead(reg, servers[0][1], args)
            httpx.delete(f"{reg.url}/v1/replicas/bench.s0")
            thr = await throughput(reg, [u for _, u in servers], args)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(10)
    return {"overhead": over, "throughput": thr, "servers": args.servers, "concurrency": args.concurrency,
            "tokens": TOKENS, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "cpus": os.cpu_count()}


def report(r: dict) -> None:
    o, t = r["overhead"], r["throughput"]
    print(f"machine: {r['cpus']} cores, load average {r['loadavg_before'][0]:.1f} before, "
          f"{r['loadavg_after'][0]:.1f} after")
    print(f"\none server, one request at a time ({o['direct']['requests']} per path, in alternating blocks):")
    print(f"  {'path':8} {'p50 us':>8} {'p99 us':>8} {'client CPU us/req':>18}")
    for name in ("direct", "fleet"):
        print(f"  {name:8} {o[name]['p50_us']:8.0f} {o[name]['p99_us']:8.0f} {o[name]['cpu_us_per_request']:18.0f}")
    added_cpu = o["fleet"]["cpu_us_per_request"] - o["direct"]["cpu_us_per_request"]
    added_p50 = o["fleet"]["p50_us"] - o["direct"]["p50_us"]
    cpu_ratio = o["fleet"]["cpu_us_per_request"] / o["direct"]["cpu_us_per_request"]
    print(f"  fleet adds {added_p50:.0f} us at p50 and {added_cpu:.0f} us of client CPU per request "
          f"(goal <= 100 us: {added_cpu / 100:.2f}x of it; fleet/direct CPU {cpu_ratio:.2f}x)")
    print(f"\n{r['servers']} servers, {r['concurrency']} requests in flight:")
    print(f"  direct (round-robin) {t['direct_rps']:8.0f} req/s   blocks {[round(x) for x in t['blocks']['direct']]}")
    print(f"  fleet                {t['fleet_rps']:8.0f} req/s   blocks {[round(x) for x in t['blocks']['fleet']]}")
    print(f"  fleet/direct {t['fleet_rps'] / t['direct_rps']:.2f}x (goal >= 0.8x); answers per server through the "
          f"fleet: {t['fleet_answers_per_server']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--servers", type=int, default=3, help="stand-in servers for the throughput part")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=300, help="sequential requests per block and path")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each throughput block")
    p.add_argument("--blocks", type=int, default=4, help="blocks per path (alternating)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter blocks")
    args = p.parse_args()
    if args.quick:
        args.requests, args.seconds, args.blocks = 100, 1.5, 2
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.serve:
        serve(args.serve)
        sys.exit(0)
    import uvloop
    result = uvloop.run(main(args))
    report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fleet_client.json").write_text(json.dumps(result, indent=1))
