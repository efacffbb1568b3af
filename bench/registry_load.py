"""Heartbeat capacity of the standalone registry: ``PUT /v1/replicas/{replica_id}`` under load.

Goal: 10,000 replicas at a 2 s interval (5,000 heartbeats/s) with p99 <= 50 ms.

Each target (the registry, and two baselines that answer the same PUT with a fixed JSON:
bare ASGI and a bare FastAPI route, see ``baseline_app.py``) is started on its own CPU
with ``taskset``; every load generator runs pinned to the other CPU. Per target:

1. probe: sequential PUTs on one idle keep-alive connection (latency with no load at all);
2. open loop: ``openloop.py`` at ``--rate`` over ``--replicas`` ids for ``--duration-s``,
   latency measured from each request's due time;
3. closed loop: ``wrk`` + ``heartbeat.lua`` as fast as the server answers (the ceiling);

and for the registry only:

4. sweep: open-loop runs at fractions of that ceiling, for the highest rate meeting the p99;
5. ``--profile``: ``py-spy`` samples the registry under the open-loop rate (where time goes).

Prints a table; writes ``bench/results/registry_load.json``. Run from the repo root::

    .venv/bin/python bench/registry_load.py            # full run, about 2.5 minutes
    .venv/bin/python bench/registry_load.py --quick    # smoke test, about 30 s
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
HOST = "127.0.0.1"  # load is only ever aimed at loopback

HEARTBEAT = {"node": "n17", "server": "s0", "endpoint": "http://10.0.0.17:8000", "state": "SERVING",
             "version": 3, "target": 3, "incarnation": 1, "timings": {"pause_s": 0.41}}
PROBE_GAPS_S = (0.0, 0.1)  # back to back, and spaced wider than a delayed ACK (40 ms)
SWEEP_FRACTIONS = (0.5, 0.7, 0.85, 1.0)  # of the closed-loop ceiling
CLK_TCK = os.sysconf("SC_CLK_TCK")

INSTALL_HINTS = {
    "wrk": "apt-get install -y wrk",
    "taskset": "apt-get install -y util-linux",
    "py-spy": ".venv/bin/pip install py-spy   (only needed for --profile)",
}


# -- options ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate", type=float, default=5000.0, help="open-loop heartbeats per second")
    p.add_argument("--replicas", type=int, default=10_000, help="distinct replica ids")
    p.add_argument("--duration-s", type=float, default=20.0, help="measured open-loop time")
    p.add_argument("--closed-duration-s", type=float, default=10.0, help="wrk run time")
    p.add_argument("--connections", type=int, default=1000,
                   help="keep-alive connections, open and closed loop (about one per node)")
    p.add_argument("--slo-p99-ms", type=float, default=50.0)
    p.add_argument("--targets", default="registry,asgi,fastapi",
                   help="comma list of registry, asgi, fastapi")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="registry: open-loop rates at fractions of its ceiling")
    p.add_argument("--sweep-step-s", type=float, default=5.0)
    p.add_argument("--profile", action="store_true", help="py-spy the registry under load")
    p.add_argument("--profile-s", type=float, default=10.0)
    p.add_argument("--registry-cmd", default=None,
                   help="command starting the registry under test, '--host H --port P' appended "
                        "(default: the venv's `rolloutd registry`); to compare a changed build")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="short runs, no sweep: a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS / "registry_load.json")
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s, args.closed_duration_s = 3.0, 3.0
        args.sweep_step_s, args.profile_s, args.sweep = 2.0, 3.0, False
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if unknown := set(args.targets) - {"registry", "asgi", "fastapi"}:
        p.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if args.rate <= 0 or args.replicas < 1 or args.connections < 1 or args.duration_s <= 0:
        p.error("rate, replicas, connections and duration must be positive")
    return args


def missing_tools(profile: bool) -> list[str]:
    needed = ["wrk", "taskset"] + (["py-spy"] if profile else [])
    return [t for t in needed if not find_tool(t)]


def find_tool(name: str) -> str | None:
    """The venv's copy first (py-spy is pip-installed there), then PATH."""
    venv = Path(sys.executable).parent / name
    return str(venv) if venv.exists() else shutil.which(name)


