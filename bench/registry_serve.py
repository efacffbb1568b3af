"""Egress of the registry: how fast it serves a version's bytes, next to nginx with sendfile.

Every node pulls each new version from the registry with ``GET /v1/versions/{v}/files/{name}``
(parallel single ``Range`` requests), so this is the rate that bounds a rollout. One random
test file in tmpfs is served, in the same run, by:

- ``registry-disk``: ``rolloutd registry --data-dir <tmpfs>``, the file published with
  ``rolloutd publish`` (publish time is measured too);
- ``registry-memory``: the same without ``--data-dir`` (bytes held in the process);
- ``nginx``: worker_processes 1, sendfile on, tcp_nopush on, the reference;
- ``nginx-nosendfile``: the same with sendfile off (read + write through a buffer, as the
  registry does), to tell what sendfile itself is worth on this machine.

Clients: ``curl`` (one stream), ``aria2c -x N -s N -k piece``, ``rangepull.py`` (``ranges``:
aiohttp, N concurrent 64 MiB ``Range`` requests, bytes discarded: how the daemon pulled before
its pull workers) and ``streampull.py`` (``streams``: N threads fetching 64 MiB ranges with the
pull workers' own source, each body read into a reused buffer and dropped: how the daemon
pulls, at little cost to the client, so that the servers set the rate). Servers run
pinned to one CPU, clients to the other (``taskset``). Every (server, client) pair is measured
``--repeats`` times, interleaved, and reported as median and spread, with the ratio to nginx
for the same client. Before the servers start, ``dd``/``cp`` into tmpfs give this machine's
write limit. Prints a table; writes ``bench/results/registry_serve.json``. From the repo root::

    .venv/bin/python bench/registry_serve.py --profile  # full run, about 1.5 minutes
    .venv/bin/python bench/registry_serve.py --quick    # smoke test, about 10 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from registry_load import (
    cpu_times,
    display_path,
    find_tool,
    free_port,
    parse_frame,
    pinned,
    process_cpu_s,
    py_spy,
    python_frame,
    run_in_scratch,
    run_main,
    stop,
    write_report,
)

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
HOST = "127.0.0.1"  # only loopback is ever targeted

FILE_NAME = "model.safetensors"  # `rolloutd publish` takes a directory's *.safetensors files
SERVERS = ("registry-disk", "registry-memory", "nginx", "nginx-nosendfile")
CLIENTS = ("curl", "aria2c", "ranges", "streams")
BASELINE = "nginx"
WRITE_PIECE = 16 << 20
MIN_RATE_BPS = 20e6  # a transfer slower than this is broken: it sets every subprocess timeout
START_TIMEOUT_S = 30.0

INSTALL_HINTS = {
    "taskset": "apt-get install -y util-linux",
    "dd": "apt-get install -y coreutils",
    "curl": "apt-get install -y curl",
    "aria2c": "apt-get install -y aria2",
    "nginx": "apt-get install -y nginx",
    "py-spy": ".venv/bin/pip install py-spy   (only needed for --profile)",
}


# -- options ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="test file size")
    p.add_argument("--repeats", type=int, default=3, help="measurements per server and client")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma list of {', '.join(SERVERS)}")
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"comma list of {', '.join(CLIENTS)}")
    p.add_argument("--connections", type=int, default=8,
                   help="parallel connections of aria2c (-x, -s) and of the ranges and streams clients")
    p.add_argument("--piece-mib", type=int, default=64,
                   help="ranges client: bytes per Range request; aria2c: -k (min split size)")
    p.add_argument("--registry-cmd", default=None,
                   help="command starting the registry under test, '--host H --port P [--data-dir D]' "
                        "appended (default: the venv's `rolloutd registry`); to compare a changed build, "
                        "e.g. 'env PYTHONPATH=DIR .venv/bin/rolloutd registry' (not `python -m`, which "
                        "puts the current directory, and so the repo's own package, first)")
    p.add_argument("--tmp-dir", type=Path, default=Path("/dev/shm"),
                   help="tmpfs under which the test files live (a fresh directory, removed at the end)")
    p.add_argument("--profile", action="store_true",
                   help="py-spy the registries while the ranges client pulls (where the time goes)")
    p.add_argument("--profile-s", type=float, default=5.0)
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="128 MiB, one repeat: a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS / "registry_serve.json")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats, args.profile_s = 128, 1, 2.0
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if unknown := (set(args.servers) - set(SERVERS)) | (set(args.clients) - set(CLIENTS)):
        p.error(f"unknown servers or clients: {', '.join(sorted(unknown))}")
    if min(args.size_mib, args.repeats, args.connections, args.piece_mib) < 1:
        p.error("size, repeats, connections and piece must be positive")
    if not 1 <= args.connections <= 16:
        p.error("aria2c allows 1 to 16 connections per server")
    args.size = args.size_mib << 20
    return args


def missing_tools(args: argparse.Namespace) -> list[str]:
    needed = {"taskset", "dd"}
    needed |= {c for c in args.clients if c in ("curl", "aria2c")}
    needed |= {"nginx"} if any(s.startswith("nginx") for s in args.servers) else set()
    needed |= {"py-spy"} if args.profile else set()
    return sorted(t for t in needed if not find_tool(t))


def check_room(args: argparse.Namespace) -> str | None:
    """The source, aria2c's copy, the disk registry's copy and the memory registry's (whose
    upload buffer grows by reallocation) hold the file about 5 times over: refuse early unless
    memory and tmpfs have room for 7."""
    need = 7 * args.size
    meminfo = dict(re.findall(r"^(\w+):\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M))
    available = min(int(meminfo.get("MemAvailable", 0)) << 10, shutil.disk_usage(args.tmp_dir).free)
    if available < need:
        return f"needs about {need >> 20} MiB of memory and of room in {args.tmp_dir}; has {available >> 20} MiB"
    return None


# -- the test file and this machine's limits ----------------------------------------------------------

def make_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for done in range(0, size, WRITE_PIECE):
            f.write(os.urandom(min(WRITE_PIECE, size - done)))


def timed_s(argv: list[str], cpu: int | None, timeout_s: float) -> float:
    t = time.perf_counter()
    subprocess.run(pinned(cpu, argv), check=True, capture_output=True, timeout=timeout_s)
    return time.perf_counter() - t


def machine_limits(src: Path, scratch: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """MB/s of plain copies on the client CPU. A write to tmpfs pages that do not exist yet
    (a new file) is far slower on some VMs than one to pages already there (page faults
    are expensive), so both are measured; reading back is the ceiling of any server."""
    timeout = transfer_timeout_s(args.size)
    dd = lambda *extra: ["dd", f"if={src}", "bs=4M", *extra]
    out: dict[str, list[float]] = {k: [] for k in ("dd write, new file", "cp, new file",
                                                   "dd write over existing pages", "dd read to /dev/null")}
    for _ in range(args.repeats):
        copy = scratch / "copy"
        for name, argv in (("dd write, new file", dd(f"of={copy}")),
                           ("dd write over existing pages", dd(f"of={copy}", "conv=notrunc")),
                           ("dd read to /dev/null", dd("of=/dev/null"))):
            out[name].append(args.size / timed_s(argv, args.load_cpu, timeout) / 1e6)
        copy.unlink()
        out["cp, new file"].append(args.size / timed_s(["cp", str(src), str(copy)], args.load_cpu, timeout) / 1e6)
        copy.unlink()
    return out


def transfer_timeout_s(size: int) -> float:
    return 30.0 + size / MIN_RATE_BPS


# -- servers ------------------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    path: str  # URL path of the test file

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}{self.path}"

    @property
    def is_registry(self) -> bool:
        return self.name.startswith("registry")

    def pids(self) -> list[int]:
        """The server's processes (nginx: master and workers), for CPU accounting."""
        return [self.proc.pid, *child_pids(self.proc.pid)]


