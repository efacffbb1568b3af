"""The daemon's own footprint: memory and CPU of ``rolloutd run`` while its servers idle, and
during a stream of updates, next to the limits it is held to.

A real registry (embedded here) and ``rolloutd run`` with ``--servers`` real ``vllm serve``
children (CPU build, small model) on their default intervals (heartbeat 5 s, health probe
5 s). Once every server is SERVING, the daemon's CPU time (utime + stime from /proc) and RSS
are read over ``--idle-s`` seconds of idling, then over ``--updates`` versions published one
after another. The vLLM processes are not counted: only the daemon's own process.

    .venv/bin/python bench/footprint.py                 # 1 server, 60 s idle, 10 updates
    .venv/bin/python bench/footprint.py --servers 2
    .venv/bin/python bench/footprint.py --ref-repo DIR   # the same for another build's daemon, after

``--ref-repo`` runs the daemon of another build (a directory holding its ``rolloutd/``
package, e.g. ``git archive <commit> rolloutd | tar -x -C DIR``) right after this build's, with
the same servers, plugin and registry: the two lines side by side. Besides CPU and RSS, the
daemon's wake-ups per second while idle (times any of its threads was put on a CPU, from
``/proc/<pid>/task/*/schedstat``) say how often it stirs, which costs more than its CPU time
shows on a machine where each wake-up is expensive. Then ``--requests`` one-token completions,
one after another, through the first server's gateway: the daemon's CPU per request relayed,
and the lines its log gained per request (vLLM's access log reaches the journal through it).
The pull workers the daemon keeps for its next pull (``pull.keep_workers_s``) are its children,
not counted in its RSS: their RSS and idle CPU are printed beside.

Limits (ratios printed against them): RSS <= 150 MiB; idle CPU <= 0.5 % of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rolloutd.demo import tinymodel  # noqa: E402
from rolloutd.demo.cpu_vllm import CPU_ENV, cpu_args  # noqa: E402
from rolloutd.trainer import EmbeddedRegistry  # noqa: E402

RSS_LIMIT_MIB = 150.0
IDLE_CPU_LIMIT = 0.005  # of one core
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident now, and the peak (VmHWM)."""
    values = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(values["VmRSS"].split()[0]) / 1024, int(values["VmHWM"].split()[0]) / 1024


def wakeups(pid: int) -> int:
    """Times any thread of ``pid`` was put on a CPU (schedstat's third field, summed)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[2])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total


def wait_serving(admin: str, version: int, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            st = httpx.get(admin + "/status", timeout=5).json()
            if sum(s["state"] == "SERVING" and s["version"] == version for s in st["servers"]) == n:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"servers not serving version {version} after {timeout_s} s")


def relay(cfg: dict, model: Path, pid: int, log: Path, n: int) -> tuple[float, float]:
    """``n`` one-token completions through the first server's gateway, one after another: the
    daemon's CPU seconds and its new log lines, per request."""
    url = f"http://127.0.0.1:{cfg['servers'][0]['public_port']}/v1/completions"
    body = {"model": str(model), "prompt": "hello", "max_tokens": 1}
    with httpx.Client(timeout=30) as client:
        client.post(url, json=body).raise_for_status()  # the first one warms vLLM up
        time.sleep(0.5)
        lines0, c0 = log.read_bytes().count(b"\n"), cpu_s(pid)
        for _ in range(n):
            client.post(url, json=body).raise_for_status()
        time.sleep(0.5)  # the last lines forwarded
        return (cpu_s(pid) - c0) / max(n, 1), (log.read_bytes().count(b"\n") - lines0) / max(n, 1)


