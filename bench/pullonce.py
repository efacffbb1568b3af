"""Pull one version into a mirror directory with rolloutd's puller, as the daemon does.

Prints one JSON object: bytes, seconds (the pull itself: lease to commit, without the
interpreter's start), GB/s, the CPU seconds of the pull (this process and its pull workers,
which are reaped before the pull returns), retries, the version's path and digest. Used by
``pull.py``::

    python bench/pullonce.py http://127.0.0.1:8700 --mirror /dev/shm/m --version 1 --workers 2 --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import psutil

# The repo's rolloutd (not the venv's installed copy), or another checkout's with --repo DIR
_repo = sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_repo))

from registry_load import machine_busy_s  # noqa: E402

from rolloutd.config import Pull  # noqa: E402
from rolloutd.rollout import puller as puller_module  # noqa: E402
from rolloutd.rollout.mirror import Mirror  # noqa: E402
from rolloutd.rollout.registry_client import RegistryClient, Timeouts  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="registry URL")
    p.add_argument("--mirror", type=Path, required=True, help="mirror directory")
    p.add_argument("--version", default="latest")
    p.add_argument("--streams", type=int, default=4, help="concurrent transfers, over all workers")
    p.add_argument("--workers", type=int, default=1, help="pull worker processes")
    p.add_argument("--priority", choices=("idle", "low", "normal"), default="normal",
                   help="CPU priority of the pull workers")
    p.add_argument("--again", action="store_true",
                   help="as the daemon between two RL steps: pull the version once more (not timed), so that "
                        "the workers of that pull are kept as the daemon keeps its last pull's (a build that "
                        "keeps them), and remove it, as the daemon's gc removes one no server uses (a build "
                        "that recycles overwrites its files); then the timed pull")
    keep = Pull.model_fields.get("keep_workers_s")  # None in a build (--repo) that starts them per pull
    p.add_argument("--keep-workers-s", type=float, default=keep.default if keep else 0.0,
                   help="how long the puller keeps its workers after a pull (default: the daemon's)")
    p.add_argument("--request-mib", type=int, default=16, help="largest Range request")
    p.add_argument("--piece-kib", type=int, default=1024, help="largest piece read from a response at once")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--repo", type=Path, help="import rolloutd from this directory (to compare builds)")
    args = p.parse_args()
    args.version = int(args.version) if args.version != "latest" else args.version
    return args


async def pull(args: argparse.Namespace) -> dict:
    async with RegistryClient(args.url, timeouts=Timeouts(read_s=60.0), max_connections=args.streams + 2) as client:
        mirror = Mirror(args.mirror, max_bytes=1 << 50)
        puller = make_puller(client, mirror, holder="bench-node", streams=args.streams,
                             request_bytes=args.request_mib << 20, piece_bytes=args.piece_kib << 10,
                             workers=args.workers, priority=args.priority, keep_workers_s=args.keep_workers_s)
        try:
            if args.again:  # as the daemon between two RL steps
                remove_all(mirror)
                await asyncio.wait_for(puller.pull(args.version), args.timeout_s)  # the step before: workers kept
                remove_all(mirror)  # gc: the timed pull overwrites these files
            kept = set(getattr(puller, "kept_worker_pids", []))  # workers alive before the pull
            cpu0, own0, machine0 = _cpu() + _live_cpu(kept), _own_cpu(), machine_busy_s()
            result = await asyncio.wait_for(puller.pull(args.version), args.timeout_s)
            kept |= set(getattr(puller, "kept_worker_pids", []))  # and those alive after it
            cpu, own, machine = _cpu() + _live_cpu(kept) - cpu0, _own_cpu() - own0, machine_busy_s() - machine0
        finally:
            if hasattr(puller, "close"):
                await puller.close()
    return {"bytes": result.bytes, "seconds": round(result.seconds, 4),
            "gb_per_s": round(result.bytes / result.seconds / 1e9, 4), "client_cpu_s": round(cpu, 3),
            "puller_cpu_s": round(own, 3), "machine_cpu_s": round(machine, 3), "retries": result.retries,
            "path": str(result.path),
            "digest": result.digest}


def remove_all(mirror: Mirror) -> None:
    for v in mirror.versions():
        mirror.remove(v, "pulled again")


def make_puller(client, mirror, **settings):
    """The puller as this build (``--repo``) takes its settings: a ``PullSettings``, or keywords in
    an older one; a setting the build lacks (workers, priority, keep_workers_s) is left out."""
    import inspect
    settings_model = getattr(puller_module, "PullSettings", None)
    if settings_model is not None:
        known = settings_model.model_fields
        return puller_module.Puller(client, mirror, settings_model(**{k: v for k, v in settings.items() if k in known}))
    known = inspect.signature(puller_module.Puller).parameters
    return puller_module.Puller(client, mirror, **{k: v for k, v in settings.items() if k in known})


def _live_cpu(pids: set[int]) -> float:
    """CPU seconds of pull workers that are alive (kept between pulls: not reaped, so not in
    ``os.times``' children)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def _cpu() -> float:
    """CPU seconds of this process and of its children reaped so far (the pull workers that
    were not kept)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _own_cpu() -> float:
    """CPU seconds of this process alone: the puller's loop, without its workers."""
    t = os.times()
    return t.user + t.system


def main() -> None:
    args = parse_args()
    if args.loop == "uvloop":
        import uvloop
        out = uvloop.run(pull(args))
    else:
        out = asyncio.run(pull(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
