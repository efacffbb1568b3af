"""What the fleet page costs the registry at 10,000 replicas, and how fast the page renders.

The standalone registry (pinned to one CPU, as in ``registry_load.py``) takes heartbeats from
``openloop.py`` at the fleet's rate (10,000 distinct replicas on 1,250 nodes, every 2 s: 5,000/s) in
three back-to-back runs of ``--duration-s`` each:

  A. no page open;
  B. the fleet page open in a real headless Chromium, polling ``/v1/fleet`` every 2 s;
  C. no page again (A and C bracket any drift of the machine's load).

Per run: the registry's CPU share of its core and microseconds per heartbeat, its resident memory,
heartbeat latency (p50/p99 from each request's due time), and the noise (other processes' CPU on the
registry's core). Then the ratios B/A and B/C. For the page: its render time (``window.rolloutdFleet``,
measured in the page around each render) and the ``/v1/fleet`` requests as the browser saw them
(Resource Timing: duration and size). Also the time ``rolloutd fleet --json`` takes to fetch every
node. Writes ``bench/results/ui_load.json`` and a screenshot ``bench/results/ui_load.png``::

    .venv/bin/python bench/ui_load.py               # about 2 minutes
    .venv/bin/python bench/ui_load.py --quick       # 8 s runs: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent))

from registry_load import HOST, RESULTS, CpuMeter, find_tool, pinned, running_server  # noqa: E402

TEMPLATE = ('{"node": "$node", "server": "$server", "endpoint": "http://$node:9001", "state": "SERVING", '
            '"version": 3, "target": 3, "incarnation": 1, "timings": {"paused": 0.41, "pull": 2.7}}')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=5000.0, help="heartbeats per second (10,000 every 2 s)")
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--duration-s", type=float, default=20.0, help="each of the three runs")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1, help="the load generator's and the browser's CPU")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s = 8.0
    return args


def open_loop(port: int, args: argparse.Namespace, body_file: Path) -> dict:
    argv = [sys.executable, str(BENCH / "openloop.py"), "--host", HOST, "--port", str(port),
            "--rate", str(args.rate), "--duration-s", str(args.duration_s), "--warmup-s", "2",
            "--replicas", str(args.replicas), "--connections", str(args.connections),
            "--body-file", str(body_file), "--body-template"]
    out = subprocess.run(pinned(args.load_cpu, argv), capture_output=True, text=True, check=True,
                         timeout=args.duration_s + 90)
    return json.loads(out.stdout)


def register_all(port: int, replicas: int, connections: int = 32) -> float:
    """One heartbeat from every replica before the runs, so each run sees the whole directory
    (under load the open loop may not reach every replica in its first seconds)."""
    import asyncio
    import string

    import aiohttp
    from openloop import replica_id

    async def go() -> None:
        queue = list(range(replicas))
        async with aiohttp.ClientSession(f"http://{HOST}:{port}") as session:
            async def worker() -> None:
                while queue:
                    k = queue.pop()
                    node, server = replica_id(k).split("-")
                    body = string.Template(TEMPLATE).substitute(node=node, server=server)
                    async with session.put(f"/v1/replicas/{replica_id(k)}", data=body,
                                           headers={"content-type": "application/json"}) as r:
                        r.raise_for_status()
            await asyncio.gather(*(worker() for _ in range(connections)))
    t = time.perf_counter()
    asyncio.run(go())
    return round(time.perf_counter() - t, 1)


def rss_mib(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "peak_rss_mib": round(int(fields["VmHWM"].split()[0]) / 1024, 1)}


def run(pid: int, port: int, args: argparse.Namespace, body_file: Path, name: str) -> dict:
    meter = CpuMeter(pid, args.server_cpu)
    load = open_loop(port, args, body_file)
    cpu = meter.read(load["answered_total"])
    result = {"run": name, "achieved_rps": load["achieved_rps"], "errors": load["errors"],
              "p50_ms": load["latency"]["p50_ms"], "p99_ms": load["latency"]["p99_ms"], **cpu, **rss_mib(pid),
              "loadavg_1m": round(os.getloadavg()[0], 2)}
    print(f"  {name}: {result['achieved_rps']:.0f} heartbeats/s, p99 {result['p99_ms']} ms, registry CPU "
          f"{result['server_cpu_share']:.0%} ({result['server_cpu_us_per_request']} us/heartbeat), RSS "
          f"{result['rss_mib']} MiB, noise {result.get('other_load_on_server_cpu', 0):.0%}", flush=True)
    return result


def publish_versions(url: str) -> None:
    from rolloutd.demo.tinymodel import llama_state_dict
    from rolloutd.trainer.publish import RegistryHTTP
    reg = RegistryHTTP(url)
    try:
        for v in (1, 2, 3):
            reg.publish(v, llama_state_dict(v, hidden=64, layers=1, vocab=64, intermediate=64), chunk_bytes=4096)
    finally:
        reg.close()


def page_stats(driver) -> dict:
    got = driver.execute_script("""
        const f = performance.getEntriesByType('resource').filter(e => e.name.includes('/v1/fleet'));
        const d = f.map(e => e.duration).sort((a, b) => a - b);
        return {render: window.rolloutdFleet, polls: f.length,
                fetch_p50_ms: d[Math.floor(d.length / 2)], fetch_max_ms: d[d.length - 1],
                body_bytes: f.length ? f[f.length - 1].encodedBodySize : null,
                rows: document.querySelectorAll('tr[data-replica]').length,
                pageinfo: document.getElementById('pageinfo').textContent};""")
    r = got.pop("render")
    got.update(renders=r["renders"], render_last_ms=round(r["lastRenderMs"], 1),
               render_max_ms=round(r["maxRenderMs"], 1))
    got["fetch_p50_ms"] = round(got["fetch_p50_ms"] or 0, 1)
    got["fetch_max_ms"] = round(got["fetch_max_ms"] or 0, 1)
    return got


def view_cost(replicas: int, repeats: int = 20) -> dict:
    """CPU time of one ``GET /v1/fleet`` answer at this fleet size, in this process (the store, the
    view and the JSON encoding, no HTTP): with the pass over every replica (a cache miss: at most
    once a second however many pages are open) and without (a hit). CPU time, not wall time, so
    other processes on the machine count for little."""
    from rolloutd.registry.fleet import FleetQuery, FleetView
    from rolloutd.registry.store import Store
    from rolloutd.wire.messages import Heartbeat
    from tests.support.store_versions import manifest
    store = Store(keep_versions=3)
    for v in (1, 2, 3):
        store.publish(manifest(v), {})
    states = ("SERVING",) * 17 + ("UPDATING", "BACKOFF", "SYNCING")
    for k in range(replicas):
        node, server = f"n{k // 8:04d}", f"s{k % 8}"
        store.heartbeat(f"{node}-{server}", Heartbeat(node=node, server=server, state=states[k % len(states)],
                                                      version=3 - (k % 7 == 0), target=3, incarnation=1,
                                                      timings={"paused": 0.41, "pull": 2.7}))
    out = {}
    for name, cache_s in (("miss", 0.0), ("hit", 3600.0)):
        view = FleetView(store, cache_s=cache_s)
        view.document(FleetQuery())
        t = time.process_time()
        for _ in range(repeats):
            body = json.dumps(view.document(FleetQuery()), separators=(",", ":"))
        out[f"{name}_cpu_ms"] = round(1e3 * (time.process_time() - t) / repeats, 2)
    out["answer_bytes"] = len(body)
    # One open page polls every 2 s; the pass runs at most once a second, whoever asks.
    out["one_page_cpu_share"] = round((out["miss_cpu_ms"]) / 2000, 4)
    out["worst_cpu_share_any_pages"] = round(out["miss_cpu_ms"] / 1000, 4)
    return out


def cli_fetch_all(url: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rolloutd.cli", "fleet", "--registry", url, "--json"], check=True,
                   capture_output=True, timeout=120, cwd=BENCH.parent)
    return round(time.perf_counter() - t, 2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("taskset",):
        if not find_tool(tool):
            print(f"ui_load: needs {tool} (apt-get install -y util-linux)", file=sys.stderr)
            return 1
    from tests.support.browser import chromium, full_screenshot, wait_for
    # This script, and so the browser it starts, on the load generator's CPU: the registry's own
    # CPU (taskset) stays the registry's.
    os.sched_setaffinity(0, {args.load_cpu})
    RESULTS.mkdir(parents=True, exist_ok=True)
    cost = view_cost(args.replicas)
    print(f"GET /v1/fleet at {args.replicas} replicas, in process: {cost['miss_cpu_ms']} ms CPU with the pass over "
          f"every replica, {cost['hit_cpu_ms']} ms without; {cost['answer_bytes']} bytes", flush=True)
    body_file = Path(tempfile.mkstemp(prefix="ui_load.", suffix=".json")[1])
    body_file.write_text(TEMPLATE)
    registry_cmd = f"{shlex.quote(sys.executable)} -m rolloutd.cli registry"
    out: dict = {"replicas": args.replicas, "nodes": -(-args.replicas // 8), "rate": args.rate,
                 "duration_s": args.duration_s, "cpus": os.cpu_count(), "loadavg_1m_start": os.getloadavg()[0],
                 "view_cost": cost}
    try:
        with running_server("registry", args.server_cpu, registry_cmd) as (pid, port):
            url = f"http://{HOST}:{port}"
            publish_versions(url)
            print(f"registered {args.replicas} replicas in {register_all(port, args.replicas)} s", flush=True)
            print(f"registry pid {pid} on {url}; {args.replicas} replicas at {args.rate:.0f} heartbeats/s", flush=True)
            out["A"] = run(pid, port, args, body_file, "A (no page)")
            with chromium(Path(tempfile.mkdtemp(prefix="ui_load.profile.")), height=1200) as driver:
                driver.get(url + "/ui")
                wait_for(driver, lambda: driver.execute_script("return window.rolloutdFleet.renders"), 30,
                         "rendered once")
                out["B"] = run(pid, port, args, body_file, "B (page open)")
                out["page"] = page_stats(driver)
                full_screenshot(driver, RESULTS / "ui_load.png")
            out["C"] = run(pid, port, args, body_file, "C (no page)")
            out["cli_fetch_all_s"] = cli_fetch_all(url)
    finally:
        body_file.unlink(missing_ok=True)
    a, b, c = out["A"], out["B"], out["C"]
    base_cpu = (a["server_cpu_share"] + c["server_cpu_share"]) / 2
    heartbeat_us = (a["server_cpu_us_per_request"] + c["server_cpu_us_per_request"]) / 2
    out["ratios"] = {"cpu_B_over_AC": round(b["server_cpu_share"] / base_cpu, 3) if base_cpu else None,
                     "us_per_heartbeat_B_over_AC": round(b["server_cpu_us_per_request"] / heartbeat_us, 3),
                     # the page's CPU against the heartbeats' at the goal rate, side by side in one run
                     "page_cpu_over_heartbeat_cpu": round(cost["miss_cpu_ms"] / 2000 / (args.rate * heartbeat_us / 1e6),
                                                          4),
                     "p99_B_over_AC": round(b["p99_ms"] / ((a["p99_ms"] + c["p99_ms"]) / 2), 3),
                     "rss_B_minus_A_mib": round(b["rss_mib"] - a["rss_mib"], 1)}
    p = out["page"]
    print(f"page: {p['renders']} renders, last {p['render_last_ms']} ms, max {p['render_max_ms']} ms; "
          f"/v1/fleet p50 {p['fetch_p50_ms']} ms, max {p['fetch_max_ms']} ms, {p['body_bytes']} bytes; "
          f"{p['rows']} rows shown ({p['pageinfo']})")
    print(f"one open page's CPU / the heartbeats' CPU at {args.rate:.0f}/s: "
          f"{out['ratios']['page_cpu_over_heartbeat_cpu']}; CPU per heartbeat with the page open / without: "
          f"{out['ratios']['us_per_heartbeat_B_over_AC']}")
    print(f"registry CPU with the page open / without: {out['ratios']['cpu_B_over_AC']}; heartbeat p99 ratio "
          f"{out['ratios']['p99_B_over_AC']}; RSS B - A {out['ratios']['rss_B_minus_A_mib']} MiB; "
          f"`rolloutd fleet --json` of every node: {out['cli_fetch_all_s']} s")
    (RESULTS / "ui_load.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
