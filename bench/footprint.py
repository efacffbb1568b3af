"""The daemon's own footprint: memory and CPU of ``rolloutd run`` while its servers idle, and
during a stream of updates, next to the limits it is held to.

A real registry (embedded here) and ``rolloutd run`` with ``--servers`` real ``vllm serve``
children (CPU build, small model) on their default intervals (heartbeat 5 s, health probe
5 s). Once every server is SERVING, the daemon's CPU time (utime + stime from /proc) and RSS
are read over ``--idle-s`` seconds of idling, then over ``--updates`` versions published one
after another. The vLLM processes are not counted: only the daemon's own process.

    .venv/bin/python bench/footprint.py                 # 1 server, 60 s idle, 10 updates
    .venv/bin/python bench/footprint.py --servers 2

Limits (ratios printed against them): RSS <= 150 MiB; idle CPU <= 0.5 % of one core.
"""

from __future__ import annotations

import argparse
import json
import os
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
from rolloutd.registry import EmbeddedRegistry  # noqa: E402

RSS_LIMIT_MIB = 150.0
IDLE_CPU_LIMIT = 0.005  # of one core
TICKS = os.sysconf("SC_CLK_TCK")
FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager",
         "--kv-cache-memory-bytes", str(64 << 20)]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--idle-s", type=float, default=60)
    ap.add_argument("--updates", type=int, default=10)
    args = ap.parse_args()
    vllm = ROOT / ".venv-vllm" / "bin" / "vllm"
    work = Path(tempfile.mkdtemp(prefix="rolloutd-footprint-"))
    model = tinymodel.build(work / "model", seed=0)
    admin_port = free_port()
    cfg = {"registry": {"url": ""}, "admin": {"port": admin_port}, "gateway": {"host": "127.0.0.1"},
           "state_dir": str(work / "state"),
           "mirror": {"dir": str(work / "mirror"), "max_bytes": "1GiB"},
           "vllm": {"command": [str(vllm), "serve"], "args": FLAGS,
                    "env": {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}},
           "servers": [{"name": f"s{i}", "model": str(model), "public_port": free_port(),
                        "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())}}
                       for i in range(args.servers)]}
    with EmbeddedRegistry(port=0) as reg:
        cfg["registry"]["url"] = reg.url
        (work / "rolloutd.yaml").write_text(yaml.safe_dump(cfg))
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
        log = open(work / "rolloutd.log", "wb")
        daemon = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "run", "-c", str(work / "rolloutd.yaml")],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        admin = f"http://127.0.0.1:{admin_port}"
        try:
            wait_serving(admin, 1, args.servers, 300)
            time.sleep(5)  # let start-up work settle
            c0, t0 = cpu_s(daemon.pid), time.monotonic()
            time.sleep(args.idle_s)
            idle = (cpu_s(daemon.pid) - c0) / (time.monotonic() - t0)
            rss_idle, _ = rss_mib(daemon.pid)
            c0, t0 = cpu_s(daemon.pid), time.monotonic()
            for v in range(2, 2 + args.updates):
                reg.publish(v, tinymodel.state_dict(tinymodel.TINY, v), shard_bytes=600_000, chunk_bytes=1 << 16)
                wait_serving(admin, v, args.servers, 60)
            per_update = (cpu_s(daemon.pid) - c0) / max(args.updates, 1)
            rss_now, rss_peak = rss_mib(daemon.pid)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            log.close()
    result = {"servers": args.servers, "idle_s": args.idle_s, "idle_cpu_fraction": round(idle, 5),
              "idle_cpu_vs_limit": round(idle / IDLE_CPU_LIMIT, 3), "rss_idle_mib": round(rss_idle, 1),
              "rss_after_updates_mib": round(rss_now, 1), "rss_peak_mib": round(rss_peak, 1),
              "rss_peak_vs_limit": round(rss_peak / RSS_LIMIT_MIB, 3), "updates": args.updates,
              "daemon_cpu_s_per_update": round(per_update, 4)}
    print(f"daemon idle CPU {idle * 100:.3f} % of a core (limit {IDLE_CPU_LIMIT * 100:.1f} %: ratio "
          f"{result['idle_cpu_vs_limit']}); RSS {rss_idle:.1f} MiB idle, {rss_now:.1f} MiB after {args.updates} "
          f"updates, peak {rss_peak:.1f} MiB (limit {RSS_LIMIT_MIB:.0f} MiB: ratio {result['rss_peak_vs_limit']}); "
          f"{per_update * 1000:.1f} ms of daemon CPU per update of {args.servers} server(s)")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"footprint-{args.servers}.json").write_text(json.dumps(result, indent=2))
    return 0 if result["idle_cpu_vs_limit"] <= 1 and result["rss_peak_vs_limit"] <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