def child_pids(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def registry_argv(args: argparse.Namespace, port: int, data_dir: Path | None) -> list[str]:
    base = shlex.split(args.registry_cmd) if args.registry_cmd else [find_tool("rolloutd") or "rolloutd", "registry"]
    argv = [*base, "--host", HOST, "--port", str(port)]
    return argv + ["--data-dir", str(data_dir)] if data_dir else argv


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile {sendfile};
    tcp_nopush on;
    {buffers}
    default_type application/octet-stream;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen {host}:{port};
        root {root};
    }}
}}
"""


def nginx_argv(conf_dir: Path, root: Path, port: int, sendfile: bool) -> list[str]:
    """A throwaway config: every path nginx writes is under ``conf_dir``. Without sendfile,
    1 MiB buffers make it move bytes the way the registry does (read, then write)."""
    conf_dir.mkdir(parents=True)
    conf = conf_dir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=conf_dir, host=HOST, port=port, root=root,
                                      sendfile="on" if sendfile else "off",
                                      buffers="" if sendfile else "output_buffers 2 1m;"))
    return [find_tool("nginx"), "-p", str(conf_dir), "-e", "stderr", "-c", str(conf)]


@contextlib.contextmanager
def running_server(name: str, tmp: Path, args: argparse.Namespace) -> Iterator[Server]:
    """Start one server pinned to the server CPU, wait until it answers; always stop it."""
    port = free_port()
    if name.startswith("registry"):
        data_dir = tmp / name if name == "registry-disk" else None
        argv, path = registry_argv(args, port, data_dir), f"/v1/versions/{{version}}/files/{FILE_NAME}"
        probe = "/healthz"
    else:
        argv = nginx_argv(tmp / name, tmp, port, sendfile=name == "nginx")
        path = probe = f"/src/{FILE_NAME}"
    log_path = RESULTS / f"registry_serve.{name}.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(pinned(args.server_cpu, argv), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    server = Server(name, proc, port, path)
    workers: list[int] = []
    try:
        wait_up(proc, f"http://{HOST}:{port}{probe}", log_path)
        workers = child_pids(proc.pid)
        yield server
    finally:
        stop(proc)
        stop_leftovers(workers)


def wait_up(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {display_path(log_path)}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server not up after {START_TIMEOUT_S} s; see {display_path(log_path)}")


def stop_leftovers(pids: list[int]) -> None:
    """nginx workers end with their master; should the master have been killed, end those still
    running (a pid whose command is no longer nginx was reused: leave it alone)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "nginx":
                os.kill(pid, signal.SIGKILL)


