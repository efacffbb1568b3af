"""One child process of the daemon: spawn, forward output, signal all its processes, reap.

This module is the daemon's OS seam for a running child; the supervisor decides *when*, this
module does *how*. Where the child's processes live (a delegated cgroup, or its process group)
and what an earlier run left behind are the containment's (containment.py, cgroups.py,
leftovers.py); ``/dev/shm`` segments are leftovers.py.

- :meth:`Child.spawn` starts a command in its own session (so its process group is its pid),
  placed at once in its scope (its own cgroup, or that process group), where everything it
  forks, such as vLLM's engine core and workers, is too; stdin from ``/dev/null``, stdout and
  stderr into one pipe. A reader task logs every line to
  ``rolloutd.server.<name>`` as ``<name>[<pid>]: <line>`` (undecodable bytes replaced, lines
  over 64 KiB split), at the level the child gave the line (vLLM's ``WARNING 12-01 20:09:15
  [file.py:266] ...`` prefix, also after ``(APIServer pid=N)``; a traceback at the level of the
  line that started it; anything else at INFO), except where that level would alarm for nothing:
  warnings expected in rolloutd's use (``RotaryEmbedding: Failed to load weights`` at each
  update) at DEBUG, said once at INFO; and once rolloutd has signalled the child (a stop it asked
  for, while none of the child's vital processes had died on its own), vLLM's shutdown warnings
  and its ``EngineDeadError`` record at INFO (an error record is held until its traceback ends, to
  see its cause; any other error keeps its level). It ends at
  end of file, when the last process holding the pipe is gone; the child owns it, and its stop
  (or wait) awaits it.
- :meth:`Child.stop` signals the **scope**, every process of it: SIGTERM, a grace period for all
  of them (not only the leader), then SIGKILL. The leader is reaped on every path; cancelling the caller
  hurries to SIGKILL and still reaps before the cancellation goes on. A child has one stop task:
  every caller awaits that one (a second stop never runs beside the first). Lines start with
  ``stop``. Once its processes are gone, its record (if any) is forgotten, its cgroup (if any)
  removed, and the shared-memory segments they left are removed
  (:func:`rolloutd.supervise.leftovers.remove_shm_leftovers`): vLLM's by their names, and those
  :meth:`Child.note_shm` saw its processes hold (once healthy, and before a stop signals them).
  With ``scratch``, each spawn gets a directory of its own there
  (:class:`rolloutd.supervise.leftovers.Scratch`): its ``TMPDIR``, with the record of the names
  it holds, for a daemon started after this one crashed; removed after the segments.
- :func:`describe_exit` turns an exit status into words for logs and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import TypeVar

from rolloutd.supervise.containment import Containment, Scope
from rolloutd.supervise.leftovers import (
    ProcessGroups,
    Scratch,
    remove_shm_leftovers,
    shm_held_by,
    shm_names,
    started_s,
)

log = logging.getLogger("rolloutd.supervise.child")

MAX_LINE_BYTES = 64 * 1024      # a longer output line is logged in pieces of this size
_READ_BYTES = 64 * 1024
_DRAIN_S = 1.0                  # after the group is gone, how long the last output may take to arrive
_HELD_LINES = 500               # an error record held during a stop longer than this is logged as it is
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}

T = TypeVar("T")
_SAID: set[str] = set()         # the explanations of EXPECTED_WARNINGS given already, once per daemon


class ChildError(Exception):
    pass


def _pipe_file(fd: int, loop: asyncio.AbstractEventLoop):
    """The file object a read-pipe transport is given for ``fd``; the transport closes ``fd``.
    uvloop closes the descriptor itself (libuv) and then closes the file object as well: with
    ``closefd`` the same number would be closed twice, and the second close can take a
    descriptor another thread has just opened under that number (a scan of /proc in a worker
    thread then fails with EBADF). asyncio's own loop closes only the file object."""
    return open(fd, "rb", buffering=0, closefd=not type(loop).__module__.startswith("uvloop"))


