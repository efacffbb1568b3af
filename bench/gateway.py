"""What the gateway costs: streamed generation through it and straight to vLLM, side by side.

A real ``vllm serve`` (CPU build, small model) on core 0, on a UNIX socket as the daemon starts
it, and rolloutd's gateway in front of it in a process of its own on core 1 (uvloop, as in the
daemon); "direct" is a client on that socket. The same client measures both
paths in the same run, alternating request by request so that the machine's noise falls on
both alike:

- **latency**: sequential streamed generations (``/inference/v1/generate``, ``stream: true``,
  ``--tokens`` tokens), the paths in turns whose order rotates every round: time to the first
  chunk and to the end, p50 and p99, per path; the gateway's added latency is the difference.
  ``GET /health`` (no generation at all) shows the proxying cost alone.
- **throughput**: ``--concurrency`` streams at once for ``--seconds`` per block, blocks
  alternating direct / gateway twice; generated tokens per second per path.

Goals (ratios printed against them): at most 1 ms added at p50; at least 0.95x the direct
throughput.

``--during-pull``: the gateway in the daemon as shipped (``rolloutd run``, its real ``vllm
serve`` child on core 0), idle and while the daemon pulls a ``--pull-gib`` version from a
registry in its own process. Paired ``/v1/completions`` of one token, direct to vLLM and
through the gateway in turns; a pair counts as "during the pull" when both requests fall
inside the pull (while the mirror holds the version's hidden ``.partial`` directory, watched
every 10 ms: polling the daemon's /status would load the loop being measured). The registry
stands for the trainer's host, whose CPU is not the node's: it runs at nice 10. Each version
is the served model's weights plus a filler tensor of ``--pull-gib`` under a name vLLM's
loader drops (``...rotary_emb.inv_freq``, a buffer old checkpoints carried), so the update
after the pull loads for real and the next pull can follow. ``--ref-repo DIR`` runs the
daemon and registry of another build the same way (to compare, e.g. the build before a change).
Goal: at most 1 ms p50 and 5 ms p99 added during the pull. The last stdout line is one JSON
object with ``added_p50_ms`` / ``added_p99_ms`` (during the pull) and ``idle_added_p50_ms`` /
``idle_added_p99_ms``.

    .venv/bin/python bench/gateway.py            # about 2 minutes
    .venv/bin/python bench/gateway.py --quick    # about 1 minute
    .venv/bin/python bench/gateway.py --during-pull   # 2 pulls of 2 GiB, a few minutes after vLLM's start

``--attack``: the gateway (its own process on core 1, with a token, as on a node) while
``--attackers`` connections send trailer bombs: a chunked request whose last chunk is followed
by a trailer field that never ends (each connection sends up to ``--bomb-mib``, then starts
again on a new connection). Blocks of ``--block-s`` seconds in turns, their order rotating every
round: quiet, attackers without the token, attackers with it (the trailer bound alone stops
those). In every block, paired one-token ``/v1/completions``, direct to vLLM and through the
gateway in turns, as ``--during-pull`` measures them; the gateway process's RSS is sampled every
50 ms. The attackers run at nice 10 on core 0, with vLLM (they stand for other hosts). With
``--ref-repo DIR`` the gateway is that build's (e.g. the one before the trailer bound).

    .venv/bin/python bench/gateway.py --attack   # about 4 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from rolloutd.demo import tinymodel  # noqa: E402
from rolloutd.demo.cpu_vllm import CPU_ENV, cpu_args  # noqa: E402
from rolloutd.supervise.plugin_path import install_plugin  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.support.vllm_server import VllmServer  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROMPT = [1, 5, 9, 13, 40]


def serve_gateway(upstream: str, port: str) -> None:
    """The gateway alone, as the daemon runs it (``--serve-gateway``)."""
    import uvloop

    from rolloutd.config import Gateway as Settings
    from rolloutd.gateway.relay import Gateway
    from rolloutd.metrics import Metrics
    from rolloutd.wire.states import ServerState

    async def main() -> None:
        gw = Gateway("bench", Path(upstream), int(port), Settings(host="127.0.0.1"), None, Metrics())
        await gw.start()
        gw.on_state(ServerState.SERVING)
        print("ready", flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())


# The gateway alone, as the daemon runs it, for --attack (run with ``-c`` so that PYTHONPATH
# picks the build: this tree, or --ref-repo).
GATEWAY_CHILD = """
import asyncio, sys
from pathlib import Path
import uvloop
from rolloutd.config import Gateway as Settings
from rolloutd.gateway.relay import Gateway
from rolloutd.metrics import Metrics
from rolloutd.wire.states import ServerState

async def main():
    gw = Gateway("bench", Path(sys.argv[1]), int(sys.argv[2]), Settings(host="127.0.0.1"), sys.argv[3], Metrics())
    await gw.start()
    gw.on_state(ServerState.SERVING)
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def body(tokens: int) -> dict:
    return {"token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}


def client(target: str | Path, **kw) -> httpx.Client:
    """A client of ``target``: a URL, or a UNIX socket (a Path)."""
    if isinstance(target, Path):
        return httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(target)), **kw)
    return httpx.Client(base_url=target, **kw)


