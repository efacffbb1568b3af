"""The pause window of an update on a real vLLM (CPU build), next to the design it replaces.

rolloutd pulls a version into the node mirror while the server keeps generating; the server
pauses only to load the mirror. The design it replaces fetches the bytes *during* the pause.
On one ``vllm serve`` with a ~320 MB test model (``tinymodel.BENCH``), in the same run,
interleaved, ``--repeats`` times each:

- ``mirror``: pause → start → update(mirror path) → finish → resume, the bytes already in the
  mirror (pulled beforehand by the puller from a real registry over loopback);
- ``fetch-in-pause``: pause → pull the same version from the registry (the same puller, into
  a fresh tmpfs directory, from a registry in its own process: the fastest fetch this machine
  has; across a network it can only be slower) → start → update → finish → resume;
- ``memcpy``: one copy of the same bytes from the mirror's files into memory, the floor for
  any load.

Each update alternates between two versions so that weights really change; one update before
the measured ones warms the server up (the first load after start is reported apart). Reports medians,
the ratio pause(mirror) / pause(fetch-in-pause) (goal <= 0.2) and pause(mirror) / memcpy.
Writes ``bench/results/pause.json``. From the repo root::

    .venv/bin/python bench/pause.py             # about 2 minutes
    .venv/bin/python bench/pause.py --repeats 2 --shape tiny   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rolloutd.demo import tinymodel  # noqa: E402
from rolloutd.rollout.mirror import Mirror  # noqa: E402
from rolloutd.rollout.puller import Puller, PullSettings  # noqa: E402
from rolloutd.rollout.registry_client import RegistryClient  # noqa: E402
from rolloutd.supervise.plugin_path import install_plugin  # noqa: E402
from rolloutd.trainer.publish import RegistryHTTP  # noqa: E402
from tests.support.vllm_server import VllmServer, client  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SHAPES = {"bench": tinymodel.BENCH, "tiny": tinymodel.TINY}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", choices=SHAPES, default="bench")
    p.add_argument("--streams", type=int, default=4, help="puller streams")
    p.add_argument("--cpus", default="0-1", help="cores vLLM's compute threads are bound to (all of them: "
                   "nothing else runs during a pause)")
    p.add_argument("--scratch", type=Path, default=Path("/dev/shm"), help="tmpfs for mirror and fetches")
    return p.parse_args(argv)


async def pull(url: str, mirror: Mirror, version: int, streams: int):
    async with RegistryClient(url) as c:
        return await Puller(c, mirror, PullSettings(holder="bench-node", streams=streams)).pull(version)


def post(c, step: str, **kw) -> float:
    t0 = time.perf_counter()
    r = c.post(f"/{step}", **kw)
    if r.status_code != 200:
        raise RuntimeError(f"{step}: HTTP {r.status_code} {r.text[:500]}")
    return time.perf_counter() - t0


def update(url: str, fetch, label: str) -> dict[str, float]:
    """One update; ``fetch()`` runs inside the pause and returns (path, digest)."""
    parts = {}
    with client(url) as c:
        t0 = time.perf_counter()
        parts["pause"] = post(c, "pause", params={"mode": "abort"})
        t = time.perf_counter()
        path, digest = fetch()
        parts["fetch"] = time.perf_counter() - t
        parts["start"] = post(c, "start_weight_update")
        parts["update"] = post(c, "update_weights", json={"update_info": {"path": str(path), "digest": digest}})
        parts["finish"] = post(c, "finish_weight_update", json={"weight_version": label})
        parts["resume"] = post(c, "resume")
        parts["window"] = time.perf_counter() - t0
        if c.get("/weight_info").json()["weight_version"] != label:
            raise RuntimeError("the server does not report the version just loaded")
    return parts


def memcpy_s(directory: Path) -> float:
    """One copy of every safetensors byte (page cache of the tmpfs mirror) into anonymous memory
    whose pages are already faulted in: the floor for a load."""
    files = sorted(directory.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    dst = np.ones(total, np.uint8)
    t0 = time.perf_counter()
    off = 0
    for f in files:
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            src = np.frombuffer(mm, np.uint8)
            dst[off:off + src.size] = src
            off += src.size
            del src
    return time.perf_counter() - t0


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rolloutd-pause-", dir=args.scratch))
    server = None
    try:
        print(f"building the {args.shape} model ...", flush=True)
        model = tinymodel.build(work / "model", shape, seed=0)
        mirror = Mirror(work / "mirror", max_bytes=1 << 40)
        with standalone_registry(work) as reg:
            for v in (1, 2):
                m = reg.publish(v, tinymodel.state_dict(shape, seed=v))
            size = m.total_bytes
            print(f"published versions 1, 2 ({size / 1e6:.0f} MB each, {len(m.files)} files); pulling into the mirror",
                  flush=True)
            mirrored = {v: asyncio.run(pull(reg.url, mirror, v, args.streams)) for v in (1, 2)}
            print("starting vllm serve ...", flush=True)
            t0 = time.perf_counter()
            server = VllmServer(model, _free_port(), work / "vllm.log", pythonpath=[install_plugin(work / "plugin")],
                                cpus=args.cpus)
            server.wait_healthy(600)
            print(f"  healthy after {time.perf_counter() - t0:.0f} s", flush=True)
            first = update(server.url, lambda: (mirrored[1].path, mirrored[1].digest), "warm-up")
            print(f"  first update after start (not counted): window {first['window']:.3f} s", flush=True)
            rows = {"mirror": [], "fetch-in-pause": []}
            copies = []
            for i in range(args.repeats):
                for design in rows:
                    v = 1 + (len(rows["mirror"]) + len(rows["fetch-in-pause"])) % 2
                    if design == "mirror":
                        res = mirrored[v]
                        fetch = lambda res=res: (res.path, res.digest)  # noqa: E731
                    else:
                        def fetch(v=v, i=i):
                            scratch = Mirror(work / f"fetch-{i}-{v}", max_bytes=1 << 40)
                            r = asyncio.run(pull(reg.url, scratch, v, args.streams))
                            return r.path, r.digest
                    rows[design].append(update(server.url, fetch, f"{design}-{i}-{v}"))
                    print(f"  {design:15s} #{i}: window {rows[design][-1]['window']:.3f} s "
                          + " ".join(f"{k} {x:.3f}" for k, x in rows[design][-1].items() if k != "window"), flush=True)
                copies.append(memcpy_s(mirrored[1].path))
                for d in work.glob("fetch-*"):
                    shutil.rmtree(d)
        report = summarize(rows, copies, size, args)
        report["first_update"] = first
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    (RESULTS / "pause.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0


def summarize(rows: dict, copies: list[float], size: int, args) -> dict:
    m, f = rows["mirror"], rows["fetch-in-pause"]
    copy = statistics.median(copies)
    summary = {
        "bytes": size, "repeats": args.repeats, "shape": args.shape, "vllm_cpus": args.cpus,
        "mirror_window_s": round(med(m, "window"), 4),
        "mirror_parts_s": {k: round(med(m, k), 4) for k in ("pause", "start", "update", "finish", "resume")},
        "fetch_in_pause_window_s": round(med(f, "window"), 4),
        "fetch_in_pause_fetch_s": round(med(f, "fetch"), 4),
        "memcpy_s": round(copy, 4),
        "memcpy_gb_per_s": round(size / copy / 1e9, 2),
        "ratio_mirror_to_fetch_in_pause": round(med(m, "window") / med(f, "window"), 3),
        "goal_ratio_at_most": 0.2,
        "ratio_mirror_to_memcpy": round(med(m, "window") / copy, 2),
    }
    return {"summary": summary, "runs": rows, "memcpy_s": copies}


@contextlib.contextmanager
def standalone_registry(work: Path):
    """``rolloutd registry`` in its own process (bytes in memory), as a trainer would run it."""
    port = _free_port()
    log = open(work / "registry.log", "wb")
    proc = subprocess.Popen([str(ROOT / ".venv/bin/rolloutd"), "registry", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        reg = RegistryHTTP(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                reg.latest()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the registry did not start; see " + str(work / "registry.log")) from None
                time.sleep(0.1)
        yield reg
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
