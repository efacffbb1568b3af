"""Publishing a state dict: its time against one memory copy of the same bytes, and what the
registry's heartbeats see meanwhile.

Each measurement runs in a fresh process (the trainer) that builds a ``--gib`` state dict of
torch tensors (a Llama-like mix: fp32 embedding, bf16 layer weights, fp32 norms), starts an
``EmbeddedRegistry`` and waits; this script then sends heartbeats to that registry from its
own process (``PUT /v1/replicas/{id}`` every ``--beat-ms``, each timed) while the trainer:

- ``memcpy``: copies every tensor once into fresh memory (``torch.empty`` + ``copy_``): the
  memory-copy time the goal is stated against;
- ``publish``: ``reg.publish(version, state_dict)``, bytes in memory;
- ``publish-disk``: the same with ``data_dir`` on tmpfs (``--tmp-dir``);
- ``async``: ``reg.publish_async(version, state_dict)``: the time until it returns (what the
  training step waits: the snapshot copy) and until the handle is done;
- ``http``: ``RegistryHTTP(url).publish(version, state_dict)`` to a standalone ``rolloutd
  registry`` (bytes in memory) in a process of its own, which the heartbeats go to; the
  registry's own CPU time per version is reported beside it;
- ``publish-ref``, ``http-ref``: ``publish`` and ``http`` with rolloutd from ``--ref-repo``
  (another build, e.g. before a change: ``git archive <commit> rolloutd vllm_plugin | tar -x -C
  DIR``), trainer and registry alike.

``--steps N``: each trainer process does it N times in a row, as a trainer publishes once per
training step into a registry that keeps running (versions 1..N; the registry keeps its newest
three, so from the fourth on it frees one version for each it receives); the time reported is
the last step's. The first step is the first use of a fresh process's memory, which on a
virtual machine that hands freed memory back to its host costs more than the copy itself.

Modes run ``--repeats`` times, interleaved. Reported per mode: median seconds, seconds / memcpy
seconds (goal: publish <= 2x), and heartbeat latency p50 / p99 / max while the trainer worked
(goal: every heartbeat answered within its 2 s timeout). The last stdout line is one JSON
object: ``<mode>_to_memcpy`` for each mode (``http_to_memcpy``: ``RegistryHTTP.publish``, goal
<= 3x; median seconds over median memcpy seconds) and ``<mode>_to_memcpy_paired`` (the median of
each run over the memcpy of its own round), then the whole summary with each mode's CPU time
(``trainer_cpu_s``, every thread of the trainer's process; ``registry_cpu_s``);
``bench/results/publish.json`` holds every run. From the repo root::

    .venv/bin/python bench/publish.py                 # 2 GiB, 3 repeats, a few minutes
    .venv/bin/python bench/publish.py --gib 0.25 --repeats 1 --modes memcpy,publish,async
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
MODES = ("memcpy", "publish", "publish-disk", "async", "http", "publish-ref", "http-ref")
BEAT = json.dumps({"node": "bench", "server": "s0", "state": "SERVING", "version": 1, "incarnation": 1}).encode()
TIMEOUT_S = 2.0  # the daemon's default heartbeat timeout


# -- the trainer (a child process) ------------------------------------------------------------------

def state_dict(gib: float) -> dict:
    """About ``gib`` GiB: a fp32 embedding (1/8 of it), bf16 layer weights, fp32 norms."""
    import torch
    total = int(gib * (1 << 30))
    hidden = 4096
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.empty(total // 8 // (4 * hidden), hidden).uniform_(generator=g)}
    per_layer = 4 * hidden * hidden * 2  # q, k, v, o in bf16
    for i in range(max(1, (total - total // 8) // per_layer)):
        for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"model.layers.{i}.self_attn.{w}.weight"] = torch.empty(hidden, hidden, dtype=torch.bfloat16).uniform_(
                generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden)
    return sd


def child(mode: str, gib: float, tmp_dir: Path, registry_url: str | None, steps: int = 1) -> None:
    import tempfile

    import torch

    from rolloutd.trainer import EmbeddedRegistry, RegistryHTTP
    sd = state_dict(gib)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="rolloutd-bench-publish.") as tmp:
        data_dir = Path(tmp) / "data" if mode == "publish-disk" else None
        if mode == "http":
            reg, port = RegistryHTTP(registry_url), int(registry_url.rsplit(":", 1)[1])
        else:
            reg = EmbeddedRegistry(port=0, data_dir=data_dir).start()
            port = reg.port
        try:
            print(json.dumps({"port": port, "bytes": nbytes}), flush=True)
            sys.stdin.readline()  # the heartbeats are going
            out: dict = {"seconds_each": []}
            for version in range(1, steps + 1):
                t0, cpu0 = time.perf_counter(), time.process_time()
                if mode == "memcpy":
                    copies = [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in sd.values()]
                    del copies
                elif mode == "async":
                    handle = reg.publish_async(version, sd)
                    out["returned_s"] = round(time.perf_counter() - t0, 4)
                    handle.wait()
                else:
                    reg.publish(version, sd)
                out["seconds_each"].append(round(time.perf_counter() - t0, 4))
                out["trainer_cpu_s"] = round(time.process_time() - cpu0, 3)  # every thread's, the last step's
            out["seconds"] = out["seconds_each"][-1]
            print(json.dumps(out), flush=True)
        finally:
            (reg.close if mode == "http" else reg.stop)()


# -- heartbeats ---------------------------------------------------------------------------------------

class Beats(threading.Thread):
    """PUT a heartbeat every ``every_s``; record (sent at, latency) of each."""

    def __init__(self, port: int, every_s: float):
        super().__init__(daemon=True)
        self.port, self.every_s = port, every_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        i = 0
        while not self.stop.is_set():
            t0 = time.perf_counter()
            conn.request("PUT", f"/v1/replicas/bench.s{i % 8}", body=BEAT,
                         headers={"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"heartbeat: HTTP {r.status}")
            t1 = time.perf_counter()
            self.samples.append((t0, t1 - t0))
            i += 1
            self.stop.wait(max(0.0, self.every_s - (t1 - t0)))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_registry(env: dict) -> tuple[subprocess.Popen, str]:
    """A standalone ``rolloutd registry`` (bytes in memory) with the given build; its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "registry", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the registry did not start") from None
            time.sleep(0.2)


