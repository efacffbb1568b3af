"""A soak under chaos: the real daemon, two real vLLM servers, versions every few seconds, faults
at random, and every answer a server gives checked against transformers.

What runs, all on this machine:

- a standalone registry (``rolloutd registry``, bytes in memory), reached by the daemon through
  a fake network path that can corrupt or throttle byte transfers (bench/soak_faults.py);
- ``rolloutd run`` as shipped, a subprocess with its own config file, supervising two real CPU
  ``vllm serve`` (a tied Qwen2-shaped model; compute threads bound to cores 0 and 1);
- a trainer (bench/soak_check.py) that publishes a new version every ``--publish-every-s`` over
  HTTP, with a canary, and computes each version's reference greedy outputs with transformers;
- faults, one every ``--fault-every-s`` (less when the run is too short for every kind to happen
  once; the first round is completed even past ``--minutes``, up to twice as long, so that every
  kind happens on a slow host too), each kind once per round in a random order: kill -9 of a
  server's process group, of its engine core (also mid-update), a registry restart that loses
  every version, a corrupted chunk, a slow pull, SIGHUP after a server's entry changed, a
  version the plugin must refuse, kill -9 of the daemon itself (also mid-pull) and its restart;
- a checker that asks every server claimed SERVING (by ``/status`` and by the registry's
  directory) for a greedy generation through its gateway, about once a second, and judges it.

After ``--minutes``: a last version is published and every server must serve it (``converged``),
the daemon is stopped with SIGTERM, and nothing of it may be left: no process carrying its tag,
no ``/dev/shm`` segment its children mapped. The daemon's RSS and open fds are sampled every
``--sample-every-s`` over the run (median of the first quarter against the last, over the
daemon's longest life), and its event loop's longest lateness is read from its metrics
(``rolloutd_loop_lag_max_seconds``, every life's).

Progress lines go to stdout; the last line is one JSON object. Exit status 1 when a goal is
missed (``goals_missed`` in the JSON says which). From the repository root::

    .venv/bin/python bench/soak.py --minutes 60          # about 65 minutes
    .venv/bin/python bench/soak.py --minutes 3 --seed 1  # what tests/system/test_soak.py runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.soak_check import FAMILY, PROMPTS, Checker, Claim, Trainer  # noqa: E402
from bench.soak_faults import KINDS, Chaos, FakeFaultyPath, RegistryProcess, daemon_metrics, over_lives  # noqa: E402
from rolloutd.demo import families  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.support.daemon_harness import DaemonProcess, config, tagged_pids, vllm_server  # noqa: E402
from tests.support.vllm_server import require_vllm, shm_mapped  # noqa: E402

SERVERS = 2


def say(msg: str) -> None:
    print(f"soak: {msg}", flush=True)


# -- the daemon's footprint over the run -------------------------------------------------------------
@dataclass
class Sampler:
    """The daemon's RSS and open fds, the shared-memory segments its children map, the load."""

    daemon: DaemonProcess
    samples: list[tuple[float, float, int, int]] = field(default_factory=list)  # (t, RSS MiB, fds, daemon pid)
    shm: set[str] = field(default_factory=set)
    load: list[float] = field(default_factory=list)
    states: Counter = field(default_factory=Counter)  # (server, state) -> samples

    def sample(self) -> None:
        proc = self.daemon.proc
        if proc.poll() is not None:
            return  # down: killed by a daemon_crash fault and not started again yet (or gone: the stop says why)
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1)) / 1024
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        except (OSError, AttributeError):  # it died between the two looks
            return
        self.samples.append((time.monotonic(), rss, fds, proc.pid))
        self.shm |= {n for n in shm_mapped(tagged_pids(self.daemon.tag)) if n.startswith("psm_")}
        self.load.append(os.getloadavg()[0])
        with contextlib.suppress(httpx.HTTPError, ValueError):
            self.states.update((s["name"], s["state"]) for s in self.daemon.status()["servers"])

    def serving(self) -> dict[str, float]:
        """Per server, the share of samples in which it was SERVING."""
        names = sorted({name for name, _ in self.states})
        return {n: round(self.states[(n, "SERVING")] / max(1, sum(c for (m, _), c in self.states.items() if m == n)),
                         3) for n in names}

    async def run(self, stop: asyncio.Event, every_s: float) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            await _wait(stop, every_s)

    def drift(self) -> dict:
        """Median of the first quarter of the samples against the last quarter's, over the
        daemon's longest life (a restarted daemon warms up again: that is not a leak)."""
        lives: dict[int, list] = {}
        for row in self.samples:
            lives.setdefault(row[3], []).append(row)
        longest = max(lives.values(), key=len, default=[])
        n = max(1, len(longest) // 4)
        first, last = longest[:n], longest[-n:]

        def med(rows, i):
            return statistics.median(r[i] for r in rows) if rows else 0.0
        return {"rss_first_mib": round(med(first, 1), 1), "rss_last_mib": round(med(last, 1), 1),
                "rss_drift_mib": round(med(last, 1) - med(first, 1), 1),
                "rss_max_mib": round(max((r[1] for r in self.samples), default=0.0), 1),
                "fds_first": med(first, 2), "fds_last": med(last, 2), "fd_drift": med(last, 2) - med(first, 2),
                "samples": len(self.samples), "samples_longest_life": len(longest),
                # a dozen points over that life: a leak climbs to the end, an allocator warming up levels off
                "rss_series_mib": [round(longest[i][1], 1) for i in range(0, len(longest), max(1, len(longest) // 12))]}


# -- setup -------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.tag = f"soak-{uuid.uuid4().hex[:10]}"
        self.registry = RegistryProcess(free_port(), work)
        self.path: FakeFaultyPath | None = None
        self.daemon: DaemonProcess | None = None
        self.trainer = Trainer(self.registry.url, canary=not args.no_canary)
        self.result: dict = {"minutes": args.minutes, "seed": args.seed, "cpus": os.cpu_count()}

    def start(self) -> None:
        import torch
        torch.set_num_threads(1)  # tiny models next to two vLLM servers: more threads only spin
        say(f"work directory {self.work}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        start_model = families.build(self.work / "start-model", FAMILY, 0)
        self.trainer.start_model()
        self.registry.start()
        self.path = FakeFaultyPath(self.registry.port).start()
        v = self.trainer.publish_next()
        servers = [vllm_server(f"s{i}", start_model, str(i % (os.cpu_count() or 1)))
                   for i in range(SERVERS)]
        cfg = config(self.work, self.path.url, servers, tag=self.tag,
                     node={"name": "soak-node", "advertise_host": "127.0.0.1"},
                     heartbeat={"interval_s": 0.5, "timeout_s": 2},
                     # lenient probes: the host is shared, and a slow answer is not a dead server
                     health={"interval_s": 1, "timeout_s": 5, "failures": 3},
                     # the soak kills servers on purpose, on a slow host faster than they can serve
                     # stable_after_s: FATAL would count the soak's faults, not the daemon's (a server
                     # that never comes back still fails the run: it never converges)
                     restart={"start_timeout_s": 600, "backoff_initial_s": 0.5, "backoff_max_s": 4,
                              "max_retries": 20, "stable_after_s": 60, "failed_grace_s": 2},
                     shutdown={"server_grace_s": 10, "kill_wait_s": 10})
        self.daemon = DaemonProcess(cfg, self.work).start()
        say(f"registry {self.registry.url} (through the fake path {self.path.url}), version {v} published; "
            f"rolloutd pid {self.daemon.proc.pid}, admin {self.daemon.url}; waiting for {SERVERS} servers")
        t0 = time.monotonic()
        self.daemon.wait(lambda st: all(s["state"] == "SERVING" and s["version"] == v for s in st["servers"]),
                         self.args.start_timeout_s, f"every server SERVING version {v}")
        self.result["start_s"] = round(time.monotonic() - t0, 1)
        say(f"every server SERVING v{v} after {self.result['start_s']} s; chaos for {self.args.minutes} min")

    # -- the run ---------------------------------------------------------------------------------------
    async def chaos(self) -> None:
        args = self.args
        seconds = args.minutes * 60
        spacing = min(args.fault_every_s, seconds / (len(KINDS) + 1))
        self.checker = Checker(self.daemon.url, self.registry.url, self.trainer, every_s=args.check_every_s)
        self.faults = Chaos(daemon=self.daemon, path=self.path, registry=self.registry, trainer=self.trainer,
                            rng=self.rng, spacing_s=spacing)
        self.sampler = Sampler(self.daemon)
        stop = asyncio.Event()
        t0 = time.monotonic()
        until = t0 + seconds
        say(f"a version every {args.publish_every_s:g} s, a fault every {spacing:.0f} s, a check every "
            f"{args.check_every_s:g} s per server")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.checker.run(stop))
            tg.create_task(self.sampler.run(stop, args.sample_every_s))
            tg.create_task(self._progress(stop, t0))
            tg.create_task(self._publisher(stop))
            await self.faults.run(until, first_round_by=until + seconds)
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            stop.set()
        self.result["chaos_s"] = round(time.monotonic() - t0, 1)

    async def _publisher(self, stop: asyncio.Event) -> None:
        while True:
            await _wait(stop, self.args.publish_every_s)
            if stop.is_set():
                return
            try:
                await asyncio.to_thread(self.trainer.publish_next)
            except Exception as e:  # noqa: BLE001 - the registry may be down: a trainer tries again later
                say(f"publish failed: {e!r}")

    async def _progress(self, stop: asyncio.Event, t0: float) -> None:
        while True:
            await _wait(stop, self.args.progress_every_s)
            if stop.is_set():
                return
            try:
                st = await asyncio.to_thread(self.daemon.status)
                servers = ", ".join(f"{s['name']} {s['state']} v{s['version']} inc {s['incarnation']}"
                                    for s in st["servers"])
            except (httpx.HTTPError, ValueError) as e:
                servers = f"status unavailable ({e!r})"
            c = self.checker.counts
            rss = f"{self.sampler.samples[-1][1]:.1f} MiB, {self.sampler.samples[-1][2]} fds" \
                if self.sampler.samples else "-"
            say(f"{(time.monotonic() - t0) / 60:.1f} min: v{self.trainer.next_version - 1} published "
                f"({len(self.trainer.bad)} bad) | {servers} | checks {c['checks']}: ok {c['ok'] + c['ok_spanning']} "
                f"(spanning {c['ok_spanning']}), wrong {self.checker.wrong}, torn {c['torn']}, unavailable "
                f"{c['unavailable']} | faults {dict(self.faults.fired)} | daemon {rss} | load "
                f"{os.getloadavg()[0]:.1f}")

    async def settle(self) -> None:
        """A last good version (the newest may be one every server refuses); every server must serve it."""
        v = await asyncio.to_thread(self.trainer.publish_next)
        say(f"settle: v{v} published; waiting for every server to serve it")
        t0 = time.monotonic()
        try:
            st = await asyncio.to_thread(self.daemon.wait, lambda st: all(
                s["state"] == "SERVING" and s["version"] == v for s in st["servers"]), self.args.settle_timeout_s,
                f"every server SERVING version {v}")
        except AssertionError as e:
            self.result["converged"] = False
            say(f"settle: NOT converged: {str(e)[:2000]}")
            return
        self.result.update(converged=True, settle_s=round(time.monotonic() - t0, 1))
        async with httpx.AsyncClient(timeout=90) as http:  # every prompt, on every server
            for s in st["servers"]:
                claim = Claim(s["name"], s["endpoint"], s["version"], s["incarnation"])
                for i in range(len(PROMPTS)):
                    verdict = await self.checker.check(http, claim, prompt=i)
                    if verdict is None or verdict.kind != "ok":
                        self.result["converged"] = False
                        say(f"settle: {s['name']} prompt {i}: {verdict}")
        say(f"settle: every server SERVING v{v} after {self.result['settle_s']} s, outputs checked")

    # -- the end ---------------------------------------------------------------------------------------
    def read_metrics(self) -> None:
        """The daemon's counters over all its lives (a daemon_crash fault read the killed ones')."""
        lives = [*self.faults.lives, daemon_metrics(self.daemon.url)]
        self.result.update(over_lives(lives), daemon_lives=len(lives))

    def stop(self) -> None:
        """SIGTERM; then nothing of the daemon may be left."""
        try:
            self.result["daemon_exit"] = self.daemon.stop(120)
        except AssertionError as e:
            self.result["daemon_exit"] = None
            say(f"stop: {str(e)[:1000]}")
        deadline = time.monotonic() + 20
        while tagged_pids(self.tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = tagged_pids(self.tag)
        shm = sorted(n for n in self.sampler.shm if (Path("/dev/shm") / n).exists())
        self.result.update(orphans=len(left) + len(shm), orphan_processes=left, orphan_shm=shm,
                           shm_segments_seen=len(self.sampler.shm))
        self.daemon.kill_everything()  # whatever was left is reported above; now it goes
        for name in shm:
            (Path("/dev/shm") / name).unlink(missing_ok=True)

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.kill_everything()
        if self.path is not None:
            self.path.stop()
        self.registry.crash()

    def summary(self) -> dict:
        c, r, args = self.checker.counts, self.result, self.args
        r.update(self.sampler.drift(), serving_share=self.sampler.serving())
        r.update(versions_published=self.trainer.next_version - 1, bad_versions=len(self.trainer.bad),
                 republished=self.trainer.republished,
                 faults={k: self.faults.fired[k] for k in KINDS}, fault_rounds=self.faults.rounds,
                 faults_missed=dict(self.faults.missed), fault_errors=self.faults.errors,
                 fault_log=self.faults.log[-200:], corrupt_uncaught=len(self.faults.uncaught),
                 checks=c["checks"], checks_ok=c["ok"], checks_spanning_ok=c["ok_spanning"],
                 wrong_outputs=self.checker.wrong, torn_loads=c["torn"], stale_outputs=c["stale"],
                 bad_version_served=c["bad_version"], claim_mismatches=c["claim_mismatch"],
                 unjudged=c["unjudged"], partial=c["partial"], unavailable=c["unavailable"],
                 directory_only_claims=c["directory_only_claims"],
                 problems=self.checker.problems[:10],
                 load1_mean=round(statistics.mean(self.sampler.load), 2) if self.sampler.load else None)
        goals = {
            "wrong_outputs": r["wrong_outputs"] == 0, "torn_loads": r["torn_loads"] == 0,
            "claim_mismatches": r["claim_mismatches"] == 0, "orphans": r["orphans"] == 0,
            "converged": r.get("converged") is True, "daemon_exit": r.get("daemon_exit") == 0,
            "task_errors": r.get("task_errors") == 0, "fault_errors": not r["fault_errors"],
            "corrupt_uncaught": r["corrupt_uncaught"] == 0,
            "checks": r["checks_ok"] > 0,
            "rss_drift_mib": r["rss_drift_mib"] <= args.max_rss_drift_mib,
            "fd_drift": r["fd_drift"] <= args.max_fd_drift,
            "loop_stall_max_s": r.get("loop_stall_max_s", float("inf")) <= args.max_loop_stall_s,
            "every_fault_kind": all(r["faults"][k] > 0 for k in KINDS),
        }
        r["goals_missed"] = [g for g, ok in goals.items() if not ok]
        return r


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60, help="length of the chaos (default %(default)s)")
    ap.add_argument("--seed", type=int, default=None, help="the fault schedule's random seed (default: random)")
    ap.add_argument("--publish-every-s", type=float, default=5)
    ap.add_argument("--fault-every-s", type=float, default=60,
                    help="at most this long between faults; less when the run is too short for every kind")
    ap.add_argument("--check-every-s", type=float, default=1)
    ap.add_argument("--sample-every-s", type=float, default=5)
    ap.add_argument("--progress-every-s", type=float, default=30)
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--settle-timeout-s", type=float, default=600)
    ap.add_argument("--no-canary", action="store_true", help="publish versions without a canary")
    ap.add_argument("--max-rss-drift-mib", type=float, default=10, help="goal (default %(default)s)")
    ap.add_argument("--max-fd-drift", type=float, default=10, help="goal (default %(default)s)")
    ap.add_argument("--max-loop-stall-s", type=float, default=2, help="goal (default %(default)s)")
    ap.add_argument("--workdir", help="models, mirror, logs (default: a temporary directory, removed on success)")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_vllm()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolloutd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, work)
    try:
        soak.start()
        asyncio.run(soak.chaos())
        asyncio.run(soak.settle())
        soak.read_metrics()
        soak.stop()
        result = soak.summary()
    except Exception as e:  # the soak itself broke: still one JSON line, and a failure
        traceback.print_exc()
        result = {**soak.result, "error": repr(e), "goals_missed": ["error"]}
    finally:
        soak.close()
    say(f"daemon log {soak.daemon.log if soak.daemon else '-'}; goals missed: {result['goals_missed'] or 'none'}")
    if not result["goals_missed"] and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 1 if result["goals_missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