def one_stream(c: httpx.Client, tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    with c.stream("POST", "/inference/v1/generate", json=body(tokens)) as r:
        r.raise_for_status()
        for _ in r.iter_raw():
            if first is None:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def latency(urls: dict[str, str | Path], n: int, tokens: int) -> dict[str, dict[str, list[float]]]:
    """Per path, per kind (first chunk, whole stream, /health): n samples in ms, taken in turns
    (sample i of every path one right after the other, so pairs share the machine's state)."""
    out = {name: {"first": [], "total": [], "health": []} for name in urls}
    names = list(urls)
    clients = {name: client(target, timeout=60) for name, target in urls.items()}
    try:
        for c in clients.values():  # warm both paths (connections, vLLM's first requests)
            for _ in range(5):
                one_stream(c, tokens)
        for i in range(n):
            for name in turns(names, i):
                first, total = one_stream(clients[name], tokens)
                out[name]["first"].append(first * 1e3)
                out[name]["total"].append(total * 1e3)
        for i in range(5 * n):
            for name in turns(names, i):
                t0 = time.perf_counter()
                clients[name].get("/health").raise_for_status()
                out[name]["health"].append((time.perf_counter() - t0) * 1e3)
    finally:
        for c in clients.values():
            c.close()
    return out


def turns(names: list[str], i: int) -> list[str]:
    """The order of the paths in round ``i``: rotated every round, so that no path always goes
    first (right after a pause) or last."""
    k = i % len(names)
    return names[k:] + names[:k]


def summary(samples: dict[str, dict[str, list[float]]], proxy: str) -> dict:
    """A proxy's added latency: p50 and p99 of its paired differences to the direct samples."""
    out = {}
    for kind, direct in samples["direct"].items():
        diffs = [b - a for a, b in zip(direct, samples[proxy][kind], strict=True)]
        out[f"{kind}_p50"], out[f"{kind}_p99"] = round(pct(diffs, 0.5), 3), round(pct(diffs, 0.99), 3)
    return out


async def throughput_block(target: str | Path, concurrency: int, seconds: float, tokens: int) -> float:
    """Generated tokens per second with ``concurrency`` streams for ``seconds``."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            async with c.stream("POST", "/inference/v1/generate", json=body(tokens)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        done += len(json.loads(line[6:])["choices"][0]["token_ids"])
    t0 = time.perf_counter()
    where = ({"base_url": "http://localhost", "transport": httpx.AsyncHTTPTransport(uds=str(target))}
             if isinstance(target, Path) else {"base_url": target})
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency), **where) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(urls: dict[str, str | Path], concurrency: int, seconds: float, tokens: int, rounds: int,
               gateway_pid: int) -> tuple[dict, dict, float]:
    """Tokens/s per path (median of rounds), each proxy's median ratio to the direct block of the
    same round, and the gateway process's CPU (share of one core) while it carried load."""
    rates = {name: [] for name in urls}
    busy = wall = 0.0
    for i in range(rounds):
        order = list(urls) if i % 2 == 0 else list(reversed(urls))  # neither path always goes first
        for name in order:
            c0, t0 = cpu_s(gateway_pid), time.perf_counter()
            rates[name].append(asyncio.run(throughput_block(urls[name], concurrency, seconds, tokens)))
            if name == "gateway":
                busy, wall = busy + cpu_s(gateway_pid) - c0, wall + time.perf_counter() - t0
    ratios = {name: round(statistics.median(r / d for r, d in zip(rates[name], rates["direct"], strict=True)), 3)
              for name in urls if name != "direct"}
    return {name: round(statistics.median(r), 1) for name, r in rates.items()}, ratios, round(busy / wall, 3)


NGINX_CONF = """daemon off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fcgi; uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream vllm {{ server unix:{upstream}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://vllm; proxy_http_version 1.1; proxy_set_header Connection "";
                 proxy_buffering off; proxy_request_buffering off; }}
  }}
}}
"""


def start_nginx(work: Path, upstream: Path, port: int, core: int) -> subprocess.Popen | None:
    """The peer: nginx as a streaming reverse proxy (no buffering, kept-alive upstream), when installed."""
    if not shutil.which("nginx"):
        print("nginx not found: the peer is skipped (apt-get install nginx-light)", file=sys.stderr)
        return None
    conf = work / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=work, upstream=upstream, port=port))
    proc = subprocess.Popen(["taskset", "-c", str(core), "nginx", "-c", str(conf), "-p", str(work)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"nginx did not start: {(work / 'error.log').read_text()}")


# -- the gateway in the daemon, while it pulls ------------------------------------------------------

FILLER = "model.layers.0.self_attn.rotary_emb.inv_freq"  # vLLM's loaders drop it: bulk that loads as nothing


class _UnixConnection(http.client.HTTPConnection):
    """http.client over a UNIX socket (vLLM's, as the daemon starts it)."""

    def __init__(self, path: Path, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class Completions:
    """One kept-alive connection (to a port, or a UNIX socket); ``once()`` times a one-token
    completion, in ms."""

    def __init__(self, where: int | Path, model: str, token: str | None = None):
        self.conn = (_UnixConnection(where, 60) if isinstance(where, Path)
                     else http.client.HTTPConnection("127.0.0.1", where, timeout=60))
        self.body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
        self.headers = {"content-type": "application/json"}
        if token is not None:
            self.headers["authorization"] = f"Bearer {token}"

    def once(self) -> float:
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body=self.body, headers=self.headers)
        r = self.conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {r.status}")
        return (time.perf_counter() - t0) * 1e3

    def warm(self) -> None:
        """A fresh connection and two requests on it: vLLM closes a connection idle for 5 s."""
        self.conn.close()
        for _ in range(2):
            self.once()


class PullWatch(threading.Thread):
    """The intervals during which a pull was under way, from the mirror: a version's hidden
    ``.<v>.partial`` directory exists from the moment the pull has made room until its commit.
    Watching the directory costs the daemon nothing (polling its /status would itself load the
    loop the gateway runs on)."""

    def __init__(self, mirror: Path):
        super().__init__(daemon=True)
        self.mirror, self.stop = mirror, threading.Event()
        self.windows: list[list[float]] = []  # [start, end]

    def run(self) -> None:
        while not self.stop.is_set():
            pulling = any(p.name.endswith(".partial") for p in self.mirror.iterdir()) if self.mirror.is_dir() else False
            now = time.perf_counter()
            if pulling and (not self.windows or self.windows[-1][1] is not None):
                self.windows.append([now, None])
            elif not pulling and self.windows and self.windows[-1][1] is None:
                self.windows[-1][1] = now
            self.stop.wait(0.01)

    def covers(self, t0: float, t1: float) -> bool:
        return any(a <= t0 and (b is None or t1 <= b) for a, b in self.windows)


def loop_lag_max(admin: str) -> float:
    """``rolloutd_loop_lag_max_seconds`` of the daemon: its loop's longest lateness so far."""
    text = httpx.get(admin + "/metrics", timeout=5).text
    return float(re.search(r"^rolloutd_loop_lag_max_seconds (\S+)$", text, re.M)[1])


def status(admin: str) -> dict:
    return httpx.get(admin + "/status", timeout=5).json()


def wait_serving(admin: str, version: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            st = status(admin)
            if st["servers"] and all(s["state"] == "SERVING" and s["version"] == version for s in st["servers"]):
                return st
        time.sleep(0.2)
    raise TimeoutError(f"the server is not SERVING version {version} after {timeout_s} s")


def one_pair(a: Completions, b: Completions, i: int) -> tuple:
    """(start, end, a's ms, b's ms), ``a`` first in even rounds and ``b`` first in odd ones."""
    t0 = time.perf_counter()
    if i % 2 == 0:
        x, y = a.once(), b.once()
    else:
        y, x = b.once(), a.once()
    return t0, time.perf_counter(), x, y


def paired_with_null(direct: Completions, gateway: Completions, other: Completions, until) -> tuple[list, list]:
    """Rounds of a (direct, gateway) pair then a (direct, another direct connection) pair: the
    second kind is the same statistic for a hop that adds nothing, so its p99 is what the
    machine's jitter alone makes of a paired difference, measured in the same moments."""
    gateway_pairs: list[tuple] = []
    null_pairs: list[tuple] = []
    while not until():
        gateway_pairs.append(one_pair(direct, gateway, len(gateway_pairs)))
        null_pairs.append(one_pair(direct, other, len(null_pairs)))
    return gateway_pairs, null_pairs


def added(samples: list[tuple]) -> dict:
    diffs = [g - d for _, _, d, g in samples]
    direct, through = [d for *_, d, _ in samples], [g for *_, g in samples]
    direct_p99, gateway_p99 = pct(direct, 0.99), pct(through, 0.99)
    return {"pairs": len(diffs), "added_p50_ms": round(pct(diffs, 0.5), 3), "added_p99_ms": round(pct(diffs, 0.99), 3),
            "direct_p50_ms": round(pct(direct, 0.5), 3), "gateway_p50_ms": round(pct(through, 0.5), 3),
            # the difference of the two p99s: what the hop adds to the tail a client sees,
            # without the jitter of pairing two requests made a few ms apart
            "direct_p99_ms": round(direct_p99, 3), "gateway_p99_ms": round(gateway_p99, 3),
            "p99_difference_ms": round(gateway_p99 - direct_p99, 3),
            "p99_difference_ci95_ms": p99_difference_interval(samples)}


def p99_difference_interval(samples: list[tuple], resamples: int = 2000) -> list[float] | None:
    """A 95 % bootstrap interval of (gateway p99 - direct p99): the pairs resampled with
    replacement (a pair stays a pair: both requests saw the same moment of the machine)."""
    import numpy as np
    if len(samples) < 200:  # fewer than two samples beyond the p99: no interval worth the name
        return None
    d = np.array([x[2] for x in samples])
    g = np.array([x[3] for x in samples])
    rows = np.random.default_rng(0).integers(0, len(samples), size=(resamples, len(samples)))
    k = min(len(samples) - 1, int(0.99 * len(samples)))  # pct()'s rank
    diff = np.sort(g[rows], axis=1)[:, k] - np.sort(d[rows], axis=1)[:, k]
    return [round(float(x), 3) for x in np.quantile(diff, [0.025, 0.975])]


def lower_session(pid: int) -> None:
    """Nice 10 for the session group of ``pid`` too: under autogroup (no systemd cgroup) the
    kernel shares the CPU between sessions first, so a process's own nice only counts against
    the other processes of its session, and a registry at nice 10 alone in its session would
    still compete with the daemon as an equal."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text("10")


def during_pull(args: argparse.Namespace) -> int:
    import numpy as np
    import yaml

    from rolloutd.trainer import RegistryHTTP
    from rolloutd.trainer.shards import save_shards
    need = int((4 * args.pull_gib + 1) * (1 << 30))  # filler, the registry's copy, the mirror's two
    meminfo = {k: int(v.split()[0]) << 10 for k, v in (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text()
                                                       .splitlines())}
    if meminfo["MemAvailable"] < need:
        print(f"needs about {need >> 30} GiB of free memory, has {meminfo['MemAvailable'] >> 30}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="rolloutd-bench-gateway-pull.", dir="/dev/shm"))
    procs: list[subprocess.Popen] = []
    try:
        model = tinymodel.build(work / "model", seed=0)
        filler = work / "filler"
        save_shards({FILLER: np.zeros(int(args.pull_gib * (1 << 30)) // 4, np.float32)}, filler)
        reg_port, admin_port, gw_port = free_port(), free_port(), free_port()
        reg_log = open(work / "registry.log", "wb")
        env = {**os.environ, "PYTHONPATH": str(args.ref_repo or ROOT)}
        pin = ["taskset", "-c", str(args.registry_core)] if args.registry_core is not None else []
        procs.append(subprocess.Popen([*pin, "nice", "-n", "10", sys.executable, "-m", "rolloutd.cli", "registry",
                                       "--host", "127.0.0.1", "--port", str(reg_port), "--keep-versions", "2"],
                                      cwd="/", env=env, stdout=reg_log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        lower_session(procs[-1].pid)
        reg = RegistryHTTP(f"http://127.0.0.1:{reg_port}")
        wait_up(reg)

        def publish(version: int, with_filler: bool) -> None:
            d = work / f"v{version}"
            save_shards(tinymodel.state_dict(tinymodel.TINY, version), d)  # the served model's tensors
            if with_filler:
                os.link(filler / "model.safetensors", d / "filler.safetensors")
            reg.publish_dir(version, d)
            shutil.rmtree(d)
        publish(1, False)
        cfg = {"registry": {"url": reg.url}, "admin": {"port": admin_port}, "state_dir": str(work / "state"),
               "mirror": {"dir": str(work / "mirror"), "max_bytes": f"{int(3 * args.pull_gib + 1)}GiB"},
               "vllm": {"command": [str(ROOT / ".venv-vllm" / "bin" / "vllm"), "serve"],
                        "args": cpu_args(), "env": {**CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"}},
               # every process of vLLM on core 0 (its engine core polls: unbound, it takes the
               # other core from the daemon and the client), as a node's config would put it
               "servers": [{"name": "s0", "model": str(model), "public_port": gw_port, "cpus": [0]}]}
        if args.pull_priority:
            cfg["pull"] = {"cpu_priority": args.pull_priority}
        (work / "rolloutd.yaml").write_text(yaml.safe_dump(cfg))
        daemon_log = open(work / "rolloutd.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "run", "-c", str(work / "rolloutd.yaml")],
                                      cwd="/", env=env, stdout=daemon_log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        admin = f"http://127.0.0.1:{admin_port}"
        wait_serving(admin, 1, 600)
        if args.daemon_fifo:  # an experiment: the daemon's loop thread real-time (SCHED_FIFO 1);
            # -R: what it starts afterwards (pull workers, threads) is not
            subprocess.run(["chrt", "-f", "-R", "-p", "1", str(procs[-1].pid)], check=True)
        # vLLM on core 0 (above), the client on core 1; the daemon, its pull workers and the
        # registry where the scheduler puts them, as on a node.
        os.sched_setaffinity(0, {1 % os.cpu_count()})
        direct = Completions(work / "state" / "sockets" / "s0.sock", str(model))  # vLLM's own socket
        gateway = Completions(gw_port, str(model))
        other = Completions(work / "state" / "sockets" / "s0.sock", str(model))  # for the null pairs
        for _ in range(20):
            direct.once(), gateway.once(), other.once()
        count = iter(range(args.idle_pairs))
        idle, idle_null = paired_with_null(direct, gateway, other, lambda: next(count, None) is None)
        lag_before = loop_lag_max(admin)
        watch = PullWatch(work / "mirror")
        watch.start()
        during: list[tuple] = []
        during_null: list[tuple] = []
        for k in range(args.pulls):
            version = 2 + k
            if version > 2:
                reg.retire(version - 1)  # the node holds it: the registry need not keep two
            started, deadline = len(watch.windows), time.monotonic() + 900  # the pull may start at once
            publish(version, True)
            direct.warm(), gateway.warm(), other.warm()
            # Until this pull ended (the update after it pauses the server: not measured here).
            # Nothing asks the daemon anything meanwhile: a poller of its /status would load the
            # loop measured, and take the client's core (httpx.get cost it about 3 ms of CPU a
            # call: every daemon wake-up it delayed showed in the gateway's tail).
            samples, nulls = paired_with_null(direct, gateway, other, lambda started=started, deadline=deadline: (
                time.monotonic() > deadline or (len(watch.windows) > started and watch.windows[-1][1] is not None)))
            during += [x for x in samples if watch.covers(x[0], x[1])]
            during_null += [x for x in nulls if watch.covers(x[0], x[1])]
            wait_serving(admin, version, 900)
        watch.stop.set()
        watch.join(5)
        lag_after = loop_lag_max(admin)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        RESULTS.mkdir(parents=True, exist_ok=True)
        for name in ("rolloutd.log", "registry.log"):  # kept: they say what happened
            if (work / name).exists():
                shutil.copyfile(work / name, RESULTS / f"gateway-during-pull.{name}")
        shutil.rmtree(work, ignore_errors=True)
    result = {"pull_gib": args.pull_gib, "pulls": args.pulls, "build": str(args.ref_repo or "this tree"),
              "pull_cpu_priority": args.pull_priority or "default", "daemon_fifo": args.daemon_fifo,
              "registry_core": args.registry_core,
              "idle": added(idle), "during_pull": added(during),
              # the same statistic for two direct connections: the noise floor of a paired p99
              "idle_null": added(idle_null), "during_pull_null": added(during_null),
              "pull_seconds": [round(b - a, 2) for a, b in watch.windows if b is not None],
              # every pair measured during the pulls, (direct ms, other ms), to pool runs
              "during_pull_pairs": [[round(d, 3), round(g, 3)] for *_, d, g in during],
              "during_pull_null_pairs": [[round(d, 3), round(g, 3)] for *_, d, g in during_null],
              "goal": {"added_p50_ms_max": 1.0, "added_p99_ms_max": 5.0},
              "loadavg": Path("/proc/loadavg").read_text().split()[:3],
              # the daemon's own probe: the longest its loop woke late, before the pulls and
              # after them (a rise is a stall during a pull or the update after it)
              "loop_lag_max_ms": {"before_pulls": round(lag_before * 1e3, 2), "after": round(lag_after * 1e3, 2)}}
    dp = result["during_pull"]
    result.update(added_p50_ms=dp["added_p50_ms"], added_p99_ms=dp["added_p99_ms"],
                  idle_added_p50_ms=result["idle"]["added_p50_ms"], idle_added_p99_ms=result["idle"]["added_p99_ms"],
                  null_added_p99_ms=result["during_pull_null"]["added_p99_ms"],
                  idle_null_added_p99_ms=result["idle_null"]["added_p99_ms"],
                  p99_difference_ms=dp["p99_difference_ms"], p99_difference_ci95_ms=dp["p99_difference_ci95_ms"],
                  null_p99_difference_ms=result["during_pull_null"]["p99_difference_ms"],
                  null_p99_difference_ci95_ms=result["during_pull_null"]["p99_difference_ci95_ms"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = ("gateway-during-pull" + ("-ref" if args.ref_repo else "")
            + (f"-{args.pull_priority}" if args.pull_priority else "") + ("-fifo" if args.daemon_fifo else ""))
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    for name in ("idle", "during_pull", "idle_null", "during_pull_null"):
        a = result[name]
        hop = "direct again" if name.endswith("null") else "gateway"
        print(f"{name:16} {a['pairs']:5d} pairs: direct p50 {a['direct_p50_ms']:.2f} ms, {hop} p50 "
              f"{a['gateway_p50_ms']:.2f} ms; added p50 {a['added_p50_ms']:+.3f} ms, p99 {a['added_p99_ms']:+.3f} ms; "
              f"p99s {a['direct_p99_ms']:.2f} / {a['gateway_p99_ms']:.2f} ms, difference "
              f"{a['p99_difference_ms']:+.2f} ms, 95 % interval {a['p99_difference_ci95_ms']}")
    print(f"daemon loop lag, longest: {result['loop_lag_max_ms']['before_pulls']} ms before the pulls, "
          f"{result['loop_lag_max_ms']['after']} ms after them and their updates")
    print(f"pulls took {result['pull_seconds']} s; goal during the pull: <= 1 ms p50 "
          f"({dp['added_p50_ms'] / 1.0:.2f}x of it), <= 5 ms p99 ({dp['added_p99_ms'] / 5.0:.2f}x of it)")
    print(json.dumps({k: result[k] for k in ("added_p50_ms", "added_p99_ms", "idle_added_p50_ms",
                                              "idle_added_p99_ms", "null_added_p99_ms", "idle_null_added_p99_ms",
                                              "p99_difference_ms", "p99_difference_ci95_ms", "null_p99_difference_ms",
                                              "null_p99_difference_ci95_ms")}))
    return 0 if dp["added_p50_ms"] <= 1.0 and dp["added_p99_ms"] <= 5.0 else 1


# -- the gateway under attack: trailer bombs ------------------------------------------------------

ATTACK_TOKEN = "bench-attack-token"


def serve_attack(port: int, attackers: int, token: str, bomb_mib: float) -> None:
    """``--serve-attack``: ``attackers`` connections sending trailer bombs until SIGTERM
    ("ready" once they start), then one JSON line: connections made, bytes sent."""
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    head = (b"POST /inference/v1/generate HTTP/1.1\r\nHost: node\r\nTransfer-Encoding: chunked\r\n" + auth
            + b"\r\n5\r\nhello\r\n0\r\nX-Bomb: ")
    filler, limit = b"a" * 65536, int(bomb_mib * (1 << 20))
    stats = {"connections": 0, "bytes": 0}

    async def bomber() -> None:
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                stats["connections"] += 1
                writer.write(head)
                sent = 0
                while sent < limit:
                    writer.write(filler)
                    await writer.drain()
                    sent += len(filler)
                    stats["bytes"] += len(filler)
                writer.close()
            except OSError:
                await asyncio.sleep(0.01)

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        tasks = [asyncio.create_task(bomber()) for _ in range(attackers)]
        print("ready", flush=True)
        await stop.wait()
        for t in tasks:
            t.cancel()
        print(json.dumps(stats), flush=True)
    asyncio.run(main())


class RssWatch(threading.Thread):
    """The gateway process's resident memory every 50 ms, by the block it fell in."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.kind, self.stop = pid, "warm-up", threading.Event()
        self.peak: dict[str, int] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, StopIteration):
                rss = next(int(line.split()[1]) << 10 for line in Path(f"/proc/{self.pid}/status").open()
                           if line.startswith("VmRSS:"))
                self.peak[self.kind] = max(self.peak.get(self.kind, 0), rss)
            self.stop.wait(0.05)


def tried(c: Completions, failed: list) -> float:
    """``c.once()``, or when it fails (a gateway stalled past the client's 60 s timeout, or one
    that closed the connection) the time the client waited, noted in ``failed``; a new
    connection follows."""
    t0 = time.perf_counter()
    try:
        return c.once()
    except (OSError, http.client.HTTPException, RuntimeError) as e:
        failed.append(f"{type(e).__name__}: {e}")
        c.conn.close()
        return (time.perf_counter() - t0) * 1e3


def attack(args: argparse.Namespace) -> int:
    kinds = ("quiet", "attack_without_token", "attack_with_token")
    work = Path(tempfile.mkdtemp(prefix="rolloutd-bench-gateway-attack."))
    model = tinymodel.build(work / "model", seed=0)
    server = VllmServer(model, work / "vllm.sock", work / "vllm.log", pythonpath=[install_plugin(work / "plugin")],
                        cpus="0")
    subprocess.run(["taskset", "-a", "-p", "-c", "0", str(server.proc.pid)], check=True, capture_output=True)
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    gw_port = free_port()
    gateway = subprocess.Popen(["taskset", "-c", str(1 % os.cpu_count()), sys.executable, "-c", GATEWAY_CHILD,
                                str(server.socket), str(gw_port), ATTACK_TOKEN], stdout=subprocess.PIPE, text=True,
                               cwd="/", env={**os.environ, "PYTHONPATH": str(args.ref_repo or ROOT)})
    samples: dict[str, list[tuple]] = {kind: [] for kind in kinds}
    failed: dict[str, list[str]] = {kind: [] for kind in kinds}
    recovery: dict[str, list[float]] = {kind: [] for kind in kinds[1:]}  # s until it answered again
    attackers: dict[str, list[dict]] = {kind: [] for kind in kinds[1:]}
    rss = RssWatch(gateway.pid)
    attacker = None
    try:
        assert gateway.stdout.readline().strip() == "ready"
        server.wait_healthy()
        model_name = str(model)
        direct = Completions(server.socket, model_name)
        through = Completions(gw_port, model_name, ATTACK_TOKEN)
        for _ in range(20):
            direct.once(), through.once()
        rss.start()
        for i in range(args.blocks):
            for kind in turns(list(kinds), i):
                attacker = None
                if kind != "quiet":
                    token = ATTACK_TOKEN if kind == "attack_with_token" else ""
                    attacker = subprocess.Popen(["taskset", "-c", "0", "nice", "-n", "10", sys.executable, __file__,
                                                 "--serve-attack", str(gw_port), str(args.attackers), token,
                                                 str(args.bomb_mib)], stdout=subprocess.PIPE, text=True,
                                                start_new_session=True)
                    lower_session(attacker.pid)
                    assert attacker.stdout.readline().strip() == "ready"
                    time.sleep(0.5)  # the bombs under way
                rss.kind = kind
                for c in (direct, through):  # a fresh connection (vLLM closes one idle for 5 s)
                    c.conn.close()
                    tried(c, failed[kind])
                deadline = time.monotonic() + args.block_s
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    if len(samples[kind]) % 2 == 0:
                        x, y = tried(direct, failed[kind]), tried(through, failed[kind])
                    else:
                        y, x = tried(through, failed[kind]), tried(direct, failed[kind])
                    samples[kind].append((t0, time.perf_counter(), x, y))
                rss.kind = "between"
                if attacker is not None:
                    attacker.send_signal(signal.SIGTERM)
                    out, _ = attacker.communicate(timeout=60)
                    attackers[kind].append(json.loads(out.strip().splitlines()[-1]))
                    # Until the gateway answers again (at once, unless the attack left it busy).
                    t0, gone = time.monotonic(), []
                    while time.monotonic() - t0 < args.recovery_max_s:
                        before = len(gone)
                        tried(through, gone)
                        if len(gone) == before:
                            break
                    recovery[kind].append(round(time.monotonic() - t0, 2))
                attacker = None
                time.sleep(1.0)  # the attack's connections end before the next block
        rss.stop.set()
        hwm = next(int(line.split()[1]) << 10 for line in Path(f"/proc/{gateway.pid}/status").open()
                   if line.startswith("VmHWM:"))
    finally:
        if attacker is not None:
            attacker.kill()
        gateway.terminate()
        gateway.wait(10)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {"build": str(args.ref_repo or "this tree"), "attackers": args.attackers, "bomb_mib": args.bomb_mib,
              "block_s": args.block_s, "blocks": args.blocks,
              "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    for kind in kinds:
        result[kind] = {**added(samples[kind]), "gateway_rss_max_mib": round(rss.peak.get(kind, 0) / (1 << 20), 1),
                        "failed_requests": len(failed[kind]), "failures": sorted(set(failed[kind]))[:5]}
        if kind in attackers:
            result[kind]["attacker_connections"] = sum(a["connections"] for a in attackers[kind])
            result[kind]["attacker_mib_sent"] = round(sum(a["bytes"] for a in attackers[kind]) / (1 << 20), 1)
            result[kind]["recovery_s"] = recovery[kind]
    result["gateway_rss_peak_mib"] = round(hwm / (1 << 20), 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gateway-attack{'-ref' if args.ref_repo else ''}.json").write_text(json.dumps(result, indent=1))
    for kind in kinds:
        a = result[kind]
        print(f"{kind:21} {a['pairs']:5d} pairs: direct p50 {a['direct_p50_ms']:.2f} p99 {a['direct_p99_ms']:.2f} ms, "
              f"gateway p50 {a['gateway_p50_ms']:.2f} p99 {a['gateway_p99_ms']:.2f} ms; added p50 "
              f"{a['added_p50_ms']:+.3f} ms, p99 {a['added_p99_ms']:+.3f} ms; gateway RSS max "
              f"{a['gateway_rss_max_mib']} MiB; {a['failed_requests']} requests failed"
              + (f"; attackers: {a['attacker_connections']} connections, "
                                                   f"{a['attacker_mib_sent']} MiB sent, answering again "
                                                   f"{a['recovery_s']} s after it" if kind in attackers else ""))
    print(f"gateway RSS peak (VmHWM): {result['gateway_rss_peak_mib']} MiB")
    print(json.dumps({kind: {k: result[kind][k] for k in ("added_p50_ms", "added_p99_ms", "gateway_rss_max_mib")}
                      for kind in kinds}))
    return 0


def wait_up(reg) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            reg.latest()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests, shorter blocks")
    p.add_argument("--serve-gateway", nargs=2, metavar=("SOCKET", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=16, help="tokens per generation (latency)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--during-pull", action="store_true", help="the gateway in the daemon, idle and while it pulls")
    p.add_argument("--pull-gib", type=float, default=2.0, help="--during-pull: size of each version")
    p.add_argument("--pulls", type=int, default=2, help="--during-pull: versions pulled")
    p.add_argument("--idle-pairs", type=int, default=300, help="--during-pull: pairs measured idle")
    p.add_argument("--pull-priority", choices=("idle", "low", "normal"),
                   help="--during-pull: the daemon's pull.cpu_priority (default: the setting's default)")
    p.add_argument("--registry-core", type=int, help="--during-pull, an experiment: pin the registry (the "
                   "trainer's host, not the node's) to this core")
    p.add_argument("--daemon-fifo", action="store_true", help="--during-pull, an experiment: the daemon's main "
                   "thread (its loop: the gateway) real-time, SCHED_FIFO priority 1")
    p.add_argument("--ref-repo", type=Path, help="--during-pull: run the daemon and the registry of another build "
                   "(a directory holding its rolloutd/ and vllm_plugin/), to compare; --attack: that build's gateway")
    p.add_argument("--attack", action="store_true", help="the gateway while connections send trailer bombs")
    p.add_argument("--attackers", type=int, default=20, help="--attack: connections sending bombs at once")
    p.add_argument("--bomb-mib", type=float, default=32.0, help="--attack: most one connection sends before it "
                   "starts again on a new one")
    p.add_argument("--block-s", type=float, default=10.0, help="--attack: seconds of each block")
    p.add_argument("--blocks", type=int, default=3, help="--attack: rounds of (quiet, without token, with token)")
    p.add_argument("--recovery-max-s", type=float, default=120.0, help="--attack: longest wait for the gateway "
                   "to answer again after an attack")
    p.add_argument("--serve-attack", nargs=4, metavar=("PORT", "N", "TOKEN", "MIB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_gateway:
        serve_gateway(*args.serve_gateway)
        return 0
    if args.serve_attack:
        port, n, token, mib = args.serve_attack
        serve_attack(int(port), int(n), token, float(mib))
        return 0
    if args.during_pull:
        return during_pull(args)
    if args.attack:
        return attack(args)
    n, seconds, rounds = (60, 2.0, 4) if args.quick else (200, 3.0, 12)

    work = Path(tempfile.mkdtemp(prefix="rolloutd-bench-gateway."))
    model = tinymodel.build(work / "model", seed=0)
    server = VllmServer(model, work / "vllm.sock", work / "vllm.log", pythonpath=[install_plugin(work / "plugin")],
                        cpus="0")
    # vLLM (every process of it: it forks its engine later, which inherits this) on core 0; the
    # client and the proxies on the other core. On a GPU node generation does not compete with
    # a proxy for the CPU; here it would, and would measure the machine rather than the proxy.
    subprocess.run(["taskset", "-a", "-p", "-c", "0", str(server.proc.pid)], check=True, capture_output=True)
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    gw_port = free_port()
    gateway = subprocess.Popen(["taskset", "-c", str(1 % os.cpu_count()), sys.executable, __file__,
                                "--serve-gateway", str(server.socket), str(gw_port)], stdout=subprocess.PIPE,
                               text=True)
    nginx = None
    try:
        assert gateway.stdout.readline().strip() == "ready"
        server.wait_healthy()
        urls = {"direct": server.socket, "gateway": f"http://127.0.0.1:{gw_port}"}
        nginx_port = free_port()
        nginx = start_nginx(work, server.socket, nginx_port, 1 % os.cpu_count())
        if nginx is not None:
            urls["nginx"] = f"http://127.0.0.1:{nginx_port}"
        tput, ratio, gateway_cpu = throughput(urls, args.concurrency, seconds, 64, rounds, gateway.pid)
        samples = latency(urls, n, args.tokens)
    finally:
        for proc in (gateway, nginx):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        server.stop()
    proxies = [name for name in urls if name != "direct"]
    added = {name: summary(samples, name) for name in proxies}
    quantiles = (("p50", 0.5), ("p99", 0.99))
    lat = {name: {f"{kind}_{q}": round(pct(v, p), 3) for kind, v in kinds.items() for q, p in quantiles}
           for name, kinds in samples.items()}
    g = added["gateway"]
    result = {"requests_per_path": n, "tokens": args.tokens, "throughput_rounds": rounds, "latency_ms": lat,
              "added_ms": added,
              "throughput_tokens_per_s": tput, "throughput_ratio": ratio, "gateway_cpu_share_of_a_core": gateway_cpu,
              "goal": {"added_p50_ms_max": 1.0, "throughput_ratio_min": 0.95},
              "ratios_to_goal": {"added_first_chunk_p50": round(g["first_p50"] / 1.0, 3),
                                 "added_total_p50": round(g["total_p50"] / 1.0, 3),
                                 "throughput": round(ratio["gateway"] / 0.95, 3)}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps(result, indent=1))
    for name in urls:
        d = lat[name]
        print(f"{name:8} first chunk p50 {d['first_p50']:.2f} ms p99 {d['first_p99']:.2f} ms | "
              f"whole stream p50 {d['total_p50']:.2f} ms p99 {d['total_p99']:.2f} ms | "
              f"/health p50 {d['health_p50']:.3f} ms | {tput[name]:.0f} tokens/s")
    for name in proxies:
        a = added[name]
        print(f"added by {name} (paired): first chunk p50 {a['first_p50']:+.2f} ms, p99 {a['first_p99']:+.2f} ms; "
              f"whole stream p50 {a['total_p50']:+.2f} ms, p99 {a['total_p99']:+.2f} ms; "
              f"/health p50 {a['health_p50']:+.3f} ms; throughput {ratio[name]:.3f}x direct")
    print(f"goal: <= 1 ms added at p50 (gateway: {g['first_p50'] / 1.0:.2f}x, {g['total_p50'] / 1.0:.2f}x of "
          f"it), >= 0.95x throughput (gateway: {ratio['gateway'] / 0.95:.2f}x of it); the gateway used "
          f"{gateway_cpu * 100:.1f} % of a core under load")
    ok = g["first_p50"] <= 1.0 and g["total_p50"] <= 1.0 and ratio["gateway"] >= 0.95
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