# -- CPU pinning and accounting ---------------------------------------------------------------------

def pinned(cpu: int | None, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_times(cpu: int) -> dict[str, float]:
    """Seconds one CPU spent busy (user, nice, system) and stolen by the hypervisor."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            v = [int(x) / CLK_TCK for x in line.split()[1:]]
            return {"busy": v[0] + v[1] + v[2], "steal": v[7] if len(v) > 7 else 0.0}
    return {"busy": 0.0, "steal": 0.0}


def machine_busy_s() -> float:
    """Seconds all CPUs together spent busy (user, nice, system, interrupts), not idle or stolen:
    on loopback the kernel charges much of a transfer to whichever core is in the stack."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()  # the "cpu" line: all CPUs
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / CLK_TCK


@dataclass
class CpuMeter:
    """How busy the server was during one run, and how much else ran on its CPU (noise)."""
    pid: int
    cpu: int | None
    wall0: float = field(default_factory=time.perf_counter)
    proc0: float = 0.0
    cpu0: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.proc0 = process_cpu_s(self.pid)
        self.cpu0 = cpu_times(self.cpu) if self.cpu is not None else {}

    def read(self, requests: int) -> dict:
        wall = time.perf_counter() - self.wall0
        used = process_cpu_s(self.pid) - self.proc0
        out = {"server_cpu_share": round(used / wall, 3),
               "server_cpu_us_per_request": round(1e6 * used / requests, 1) if requests else None}
        if self.cpu is not None:
            now = cpu_times(self.cpu)
            out["other_load_on_server_cpu"] = round(max(0.0, now["busy"] - self.cpu0["busy"] - used) / wall, 3)
            out["steal_on_server_cpu"] = round((now["steal"] - self.cpu0["steal"]) / wall, 3)
        return out


# -- servers -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_argv(target: str, port: int, registry_cmd: str | None) -> list[str]:
    if target == "registry":
        base = shlex.split(registry_cmd) if registry_cmd else [find_tool("rolloutd") or "rolloutd", "registry"]
        return [*base, "--host", HOST, "--port", str(port)]
    # Baselines: uvicorn's own CLI with the stack the registry is meant to run on.
    return [sys.executable, "-m", "uvicorn", f"baseline_app:{target}", "--app-dir", str(BENCH),
            "--host", HOST, "--port", str(port), "--loop", "uvloop", "--http", "httptools",
            "--no-access-log", "--log-level", "warning", "--timeout-keep-alive", "75"]


@contextlib.contextmanager
def running_server(target: str, cpu: int | None, registry_cmd: str | None) -> Iterator[tuple[int, int]]:
    """Start a target, wait for /healthz, yield (pid, port); always stop it, also on errors."""
    port = free_port()
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / f"registry_load.{target}.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(pinned(cpu, server_argv(target, port, registry_cmd)),
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(proc, port, log_path)
        yield proc.pid, port
    finally:
        stop(proc)


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server not healthy after {timeout_s} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def replica_count(port: int) -> int | None:
    """How many replicas the registry's directory holds (checks the ids really were distinct)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/v1/replicas", timeout=30) as r:
            return len(json.load(r)["replicas"])
    except (OSError, ValueError, KeyError):
        return None


# -- load --------------------------------------------------------------------------------------------

def probe(port: int, body: bytes, gap_s: float, n: int = 20) -> dict:
    """Sequential PUTs on one keep-alive connection, ``gap_s`` apart, with no other load.
    Back to back (gap 0) shows per-response stalls that spaced requests do not, e.g. Nagle
    holding a response's last segment for the client's delayed ACK (about 40 ms)."""
    request = (f"PUT /v1/replicas/n0000-s0 HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    times = []
    with socket.create_connection((HOST, port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(request)
            read_response(s)
            times.append(time.perf_counter() - t)
            time.sleep(gap_s)
    times = sorted(times[1:])  # the first answer on a fresh connection is never delayed-ACKed
    return {"gap_ms": 1e3 * gap_s, "requests": n, "p50_ms": round(1e3 * times[len(times) // 2], 3),
            "max_ms": round(1e3 * times[-1], 3)}


def read_response(s: socket.socket) -> None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536) or _closed()
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
    while len(rest) < length:
        rest += s.recv(65536) or _closed()


def _closed() -> bytes:
    raise ConnectionError("server closed the connection")


def open_loop(port: int, args: argparse.Namespace, body_file: Path, rate: float,
              duration_s: float, warmup_s: float) -> dict:
    argv = [sys.executable, str(BENCH / "openloop.py"), "--host", HOST, "--port", str(port),
            "--rate", str(rate), "--duration-s", str(duration_s), "--warmup-s", str(warmup_s),
            "--replicas", str(args.replicas), "--connections", str(args.connections),
            "--body-file", str(body_file)]
    out = subprocess.run(pinned(args.load_cpu, argv), capture_output=True, text=True, check=True,
                         timeout=warmup_s + duration_s + 60)
    result = json.loads(out.stdout)
    result["loop"] = "open"
    return result


def closed_loop(port: int, args: argparse.Namespace, body_file: Path, duration_s: float) -> dict:
    argv = [find_tool("wrk"), "-t1", f"-c{args.connections}", f"-d{duration_s:g}s", "--timeout", "10s",
            "--latency", "-s", str(BENCH / "heartbeat.lua"), f"http://{HOST}:{port}",
            "--", str(args.replicas), str(body_file)]
    t0 = os.times()
    out = subprocess.run(pinned(args.load_cpu, argv), capture_output=True, text=True, check=True,
                         timeout=duration_s + 60)
    t1 = os.times()
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no results:\n{out.stdout}\n{out.stderr}")
    w = json.loads(line.split(" ", 1)[1])
    seconds = w["duration_us"] / 1e6
    socket_errors = w["connect_errors"] + w["read_errors"] + w["write_errors"] + w["timeouts"]
    return {
        "loop": "closed", "connections": args.connections, "requests": w["requests"],
        "achieved_rps": round(w["requests"] / seconds, 1),
        "errors": w["non_2xx"] + socket_errors, "non_2xx": w["non_2xx"], "socket_errors": socket_errors,
        "latency": {"p50_ms": w["p50_us"] / 1e3, "p90_ms": w["p90_us"] / 1e3, "p99_ms": w["p99_us"] / 1e3,
                    "p99.9_ms": w["p99.9_us"] / 1e3, "mean_ms": round(w["mean_us"] / 1e3, 3),
                    "max_ms": w["max_us"] / 1e3},
        "generator_cpu_share": round((t1.children_user + t1.children_system
                                      - t0.children_user - t0.children_system) / seconds, 3),
    }


def metered(pid: int, cpu: int | None, phase, *phase_args, **phase_kwargs) -> dict:
    """Run one load phase and add the server's CPU use during it."""
    meter = CpuMeter(pid, cpu)
    result = phase(*phase_args, **phase_kwargs)
    result.update(meter.read(result.get("answered_total", result["requests"])))
    return result


def sweep(pid: int, port: int, args: argparse.Namespace, body_file: Path, ceiling: float) -> list[dict]:
    steps = []
    for fraction in SWEEP_FRACTIONS:
        rate = max(100.0, round(fraction * ceiling, -2))
        step = metered(pid, args.server_cpu, open_loop, port, args, body_file, rate,
                       args.sweep_step_s, warmup_s=1.0)
        step["fraction_of_ceiling"] = fraction
        steps.append(step)
        print(f"  sweep {rate:>8.0f}/s: achieved {step['achieved_rps']:>8.0f}/s, "
              f"p99 {fmt_ms(step['latency']['p99_ms'])} ms, errors {step['errors']}", flush=True)
    return steps


def meets_slo(run: dict, slo_ms: float) -> bool:
    p99 = run["latency"]["p99_ms"]
    return (run["errors"] == 0 and p99 is not None and p99 <= slo_ms
            and run["achieved_rps"] >= 0.98 * run["offered_rps"])


# -- profile ------------------------------------------------------------------------------------------

PROFILE_HZ = 200
# Where a sampled stack's time is booked. Each sample goes to the innermost frame that has a
# category, so a C function (native frames are sampled too) counts for the Python code that
# called it, and stdlib helpers (typing, enum, re...) count for their caller. Keys are a
# frame's top-level package, or its C source/library name without extension.
PACKAGE_CATEGORY = {
    "prometheus_client": "prometheus metrics",
    "pydantic": "pydantic parse/validate", "pydantic_core": "pydantic parse/validate",
    "logging": "logging",
    "json": "JSON encode (responses)", "_json": "JSON encode (responses)",
    "rolloutd": "registry code (guard, route)",
    "fastapi": "FastAPI (routing, params, middleware)",
    "starlette": "Starlette (routing, Request, responses)",
    "uvicorn": "uvicorn + httptools (HTTP/1.1)", "httptools": "uvicorn + httptools (HTTP/1.1)",
    "parser": "uvicorn + httptools (HTTP/1.1)",  # httptools' C parser
    "asyncio": "event loop", "selectors": "event loop", "socket": "event loop",
    "uvloop": "event loop", "loop": "event loop", "_asynciomodule": "event loop",
    "gcmodule": "garbage collector",
}
STORE_FILE = "rolloutd/registry/store.py"
SYSCALLS = {"read", "write", "writev", "send", "sendto", "sendmsg", "recv", "recvfrom", "recvmsg",
            "epoll_wait", "epoll_pwait", "epoll_ctl", "accept4", "close", "getpid"}
FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


@contextlib.contextmanager
def py_spy(pid: int, cpu: int | None, duration_s: float, threads: bool = False) -> Iterator[Callable[[float], str]]:
    """Record ``pid`` with py-spy (native frames, raw format) on ``cpu`` for ``duration_s``;
    yields ``collect(timeout_s) -> raw text``, which raises RuntimeError if py-spy failed.
    py-spy is always stopped and its output file removed."""
    raw = Path(tempfile.mkstemp(prefix="py_spy.", suffix=".txt")[1])
    argv = [find_tool("py-spy"), "record", "--pid", str(pid), "--duration", f"{duration_s:g}",
            "--rate", str(PROFILE_HZ), "--native", *(["--threads"] if threads else []),
            "--format", "raw", "--output", str(raw)]
    spy = subprocess.Popen(pinned(cpu, argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def collect(timeout_s: float) -> str:
        _, err = spy.communicate(timeout=timeout_s)
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed ({spy.returncode}): {err.strip()[-500:]}")
        return raw.read_text()
    try:
        yield collect
    finally:
        if spy.poll() is None:
            spy.kill()
            spy.wait()
        raw.unlink(missing_ok=True)


def profile(pid: int, port: int, args: argparse.Namespace, body_file: Path) -> dict:
    """Sample the registry (Python and native frames) while the open loop runs at ``--rate``."""
    try:
        with py_spy(pid, args.load_cpu, args.profile_s) as collect:
            meter = CpuMeter(pid, args.server_cpu)
            load = open_loop(port, args, body_file, args.rate, args.profile_s + 1.0, warmup_s=0.5)
            cpu = meter.read(load["answered_total"])
            summary = summarize_profile(collect(timeout_s=60))
    except RuntimeError as e:
        return {"error": str(e)}
    summary.update(server_cpu_share=cpu["server_cpu_share"], achieved_rps=load["achieved_rps"],
                   sampled_busy_share=round(summary["samples"] / (PROFILE_HZ * args.profile_s), 3))
    return summary


def parse_frame(frame: str) -> tuple[str, str]:
    m = FRAME_RE.match(frame)
    return (m["func"], m["file"]) if m else (frame, "")


def package_of(file: str) -> str:
    return file.split("/", 1)[0].split(".", 1)[0]


def categorize(frames: list[str]) -> str:
    func, file = parse_frame(frames[-1])
    if func in SYSCALLS and file.startswith("libc"):
        return "system calls (socket I/O, epoll)"
    for frame in reversed(frames):
        func, file = parse_frame(frame)
        if file == STORE_FILE:
            return "registry store"
        if func.startswith("gc_collect"):
            return "garbage collector"
        if category := PACKAGE_CATEGORY.get(package_of(file)):
            return category
    return "other"


def python_frame(frames: list[str]) -> str:
    """The innermost Python function of a stack: what the time is spent in, C callees included."""
    for frame in reversed(frames):
        func, file = parse_frame(frame)
        if file.endswith(".py"):
            return f"{func} ({file})"
    return "(no Python frame)"


def summarize_profile(raw: str, top: int = 15) -> dict:
    """Shares of the sampled (busy) time per category, and the Python functions with most."""
    categories, functions, total = Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        categories[categorize(frames)] += n
        functions[python_frame(frames)] += n
    scale = 1 / total if total else 0.0
    return {
        "samples": total,
        "categories": {c: round(n * scale, 3) for c, n in categories.most_common()},
        "top_python_functions": [{"function": f, "share": round(n * scale, 3)}
                                 for f, n in functions.most_common(top)],
    }


# -- one target -----------------------------------------------------------------------------------------

def bench_target(target: str, args: argparse.Namespace, body_file: Path) -> dict:
    body = body_file.read_bytes()
    with running_server(target, args.server_cpu, args.registry_cmd) as (pid, port):
        print(f"{target}: pid {pid}, port {port}", flush=True)
        result = {"probe": [probe(port, body, gap_s) for gap_s in PROBE_GAPS_S]}
        warmup_s = min(5.0, args.replicas / args.rate)  # one interval: every replica registers once
        result["open"] = metered(pid, args.server_cpu, open_loop, port, args, body_file, args.rate,
                                 args.duration_s, warmup_s)
        if target == "registry":
            result["open"]["replicas_in_directory"] = replica_count(port)
        print(f"  open loop  {row_text(result['open'])}", flush=True)
        result["closed"] = metered(pid, args.server_cpu, closed_loop, port, args, body_file,
                                   args.closed_duration_s)
        print(f"  closed loop {row_text(result['closed'])}", flush=True)
        if target == "registry" and args.sweep:
            result["sweep"] = sweep(pid, port, args, body_file, result["closed"]["achieved_rps"])
        if target == "registry" and args.profile:
            result["profile"] = profile(pid, port, args, body_file)
    return result


def row_text(run: dict) -> str:
    lat = run["latency"]
    return (f"achieved {run['achieved_rps']:.0f}/s, p50 {fmt_ms(lat['p50_ms'])} ms, "
            f"p99 {fmt_ms(lat['p99_ms'])} ms, errors {run['errors']}, "
            f"server CPU {100 * run['server_cpu_share']:.0f}%")


# -- report --------------------------------------------------------------------------------------------

def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def verdict(results: dict, args: argparse.Namespace) -> dict:
    out: dict = {"goal_rps": args.rate, "slo_p99_ms": args.slo_p99_ms}
    reg = results.get("registry")
    if reg:
        o = reg["open"]
        out["achieved_over_goal"] = round(o["achieved_rps"] / args.rate, 3)
        out["p99_over_slo"] = round(o["latency"]["p99_ms"] / args.slo_p99_ms, 3) if o["latency"]["p99_ms"] else None
        out["meets_goal"] = meets_slo(o, args.slo_p99_ms)
        for base in ("asgi", "fastapi"):
            if base in results:
                out[f"ceiling_over_{base}"] = round(
                    reg["closed"]["achieved_rps"] / results[base]["closed"]["achieved_rps"], 3)
        runs = [o] + reg.get("sweep", [])
        good = [r["offered_rps"] for r in runs if meets_slo(r, args.slo_p99_ms)]
        out["highest_rate_meeting_slo"] = max(good, default=None)
    return out


def print_report(report: dict) -> None:
    args = report["config"]
    print(f"\nHeartbeat load: PUT /v1/replicas/{{id}}, {args['replicas']} replica ids, "
          f"{args['connections']} keep-alive connections")
    print(f"Pinning: {report['environment']['pinning']}")
    header = (f"{'target':<9} {'run':<14} {'offered/s':>9} {'achieved/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'p99.9':>7} {'max ms':>7} {'errors':>6} {'srv CPU':>7} {'us/req':>6} {'gen CPU':>7} {'noise':>5}")
    print(header)
    print("-" * len(header))
    for target, res in report["targets"].items():
        for pr in res["probe"]:
            label = f"probe gap {pr['gap_ms']:g}ms"
            print(f"{target:<9} {label:<14} {'':>9} {'':>10} {fmt_ms(pr['p50_ms']):>7} "
                  f"{'':>7} {'':>7} {fmt_ms(pr['max_ms']):>7}")
        for label, run in [("open loop", res["open"]), ("closed (wrk)", res["closed"])] + [
                (f"sweep {s['fraction_of_ceiling']:.0%}", s) for s in res.get("sweep", [])]:
            print_row(target, label, run)
    print_verdict(report["verdict"], report["targets"])
    if prof := report["targets"].get("registry", {}).get("profile"):
        print_profile(prof)


def print_row(target: str, label: str, run: dict) -> None:
    lat = run["latency"]
    offered = f"{run['offered_rps']:.0f}" if "offered_rps" in run else "max"
    noise = run.get("other_load_on_server_cpu", 0.0) + run.get("steal_on_server_cpu", 0.0)
    us = run.get("server_cpu_us_per_request")
    print(f"{target:<9} {label:<14} {offered:>9} {run['achieved_rps']:>10.0f} {fmt_ms(lat['p50_ms']):>7} "
          f"{fmt_ms(lat['p99_ms']):>7} {fmt_ms(lat['p99.9_ms']):>7} {fmt_ms(lat['max_ms']):>7} "
          f"{run['errors']:>6} {100 * run['server_cpu_share']:>6.0f}% {us if us is not None else '-':>6} "
          f"{100 * run['generator_cpu_share']:>6.0f}% {100 * noise:>4.0f}%")


def print_verdict(v: dict, targets: dict) -> None:
    if "achieved_over_goal" not in v:
        return
    print(f"\nGoal {v['goal_rps']:.0f}/s with p99 <= {v['slo_p99_ms']:g} ms (registry, open loop): "
          f"achieved/goal = {v['achieved_over_goal']:.2f}, p99/SLO = {v['p99_over_slo']}, "
          f"{'MET' if v['meets_goal'] else 'NOT MET'}")
    reg = targets["registry"]["closed"]["achieved_rps"]
    for base in ("asgi", "fastapi"):
        if f"ceiling_over_{base}" in v:
            print(f"Registry ceiling {reg:.0f}/s = {100 * v[f'ceiling_over_{base}']:.1f}% of the {base} "
                  f"baseline ({targets[base]['closed']['achieved_rps']:.0f}/s)")
    best = v["highest_rate_meeting_slo"]
    print(f"Highest tested rate meeting the SLO: {f'{best:.0f}/s' if best else 'none'}")
    if (n := targets["registry"]["open"].get("replicas_in_directory")) is not None:
        print(f"Replicas in the registry's directory after the open loop: {n}")


def print_profile(prof: dict) -> None:
    if "error" in prof:
        print(f"\nProfile: {prof['error']}")
        return
    print(f"\nRegistry profile under the open loop: {prof['achieved_rps']:.0f}/s, server CPU "
          f"{100 * prof['server_cpu_share']:.0f}%, {prof['samples']} busy samples "
          f"({100 * prof['sampled_busy_share']:.0f}% of the samples a busy process would give).")
    print("Shares of busy time:")
    for category, share in prof["categories"].items():
        print(f"  {100 * share:5.1f}%  {category}")
    print("Innermost Python function (self time, C callees included):")
    for entry in prof["top_python_functions"]:
        print(f"  {100 * entry['share']:5.1f}%  {entry['function']}")


# -- environment and main ------------------------------------------------------------------------------

def environment(args: argparse.Namespace) -> dict:
    versions = {}
    for pkg in ("uvicorn", "uvloop", "httptools", "fastapi", "starlette", "pydantic", "prometheus_client"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), platform.processor())
    pin = (f"servers on CPU {args.server_cpu}, load generators on CPU {args.load_cpu} (taskset)"
           if args.server_cpu is not None else "none (fewer than 2 CPUs)")
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model, "kernel": platform.release(),
            "python": platform.python_version(), "packages": versions, "pinning": pin,
            "loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}


def display_path(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def setup_pinning(args: argparse.Namespace) -> None:
    """Keep this process off the server's CPU; without two CPUs, run unpinned."""
    cpus = os.sched_getaffinity(0)
    if {args.server_cpu, args.load_cpu} <= cpus and args.server_cpu != args.load_cpu:
        os.sched_setaffinity(0, {args.load_cpu})
    else:
        print(f"warning: CPUs {args.server_cpu} and {args.load_cpu} not both available; not pinning",
              file=sys.stderr)
        args.server_cpu = args.load_cpu = None


def missing_tools_message(name: str, missing: list[str], hints: dict[str, str]) -> str:
    return f"{name}: missing tools:\n" + "\n".join(f"  {t}: {hints[t]}" for t in missing)



def run_in_scratch(name: str, args: argparse.Namespace, missing: list[str], hints: dict[str, str],
                   room_problem: str | None, run_all) -> tuple[dict, dict] | None:
    """What every egress benchmark does around its runs: refuse early (missing tools, no room),
    pin, note the environment, then ``run_all(scratch_dir, args)`` in a fresh directory under
    ``args.tmp_dir`` that is removed whatever happens. (environment, report), or None if refused."""
    if missing:
        print(missing_tools_message(name, missing, hints), file=sys.stderr)
        return None
    if room_problem:
        print(f"{name}: {room_problem}; try a smaller --size-mib", file=sys.stderr)
        return None
    setup_pinning(args)
    env = environment(args)
    print(f"Pinning: {env['pinning']}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=args.tmp_dir))
    try:
        return env, run_all(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)

def write_report(args: argparse.Namespace, env: dict, body: dict, print_report: Callable[[dict], None]) -> None:
    """Add the config and the environment, write ``--out`` as JSON, print the table."""
    env["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    config = {k: (display_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"config": config, "environment": env, **body}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"\nWrote {display_path(args.out)}")


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; Ctrl-C and SIGTERM unwind (so servers are stopped) to 130/143."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if missing := missing_tools(args.profile):
        print(missing_tools_message("registry_load", missing, INSTALL_HINTS), file=sys.stderr)
        return 2
    setup_pinning(args)
    env = environment(args)
    print(f"Pinning: {env['pinning']}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    body_file = RESULTS / "heartbeat_body.json"
    body_file.write_text(json.dumps(HEARTBEAT, separators=(",", ":")))
    targets = {}
    for target in args.targets:
        targets[target] = bench_target(target, args, body_file)
    write_report(args, env, {"targets": targets, "verdict": verdict(targets, args)}, print_report)
    return 0


if __name__ == "__main__":
    run_main(main)