# -- publishing ----------------------------------------------------------------------------------------

PROGRESS_RE = re.compile(r"upload v\d+: .* ([\d.]+) (B|KiB|MiB|GiB)/s")
UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def publish(server: Server, src_dir: Path, version: int, args: argparse.Namespace) -> dict:
    """``rolloutd publish`` from the client CPU: hash, upload, then the registry verifies and
    commits. Wall time is the whole of it; ``upload`` is the rate its progress line showed."""
    argv = [find_tool("rolloutd") or "rolloutd", "publish", str(version), str(src_dir),
            "--registry", f"http://{HOST}:{server.port}"]
    t = time.perf_counter()
    out = subprocess.run(pinned(args.load_cpu, argv), capture_output=True, text=True,
                         timeout=transfer_timeout_s(args.size) + 60)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"publish to {server.name} failed ({out.returncode}): {out.stderr[-1000:]}")
    rates = PROGRESS_RE.findall(out.stderr)
    upload = float(rates[-1][0]) * UNIT[rates[-1][1]] / 1e6 if rates else None
    return {"version": version, "seconds": round(seconds, 3), "mb_per_s": round(args.size / seconds / 1e6, 1),
            "upload_mb_per_s": round(upload, 1) if upload else None}


def retire(server: Server, version: int) -> None:
    """Drop a version's bytes once the next one is published, so only one is held."""
    req = urllib.request.Request(f"http://{HOST}:{server.port}/v1/versions/{version}", method="DELETE")
    with urllib.request.urlopen(req, timeout=30):
        pass


def publish_repeatedly(server: Server, src_dir: Path, args: argparse.Namespace) -> list[dict]:
    runs = []
    for version in range(1, args.repeats + 1):
        if version > 1:
            retire(server, version - 1)
        runs.append(publish(server, src_dir, version, args))
        print(f"  publish v{version} to {server.name}: {runs[-1]['seconds']:.2f} s, "
              f"{runs[-1]['mb_per_s']:.0f} MB/s", flush=True)
    server.path = server.path.format(version=args.repeats)
    return runs


# -- clients ------------------------------------------------------------------------------------------