async def _finish(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even if the caller is cancelled meanwhile, then let the cancellation
    go on: a stop that was begun is never left half done (trio's run_process does the same)."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


# -- output levels -----------------------------------------------------------------------------------
# vLLM's logging format: "WARNING 12-01 20:09:15 [file.py:266] ...", each line of a subprocess
# prefixed with "(EngineCore_DP0 pid=123) ", "(APIServer pid=1) ", "(Worker pid=7) ".
_PID_PREFIX = re.compile(r"^\([^()]*pid=\d+\) ?")
_LEVELED = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d\s+\d\d:\d\d:\d\d")
# Python's warnings module: "/x/resource_tracker.py:254: UserWarning: resource_tracker: ... leaked".
_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
           "CRITICAL": logging.CRITICAL}
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# vLLM's header of a line, without the time: the lines of one multi-line record share it.
_HEADER = re.compile(r"^(\([^()]*pid=\d+\) ?)?[A-Z]+\s+\d\d-\d\d\s+\d\d:\d\d:\d\d\s+(\[[^\]]*\])")

# Warnings vLLM prints in rolloutd's normal use that ask nothing of an operator: logged at DEBUG,
# and said once at INFO, with why, the first time one is seen.
EXPECTED_WARNINGS = (
    (re.compile(r"\bRotaryEmbedding: Failed to load weights\s*$"),
     "vLLM's warning 'RotaryEmbedding: Failed to load weights' at each update is expected (that layer holds "
     "only buffers it computes itself, which no checkpoint carries): logged at DEBUG from now on"),
    (re.compile(r"\bSECURITY WARNING: Development endpoints are enabled!"),
     "vLLM's warning 'Development endpoints are enabled' at each start is expected (rolloutd enables them to "
     "pause and load weights, and vLLM listens only on a socket that rolloutd's user alone can reach): logged "
     "at DEBUG from now on"),
)
# What vLLM prints while it stops because rolloutd stopped it: its shutdown steps' warnings
# ("[shutdown] ... force killing", "engine core exited unexpectedly" when the engine core took the
# signal first), Python's notes on the shared memory its processes left (rolloutd removes that) or
# found already gone when its tracker came to remove it,
# and the API server's EngineDeadError traceback. Logged at INFO during such a stop only; any
# other line keeps its level, and the same lines outside a stop are real failures.
_STOP_WARNINGS = re.compile(r"\[shutdown\] |resource_tracker: There appear to be \d+ leaked \w+ objects"
                            r"|resource_tracker: '[^']*': \[Errno 2\] No such file or directory")
_STOP_ERRORS = re.compile(r"\bEngineDeadError\b")


class OutputLevels:
    """The log level of each line a child prints, in order: vLLM's own level where the line has
    one; WARNING for Python's warnings; the lines of a traceback at the level of the line that
    started it (ERROR when nothing did: Python prints a bare traceback only for an exception nobody
    caught); INFO otherwise."""

    def __init__(self) -> None:
        self._level: int | None = None   # the level a continuation line inherits
        self._traceback = False          # inside "Traceback ...", before its exception line
        self.stopping = False            # rolloutd is stopping the child: its shutdown warnings are INFO
        self.expected: str | None = None  # why the last line was lowered to DEBUG (EXPECTED_WARNINGS)

    def level(self, text: str) -> int:
        body = _PID_PREFIX.sub("", text, count=1)
        self.expected = None
        if m := _LEVELED.match(body):
            self._level, self._traceback = self._lowered(_LEVELS[m.group(1)], body), False
            return self._level
        if _PY_WARNING.match(body):
            self._level, self._traceback = self._lowered(logging.WARNING, body), False
            return self._level
        if body.startswith("Traceback (most recent call last)"):
            self._traceback = True
            self._level = self._level if self._level is not None else logging.ERROR
            return self._level
        if self._level is not None and (self._traceback or not body.strip() or body[0].isspace()
                                        or body.startswith(_CHAINED)):
            if self._traceback and body.strip() and not body[0].isspace():
                self._traceback = False  # the exception's own line ends the traceback
            return self._level
        self._level, self._traceback = None, False
        return logging.INFO

    def _lowered(self, level: int, body: str) -> int:
        """A warning that asks nothing of an operator, at the level it deserves (its continuation
        lines inherit that level)."""
        if level != logging.WARNING:
            return level
        for pattern, why in EXPECTED_WARNINGS:
            if pattern.search(body):
                self.expected = why
                return logging.DEBUG
        if self.stopping and _STOP_WARNINGS.search(body):
            return logging.INFO
        return level


def vllm_header(text: str) -> str | None:
    """vLLM's header of a line (its process, level and ``[file:line]``), or None when it has none."""
    m = _HEADER.match(text)
    return None if m is None else f"{m.group(1) or ''}{m.group(2)}"


def is_stop_noise(block: list[str]) -> bool:
    """An error record of vLLM's (a message and its traceback) that a requested stop explains."""
    return any(_STOP_ERRORS.search(line) for line in block)


# -- exit statuses -----------------------------------------------------------------------------------
def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_exit(returncode: int | None, *, sent: Iterable[int] = ()) -> str:
    """Words for an exit status (asyncio's: negative is the signal); ``sent`` are the signals the
    daemon itself sent, which need no guess at the cause."""
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exited with status {returncode}"
    sig = -returncode
    words = f"killed by {signal_name(sig)}"
    if sig in set(sent):
        return words
    if sig == signal.SIGKILL:
        return words + " (out of memory?)"  # the kernel's OOM killer sends SIGKILL
    if sig in _CRASH_SIGNALS:
        return words + " (crashed)"
    return words


def _vllm_title(pid: int) -> str | None:
    """The role vLLM gave process ``pid`` in its command line (``VLLM::EngineCore``), if any."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"VLLM::"):
        return None
    return head.split(b"\0", 1)[0].decode(errors="replace").strip()


# -- one child ---------------------------------------------------------------------------------------
class Child:
    """One long-running command, in its own session and its own scope (``containment``'s: a
    cgroup, or by default its process group), supervised by the daemon."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], *,
                 containment: Containment | None = None, cpus: Iterable[int] = (),
                 log: logging.Logger | None = None, scratch: Path | None = None):
        self.name, self.argv, self.env = name, list(argv), dict(env)
        self.scratch = scratch                  # where its own directory goes (Scratch); None: none made
        self.cpus = frozenset(cpus)             # the cores it may run on; empty: the daemon's
        self.containment = containment or ProcessGroups()
        self.log = log or logging.getLogger(f"rolloutd.server.{name}")
        self.pid: int | None = None
        self.pgid: int | None = None
        self.scope: Scope | None = None         # where its processes are; set at spawn
        self.started_at: float | None = None    # time.monotonic() at spawn
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None      # the output forwarder; awaited by _drain
        self._transport: asyncio.ReadTransport | None = None
        self._sent: set[int] = set()
        self._levels = OutputLevels()
        self._held: list[tuple[str, int]] = []        # an error record of a stop, until its end shows its cause
        self._held_header: str | None = None
        self._stopping: asyncio.Task | None = None    # the one stop task; every stop() awaits it
        self._hurry = asyncio.Event()                 # a stopper was cancelled: skip the grace period
        self._gone = False                            # the group is gone and its traces removed
        self._shm_before: set[str] = set()            # /dev/shm names that existed before the spawn
        self._shm_held: set[str] = set()              # /dev/shm names its processes were seen holding
        self._own: Scratch | None = None              # its TMPDIR and the record of _shm_held; set at spawn
        self._vital: dict[int, tuple[float | None, str]] = {}  # pid -> (start, title): see note_vital

    def __repr__(self) -> str:
        return f"{self.name}[{self.pid or '-'}]"

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def spawn(self) -> None:
        if self._proc is not None:
            raise ChildError(f"{self.name}: already spawned (pid {self.pid})")
        if not self.argv:
            raise ChildError(f"cannot start {self.name}: the command is empty")
        # Our own pipe, not asyncio's: asyncio's wait() would also wait for the pipe to close,
        # which a grandchild holding it open delays past the leader's exit.
        self._shm_before = shm_names()
        env = self.env
        if self.scratch is not None:
            try:
                self._own = Scratch.make(self.scratch)
            except OSError as e:
                raise ChildError(f"cannot start {self.name}: cannot make its directory in {self.scratch}: "
                                 f"{e.strerror or e}") from None
            env = {**env, **self._own.env()}
        try:
            scope = self.containment.scope(self.name)
        except OSError as e:
            self._remove_own()
            raise ChildError(f"cannot start {self.name}: no scope for its processes: {e}") from None
        r, w = os.pipe()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=w,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except BaseException as e:  # also a cancellation (a restart asked during the spawn): asyncio
            os.close(r)             # killed and reaped the leader; its pipe, scope and directory go too
            scope.release()
            self._remove_own()
            if not isinstance(e, OSError):
                raise
            raise ChildError(f"cannot start {self.name}: {self.argv[0]}: {e.strerror or e}") from None
        finally:
            os.close(w)
        self.pid = self.pgid = self._proc.pid  # a new session's process group id is its leader's pid
        self.started_at = time.monotonic()
        try:
            # At once, like the placement: every process and thread it starts from now on inherits
            # both (the leader is still a freshly exec'd interpreter, alone in its group).
            where = f"on CPUs {sorted(self.cpus)}"
            if self.cpus:
                os.sched_setaffinity(self.pid, self.cpus)
            where = f"in {scope}"
            scope.place(self.pid)
        except OSError as e:
            os.killpg(self.pgid, signal.SIGKILL)  # not where it was asked to run: it must not run
            await self._proc.wait()
            os.close(r)
            scope.release()
            self._remove_own()
            raise ChildError(f"cannot start {self.name}: cannot place it {where}: {e.strerror or e}") from None
        self.scope = scope
        stream = asyncio.StreamReader(limit=2 * _READ_BYTES)
        loop = asyncio.get_running_loop()
        pipe = _pipe_file(r, loop)
        try:
            self._transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), pipe)
        except FileExistsError:
            # The event loop still watches this descriptor number for a pipe closed a moment ago
            # (a restart right after a stop): the same pipe under another number.
            moved = os.dup(r)
            pipe.close()
            if not pipe.closefd:
                os.close(r)
            self._transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream),
                                                              _pipe_file(moved, loop))
        self._reader = asyncio.get_running_loop().create_task(self._forward(stream), name=f"output-{self}")
        self.containment.record(self)

    # -- output --------------------------------------------------------------------------------------
    async def _forward(self, stream: asyncio.StreamReader) -> None:
        """Log the child's output line by line until end of file."""
        pending = b""
        try:
            while chunk := await stream.read(_READ_BYTES):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._emit(line)
                while len(pending) >= MAX_LINE_BYTES:
                    self._emit(pending[:MAX_LINE_BYTES])
                    pending = pending[MAX_LINE_BYTES:]
            if pending:
                self._emit(pending)  # the last line, without its newline
        finally:
            self._release()
            self._transport.close()

    def _emit(self, line: bytes) -> None:
        level = None
        for i in range(0, max(len(line), 1), MAX_LINE_BYTES):
            text = line[i:i + MAX_LINE_BYTES].decode(errors="replace").rstrip("\r")
            if level is None:  # a long line's pieces: its level
                level = self._levels.level(text)
                if (why := self._levels.expected) is not None and why not in _SAID:
                    _SAID.add(why)
                    log.info("lower %s: %s", self, why)
            self._out(text, level)

    def _out(self, text: str, level: int) -> None:
        """Log one line. During a stop rolloutd asked for, an error record of vLLM's is held until
        its end (its traceback's last line names the cause), then logged at INFO when the stop
        explains it (EngineDeadError), at its own level otherwise."""
        if not self._levels.stopping or (level < logging.ERROR and not self._held):
            self.log.log(level, "%s[%d]: %s", self.name, self.pid, text)
            return
        header = vllm_header(text)
        if self._held and level >= logging.ERROR and header in (None, self._held_header):
            self._held.append((text, level))
            if len(self._held) >= _HELD_LINES:
                self._release()
            return
        self._release()
        if level >= logging.ERROR:
            self._held, self._held_header = [(text, level)], header
        else:
            self.log.log(level, "%s[%d]: %s", self.name, self.pid, text)

    def _release(self) -> None:
        held, self._held = self._held, []
        quiet = is_stop_noise([text for text, _ in held])
        for text, level in held:
            self.log.log(logging.INFO if quiet else level, "%s[%d]: %s", self.name, self.pid, text)

    async def _drain(self) -> None:
        """Let the reader log the last lines; give up on a pipe still held open outside the group."""
        if self._reader is None:
            return
        done, _ = await asyncio.wait({self._reader}, timeout=_DRAIN_S)
        if not done:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._transport.close()  # also when the reader was cancelled before it ever ran
        await asyncio.sleep(0)  # the transport closes its pipe in a callback: let it run

    # -- state ---------------------------------------------------------------------------------------
    def _spawned(self) -> asyncio.subprocess.Process:
        if self._proc is None:
            raise ChildError(f"{self.name}: never spawned")
        return self._proc

    async def wait(self) -> int:
        """Wait for the leader to exit and reap it; once the whole group is gone, its traces go too."""
        code = await self._spawned().wait()
        if not self.group_pids():
            await self._reaped()
        return code

    async def _reaped(self) -> None:
        """Its processes are gone: log their last output, forget its record, release its scope,
        remove the shared memory they left. Each step may run again (a cancelled wait, then a
        stop); the cleaning runs once."""
        self.containment.forget(self)
        if self.scope is not None:
            self.scope.release()
        await self._drain()
        if self._gone:
            return
        await asyncio.to_thread(remove_shm_leftovers, self._shm_before, self._shm_held, owner=str(self))
        await asyncio.to_thread(self._remove_own)  # after the segments: a crash in between finds them there
        self._gone = True

    def _remove_own(self) -> None:
        if self._own is not None:
            self._own.remove()

    async def note_shm(self) -> None:
        """Learn which ``/dev/shm`` entries the group's processes map or hold open now, to remove
        those they leave (:meth:`_reaped`): segments that no resource tracker unlinks, under names
        no pattern knows. Once healthy (everything is set up by then) and before a stop signals
        the group; a scan of /proc, so in a thread."""
        if self.scope is not None and not self._gone:
            self._shm_held |= await asyncio.to_thread(lambda: shm_held_by(self.scope.pids()))
            if self._own is not None:  # for the next daemon, should this one end without stopping it
                await asyncio.to_thread(self._own.record_held, self._shm_held)

    def note_vital(self) -> None:
        """Learn the processes of the group that vLLM titled ``VLLM::<role>`` (``EngineCore_DP1``,
        ``Worker_TP1``, ``ApiServer_1``): each is one part of the server for its whole life, and
        its end breaks the server (a dead engine or worker fails every route that needs it), while
        the server's API may take several probes to say so (a dead DP engine: about 10 s here).
        Once healthy: every one of them runs by then; untitled helpers come and go. Reads /proc."""
        self._vital = {pid: (started_s(pid), title) for pid in self.group_pids()
                       if (title := _vllm_title(pid)) is not None}

    def lost_vital(self) -> str | None:
        """``"<title> (pid N)"`` of a process :meth:`note_vital` learnt that is gone (its pid dead,
        or another process now), else None. One /proc read per process."""
        for pid, (start, title) in self._vital.items():
            if start is None or started_s(pid) != start:
                return f"{title} (pid {pid})"
        return None

    def group_pids(self) -> list[int]:
        """Live processes of the child's scope (the leader, and what it forked that stayed in it)."""
        return self.scope.pids() if self.scope is not None else []

    def kill_group(self, sig: int) -> None:
        """``sig`` to every process of the child's scope."""
        if self.scope is None:
            return
        # Once the leader is reaped and no member is left, a group's number may name a new group.
        if self.returncode is not None and not self.group_pids():
            return
        if not self._sent:
            # Whatever vLLM says of its end from now on, rolloutd asked for it: unless a process of
            # it had died already without rolloutd asking (a crash), and vLLM's account of that
            # death, which may come after this signal, is a failure's and keeps its level.
            self._levels.stopping = self.returncode is None and self.lost_vital() is None
        self._sent.add(sig)
        self.scope.signal(sig)

    def describe_exit(self) -> str:
        return describe_exit(self.returncode, sent=self._sent)

    # -- stop ----------------------------------------------------------------------------------------
    async def stop(self, grace_s: float, kill_wait_s: float = 10.0) -> str:
        """TERM the group, ``grace_s`` for all of it to exit, KILL, ``kill_wait_s``; reap the leader.
        Returns how it exited; :class:`ChildError` names processes that outlived SIGKILL.

        The first call starts the child's one stop task; every call awaits that task (a second
        stop never runs beside it, and its grace is the first one's). A caller cancelled meanwhile
        hurries the stop to SIGKILL and waits for its end before the cancellation goes on."""
        self._spawned()
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(grace_s, kill_wait_s),
                                                                    name=f"stop-{self}")
        try:
            return await asyncio.shield(self._stopping)
        except asyncio.CancelledError:
            if self._stopping.done():
                raise
            self._hurry.set()
            with contextlib.suppress(Exception):  # _end logged it; the cancellation is what goes on
                await _finish(self._stopping)
            raise

    async def _stop(self, grace_s: float, kill_wait_s: float) -> str:
        await self._terminate(grace_s)
        return await self._end(kill_wait_s)

    async def _terminate(self, grace_s: float) -> None:
        pids = self.group_pids()
        if not pids:
            return
        await self.note_shm()
        log.info("stop %s: SIGTERM to %s (%d processes), grace %.1f s", self, self.scope, len(pids), grace_s)
        self.kill_group(signal.SIGTERM)
        if await self.scope.wait_empty(grace_s, hurry=self._hurry):
            return
        if self._hurry.is_set():
            log.warning("stop %s: cancelled during the grace period: SIGKILL to %s now", self, self.scope)
            return
        log.warning("stop %s: pids %s still alive after the %.1f s grace period", self, self.group_pids(), grace_s)

    async def _end(self, kill_wait_s: float) -> str:
        """SIGKILL whatever is left, reap the leader, forget the record; the exit in words."""
        if self.group_pids():
            log.warning("stop %s: SIGKILL to %s (pids %s)", self, self.scope, self.group_pids())
            self.kill_group(signal.SIGKILL)
            if not await self.scope.wait_empty(kill_wait_s):
                left = self.group_pids()
                log.error("stop %s: pids %s outlived SIGKILL by %.1f s", self, left, kill_wait_s)
                raise ChildError(f"{self.name}: processes {left} of {self.scope} outlived SIGKILL "
                                 f"by {kill_wait_s:g} s")
        await self._spawned().wait()  # prompt: the leader is dead (a zombie at most)
        await self._reaped()
        how = self.describe_exit()
        log.info("stop %s: %s", self, how)
        return how


