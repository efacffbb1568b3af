"""The pull's worker processes, seen from the daemon: start them, hand them chunks, reap them.

Pull work (network reads, digests, writes into the mirror) runs in ``workers`` child processes
(:mod:`rolloutd.rollout.fetch_worker`), never on the daemon's event loop nor under its
interpreter lock: the gateway relays tokens, heartbeats go out and the admin API answers
while a version of any size is pulled. The daemon's share of a pull is one JSON line per chunk
and one per ``progress_bytes`` written.

Contract:

- ``async with FetchPool(...) as pool`` (or ``await pool.start()`` ... ``await pool.close()``,
  for a pool kept between pulls) starts the workers (in the daemon's cgroup, each
  in its own session so a terminal's Ctrl-C reaches only the daemon, at ``priority``) and returns
  once each said it is ready; leaving the block stops and reaps every one, on every path
  (cancellation included): stdin closed (a worker exits at once at its end), then SIGKILL after
  ``stop_grace_s``. A worker whose daemon dies sees its stdin end and exits: none outlives it.
- ``await pool.fetch(job, progress)`` runs one chunk on a worker with a free stream, from the
  job's source (a worker keeps the connections of the sources it used last); ``progress``
  gets the bytes written as they are. It raises :class:`ChunkCorrupt` (bad digest or length),
  the registry's typed error, ``RegistryUnavailable`` (network), ``OSError`` (the mirror's
  file) or :class:`WorkerCrashed`.
- ``await pool.apply(job, progress)`` rebuilds one target file of a delta pull on a worker
  with a free stream (:class:`ApplyJob`); ``progress`` gets the bytes written. It raises
  :class:`DeltaRejected` (a delta that cannot be applied), :class:`TargetDiffers` (a rebuilt
  chunk differs from the target's digest), ``OSError`` (the base's or the partial's files) or
  :class:`WorkerCrashed`.
- Crash policy: a worker that exits unexpectedly fails its chunks with ``WorkerCrashed`` (the
  puller fetches them again, within its retry limit) and is started again after a delay that
  grows from ``restart_initial_s`` to ``restart_max_s``; each restart is counted and reported
  (``on_restart`` gets the workers' pids).
- A worker that does not die but stops working is treated like one that crashed: its chunks
  fail with ``WorkerCrashed`` at once, it is killed (SIGKILL) and started again. That is a
  worker silent for ``silence_s`` (it writes a line every ``beat_s`` however busy) with no
  thread waiting for a CPU (stopped by SIGSTOP, or hung in the kernel; one only starved by its
  low priority on a busy node is waited for), one that writes a line over ``EVENT_LINE_LIMIT`` (it bounds its own lines
  far below: the stream is out of step), and one that has not ended a chunk ``silence_s`` after
  the chunk's own ``timeout_s`` and is not waiting for a CPU (a stream stuck in the kernel,
  where no timeout of its own reaches it). A killed worker that is not gone ``KILL_WAIT_S`` later (stuck in the kernel)
  is left to the kernel and replaced: nothing here waits on a worker without a deadline, so a
  stuck worker never holds a pull, or the daemon's stop, beyond these bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rolloutd.rollout.sources import SourceSpec
from rolloutd.wire import errors

log = logging.getLogger("rolloutd.rollout.fetch_pool")

MiB = 1 << 20
EVENT_LINE_LIMIT = 64 << 10  # longest line read from a worker (it writes at most fetch_worker.MAX_EVENT_BYTES)
KILL_WAIT_S = 5.0            # after SIGKILL, longest wait for a worker to be gone
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the rolloutd the daemon runs: the workers' too


class ChunkCorrupt(Exception):
    """A chunk's bytes do not match the manifest digest (or came short)."""


class WorkerCrashed(Exception):
    """The worker fetching a chunk exited before it finished."""


class DeltaRejected(Exception):
    """A delta file cannot be applied to the base (bad bytes, a base file it names is not there)."""


class TargetDiffers(DeltaRejected):
    """A chunk rebuilt from a delta differs from the target's digest."""