def run_client(argv: list[str], args: argparse.Namespace,
               timeout_s: float) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run a client pinned to the load CPU: its output, wall seconds and CPU seconds."""
    t0, c0 = time.perf_counter(), os.times()
    out = subprocess.run(pinned(args.load_cpu, argv), capture_output=True, text=True, timeout=timeout_s)
    wall, c1 = time.perf_counter() - t0, os.times()
    if out.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({out.returncode}): {(out.stderr or out.stdout)[-1000:]}")
    return out, wall, c1.children_user + c1.children_system - c0.children_user - c0.children_system


def curl(url: str, args: argparse.Namespace, _dest: Path) -> dict:
    timeout = transfer_timeout_s(args.size)
    argv = [find_tool("curl"), "-s", "-o", "/dev/null", "--max-time", f"{timeout:.0f}",
            "-w", "%{http_code} %{size_download} %{speed_download} %{time_total}", url]
    out, _, cpu = run_client(argv, args, timeout + 10)
    code, size, speed, seconds = out.stdout.split()
    if code != "200" or int(size) != args.size:
        raise RuntimeError(f"curl got HTTP {code} with {size} bytes from {url}")
    return {"gb_per_s": float(speed) / 1e9, "seconds": float(seconds), "client_cpu_s": cpu}


def aria2c(url: str, args: argparse.Namespace, dest: Path) -> dict:
    """aria2c writes where ``dest`` already is: overwriting pages that exist keeps the cost of
    first-touch page faults (see machine_limits) out of the figure."""
    timeout = transfer_timeout_s(args.size)
    n = str(args.connections)
    argv = [find_tool("aria2c"), "--no-conf=true", "-x", n, "-s", n, "-k", f"{args.piece_mib}M",
            "--file-allocation=none", "--allow-overwrite=true", "--auto-file-renaming=false",
            "-d", str(dest.parent), "-o", dest.name, "--max-tries=1", f"--timeout={timeout:.0f}",
            "--summary-interval=0", "--show-console-readout=false", "--console-log-level=warn",
            "--download-result=hide", url]
    _, wall, cpu = run_client(argv, args, timeout + 10)
    if dest.stat().st_size != args.size:
        raise RuntimeError(f"aria2c wrote {dest.stat().st_size} bytes from {url}")
    return {"gb_per_s": args.size / wall / 1e9, "seconds": wall, "client_cpu_s": cpu}


def ranges(url: str, args: argparse.Namespace, _dest: Path, rounds: int = 1) -> dict:
    timeout = transfer_timeout_s(args.size) * rounds
    argv = [sys.executable, str(BENCH / "rangepull.py"), url, "--size", str(args.size),
            "--chunk-mib", str(args.piece_mib), "--concurrency", str(args.connections),
            "--rounds", str(rounds), "--timeout-s", f"{timeout:.0f}"]
    out, _, _ = run_client(argv, args, timeout + 30)
    r = json.loads(out.stdout)  # its own CPU and time cover the pull, not the interpreter start
    return {"gb_per_s": r["gb_per_s"], "seconds": r["seconds"], "client_cpu_s": r["client_cpu_s"]}


def streams(url: str, args: argparse.Namespace, _dest: Path, rounds: int = 1) -> dict:
    timeout = transfer_timeout_s(args.size) * rounds
    argv = [sys.executable, str(BENCH / "streampull.py"), url, "--size", str(args.size),
            "--chunk-mib", str(args.piece_mib), "--concurrency", str(args.connections), "--rounds", str(rounds)]
    out, _, _ = run_client(argv, args, timeout + 30)
    r = json.loads(out.stdout)  # its own CPU and time cover the pull, not the interpreter start
    return {"gb_per_s": r["gb_per_s"], "seconds": r["seconds"], "client_cpu_s": r["client_cpu_s"]}


CLIENT_RUN = {"curl": curl, "aria2c": aria2c, "ranges": ranges, "streams": streams}


def client_label(client: str, args: argparse.Namespace) -> str:
    return {"curl": "curl (1 stream)",
            "aria2c": f"aria2c -x{args.connections} -s{args.connections} -k{args.piece_mib}M",
            "ranges": f"ranges {args.connections}x{args.piece_mib} MiB",
            "streams": f"streams {args.connections}x{args.piece_mib} MiB"}[client]


# -- one transfer, with the server's CPU ------------------------------------------------------------

def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += process_cpu_s(pid)
    return total


def thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (the registry's event loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transfer(server: Server, client: str, args: argparse.Namespace, dest: Path) -> dict:
    pids, main_tid = server.pids(), server.proc.pid
    core0, srv0, main0 = cpu_times(args.server_cpu), cpu_of(pids), thread_cpu_s(main_tid)
    wall0 = time.perf_counter()
    result = CLIENT_RUN[client](server.url, args, dest)
    wall = time.perf_counter() - wall0
    core1, srv1, main1 = cpu_times(args.server_cpu), cpu_of(pids), thread_cpu_s(main_tid)
    used, gb = srv1 - srv0, args.size / 1e9
    result.update(
        server_cpu_s=round(used, 3),
        server_cpu_share=round(used / result["seconds"], 3),
        server_cpu_s_per_gb=round(used / gb, 3),
        client_cpu_s_per_gb=round(result["client_cpu_s"] / gb, 3),
        client_cpu_share=round(result["client_cpu_s"] / result["seconds"], 3),
        # CPU time of anything else on the server's core, and hypervisor steal
        noise=round((max(0.0, core1["busy"] - core0["busy"] - used) + core1["steal"] - core0["steal"]) / wall, 3))
    if server.is_registry:  # its event-loop thread; the rest is anyio's worker threads
        result["server_main_thread_cpu_s"] = round(main1 - main0, 3)
    result["gb_per_s"] = round(result["gb_per_s"], 4)
    result["seconds"] = round(result["seconds"], 4)
    result["client_cpu_s"] = round(result["client_cpu_s"], 3)
    return result


def measure(servers: dict[str, Server], args: argparse.Namespace, src: Path, dest: Path) -> dict:
    """Every (server, client) pair ``repeats`` times, interleaved so that a slow spell of the
    machine hits all servers alike rather than one."""
    runs: dict = {s: {c: [] for c in args.clients} for s in servers}
    for rep in range(args.repeats):
        for client in args.clients:
            for name, server in servers.items():
                run = transfer(server, client, args, dest)
                if rep == 0 and client == "aria2c" and not same_bytes(src, dest):
                    raise RuntimeError(f"aria2c got other bytes from {name} than were published")
                runs[name][client].append(run)
                print(f"  [{rep + 1}/{args.repeats}] {name:<17} {client:<7} {run['gb_per_s']:6.2f} GB/s  "
                      f"server CPU {100 * run['server_cpu_share']:3.0f}%", flush=True)
    return runs


def same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(WRITE_PIECE), fb.read(WRITE_PIECE)
            if x != y:
                return False
            if not x:
                return True


# -- profile ------------------------------------------------------------------------------------------

PROFILE_HZ = 200
LEAF_CATEGORY = [  # (leaf function names, category) for native frames of the C library
    ({"write", "writev", "send", "sendto", "sendmsg", "__send"}, "socket send (copies into the kernel)"),
    ({"pread64", "read", "__pread64"}, "file read"),
    ({"epoll_wait", "epoll_pwait"}, "epoll wait (idle)"),
    ({"getpid"}, "getpid (asyncio/anyio loop checks)"),
    ({"sem_post", "sem_wait", "pthread_cond_signal", "pthread_cond_wait", "pthread_cond_timedwait"},
     "thread hand-off (semaphores, conditions)"),
]


def leaf_category(frames: list[str]) -> str:
    func, file = parse_frame(frames[-1])
    if file.startswith("libc"):
        for names, category in LEAF_CATEGORY:
            if func in names:
                return category
        # py-spy resolves no symbol for glibc's internal futex helpers (the wake in a lock
        # release, the wait in a lock acquire): how threads hand the GIL and work to each other
        return "libc without symbol (futex: waking or waiting for other threads)" if func.startswith(
            "0x") else f"libc {func}"
    if file.endswith(".py"):
        return "Python: " + file.split("/", 1)[0]
    return "native: " + (file.split(".", 1)[0] or func)


def summarize_threads(raw: str, main_tid: int, top: int = 8) -> dict:
    """Shares of the main thread's samples (idle included: py-spy's idle filter does not work
    with --native here, so waits show as their own categories) and how often other threads ran."""
    main, leaves, threads, total = Counter(), Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        if len(frames) < 2:
            continue
        thread = frames[0]
        threads[thread] += n
        if f"({main_tid})" in thread:
            total += n
            main[leaf_category(frames[1:])] += n
            leaves[f"{frames[-1]} in {python_frame(frames)}"] += n
    scale = 1 / total if total else 0.0
    return {"main_thread_samples": total,
            "main_thread": {c: round(n * scale, 3) for c, n in main.most_common()},
            "main_thread_top_leaves": [{"leaf": f, "share": round(n * scale, 3)} for f, n in leaves.most_common(top)],
            "samples_per_thread": dict(threads.most_common())}


def profile(server: Server, args: argparse.Namespace, gb_per_s: float) -> dict:
    """Sample the registry (all threads, native frames) while the ranges client pulls the file
    again and again for about ``--profile-s``."""
    rounds = max(1, min(100, math.ceil((args.profile_s + 1) * gb_per_s * 1e9 / args.size)))
    try:
        with py_spy(server.proc.pid, args.load_cpu, args.profile_s, threads=True) as collect:
            pids = server.pids()
            srv0, main0, t0 = cpu_of(pids), thread_cpu_s(server.proc.pid), time.perf_counter()
            load = ranges(server.url, args, Path(), rounds=rounds)
            wall = time.perf_counter() - t0
            used, main = cpu_of(pids) - srv0, thread_cpu_s(server.proc.pid) - main0
            summary = summarize_threads(collect(timeout_s=args.profile_s + 60), server.proc.pid)
    except RuntimeError as e:
        return {"error": str(e)}
    summary.update(rounds=rounds, gb_per_s=load["gb_per_s"], server_cpu_share=round(used / wall, 3),
                   main_thread_cpu_share=round(main / wall, 3))
    return summary


# -- summary and report ---------------------------------------------------------------------------------

def stats(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median": round(med, 4), "min": round(min(values), 4), "max": round(max(values), 4),
            "spread_pct": round(100 * (max(values) - min(values)) / med, 1) if med else None}


def summarize(runs: dict, args: argparse.Namespace) -> dict:
    out: dict = {}
    for name, by_client in runs.items():
        out[name] = {}
        for client, rs in by_client.items():
            out[name][client] = {
                "gb_per_s": stats([r["gb_per_s"] for r in rs]),
                "server_cpu_share": statistics.median(r["server_cpu_share"] for r in rs),
                "server_cpu_s_per_gb": statistics.median(r["server_cpu_s_per_gb"] for r in rs),
                "client_cpu_s_per_gb": statistics.median(r["client_cpu_s_per_gb"] for r in rs),
                "client_cpu_share": statistics.median(r["client_cpu_share"] for r in rs),
                "noise_max": max(r["noise"] for r in rs),
            }
            if "server_main_thread_cpu_s" in rs[0]:
                out[name][client]["server_main_thread_share_of_cpu"] = round(
                    sum(r["server_main_thread_cpu_s"] for r in rs) / max(1e-9, sum(r["server_cpu_s"] for r in rs)), 3)
    if BASELINE in out:
        for name in out:
            for client, s in out[name].items():
                base = out[BASELINE][client]["gb_per_s"]["median"]
                s["ratio_to_nginx"] = round(s["gb_per_s"]["median"] / base, 3) if base else None
    return out


def print_report(report: dict) -> None:
    cfg, env = report["config"], report["environment"]
    print(f"\nEgress: one {cfg['size_mib']} MiB file in tmpfs, median of {cfg['repeats']} [min-max]; "
          f"{env['pinning']}")
    print("\nCopies on the client CPU, MB/s, median [min-max]:")
    for name, values in report["limits"].items():
        v = stats(values)
        print(f"  {name:<30} {v['median']:>6.0f} [{v['min']:.0f}-{v['max']:.0f}]")
    print("rolloutd publish, each version in turn (s, MB/s overall, upload MB/s as its progress showed):")
    for name, pubs in report["publish"].items():
        runs = ", ".join(f"v{p['version']} {p['seconds']:.2f} s {p['mb_per_s']:.0f} {p['upload_mb_per_s'] or 0:.0f}"
                         for p in pubs)
        print(f"  {name:<16} median {statistics.median(p['mb_per_s'] for p in pubs):.0f} MB/s; {runs}")
    header = (f"{'server':<17} {'client':<22} {'GB/s':>6} {'[min-max]':>13} {'x nginx':>7} "
              f"{'srv CPU':>7} {'srv s/GB':>8} {'loop':>5} {'cli CPU':>7} {'cli s/GB':>8} {'noise':>5}")
    print("\n" + header + "\n" + "-" * len(header))
    for client in cfg["clients"]:
        for name, by_client in report["summary"].items():
            s = by_client[client]
            g = s["gb_per_s"]
            ratio = f"{s['ratio_to_nginx']:.2f}" if s.get("ratio_to_nginx") is not None else "-"
            main = s.get("server_main_thread_share_of_cpu")
            loop = f"{100 * main:.0f}%" if main is not None else ""
            print(f"{name:<17} {report['client_labels'][client]:<22} {g['median']:>6.2f} "
                  f"{g['min']:>6.2f}-{g['max']:<6.2f} {ratio:>7} {100 * s['server_cpu_share']:>6.0f}% "
                  f"{s['server_cpu_s_per_gb']:>8.2f} {loop:>5} {100 * s['client_cpu_share']:>6.0f}% "
                  f"{s['client_cpu_s_per_gb']:>8.2f} "
                  f"{100 * s['noise_max']:>4.0f}%")
    for name, prof in report.get("profile", {}).items():
        print_profile(name, prof)


def print_profile(name: str, prof: dict) -> None:
    if "error" in prof:
        print(f"\nProfile of {name}: {prof['error']}")
        return
    print(f"\nProfile of {name} under the ranges client ({prof['gb_per_s']:.2f} GB/s, {prof['rounds']} pulls): "
          f"server CPU {100 * prof['server_cpu_share']:.0f}% of a core, its event-loop thread "
          f"{100 * prof['main_thread_cpu_share']:.0f}%. Event-loop thread, share of wall-clock samples:")
    for category, share in prof["main_thread"].items():
        print(f"  {100 * share:5.1f}%  {category}")
    print("  top leaves:")
    for entry in prof["main_thread_top_leaves"]:
        print(f"  {100 * entry['share']:5.1f}%  {entry['leaf']}")


# -- main ------------------------------------------------------------------------------------------------

def run_all(tmp: Path, args: argparse.Namespace) -> dict:
    src_dir, scratch = tmp / "src", tmp / "scratch"
    src_dir.mkdir()
    scratch.mkdir()
    print(f"write {args.size_mib} MiB of random bytes to {src_dir / FILE_NAME}", flush=True)
    make_file(src_dir / FILE_NAME, args.size)
    # nginx workers may run as another user (root starts them as nobody): let them read the file
    for p in (tmp, src_dir):
        p.chmod(0o755)
    (src_dir / FILE_NAME).chmod(0o644)
    print("this machine's copy rates", flush=True)
    limits = machine_limits(src_dir / FILE_NAME, scratch, args)
    dest = scratch / FILE_NAME  # aria2c's target, written once here so its pages exist
    shutil.copyfile(src_dir / FILE_NAME, dest)
    report: dict = {"limits": {k: [round(v, 1) for v in vs] for k, vs in limits.items()}, "publish": {}}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in args.servers:
            servers[name] = stack.enter_context(running_server(name, tmp, args))
            print(f"{name}: pid {servers[name].proc.pid}, port {servers[name].port}", flush=True)
            if servers[name].is_registry:
                report["publish"][name] = publish_repeatedly(servers[name], src_dir, args)
        report["runs"] = measure(servers, args, src_dir / FILE_NAME, dest)
        report["summary"] = summarize(report["runs"], args)
        if args.profile:
            report["profile"] = {
                name: profile(server, args, report["summary"][name].get("ranges", {}).get(
                    "gb_per_s", {}).get("median", 1.0))
                for name, server in servers.items() if server.is_registry}
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    done = run_in_scratch("registry_serve", args, missing_tools(args), INSTALL_HINTS, check_room(args), run_all)
    if done is None:
        return 2
    env, report = done
    write_report(args, env, {"client_labels": {c: client_label(c, args) for c in args.clients}, **report},
                 print_report)
    return 0


if __name__ == "__main__":
    run_main(main)