def one_run(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    root = args.ref_repo if mode.endswith("-ref") else REPO
    env["PYTHONPATH"] = str(root)
    kind = mode.removesuffix("-ref")
    registry, url = start_registry(env) if kind == "http" else (None, None)
    argv = [sys.executable, str(BENCH / "publish.py"), "--child", kind, "--gib", str(args.gib),
            "--steps", str(args.steps), "--tmp-dir", str(args.tmp_dir), *(["--registry-url", url] if url else [])]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    try:
        hello = json.loads(proc.stdout.readline())
        beats = Beats(hello["port"], args.beat_ms / 1000)
        beats.start()
        time.sleep(0.5)  # a few beats before, for the idle figure
        t0 = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        cpu0 = cpu_seconds(registry.pid) if registry is not None else None
        result = json.loads(proc.stdout.readline())
        t1 = time.perf_counter()
        if registry is not None:  # the standalone registry's own CPU time, per version received
            result["registry_cpu_s"] = round((cpu_seconds(registry.pid) - cpu0) / args.steps, 3)
        beats.stop.set()
        beats.join(30)
    finally:
        proc.stdin.close()
        proc.wait(120)
        if registry is not None:
            registry.terminate()
            registry.wait(60)
    during = [lat * 1e3 for sent, lat in beats.samples if t0 <= sent <= t1]
    idle = [lat * 1e3 for sent, lat in beats.samples if sent < t0]
    return {**result, "bytes": hello["bytes"], "beats": len(during), "beat_p50_ms": round(pct(during, 0.5), 2),
            "beat_p99_ms": round(pct(during, 0.99), 2), "beat_max_ms": round(max(during, default=float("nan")), 2),
            "beats_over_timeout": sum(d > TIMEOUT_S * 1e3 for d in during),
            "idle_beat_p50_ms": round(pct(idle, 0.5), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="size of the state dict")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=1, help="publishes (copies) per trainer process; the last is timed")
    p.add_argument("--modes", default="memcpy,publish,publish-disk,async,http",
                   help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--ref-repo", type=Path, help="a directory holding another build's rolloutd/: adds publish-ref")
    p.add_argument("--beat-ms", type=float, default=20.0, help="one heartbeat this often")
    p.add_argument("--tmp-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for publish-disk's data_dir")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--registry-url", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS / "publish.json")
    args = p.parse_args()
    if args.child:
        child(args.child, args.gib, args.tmp_dir, args.registry_url, args.steps)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.ref_repo:
        modes += [f"{m}-ref" for m in ("publish", "http") if m in modes and f"{m}-ref" not in modes]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    if any(m.endswith("-ref") for m in modes) and not args.ref_repo:
        p.error("the -ref modes need --ref-repo")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    for rep in range(args.repeats):
        for mode in modes:
            r = one_run(mode, args)
            runs[mode].append(r)
            print(f"[{rep + 1}/{args.repeats}] {mode:13} {r['seconds']:7.3f} s"
                  + (f" (returned after {r['returned_s']:.3f} s)" if "returned_s" in r else "")
                  + (f" (registry CPU {r['registry_cpu_s']:.2f} s per version)" if "registry_cpu_s" in r else "")
                  + f" (trainer CPU {r['trainer_cpu_s']:.2f} s)"
                  + f"  heartbeats: {r['beats']} p50 {r['beat_p50_ms']:.1f} ms p99 {r['beat_p99_ms']:.1f} ms "
                    f"max {r['beat_max_ms']:.1f} ms", flush=True)
    summary = {}
    base = statistics.median(r["seconds"] for r in runs["memcpy"]) if "memcpy" in runs else None
    for mode, rs in runs.items():
        s = statistics.median(r["seconds"] for r in rs)
        summary[mode] = {"seconds": s, "to_memcpy": round(s / base, 2) if base else None,
                         "gb_per_s": round(rs[0]["bytes"] / s / 1e9, 3),
                         "beat_p99_ms": max(r["beat_p99_ms"] for r in rs),
                         "beat_max_ms": max(r["beat_max_ms"] for r in rs),
                         "beats_over_timeout": sum(r["beats_over_timeout"] for r in rs)}
        if "registry_cpu_s" in rs[0]:
            summary[mode]["registry_cpu_s"] = statistics.median(r["registry_cpu_s"] for r in rs)
        summary[mode]["trainer_cpu_s"] = statistics.median(r["trainer_cpu_s"] for r in rs)
        if "memcpy" in runs:  # each run against the memory copy of its own round: steadier on a busy host
            summary[mode]["to_memcpy_paired"] = round(statistics.median(
                r["seconds"] / m["seconds"] for r, m in zip(rs, runs["memcpy"], strict=True)), 2)
        if "returned_s" in rs[0]:
            summary[mode]["returned_s"] = statistics.median(r["returned_s"] for r in rs)
            summary[mode]["returned_to_memcpy"] = round(summary[mode]["returned_s"] / base, 2) if base else None
    report = {"gib": args.gib, "repeats": args.repeats, "steps": args.steps, "beat_ms": args.beat_ms,
              "loadavg_before": load0,
              "loadavg_after": Path("/proc/loadavg").read_text().split()[:3], "runs": runs, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\n{args.gib:g} GiB state dict, step {args.steps} of each process, median of {args.repeats} "
          f"(load average {' '.join(load0)})")
    print("| mode | seconds | × memcpy | GB/s | heartbeat p99 | max | over 2 s |")
    print("|---|---|---|---|---|---|---|")
    for mode, s in summary.items():
        ratio = f"{s['to_memcpy']:.2f}" if s["to_memcpy"] is not None else ""
        extra = f" (returns after {s['returned_s']:.3f} s)" if "returned_s" in s else ""
        print(f"| {mode}{extra} | {s['seconds']:.3f} | {ratio} | {s['gb_per_s']:.2f} | {s['beat_p99_ms']:.1f} ms | "
              f"{s['beat_max_ms']:.1f} ms | {s['beats_over_timeout']} |")
    headline = {f"{m.replace('-', '_')}_to_memcpy": s["to_memcpy"] for m, s in summary.items() if m != "memcpy"}
    headline.update({f"{m.replace('-', '_')}_to_memcpy_paired": s.get("to_memcpy_paired")
                     for m, s in summary.items() if m != "memcpy"})
    print(json.dumps({**headline, "gib": args.gib, "summary": summary, "loadavg_before": load0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