@dataclass(frozen=True)
class ChunkJob:
    source: SourceSpec
    version: int
    name: str      # the file, as the source knows it
    path: Path     # where it goes: the partial directory's file, already at full size
    start: int
    end: int
    hash: str
    digest: str
    timeout_s: float | None = None  # the whole chunk's time limit (a peer); None: only read timeouts
    allocate: bool = True  # the worker allocates the range's pages first; False: they exist (recycled)


@dataclass(frozen=True)
class ApplyJob:
    version: int
    name: str                   # the target file
    base: dict[str, Path]       # the base version's files, read only: name -> path
    delta: Path                 # the delta file, fetched and checked
    target: Path                # the partial directory's file, at full size
    hash: str
    chunk_bytes: int
    digests: tuple[str, ...]    # the target file's chunk digests
    timeout_s: float | None = None  # rebuilds have no time limit of their own: only the worker's silence

    def as_json(self) -> dict:
        return {"apply": {"version": self.version, "name": self.name,
                          "base": {k: str(v) for k, v in self.base.items()}, "delta": str(self.delta),
                          "target": str(self.target), "hash": self.hash, "chunk_bytes": self.chunk_bytes,
                          "digests": list(self.digests)}}


@dataclass
class _Pending:
    future: asyncio.Future
    progress: Callable[[int], None]


@dataclass
class _Worker:
    index: int
    capacity: int
    proc: asyncio.subprocess.Process | None = None
    ready: bool = False
    inflight: dict[int, _Pending] = field(default_factory=dict)
    keeper: asyncio.Task | None = None


