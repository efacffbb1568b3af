"""The soak's faults (bench/soak.py): what it breaks, how, and when.

Every kind, in a random order each round (round-robin: each kind once per round), one every
``spacing_s``; a kind that cannot happen now (no server with a live engine to kill) lets the
next one of the round go first:

- ``kill_group``: ``kill -9`` of a server's whole process group;
- ``kill_engine``: ``kill -9`` of a serving server's engine core alone;
- ``kill_engine_mid_load``: the same while the server is UPDATING: its engine core is stopped
  (SIGSTOP), a version published, and once the daemon shows the server UPDATING (a request of
  the update held by the stopped engine), killed;
- ``registry_restart``: the standalone registry killed, down a few seconds, started again empty
  (a new instance), the trainer's newest two versions republished;
- ``corrupt_chunk``: the fake path flips a byte of the next Range reply (the puller must catch
  it by its digest);
- ``slow_pull``: the fake path delays every Range reply by 1 s for 15 s;
- ``reload``: one server's entry changed in the config file (an environment variable), then
  SIGHUP: that server restarts;
- ``bad_version``: a version lacking one tensor, without ``partial``: every server must refuse it;
- ``daemon_crash``: ``kill -9`` of the daemon itself, half the time mid-pull (Range replies
  delayed until its pull workers are seen moving a new version's bytes), then started again as
  systemd would: its pull workers (moving bytes, or kept idle for the next pull) must exit
  with it, and the new daemon must stop every server process the dead one left before it
  serves. A killed daemon takes its counters with it, so
  they are read just before the kill (``lives``).

Processes are signalled only when they carry the soak's tag in their environment: a pid read
from ``/status`` a moment ago could belong to someone else by now.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.soak_check import MISSING, Trainer
from tests.conftest import wait_healthy
from tests.support.daemon_harness import DaemonProcess, tagged_pids
from tests.support.registry_proxy import RegistryProxy
from tests.support.vllm_server import ROOT, engine_core

KINDS = ("kill_group", "kill_engine", "kill_engine_mid_load", "registry_restart", "corrupt_chunk", "slow_pull",
         "reload", "bad_version", "daemon_crash")
SLOW_DELAY_S, SLOW_FOR_S = 1.0, 15.0
WORKERS_EXIT_S = 10.0  # a pull worker exits when its stdin closes with the daemon
LEFTOVERS_STOPPED_S = 120.0  # the new daemon stops what the dead one left before starting servers


class FakeFaultyPath(RegistryProxy):
    """A fake network path from the daemon to the registry (``tests/support/registry_proxy.py``), which
    can also flip a byte of the next Range reply (``corrupt_next``). Its ``byte_delay_s``
    throttles every byte transfer."""

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port)
        self.corrupt_armed = False
        self.corrupted: list[str] = []

    def corrupt_next(self) -> None:
        self.corrupt_armed = True

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        response = await super()._handle(request)
        if (self.corrupt_armed and request.method == "GET" and "/files/" in request.path
                and response.status == 206 and response.body):
            self.corrupt_armed = False
            body = bytearray(response.body)
            body[len(body) // 2] ^= 0xFF
            response.body = bytes(body)
            self.corrupted.append(f"{request.path} {request.headers.get('range')}")
        return response


class RegistryProcess:
    """``rolloutd registry`` on a fixed port, bytes in memory: a crash loses every version."""

    def __init__(self, port: int, work: Path):
        self.port, self.work = port, work
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> RegistryProcess:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        with open(self.work / f"registry-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "registry", "--port", str(self.port)],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        wait_healthy(self.url, self.proc, timeout_s=120)
        return self

    def instance(self) -> str:
        return httpx.get(self.url + "/v1/versions/latest", timeout=10).json()["instance"]

    def crash(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def tagged(pid: int, tag: str) -> bool:
    """The process carries the soak's tag: it is one of ours, not a reused pid."""
    try:
        return f"ROLLOUTD_TEST_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