def measure(args: argparse.Namespace, work: Path, daemon_root: Path, label: str) -> dict:
    """One daemon (its package imported from ``daemon_root``) with its servers: idle, then updates."""
    vllm = ROOT / ".venv-vllm" / "bin" / "vllm"
    model = work / "model"
    admin_port = free_port()
    run_dir = work / label
    cfg = {"registry": {"url": ""}, "admin": {"port": admin_port}, "gateway": {"host": "127.0.0.1"},
           "state_dir": str(run_dir / "state"),
           "mirror": {"dir": str(run_dir / "mirror"), "max_bytes": "1GiB"},
           "vllm": {"command": [str(vllm), "serve"], "args": cpu_args(), "env": dict(CPU_ENV)},
           "servers": [{"name": f"s{i}", "model": str(model), "public_port": free_port(),
                        "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())}}
                       for i in range(args.servers)]}
    run_dir.mkdir()
    with EmbeddedRegistry(port=0) as reg:
        cfg["registry"]["url"] = reg.url
        (run_dir / "rolloutd.yaml").write_text(yaml.safe_dump(cfg))
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
        log = open(run_dir / "rolloutd.log", "wb")
        # cwd first on sys.path (-m): the package of daemon_root is the one imported
        daemon = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "run", "-c", str(run_dir / "rolloutd.yaml")],
                                  cwd=daemon_root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        admin = f"http://127.0.0.1:{admin_port}"
        try:
            wait_serving(admin, 1, args.servers, 300)
            time.sleep(5)  # let start-up work settle
            kept = kept_workers(admin)  # the first pull's workers, kept for the next (a build that keeps them)
            c0, w0, t0 = cpu_s(daemon.pid), wakeups(daemon.pid), time.monotonic()
            kc0 = sum(cpu_s(p) for p in kept)
            time.sleep(args.idle_s)
            elapsed = time.monotonic() - t0
            idle = (cpu_s(daemon.pid) - c0) / elapsed
            idle_wakeups = (wakeups(daemon.pid) - w0) / elapsed
            kept_idle = (sum(cpu_s(p) for p in kept) - kc0) / elapsed
            rss_idle, _ = rss_mib(daemon.pid)
            per_request, lines_per_request = relay(cfg, model, daemon.pid, run_dir / "rolloutd.log", args.requests)
            c0 = cpu_s(daemon.pid)
            for v in range(2, 2 + args.updates):
                reg.publish(v, tinymodel.state_dict(tinymodel.TINY, v), shard_bytes=600_000, chunk_bytes=1 << 16)
                wait_serving(admin, v, args.servers, 60)
            per_update = (cpu_s(daemon.pid) - c0) / max(args.updates, 1)
            rss_now, rss_peak = rss_mib(daemon.pid)
            kept = kept_workers(admin)
            kept_rss = [rss_mib(p)[0] for p in kept]
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            log.close()
    result = {"build": label, "servers": args.servers, "idle_s": args.idle_s, "idle_cpu_fraction": round(idle, 5),
              "idle_cpu_vs_limit": round(idle / IDLE_CPU_LIMIT, 3), "idle_wakeups_per_s": round(idle_wakeups, 1),
              "rss_idle_mib": round(rss_idle, 1),
              "rss_after_updates_mib": round(rss_now, 1), "rss_peak_mib": round(rss_peak, 1),
              "rss_peak_vs_limit": round(rss_peak / RSS_LIMIT_MIB, 3), "updates": args.updates,
              "requests": args.requests, "daemon_cpu_ms_per_request": round(per_request * 1000, 3),
              "log_lines_per_request": round(lines_per_request, 2),
              "daemon_cpu_s_per_update": round(per_update, 4),
              "kept_pull_workers": len(kept), "kept_pull_workers_idle_cpu_fraction": round(kept_idle, 5),
              "kept_pull_workers_rss_mib": [round(r, 1) for r in kept_rss]}
    print(f"{label}: daemon idle CPU {idle * 100:.3f} % of a core (limit {IDLE_CPU_LIMIT * 100:.1f} %: ratio "
          f"{result['idle_cpu_vs_limit']}), {idle_wakeups:.1f} wake-ups/s; RSS {rss_idle:.1f} MiB idle, "
          f"{rss_now:.1f} MiB after {args.updates} updates, peak {rss_peak:.1f} MiB (limit {RSS_LIMIT_MIB:.0f} MiB: "
          f"ratio {result['rss_peak_vs_limit']}); {per_update * 1000:.1f} ms of daemon CPU per update of "
          f"{args.servers} server(s); {per_request * 1000:.2f} ms of daemon CPU and {lines_per_request:.2f} log "
          f"lines per relayed request; {len(kept)} pull worker(s) kept for the next pull: RSS "
          f"{', '.join(f'{r:.1f}' for r in kept_rss) or '-'} MiB, idle CPU {kept_idle * 100:.3f} % of a core",
          flush=True)
    return result


def kept_workers(admin: str) -> list[int]:
    """The pull workers the daemon keeps idle for its next pull (none in a build without them)."""
    return httpx.get(admin + "/status", timeout=5).json().get("pull_workers_kept", [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--idle-s", type=float, default=60)
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--requests", type=int, default=300, help="one-token completions relayed after the idle time")
    ap.add_argument("--ref-repo", type=Path, default=None,
                    help="a directory holding another build's rolloutd/ package: its daemon measured after this one")
    args = ap.parse_args()
    if args.ref_repo and not (args.ref_repo / "rolloutd" / "cli.py").is_file():
        ap.error(f"--ref-repo {args.ref_repo}: no rolloutd/cli.py there")
    work = Path(tempfile.mkdtemp(prefix="rolloutd-footprint-"))
    try:
        tinymodel.build(work / "model", seed=0)
        results = [measure(args, work, ROOT, "this")]
        if args.ref_repo:
            results.append(measure(args, work, args.ref_repo.resolve(), "ref"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"footprint-{args.servers}.json").write_text(json.dumps(results, indent=2))
    mine = results[0]
    return 0 if mine["idle_cpu_vs_limit"] <= 1 and mine["rss_peak_vs_limit"] <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