class FetchPool:
    def __init__(self, *, workers: int, streams: int, piece_bytes: int = 1 * MiB,
                 request_bytes: int = 16 * MiB, priority: str = "normal", progress_bytes: int = 8 * MiB,
                 on_restart: Callable[[list[int]], None] | None = None, restart_initial_s: float = 0.1,
                 restart_max_s: float = 5.0, start_timeout_s: float = 30.0, stop_grace_s: float = 2.0,
                 beat_s: float = 1.0, silence_s: float = 10.0):
        if workers < 1 or streams < workers:
            raise ValueError(f"need at least one worker and one stream per worker (workers {workers}, "
                             f"streams {streams})")
        if not 0 < beat_s < silence_s:
            raise ValueError(f"a worker's beat (every {beat_s} s) must be shorter than the silence that "
                             f"counts as hung ({silence_s} s)")
        self._hello = {"hello": {"piece_bytes": piece_bytes, "request_bytes": request_bytes,
                                 "priority": priority, "progress_bytes": progress_bytes, "beat_s": beat_s}}
        self._silence_s = silence_s
        # streams spread over the workers as evenly as they go
        self._workers = [_Worker(i, streams // workers + (i < streams % workers)) for i in range(workers)]
        self._on_restart = on_restart or (lambda pids: None)
        self._restart_initial_s, self._restart_max_s = restart_initial_s, restart_max_s
        self._start_timeout_s, self._stop_grace_s = start_timeout_s, stop_grace_s
        self._ids = itertools.count(1)
        self._free = asyncio.Condition()
        self._closing = False
        self._broken: str | None = None  # why the last start failed, until one succeeds
        self.restarts = 0

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.returncode is None]

    @property
    def size(self) -> tuple[int, int]:
        """(workers, streams)."""
        return len(self._workers), sum(w.capacity for w in self._workers)

    @property
    def usable(self) -> bool:
        """Not closed, and its last start of a worker did not fail: worth keeping for a next pull."""
        return not self._closing and self._broken is None

    # -- life -------------------------------------------------------------------------------------------
    async def start(self) -> FetchPool:
        """Start every worker; returns once each said it is ready (``async with`` does this)."""
        try:
            await asyncio.gather(*(self._spawn(w) for w in self._workers))
        except BaseException:
            await self.close()
            raise
        for w in self._workers:
            w.keeper = asyncio.create_task(self._keep(w), name=f"pull-worker-{w.index}")  # awaited in close
        return self

    async def __aenter__(self) -> FetchPool:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop and reap every worker; safe to call twice, and under cancellation it still
        finishes the reaping before the cancellation goes on."""
        self._closing = True
        reap = asyncio.ensure_future(self._reap_all())
        try:
            await asyncio.shield(reap)
        except asyncio.CancelledError:
            await reap
            raise

    async def _reap_all(self) -> None:
        await asyncio.gather(*(self._stop(w) for w in self._workers))
        for w in self._workers:
            if w.keeper is not None:
                w.keeper.cancel()
                try:
                    await w.keeper
                except asyncio.CancelledError:
                    pass
                except Exception:  # a bug in the keeper: the workers are reaped all the same
                    log.exception("crash in the keeper of pull worker %d", w.index)
            # A chunk still awaited here belongs to a pull that was not cancelled first: it fails
            # (a cancelled future would read as a cancelled pull, and a task group ends quietly).
            self._fail(w, WorkerCrashed("the pull's workers were stopped"))

    async def _spawn(self, w: _Worker) -> None:
        w.proc = None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))}
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rolloutd.rollout.fetch_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True, limit=EVENT_LINE_LIMIT)
        try:
            hello = {"hello": {**self._hello["hello"], "streams": w.capacity}}
            async with asyncio.timeout(self._start_timeout_s):
                try:
                    w.proc.stdin.write(json.dumps(hello).encode() + b"\n")
                    await w.proc.stdin.drain()
                except (ConnectionError, RuntimeError):
                    pass  # it is gone already: its exit status says why, below
                try:
                    line = await w.proc.stdout.readline()
                except ValueError:  # a line over the limit
                    line = b""
            if not line.startswith(b'{"ready"'):
                status = None
                with contextlib.suppress(TimeoutError):  # one that goes on running is stopped below
                    async with asyncio.timeout(self._stop_grace_s):
                        status = await w.proc.wait()
                raise WorkerCrashed(f"pull worker {w.proc.pid} did not start ({_status(status)})")
        except BaseException:
            await self._stop(w)
            raise
        w.ready, self._broken = True, None
        log.debug("start pull worker %d (pid %d, %d streams)", w.index, w.proc.pid, w.capacity)

    async def _stop(self, w: _Worker) -> None:
        proc, w.ready = w.proc, False
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()  # the worker exits at the end of its stdin
        try:
            async with asyncio.timeout(self._stop_grace_s):
                await proc.wait()
        except TimeoutError:
            await _kill(proc)

    async def _keep(self, w: _Worker) -> None:
        """Read one worker's events; when it exits unexpectedly or stops working, fail its chunks
        and start it again after a growing delay, counting each restart."""
        delay = self._restart_initial_s
        while True:
            started = time.monotonic()
            if w.proc is not None:
                try:
                    why = await self._read_events(w)
                except Exception as e:  # a bug here must not leave chunks waiting for news that never comes
                    log.exception("crash reading pull worker %d", w.proc.pid)
                    why = f"could not be read ({type(e).__name__}: {e})"
                if why is not None:
                    self._hung(w, why)
                    status = await _kill(w.proc)
                else:
                    status = await _reap(w.proc)
                w.ready = False
                if self._closing:
                    return
                self._fail(w, WorkerCrashed(f"pull worker {w.proc.pid} exited ({_status(status)})"))
                log.warning("restart pull worker %d in %.1f s: pid %d %s", w.index, delay, w.proc.pid,
                            f"exited ({_status(status)})" if why is None else why)
            if time.monotonic() - started > 10 * self._restart_max_s:
                delay = self._restart_initial_s  # it had run well for a while
            await asyncio.sleep(delay)
            delay = min(2 * delay, self._restart_max_s)
            if self._closing:
                return
            try:
                await self._spawn(w)
            except (OSError, WorkerCrashed, TimeoutError) as e:
                log.warning("cannot start pull worker %d: %s", w.index, e)
                w.proc = None
                self._broken = f"cannot start a pull worker: {e}"
            self.restarts += 1
            self._on_restart(self.pids)
            async with self._free:
                self._free.notify_all()

    async def _read_events(self, w: _Worker) -> str | None:
        """Hand the worker's events to their chunks until its output ends (None), or until it
        stops working: then why (the worker must be killed)."""
        while True:
            try:
                line = await self._next_line(w)
            except TimeoutError:
                return f"wrote nothing for {self._silence_s:g} s (stopped or hung)"
            except ValueError:  # readline's limit: the rest of the stream cannot be trusted
                return f"wrote a line over {EVENT_LINE_LIMIT} bytes"
            if not line:
                return None
            try:
                event = json.loads(line)
                if "beat" in event:
                    continue
                pending = w.inflight.get(event["id"])
            except (ValueError, KeyError, TypeError):
                log.warning("pull worker %d: unexpected output %r", w.proc.pid, line[:200])
                continue
            if pending is None or pending.future.done():
                continue  # a chunk given up on (cancelled): its late news means nothing
            if "bytes" in event:
                pending.progress(int(event["bytes"]))
            elif event.get("done"):
                pending.future.set_result(None)
            elif "error" in event:
                pending.future.set_exception(_error(event["error"]))

    async def _next_line(self, w: _Worker) -> bytes:
        """The worker's next line; TimeoutError once it is silent ``silence_s`` and not waiting
        for a CPU (a silent worker that is runnable is starved, not hung: wait on)."""
        while True:
            try:
                async with asyncio.timeout(self._silence_s):  # a readline cut short leaves its bytes buffered
                    return await w.proc.stdout.readline()
            except TimeoutError:
                if not _runnable(w.proc.pid):
                    raise

    def _hung(self, w: _Worker, why: str) -> None:
        """A worker that stopped working: its chunks fail now (a hung process may take long to
        go), and it is killed; its keeper starts another."""
        log.warning("kill pull worker %d (pid %d): it %s", w.index, w.proc.pid, why)
        w.ready = False
        self._fail(w, WorkerCrashed(f"pull worker {w.proc.pid} {why}"))
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGKILL)

    def _fail(self, w: _Worker, error: BaseException) -> None:
        for pending in w.inflight.values():
            if not pending.future.done():
                if isinstance(error, asyncio.CancelledError):
                    pending.future.cancel()
                else:
                    pending.future.set_exception(error)
        w.inflight.clear()

    # -- chunks -----------------------------------------------------------------------------------------
    async def fetch(self, job: ChunkJob, progress: Callable[[int], None]) -> None:
        await self._run(job, {"source": job.source.as_json(), "version": job.version, "name": job.name,
                              "path": str(job.path), "start": job.start, "end": job.end, "hash": job.hash,
                              "digest": job.digest, "timeout_s": job.timeout_s, "allocate": job.allocate},
                        progress)

    async def apply(self, job: ApplyJob, progress: Callable[[int], None]) -> None:
        await self._run(job, job.as_json(), progress)

    async def _run(self, job: ChunkJob | ApplyJob, body: dict, progress: Callable[[int], None]) -> None:
        async with self._free:  # a chunk waits for a free stream, not while no worker can start
            await self._free.wait_for(lambda: self._closing or self._pick() is not None or self._broken)
        w = self._pick()
        if self._closing or w is None:
            raise WorkerCrashed(self._broken or "the pull's workers are stopping")
        job_id = next(self._ids)
        pending = _Pending(asyncio.get_running_loop().create_future(), progress)
        w.inflight[job_id] = pending
        try:
            line = {"job": {"id": job_id, **body}}
            try:
                w.proc.stdin.write(json.dumps(line).encode() + b"\n")
                async with asyncio.timeout(self._silence_s):  # a stopped worker's pipe fills up
                    await w.proc.stdin.drain()
            except (ConnectionError, RuntimeError) as e:  # it died under us: its keeper restarts it
                raise WorkerCrashed(f"pull worker {w.proc.pid} is gone ({e})") from None
            except TimeoutError:  # its keeper finds it silent and replaces it
                raise WorkerCrashed(f"pull worker {w.proc.pid} takes no job ({self._silence_s:g} s)") from None
            await self._outcome(w, pending, job)
        finally:
            w.inflight.pop(job_id, None)
            async with self._free:
                self._free.notify_all()

    async def _outcome(self, w: _Worker, pending: _Pending, job: ChunkJob | ApplyJob) -> None:
        """The chunk's result; a worker that has not ended a chunk ``silence_s`` past the chunk's
        own deadline is stuck where that deadline does not reach (a write in the kernel)."""
        if job.timeout_s:
            limit = job.timeout_s + self._silence_s
            wait_s = limit
            # Runnable at a glance may be its beat thread waking, not a starved worker: look again
            # often (a starved worker stays runnable), and call it stuck the first time no thread
            # of it wants a CPU.
            while not (await asyncio.wait({pending.future}, timeout=wait_s))[0]:  # the future is left as it is
                if not _runnable(w.proc.pid):
                    self._hung(w, f"did not end a chunk {limit:g} s after it began")
                    break
                wait_s = _RECHECK_S
        await pending.future

    def _pick(self) -> _Worker | None:
        """The ready worker with the most free streams, if any has one."""
        free = [(w.capacity - len(w.inflight), w) for w in self._workers if w.ready]
        room, w = max(free, key=lambda x: x[0], default=(0, None))
        return w if room > 0 else None


def _error(e: dict) -> BaseException:
    kind, message = e.get("kind"), str(e.get("message", ""))
    if kind == "http":
        err = errors.from_json(int(e.get("status") or 502), e.get("body"))
        if not isinstance(e.get("body"), dict):
            err = errors.RegistryError(message, status=int(e.get("status") or 502))
        return err
    if kind == "unavailable":
        return errors.RegistryUnavailable(message)
    if kind == "corrupt":
        return ChunkCorrupt(message)
    if kind == "write":
        return OSError(message)
    if kind == "mismatch":
        return TargetDiffers(message)
    if kind == "delta":
        return DeltaRejected(message)
    return RuntimeError(f"pull worker: {message}")


async def _reap(proc: asyncio.subprocess.Process) -> int | None:
    """The exit status of a worker whose output ended; one that does not exit within
    ``KILL_WAIT_S`` (stuck as it exits) is killed."""
    try:
        async with asyncio.timeout(KILL_WAIT_S):
            return await proc.wait()
    except TimeoutError:
        return await _kill(proc)


async def _kill(proc: asyncio.subprocess.Process) -> int | None:
    """SIGKILL, and its exit status; None if it is not gone within ``KILL_WAIT_S`` (stuck in the
    kernel: the kernel reaps it once it leaves; nobody waits for it here)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    try:
        async with asyncio.timeout(KILL_WAIT_S):
            return await proc.wait()
    except TimeoutError:
        log.error("leave pull worker %d: not gone %g s after SIGKILL (stuck in the kernel?)", proc.pid, KILL_WAIT_S)
        return None


_RECHECK_S = 0.05  # between looks at a worker past a chunk's deadline: /proc reads, cheap


def _thread_files(pid: int, name: str) -> Iterator[bytes]:
    """The contents of ``/proc/<pid>/task/<tid>/<name>`` for each thread of ``pid`` still there
    as it is read (none for a process that is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}", "rb") as f:
                yield f.read()
        except OSError:
            continue


def _runnable(pid: int) -> bool:
    """Some thread of ``pid`` is running or waiting for a CPU (state R in /proc)."""
    return any(stat[stat.rindex(b")") + 2:][:1] == b"R" for stat in _thread_files(pid, "stat"))


def cpu_times(pids: list[int]) -> tuple[float, float]:
    """(ran, waited): seconds the threads of ``pids`` have run, and have waited runnable for a
    CPU, since each started, summed (``/proc/<pid>/task/*/schedstat``). A thread or process
    gone meanwhile counts for nothing. Two readings apart say whether a slow pull is starved
    by its CPU priority on a busy node (it waits far more than it runs) or waits on its sources."""
    ran = waited = 0
    for pid in pids:
        for schedstat in _thread_files(pid, "schedstat"):
            fields = schedstat.split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


def _status(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        return f"killed by {sig}" + (" - out of memory?" if sig == "SIGKILL" else "")
    return f"exit status {returncode}"