class Chaos:
    def __init__(self, *, daemon: DaemonProcess, path: FakeFaultyPath, registry: RegistryProcess, trainer: Trainer,
                 rng: random.Random, spacing_s: float):
        self.daemon, self.path, self.registry, self.trainer = daemon, path, registry, trainer
        self.rng, self.spacing_s = rng, spacing_s
        self.fired: Counter = Counter()
        self.missed: Counter = Counter()  # tried, but what makes it that fault did not happen
        self.errors: list[str] = []
        self.log: list[dict] = []
        self.uncaught: list[str] = []  # corrupted replies the puller did not notice
        self.rounds = 0
        self._reloads = 0
        self.lives: list[dict] = []  # the counters of each daemon killed, read just before

    async def run(self, until: float, first_round_by: float) -> None:
        """Rounds until ``until``; the first round is completed even after it (every kind happens
        at least once; on a slow host servers take minutes to come back), until ``first_round_by``."""
        next_at = time.monotonic() + self.spacing_s / 2
        while time.monotonic() < until:
            pending = self.rng.sample(KINDS, len(KINDS))
            self.rounds += 1
            end = first_round_by if self.rounds == 1 else until
            while pending and time.monotonic() < end:
                await asyncio.sleep(max(0.0, min(next_at, end) - time.monotonic()))
                if time.monotonic() >= end:
                    return
                kind = await self._one_of(pending)
                if kind is None:
                    await asyncio.sleep(2)  # none can happen now (servers restarting): look again soon
                    continue
                pending.remove(kind)
                next_at = time.monotonic() + self.spacing_s

    async def _one_of(self, pending: list[str]) -> str | None:
        """Inject the first kind of ``pending`` that can happen now; the kind injected, or None."""
        for kind in pending:
            try:
                detail = await getattr(self, kind)()
            except Exception as e:  # noqa: BLE001 - a fault that broke is reported, the soak goes on
                self.errors.append(f"{kind}: {e!r}")
                print(f"soak: fault {kind} failed: {e!r}", flush=True)
                continue
            if detail is None:
                continue
            self.fired[kind] += 1
            self.log.append({"at_unix": round(time.time(), 1), "kind": kind, "detail": detail})
            print(f"soak: fault {kind}: {detail}", flush=True)
            return kind
        return None

    # -- the faults: each returns what it did, or None when it cannot happen now -----------------
    async def kill_group(self) -> str | None:
        s = self._pick(await self._servers(lambda s: s["pid"] is not None))
        if s is None or not tagged(s["pid"], self.daemon.tag):
            return None
        os.killpg(s["pid"], signal.SIGKILL)
        return f"{s['name']}: SIGKILL to group {s['pid']} ({s['state']} v{s['version']})"

    async def kill_engine(self) -> str | None:
        s, core = await self._serving_engine()
        if core is None:
            return None
        os.kill(core, signal.SIGKILL)
        return f"{s['name']}: SIGKILL to engine core {core} (SERVING v{s['version']})"

    async def kill_engine_mid_load(self) -> str | None:
        s, core = await self._serving_engine()
        if core is None:
            return None
        os.kill(core, signal.SIGSTOP)  # the update's first request to the engine waits on it
        try:
            version = await asyncio.to_thread(self.trainer.publish_next)
            seen = await self._until(lambda st: self._state(st, s["name"]) == "UPDATING", 90)
            if seen:
                await asyncio.sleep(0.5)  # a request of the update is in flight, held by the stopped engine
        finally:
            os.kill(core, signal.SIGKILL)
        if not seen:
            self.missed["kill_engine_mid_load"] += 1
            print(f"soak: {s['name']} never UPDATING to v{version} with its engine stopped; killed it anyway",
                  flush=True)
            return None
        return f"{s['name']}: SIGKILL to engine core {core} while UPDATING to v{version}"

    async def registry_restart(self) -> str | None:
        down_s = self.rng.uniform(1, 5)

        def restart() -> tuple[str, list[int]]:
            with self.trainer.lock:  # no publication reaches the new registry before the republished ones
                before = self.registry.instance()
                self.registry.crash()
                time.sleep(down_s)
                self.registry.start()
                return before, self.trainer.republish(2)
        before, again = await asyncio.to_thread(restart)
        return f"instance {before} -> {self.registry.instance()}, down {down_s:.1f} s, republished {again}"

    async def corrupt_chunk(self) -> str | None:
        done, since = len(self.path.corrupted), self.daemon.log.stat().st_size
        self.path.corrupt_next()
        if not await self._until_true(lambda: len(self.path.corrupted) > done, 60):
            self.path.corrupt_armed = False
            self.missed["corrupt_chunk"] += 1
            return None
        what = self.path.corrupted[-1]
        m = re.match(r"/v1/versions/(\d+)/files/(\S+) bytes=(\d+)-", what)
        retry = f"retry version {m.group(1)} file {m.group(2)} chunk "
        if await self._until_true(lambda: retry in self._log_since(since), 30):
            return f"flipped a byte of {what}; the puller caught it and fetched the chunk again"
        self.uncaught.append(what)
        return f"flipped a byte of {what}; NOT caught (no '{retry}...' in the daemon's log)"

    async def slow_pull(self) -> str | None:
        before = self.path.byte_requests
        self.path.byte_delay_s = SLOW_DELAY_S
        try:
            await asyncio.sleep(SLOW_FOR_S)
            await self._until_true(lambda: self.path.byte_requests > before, 45)  # at least one pull slowed
        finally:
            self.path.byte_delay_s = 0.0
        slowed = self.path.byte_requests - before
        if not slowed:
            self.missed["slow_pull"] += 1
            return None
        return f"{slowed} Range replies delayed by {SLOW_DELAY_S:g} s"

    async def reload(self) -> str | None:
        self._reloads += 1
        cfg = copy.deepcopy(self.daemon.cfg)
        entry = self.rng.choice(cfg["servers"])
        entry["env"] = {**entry.get("env", {}), "SOAK_RELOAD": str(self._reloads)}
        since = self.daemon.log.stat().st_size
        self.daemon.write(cfg)
        self.daemon.signal(signal.SIGHUP)
        if not await self._until_true(lambda: "reload: servers" in self._log_since(since), 60):
            self.missed["reload"] += 1
            return None
        line = next(ln for ln in self._log_since(since).splitlines() if "reload: servers" in ln)
        return f"{entry['name']}'s env changed, SIGHUP: {line.split('reload: ', 1)[1][:160]}"

    async def bad_version(self) -> str | None:
        if not await self._servers(lambda s: s["state"] == "SERVING"):
            return None  # with no server serving, the next version would replace it before any tried it
        version = await asyncio.to_thread(self.trainer.publish_bad)
        return f"v{version} lacks {MISSING}"

    async def daemon_crash(self) -> str | None:
        mid_pull = self.rng.random() < 0.5
        try:
            if mid_pull:
                self.path.byte_delay_s = SLOW_DELAY_S  # the pull's bytes wait: its workers are caught moving them
                version = await asyncio.to_thread(self.trainer.publish_next)
                if not await self._until(lambda st: _pulling(st, version), 60):
                    self.missed["daemon_crash"] += 1
                    return None
            st = await self._status()
            if st is None:
                return None
            self.lives.append(await asyncio.to_thread(daemon_metrics, self.daemon.url))
            # a pull's workers, and those kept idle for the next pull (while serving)
            workers = _processes([*((st.get("pull") or {}).get("workers") or []), *st.get("pull_workers_kept", [])])
            servers = _processes(tagged_pids(self.daemon.tag))
            dead = self.daemon.proc.pid
            self.daemon.proc.kill()
            await asyncio.to_thread(self.daemon.proc.wait)
        finally:
            self.path.byte_delay_s = 0.0
        if not await self._until_true(lambda: not _running(workers), WORKERS_EXIT_S):
            self.errors.append(f"daemon_crash: pull workers {_running(workers)} outlived the daemon")
        await asyncio.sleep(self.rng.uniform(0.5, 3))  # systemd's RestartSec
        t0 = time.monotonic()
        self.daemon.start()
        if not await self._until_true(lambda: not _running(servers), LEFTOVERS_STOPPED_S):
            self.errors.append(f"daemon_crash: processes {_running(servers)} the killed daemon left still run "
                               f"{LEFTOVERS_STOPPED_S:g} s after its restart")
        where = f"mid-pull of v{version}" if mid_pull else "while serving"
        if workers:
            where += f", {len(workers)} pull worker(s) gone with it"
        return (f"SIGKILL to rolloutd {dead} ({where}); started again as {self.daemon.proc.pid}, which stopped the "
                f"{len(servers)} server process(es) it left in {time.monotonic() - t0:.1f} s")

    # -- helpers -----------------------------------------------------------------------------------
    async def _status(self) -> dict | None:
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                return (await http.get(self.daemon.url + "/status")).json()
        except (httpx.HTTPError, ValueError):
            return None

    async def _servers(self, which: Callable[[dict], bool]) -> list[dict]:
        st = await self._status()
        return [s for s in (st or {}).get("servers", []) if which(s)]

    def _pick(self, servers: list[dict]) -> dict | None:
        return self.rng.choice(servers) if servers else None

    async def _serving_engine(self) -> tuple[dict | None, int | None]:
        s = self._pick(await self._servers(lambda s: s["state"] == "SERVING" and s["pid"] is not None))
        if s is None or not tagged(s["pid"], self.daemon.tag):
            return s, None
        core = await asyncio.to_thread(engine_core, s["pid"])
        return s, core if core is not None and tagged(core, self.daemon.tag) else None

    @staticmethod
    def _state(st: dict | None, name: str) -> str | None:
        return next((s["state"] for s in (st or {}).get("servers", []) if s["name"] == name), None)

    async def _until(self, predicate: Callable[[dict | None], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(await self._status()):
                return True
            await asyncio.sleep(0.1)
        return False

    @staticmethod
    async def _until_true(predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            await asyncio.sleep(0.2)
        return predicate()

    def _log_since(self, offset: int) -> str:
        with open(self.daemon.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


def _pulling(st: dict | None, version: int) -> bool:
    pull = (st or {}).get("pull") or {}
    return pull.get("version") == version and pull.get("state") == "pulling" and bool(pull.get("workers"))


def _processes(pids: list[int]) -> list[psutil.Process]:
    """The processes behind ``pids`` now (a pid reused later is not the same process)."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def _running(processes: list[psutil.Process]) -> list[int]:
    """Those still alive (a zombie is not: it waits only to be reaped)."""
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:  # gone between the two looks
            pass
    return alive


def daemon_metrics(url: str) -> dict:
    """The daemon's counters the soak reports, from its ``/metrics``."""
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            values.setdefault(s.name, {})[",".join(f"{v}" for _, v in sorted(s.labels.items()))] = s.value
    lag = values.get("rolloutd_loop_lag_seconds_count", {}).get("", 0)
    return {
        "updates": int(sum(values.get("rolloutd_updates_total", {}).values())),
        "update_failures": {k: int(v) for k, v in values.get("rolloutd_update_failures_total", {}).items() if v},
        "restarts": {k: int(v) for k, v in values.get("rolloutd_server_restarts_total", {}).items()},
        "task_errors": int(sum(values.get("rolloutd_task_errors_total", {}).values())),
        "loop_stall_max_s": round(values.get("rolloutd_loop_lag_max_seconds", {}).get("", float("nan")), 3),
        "loop_lag_samples": int(lag),
        "loop_lag_over_100ms": int(lag - values.get("rolloutd_loop_lag_seconds_bucket", {}).get("0.1", 0)),
    }


def over_lives(lives: list[dict]) -> dict:
    """The counters of every life of the daemon together: sums, and the longest stall."""
    total: dict = {}
    for life in lives:
        for k, v in life.items():
            if isinstance(v, dict):
                merged = total.setdefault(k, {})
                for label, n in v.items():
                    merged[label] = merged.get(label, 0) + n
            elif k == "loop_stall_max_s":
                total[k] = max(total.get(k, v), v)
            else:
                total[k] = total.get(k, 0) + v
    return total
