"""Pull rate of the node's puller: a whole version into a tmpfs mirror, next to curl, aria2c and cp.

The puller leases a version, fetches every chunk with parallel ``Range`` requests, checks each
chunk's digest, writes into a preallocated partial directory and renames it into place. The
same bytes (``--files`` random files, ``--size-mib`` in all) are fetched, in the same run, by:

- ``puller``: ``pullonce.py`` (rolloutd's ``Puller`` on uvloop, ``--workers`` pull worker
  processes) from ``rolloutd registry`` (bytes held in memory, or with ``--store disk`` in a
  disk store in the same tmpfs, sent with sendfile) into a mirror as the daemon's is between two
  steps: the version it held (from an untimed first pull) removed first, as gc removes one no
  server uses, so its files are recycled (``mirror.recycle``, on by default);
- ``puller-fresh``: the same into a fresh mirror directory (a daemon's first pull, or
  ``recycle: false``): every page allocated new, as for curl, aria2c and cp;
- ``curl``: one ``curl`` for all files, one after the other over one connection, from nginx
  (sendfile on) serving the same files from tmpfs;
- ``curl-parallel``: the same with ``--parallel --parallel-max <files>`` (one connection per file);
- ``aria2c``: ``aria2c -x8 -s8`` (``--connections``) for all files, from nginx;
- ``cp``: ``cp -r`` of the source files (tmpfs to tmpfs), the memory-copy limit of this machine;
- ``loopback``: the same requests as the puller's (``--streams`` connections, ``--request-mib``
  ranges, the pull workers' own source) from the same registry, each body read into a reused
  buffer and dropped (``streampull.py``): what this server and the loopback deliver to a client
  that takes the bytes out of the kernel but neither hashes nor writes them, the ceiling of any
  client of this server on this machine.

Beside each contender's own CPU (and its server's), the whole machine's busy time per GB is
reported (``/proc/stat``, every CPU, interrupts included): on loopback the kernel charges much of
a transfer to whichever core sends or receives, so only the machine's total shows what a
transfer costs in all.

Every contender but ``puller`` (and ``puller-ref``) writes new files into the same tmpfs (the
destination is removed before each run). Servers run pinned to one CPU, clients to the other
(``taskset``). Each contender runs ``--repeats`` times, interleaved; the medians and the ratios
puller / best of curl and aria2c and puller / cp are reported. Every file a contender wrote is
checked against the published manifest's chunk digests (the first repeat for all, every repeat
for the puller). Writes ``bench/results/pull.json`` and ``bench/results/pull.md``. From the repo root::

    .venv/bin/python bench/pull.py            # 2 GiB in 8 files, 3 repeats, about 2 minutes
    .venv/bin/python bench/pull.py --sweep    # first one pull per streams x request size
    .venv/bin/python bench/pull.py --workers-sweep 1,2   # the rate with 1 worker on 1 core, 2 on 2
    .venv/bin/python bench/pull.py --profile  # and py-spy the puller over one more pull
    .venv/bin/python bench/pull.py --quick    # 256 MiB, one repeat: a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from registry_load import (
    display_path,
    find_tool,
    free_port,
    machine_busy_s,
    parse_frame,
    pinned,
    process_cpu_s,
    python_frame,
    run_in_scratch,
    run_main,
    stop,
    write_report,
)
from registry_serve import (
    child_pids,
    make_file,
    nginx_argv,
    registry_argv,
    stats,
    stop_leftovers,
    transfer_timeout_s,
    wait_up,
)

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
HOST = "127.0.0.1"  # only loopback is ever targeted
sys.path.insert(0, str(REPO))

from rolloutd.config import Pull  # noqa: E402
from rolloutd.wire.manifest import Manifest, verify_file  # noqa: E402

CONTENDERS = ("puller", "puller-fresh", "puller-ref", "curl", "curl-parallel", "aria2c", "cp",
              "loopback")
DOWNLOADERS = ("curl", "curl-parallel", "aria2c")  # the "best of" the puller is compared with
MIN_RATE_BPS = 20e6  # a transfer slower than this is broken: it sets every subprocess timeout
SWEEP = [(s, r) for s in (2, 4, 8, 16) for r in (4, 16, 64)]  # (streams, request MiB)

INSTALL_HINTS = {
    "taskset": "apt-get install -y util-linux",
    "curl": "apt-get install -y curl",
    "aria2c": "apt-get install -y aria2",
    "nginx": "apt-get install -y nginx",
    "rolloutd": ".venv/bin/pip install -e .   (the registry and the publish command)",
    "py-spy": ".venv/bin/pip install py-spy   (only needed for --profile)",
}


# -- options ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mib", type=int, default=2048, help="bytes of the version, in all")
    p.add_argument("--files", type=int, default=8, help="files the version has (equal sizes)")
    p.add_argument("--repeats", type=int, default=3, help="runs per contender")
    p.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c != "puller-ref"),
                   help=f"comma list of {', '.join(CONTENDERS)}")
    p.add_argument("--streams", type=int, default=None,
                   help="puller: concurrent chunk streams (default: two per worker, as the daemon's "
                        "pull.streams: null)")
    p.add_argument("--workers", type=int, default=1, help="puller: pull worker processes (on the load CPU)")
    p.add_argument("--workers-sweep", default=None, help="comma list of worker counts: one more puller run each, "
                   "N workers allowed N CPUs (the load CPU first, then the others: on 2 cores, 2 workers "
                   "share the registry's core)")
    p.add_argument("--priority", choices=("idle", "low", "normal"), default=Pull.model_fields["cpu_priority"].default,
                   help="puller: the pull workers' CPU priority (default: the daemon's pull.cpu_priority)")
    p.add_argument("--request-mib", type=int, default=16, help="puller: largest Range request")
    p.add_argument("--piece-kib", type=int, default=1024, help="puller: largest piece read from a response at once")
    p.add_argument("--chunk-mib", type=int, default=64, help="digest chunk size of the published version")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="puller's event loop")
    p.add_argument("--connections", type=int, default=8, help="aria2c -x and -s")
    p.add_argument("--aria2c-jobs", type=int, default=None, help="aria2c -j: files at once (default: all)")
    p.add_argument("--ref-repo", type=Path, default=None,
                   help="a directory holding another build's rolloutd/ package: adds contender puller-ref, "
                        "that build's puller with the same settings (e.g. `git archive <commit> rolloutd | "
                        "tar -x -C DIR`)")
    p.add_argument("--sweep", action="store_true", help="one puller run per (streams, request MiB) of "
                   f"{SWEEP}, before the comparison")
    p.add_argument("--profile", action="store_true", help="py-spy the puller over one more pull")
    p.add_argument("--tmp-dir", type=Path, default=Path("/dev/shm"),
                   help="tmpfs for the source files and every destination (a fresh directory, removed at the end)")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--store", choices=("memory", "disk"), default="memory",
                   help="the registry's store: bytes in its memory, or a disk store in --tmp-dir (sent with sendfile)")
    p.add_argument("--registry-cmd", default=None,
                   help="command starting the registry, '--host H --port P' appended (default: the venv's "
                        "`rolloutd registry`)")
    p.add_argument("--quick", action="store_true", help="256 MiB, one repeat: a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS / "pull.json")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats = 256, 1
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    args.workers_sweep = [int(w) for w in args.workers_sweep.split(",")] if args.workers_sweep else []
    if args.ref_repo and "puller-ref" not in args.contenders:
        args.contenders.insert(1, "puller-ref")
    if "puller-ref" in args.contenders and not args.ref_repo:
        p.error("puller-ref needs --ref-repo")
    if unknown := set(args.contenders) - set(CONTENDERS):
        p.error(f"unknown contenders: {', '.join(sorted(unknown))}")
    args.per_worker_streams = args.streams is None  # the daemon's default: two streams per worker
    args.streams = args.streams or 2 * args.workers
    if min(args.size_mib, args.files, args.repeats, args.streams, args.request_mib, args.piece_kib,
           args.chunk_mib, args.connections) < 1:
        p.error("sizes, counts and settings must be positive")
    if not 1 <= args.connections <= 16:
        p.error("aria2c allows 1 to 16 connections per server")
    if (args.size_mib << 20) % args.files:
        p.error("--size-mib must split into --files equal files")
    args.size = args.size_mib << 20
    args.aria2c_jobs = args.aria2c_jobs or args.files
    return args


def missing_tools(args: argparse.Namespace) -> list[str]:
    needed = {"taskset", "rolloutd"}
    needed |= {"curl", "nginx"} if {"curl", "curl-parallel"} & set(args.contenders) else set()
    needed |= {"aria2c", "nginx"} if "aria2c" in args.contenders else set()
    needed |= {"py-spy"} if args.profile else set()
    return sorted(t for t in needed if not find_tool(t))


def check_room(args: argparse.Namespace) -> str | None:
    """The source, the registry's copy (plus its upload buffer), one destination and the
    steady pullers' mirrors: refuse early unless memory and tmpfs have room for them."""
    need = (5 + sum(c in args.contenders for c in ("puller", "puller-ref"))) * args.size
    meminfo = dict(re.findall(r"^(\w+):\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M))
    available = min(int(meminfo.get("MemAvailable", 0)) << 10, shutil.disk_usage(args.tmp_dir).free)
    if available < need:
        return f"needs about {need >> 20} MiB of memory and of room in {args.tmp_dir}; has {available >> 20} MiB"
    return None



# -- servers ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def server(name: str, argv: list[str], probe_url: str) -> Iterator[subprocess.Popen]:
    """Start a server (already pinned), wait until it answers; always stop it."""
    log_path = RESULTS / f"pull.{name}.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    workers: list[int] = []
    try:
        wait_up(proc, probe_url, log_path)
        workers = child_pids(proc.pid)
        yield proc
    finally:
        stop(proc)
        stop_leftovers(workers)


def publish(url: str, src: Path, args: argparse.Namespace) -> tuple[Manifest, float]:
    """``rolloutd publish 1`` from the client CPU; the manifest as the registry serves it."""
    argv = [find_tool("rolloutd"), "publish", "1", str(src), "--registry", url,
            "--chunk-bytes", str(args.chunk_mib << 20)]
    t = time.perf_counter()
    out = subprocess.run(pinned(args.load_cpu, argv), capture_output=True, text=True,
                         timeout=transfer_timeout_s(args.size) + 60)
    if out.returncode != 0:
        raise RuntimeError(f"publish failed ({out.returncode}): {out.stderr[-1000:]}")
    seconds = time.perf_counter() - t
    with urllib.request.urlopen(f"{url}/v1/versions/1", timeout=30) as r:
        return Manifest.model_validate_json(r.read()), seconds


# -- contenders ---------------------------------------------------------------------------------------

def run_timed(argv: list[str], args: argparse.Namespace, cpus: str | None = None
              ) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run a client pinned to the load CPU (or ``cpus``): its output, wall seconds and CPU seconds
    (its children's included)."""
    timeout = transfer_timeout_s(args.size)
    t0, c0 = time.perf_counter(), os.times()
    out = subprocess.run(pinned(cpus or args.load_cpu, argv), capture_output=True, text=True, timeout=timeout)
    wall, c1 = time.perf_counter() - t0, os.times()
    if out.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({out.returncode}): {(out.stderr or out.stdout)[-1000:]}")
    return out, wall, c1.children_user + c1.children_system - c0.children_user - c0.children_system


def pull_argv(urls: dict, dest: Path, args: argparse.Namespace, streams: int, request_mib: int,
              repo: Path | None = None, workers: int | None = None, again: bool = False) -> list[str]:
    return [sys.executable, str(BENCH / "pullonce.py"), urls["registry"], "--mirror", str(dest),
            *(["--again"] if again else []),
            "--version", "1", "--streams", str(streams), "--request-mib", str(request_mib),
            "--piece-kib", str(args.piece_kib), "--loop", args.loop, "--workers", str(workers or args.workers),
            "--priority", args.priority,
            "--timeout-s", f"{transfer_timeout_s(args.size):.0f}", *(["--repo", str(repo)] if repo else [])]


def puller(urls: dict, names: list[str], dest: Path, args: argparse.Namespace,
           streams: int | None = None, request_mib: int | None = None, repo: Path | None = None,
           workers: int | None = None, steady: bool = False) -> dict:
    """One pull into ``dest`` (fresh), or with ``steady`` into a mirror of its own that keeps the
    version between runs (pulled once untimed first) and removes it before the timed pull."""
    workers = workers or args.workers
    streams = max(streams or args.streams, workers)
    if steady:
        dest = dest.parent / f"mirror-{'ref' if repo else 'shipped'}"
        if not dest.exists():
            run_timed(pull_argv(urls, dest, args, streams, request_mib or args.request_mib, repo, workers), args)
    argv = pull_argv(urls, dest, args, streams, request_mib or args.request_mib, repo, workers, again=steady)
    out, _, _ = run_timed(argv, args, cpus=sweep_cpus(workers, args) if workers > 1 else None)
    r = json.loads(out.stdout)  # its own time and CPU: the pull, not the interpreter's start
    if r["bytes"] != args.size:
        raise RuntimeError(f"puller fetched {r['bytes']} bytes, expected {args.size}")
    return {"seconds": r["seconds"], "client_cpu_s": r["client_cpu_s"], "puller_cpu_s": r.get("puller_cpu_s"),
            "retries": r["retries"],
            "machine_cpu_s": r["machine_cpu_s"], "files_dir": r["path"]}


def curl(urls: dict, names: list[str], dest: Path, args: argparse.Namespace, parallel: bool = False) -> dict:
    dest.mkdir()
    argv = [find_tool("curl"), "-s", "-S", "--fail", "--max-time", f"{transfer_timeout_s(args.size):.0f}"]
    if parallel:
        argv += ["--parallel", "--parallel-max", str(len(names))]
    for name in names:
        argv += [f"{urls['nginx']}/{name}", "-o", str(dest / name)]
    _, wall, cpu = run_timed(argv, args)
    return {"seconds": wall, "client_cpu_s": cpu, "files_dir": str(dest)}


def aria2c(urls: dict, names: list[str], dest: Path, args: argparse.Namespace) -> dict:
    """All files at once (``-j``), each split over ``-x``/``-s`` connections, preallocated with
    fallocate as the puller does."""
    dest.mkdir()
    listing = dest.parent / "aria2c.input"
    listing.write_text("".join(f"{urls['nginx']}/{n}\n  out={n}\n" for n in names))
    n = str(args.connections)
    argv = [find_tool("aria2c"), "--no-conf=true", "-x", n, "-s", n, "-j", str(args.aria2c_jobs),
            "--file-allocation=falloc", "--allow-overwrite=true", "--auto-file-renaming=false",
            "-d", str(dest), "-i", str(listing), "--max-tries=1",
            f"--timeout={transfer_timeout_s(args.size):.0f}", "--summary-interval=0",
            "--show-console-readout=false", "--console-log-level=warn", "--download-result=hide"]
    _, wall, cpu = run_timed(argv, args)
    listing.unlink()
    return {"seconds": wall, "client_cpu_s": cpu, "files_dir": str(dest)}


def cp(urls: dict, names: list[str], dest: Path, args: argparse.Namespace) -> dict:
    _, wall, cpu = run_timed(["cp", "-r", urls["src"], str(dest)], args)
    return {"seconds": wall, "client_cpu_s": cpu, "files_dir": str(dest)}


def loopback(urls: dict, names: list[str], dest: Path, args: argparse.Namespace) -> dict:
    """The puller's requests from the same registry, the bodies read and dropped."""
    argv = [sys.executable, str(BENCH / "streampull.py"),
            *(f"{urls['registry']}/v1/versions/1/files/{n}" for n in names), "--size", str(args.size // args.files),
            "--chunk-mib", str(args.request_mib), "--concurrency", str(args.streams),
            "--piece-kib", str(args.piece_kib)]
    out, _, _ = run_timed(argv, args)
    r = json.loads(out.stdout)  # its own time and CPU: the pull, not the interpreter's start
    return {"seconds": r["seconds"], "client_cpu_s": r["client_cpu_s"], "machine_cpu_s": r["machine_cpu_s"],
            "files_dir": None}


def sweep_cpus(workers: int, args: argparse.Namespace) -> str:
    """The CPUs N workers may use: the load CPU first, then the others in order."""
    cpus = [args.load_cpu] + [c for c in range(os.cpu_count()) if c != args.load_cpu]  # this script is pinned
    return ",".join(str(c) for c in cpus[:workers])


RUN = {"puller": lambda *a, **kw: puller(*a, steady=True, **kw), "puller-fresh": puller,
       "puller-ref": lambda *a: puller(*a, repo=a[3].ref_repo, steady=True), "curl": curl,
       "curl-parallel": lambda *a: curl(*a, parallel=True), "aria2c": aria2c, "cp": cp, "loopback": loopback}


def label(name: str, args: argparse.Namespace) -> str:
    return {"puller": f"puller {args.workers} worker(s), {args.streams} streams x {args.request_mib} MiB requests, "
                      "into the files of the version removed (as shipped, between steps)",
            "puller-fresh": "the same into a fresh mirror (every page new)",
            "puller-ref": f"the same, rolloutd from {args.ref_repo}",
            "curl": "curl, files one after another",
            "curl-parallel": f"curl --parallel-max {args.files}",
            "aria2c": f"aria2c -x{args.connections} -s{args.connections} -j{args.aria2c_jobs}",
            "cp": "cp -r (tmpfs to tmpfs)",
            "loopback": f"loopback: the puller's {args.streams} streams x {args.request_mib} MiB from the registry, "
                        "read and dropped"}[name]


def check_files(files_dir: Path, manifest: Manifest) -> None:
    for entry in manifest.files:
        if bad := verify_file(files_dir / entry.name, entry, manifest):
            raise RuntimeError(f"{files_dir / entry.name}: chunks {bad[:10]} do not match the manifest")


def one_run(name: str, urls: dict, names: list[str], work: Path, args: argparse.Namespace,
            manifest: Manifest, pids: dict, verify: bool, **settings) -> dict:
    """One run of a contender into a fresh destination, with the CPU its server used."""
    dest = work / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    srv = pids.get("registry" if name.startswith("puller") or name == "loopback" else "nginx", [])
    srv0, machine0 = sum(_cpu(p) for p in srv), machine_busy_s()
    result = RUN[name](urls, names, dest, args, **settings)
    used, machine = sum(_cpu(p) for p in srv) - srv0, machine_busy_s() - machine0
    machine = result.pop("machine_cpu_s", machine)  # a Python client's own window, without its start
    if result["files_dir"] is None:  # bytes that were not kept: nothing to check
        verify = False
    if verify:
        check_files(Path(result.pop("files_dir")), manifest)
    else:
        result.pop("files_dir")
    gb = args.size / 1e9
    loop_cpu = result.pop("puller_cpu_s", None)
    result.update(gb_per_s=round(gb / result["seconds"], 4), seconds=round(result["seconds"], 4),
                  client_cpu_s_per_gb=round(result["client_cpu_s"] / gb, 3),
                  puller_loop_s_per_gb=round(loop_cpu / gb, 3) if loop_cpu is not None else None,
                  server_cpu_s_per_gb=round(used / gb, 3) if srv else None,
                  machine_cpu_s_per_gb=round(machine / gb, 3), verified=verify)
    shutil.rmtree(dest, ignore_errors=True)
    return result


def _cpu(pid: int) -> float:
    with contextlib.suppress(OSError):
        return process_cpu_s(pid)
    return 0.0


def measure(urls: dict, names: list[str], work: Path, args: argparse.Namespace, manifest: Manifest,
            pids: dict) -> dict:
    """Every contender ``repeats`` times, interleaved so that a slow spell of the machine hits all
    alike; the first repeat of each, and every puller run, is checked against the manifest."""
    runs: dict = {c: [] for c in args.contenders}
    for rep in range(args.repeats):
        for name in args.contenders:
            run = one_run(name, urls, names, work, args, manifest, pids,
                          verify=rep == 0 or name.startswith("puller"))
            runs[name].append(run)
            loop = run.get("puller_loop_s_per_gb")
            print(f"  [{rep + 1}/{args.repeats}] {name:<14} {run['gb_per_s']:6.2f} GB/s  "
                  f"client {run['client_cpu_s_per_gb']:.2f} s/GB"
                  + (f" (the puller's loop {loop:.2f}, its workers the rest)" if loop is not None else ""), flush=True)
    return runs


def warm_up(src: Path, work: Path, args: argparse.Namespace) -> None:
    """One untimed copy of the version into tmpfs, then deleted: on a VM, the first write to
    memory the guest has not used yet runs at a fraction of the usual rate (the host backs it
    then), which would otherwise land on whichever contender runs first."""
    dest = work / "dest"
    run_timed(["cp", "-r", str(src), str(dest)], args)
    shutil.rmtree(dest)


def workers_sweep(urls: dict, names: list[str], work: Path, args: argparse.Namespace, manifest: Manifest,
                  pids: dict) -> list[dict]:
    """One puller run per worker count, ``--repeats`` times, interleaved; N workers on N CPUs."""
    rows: dict[int, list[dict]] = {w: [] for w in args.workers_sweep}
    for rep in range(args.repeats):
        for w in args.workers_sweep:
            run = one_run("puller", urls, names, work, args, manifest, pids, verify=rep == 0, workers=w,
                          streams=2 * w if args.per_worker_streams else max(args.streams, w))
            rows[w].append(run)
            print(f"  workers sweep [{rep + 1}/{args.repeats}]: {w} worker(s) on CPUs {sweep_cpus(w, args)}  "
                  f"{run['gb_per_s']:6.2f} GB/s  client {run['client_cpu_s_per_gb']:.2f} s/GB", flush=True)
    return [{"workers": w, "cpus": sweep_cpus(w, args), "gb_per_s": stats([r["gb_per_s"] for r in rs]),
             "client_cpu_s_per_gb": statistics.median(r["client_cpu_s_per_gb"] for r in rs)}
            for w, rs in rows.items()]


def sweep(urls: dict, names: list[str], work: Path, args: argparse.Namespace, manifest: Manifest,
          pids: dict) -> list[dict]:
    rows = []
    for streams, request_mib in SWEEP:
        run = one_run("puller", urls, names, work, args, manifest, pids, verify=False,
                      streams=streams, request_mib=request_mib)
        rows.append({"streams": streams, "request_mib": request_mib, **run})
        print(f"  sweep: {streams:2d} streams x {request_mib:3d} MiB  {run['gb_per_s']:6.2f} GB/s  "
              f"client {run['client_cpu_s_per_gb']:.2f} s/GB", flush=True)
    return rows


# -- profile ------------------------------------------------------------------------------------------

def profile(urls: dict, work: Path, args: argparse.Namespace) -> dict:
    """py-spy (native frames) over one more pull, started under py-spy so that no sample is lost."""
    dest = work / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    raw = work / "py-spy.txt"
    argv = [find_tool("py-spy"), "record", "--native", "--rate", "200", "--format", "raw", "--output", str(raw),
            "--", *pull_argv(urls, dest, args, args.streams, args.request_mib)]
    try:
        out, _, _ = run_timed(argv, args)
    except RuntimeError as e:
        return {"error": str(e)}
    pulled = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))  # py-spy talks too
    summary = summarize_profile(raw.read_text())
    summary["gb_per_s_under_py_spy"] = pulled["gb_per_s"]
    shutil.rmtree(dest, ignore_errors=True)
    raw.unlink(missing_ok=True)
    return summary


LEAVES = [  # (substring of the innermost frame, what it is)
    ("pwrite", "pwrite: copy into tmpfs pages"),
    ("XXH3", "xxh3 hashing"), ("PYXXH3", "xxh3 hashing"),
    ("recv", "socket read: copy out of the kernel"), ("uv__read", "socket read: copy out of the kernel"),
    ("read (libc", "socket read: copy out of the kernel"),
    ("epoll", "waiting for the network (idle)"),
    ("posix_fallocate", "fallocate of the partial files"),
    ("gc_collect", "garbage collector"),
]


def leaf_label(frame: str) -> str:
    for needle, what in LEAVES:
        if needle in frame:
            return what
    func, file = parse_frame(frame)
    if file.startswith("libc") and func.startswith("0x"):
        return "libc without symbol (memcpy, locks)"
    return f"{func} ({file.split('/')[-1]})"


def summarize_profile(raw: str, top: int = 12) -> dict:
    """Shares of the busy samples of the pull (imports at start-up left out), by innermost
    frame and by innermost Python function."""
    leaves, functions, total = Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or "importlib" in stack:  # imports at start-up
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        leaves[leaf_label(frames[-1])] += n
        functions[python_frame(frames)] += n
    scale = 1 / total if total else 0.0
    return {"samples": total,
            "leaves": [{"leaf": k, "share": round(v * scale, 3)} for k, v in leaves.most_common(top)],
            "python": [{"function": k, "share": round(v * scale, 3)} for k, v in functions.most_common(top)]}


# -- summary and report ---------------------------------------------------------------------------------


def summarize(runs: dict) -> dict:
    out = {name: {"gb_per_s": stats([r["gb_per_s"] for r in rs]),
                  "client_cpu_s_per_gb": statistics.median(r["client_cpu_s_per_gb"] for r in rs),
                  "server_cpu_s_per_gb": (statistics.median(r["server_cpu_s_per_gb"] for r in rs)
                                          if rs[0]["server_cpu_s_per_gb"] is not None else None),
                  "machine_cpu_s_per_gb": statistics.median(r["machine_cpu_s_per_gb"] for r in rs)}
           for name, rs in runs.items()}
    med = {name: s["gb_per_s"]["median"] for name, s in out.items()}
    downloaders = {n: med[n] for n in DOWNLOADERS if n in med}
    ratios = {}
    if "puller" in med and downloaders:
        best = max(downloaders, key=downloaders.get)
        ratios["best_downloader"] = best
        ratios["puller_to_best_downloader"] = round(med["puller"] / downloaders[best], 3)
    if "puller" in med and "cp" in med:
        ratios["puller_to_cp"] = round(med["puller"] / med["cp"], 3)
    if "puller" in med and "puller-ref" in med:
        ratios["puller_to_puller_ref"] = round(med["puller"] / med["puller-ref"], 3)
    if "puller-fresh" in med and "cp" in med:
        ratios["puller_fresh_to_cp"] = round(med["puller-fresh"] / med["cp"], 3)
    if "puller" in med and "loopback" in med:
        ratios["puller_to_loopback"] = round(med["puller"] / med["loopback"], 3)
    if "loopback" in med and "cp" in med:
        ratios["loopback_to_cp"] = round(med["loopback"] / med["cp"], 3)
    if "puller" in out and "cp" in out:
        ratios["client_cpu_to_cp"] = round(out["puller"]["client_cpu_s_per_gb"] / out["cp"]["client_cpu_s_per_gb"], 3)
    if "puller-fresh" in out and "cp" in out:
        ratios["fresh_client_cpu_to_cp"] = round(out["puller-fresh"]["client_cpu_s_per_gb"]
                                                 / out["cp"]["client_cpu_s_per_gb"], 3)
    return {"contenders": out, "ratios": ratios}


def markdown(report: dict) -> str:
    cfg, env, summ = report["config"], report["environment"], report["summary"]
    lines = [f"# bench/pull.py: {cfg['size_mib']} MiB in {cfg['files']} files, median of {cfg['repeats']}",
             "", f"{env['cpus']} CPUs ({env['cpu_model']}); {env['pinning']}; "
             f"registry bytes in {cfg.get('store', 'memory')}; "
             f"publish {report['publish_s']:.1f} s", "",
             "| contender | GB/s median (min-max) | client s/GB | server s/GB | machine s/GB |",
             "|---|---|---|---|---|"]
    for name, s in summ["contenders"].items():
        g = s["gb_per_s"]
        srv = f"{s['server_cpu_s_per_gb']:.2f}" if s["server_cpu_s_per_gb"] is not None else ""
        lines.append(f"| {report['labels'][name]} | {g['median']:.2f} ({g['min']:.2f}-{g['max']:.2f}) | "
                     f"{s['client_cpu_s_per_gb']:.2f} | {srv} | {s['machine_cpu_s_per_gb']:.2f} |")
    r = summ["ratios"]
    lines.append("")
    if "puller_to_best_downloader" in r:
        lines.append(f"puller / best downloader ({r['best_downloader']}): **{r['puller_to_best_downloader']:.2f}**")
    if "puller_to_cp" in r:
        lines.append(f"puller / cp: **{r['puller_to_cp']:.2f}**")
    if "puller_to_loopback" in r:
        lines.append(f"puller / loopback (the same server's bytes, discarded): **{r['puller_to_loopback']:.2f}**")
    if "loopback_to_cp" in r:
        lines.append(f"loopback / cp (the most any client of this server reaches here, over cp): "
                     f"**{r['loopback_to_cp']:.2f}**")
    if "puller_fresh_to_cp" in r:
        lines.append(f"puller-fresh / cp: **{r['puller_fresh_to_cp']:.2f}**")
    if "puller_to_puller_ref" in r:
        lines.append(f"puller / puller-ref: **{r['puller_to_puller_ref']:.2f}**")
    if "client_cpu_to_cp" in r:
        lines.append(f"puller client CPU per GB / cp's: **{r['client_cpu_to_cp']:.2f}**")
    if "fresh_client_cpu_to_cp" in r:
        lines.append(f"puller-fresh client CPU per GB / cp's: **{r['fresh_client_cpu_to_cp']:.2f}**")
    if report.get("workers_sweep"):
        lines += ["", "Workers sweep (median of the repeats): workers on CPUs -> GB/s (client s/GB)", ""]
        lines += [f"- {row['workers']} on {row['cpus']}: {row['gb_per_s']['median']:.2f} "
                  f"({row['gb_per_s']['min']:.2f}-{row['gb_per_s']['max']:.2f}) ({row['client_cpu_s_per_gb']:.2f})"
                  for row in report["workers_sweep"]]
    if report.get("sweep"):
        lines += ["", "Sweep (one pull each): streams x request MiB -> GB/s (client s/GB)", ""]
        lines += [f"- {row['streams']} x {row['request_mib']} MiB: {row['gb_per_s']:.2f} "
                  f"({row['client_cpu_s_per_gb']:.2f})" for row in report["sweep"]]
    prof = report.get("profile")
    if prof and "error" not in prof:
        lines += ["", f"Profile of one pull ({prof['gb_per_s_under_py_spy']:.2f} GB/s under py-spy), "
                  "share of busy samples by innermost frame:", ""]
        lines += [f"- {100 * e['share']:.1f}% {e['leaf']}" for e in prof["leaves"]]
    return "\n".join(lines) + "\n"


def print_report(report: dict) -> None:
    print("\n" + markdown(report))


# -- main ------------------------------------------------------------------------------------------------

def file_names(args: argparse.Namespace) -> list[str]:
    return [f"model-{i:05d}-of-{args.files:05d}.safetensors" for i in range(1, args.files + 1)]


def run_all(work: Path, args: argparse.Namespace) -> dict:
    src = work / "src"
    src.mkdir()
    names = file_names(args)
    print(f"write {args.size_mib} MiB of random bytes to {args.files} files in {src}", flush=True)
    for name in names:
        make_file(src / name, args.size // args.files)
    for p in (work, src):  # nginx workers may run as another user: let them read
        p.chmod(0o755)
    for name in names:
        (src / name).chmod(0o644)
    report: dict = {"labels": {c: label(c, args) for c in args.contenders}}
    reg_port, nginx_port = free_port(), free_port()
    reg_argv = pinned(args.server_cpu, registry_argv(args, reg_port, work / "store" if args.store == "disk" else None))
    ngx_argv = pinned(args.server_cpu, nginx_argv(work / "nginx", work, nginx_port, sendfile=True))
    urls = {"registry": f"http://{HOST}:{reg_port}", "nginx": f"http://{HOST}:{nginx_port}/src", "src": str(src)}
    with server("registry", reg_argv, urls["registry"] + "/healthz") as reg, \
            server("nginx", ngx_argv, f"{urls['nginx']}/{names[0]}") as ngx:
        pids = {"registry": [reg.pid], "nginx": [ngx.pid, *child_pids(ngx.pid)]}
        manifest, report["publish_s"] = publish(urls["registry"], src, args)
        print(f"published version 1 ({len(manifest.files)} files, digest {manifest.digest}) "
              f"in {report['publish_s']:.1f} s", flush=True)
        warm_up(src, work, args)
        if args.sweep:
            report["sweep"] = sweep(urls, names, work, args, manifest, pids)
        if args.workers_sweep:
            report["workers_sweep"] = workers_sweep(urls, names, work, args, manifest, pids)
        report["runs"] = measure(urls, names, work, args, manifest, pids)
        report["summary"] = summarize(report["runs"])
        if args.profile:
            report["profile"] = profile(urls, work, args)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    done = run_in_scratch("pull", args, missing_tools(args), INSTALL_HINTS, check_room(args), run_all)
    if done is None:
        return 2
    env, report = done
    write_report(args, env, report, print_report)
    (args.out.with_suffix(".md")).write_text(markdown(json.loads(args.out.read_text())))
    print(f"Wrote {display_path(args.out.with_suffix('.md'))}")
    return 0


if __name__ == "__main__":
    run_main(main)
