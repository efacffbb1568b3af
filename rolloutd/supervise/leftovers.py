"""The process-group way of holding servers (no delegated cgroup: the demo, a daemon started by
hand or by a test), and what a server leaves behind in either way.

- :class:`ProcessGroups` and :class:`GroupScope` (the interface is containment.py): each server
  in its own session, so its process group is its leader's pid; members found with psutil
  (zombies count as gone). Process group ids 0 and 1 and the daemon's own group are never
  signalled. A process that leaves its session (``setsid``) leaves the group too and is not
  found: only a delegated cgroup (cgroups.py) holds those.
- :class:`ChildRecords` keeps one JSON record per live child under the state directory, so
  that a daemon started after a crash can stop the process groups the crashed one left behind
  (:meth:`ChildRecords.reap_leftovers`; lines start with ``clean``). A recorded group is only
  signalled while it provably is the one recorded: a recycled pid is never signalled.
- Once a server's processes are gone, the shared-memory segments they left in ``/dev/shm``
  (vLLM's ``psm_*`` and ``sem.mp-*``: its resource tracker dies with them; and whatever its
  processes were seen holding while they ran, :func:`shm_held_by`, such as the CPU
  tensor-parallel ``vllm_dist_*-cpushm_*`` that no tracker unlinks) are removed
  (:func:`remove_shm_leftovers`), never one another live process uses. This holds in both ways,
  and after a daemon that ended without its ordered stop (:class:`ShmBaseline`, which reads the
  names each server was seen holding from its :class:`Scratch` directory, its ``TMPDIR``).

One child process (spawn, output, stop, reap) is child.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

import psutil

from rolloutd.config import SCRATCH
from rolloutd.filelease import under_write_lease
from rolloutd.supervise.containment import Containment, Scope, Spawned, stop_leftover

log = logging.getLogger("rolloutd.supervise.leftovers")


# -- process groups ----------------------------------------------------------------------------------
def _live(pid: int) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except psutil.Error:  # gone, or hidden from us
        return None


def started_s(pid: int) -> float | None:
    """When a live process started, in seconds since boot (None if it is gone): with the pid, it
    names one process for the machine's uptime. The kernel counts it from boot; psutil adds the
    boot time, which follows changes of the wall clock, so the boot time is taken off again."""
    proc = _live(pid)
    try:
        return None if proc is None else round(proc.create_time() - psutil.boot_time(), 2)
    except psutil.Error:
        return None


def group_members(pgid: int) -> dict[int, float]:
    """Live (not zombie) processes of process group ``pgid``: pid -> :func:`started_s`."""
    found = {}
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:  # gone meanwhile
            continue
        if (start := started_s(pid)) is not None:
            found[pid] = start
    return found


def may_signal(pgid: int | None) -> bool:
    return pgid is not None and pgid > 1 and pgid != os.getpgrp()


def killpg(pgid: int, sig: int) -> None:
    if not may_signal(pgid):
        raise ValueError(f"refusing to signal process group {pgid}")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class GroupScope(Scope):
    """One server's process group: its leader's session."""

    def __init__(self, pgid: int | None = None):
        self.pgid = pgid

    def __str__(self) -> str:
        return f"process group {self.pgid}"

    def place(self, pid: int) -> None:
        self.pgid = pid  # spawned in a new session: its process group id is its own pid

    def pids(self) -> list[int]:
        return sorted(group_members(self.pgid)) if self.pgid is not None else []

    def signal(self, sig: int) -> None:
        if may_signal(self.pgid):
            killpg(self.pgid, sig)

    def release(self) -> None:
        pass  # a process group is nothing to give back


class ProcessGroups(Containment):
    """Servers in process groups; with ``records``, what a crashed daemon left is found again."""

    def __init__(self, records: ChildRecords | None = None, reason: str = ""):
        self.records, self.reason = records, reason

    def __str__(self) -> str:
        return "each server in its own process group" + (f" ({self.reason})" if self.reason else "")

    def scope(self, name: str) -> GroupScope:
        return GroupScope()

    async def start(self, grace_s: float, kill_wait_s: float) -> list[str]:
        return await self.records.reap_leftovers(grace_s, kill_wait_s) if self.records is not None else []

    def record(self, child: Spawned) -> None:
        if self.records is None:
            return
        try:
            self.records.add(child)
        except OSError as e:  # the record is a safety net for after a crash; the child runs on
            log.warning("spawn %s: cannot write its record: %s", child, e)

    def forget(self, child: Spawned) -> None:
        if self.records is not None:
            self.records.remove(child.name, pid=child.pid)  # never the record of a newer child of that name


# -- shared memory left by a group -------------------------------------------------------------------
SHM_DIR = Path("/dev/shm")
# What vLLM's processes create there: Python's multiprocessing.shared_memory segments ("psm_<hex>":
# vLLM's message queues and object storage; hundreds of MiB each: docs/daemon.md, "Start"), Python's
# multiprocessing named semaphores ("sem.mp-<random>": the locks of vLLM's worker processes,
# which are started with "spawn"; 32 bytes each, but they pile up), and vLLM's own mmap regions
# (KV offload, encoder cache transfer). Python's resource tracker would unlink the first two
# kinds when their owners exit, but it is in the group and dies with it under SIGKILL.
SHM_PATTERNS = ("psm_*", "sem.mp-*", "vllm_offload_*.mmap", "vllm_ec_*.mmap")


def shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def shm_in_use() -> set[str]:
    """Names under ``/dev/shm`` that a live process has open or mapped, as far as ``/proc`` shows
    (a process it hides is covered by the lease in :func:`remove_shm_leftovers`)."""
    return shm_held_by(int(e.name) for e in os.scandir("/proc") if e.name.isdigit())


def shm_held_by(pids: Iterable[int]) -> set[str]:
    """Names under ``/dev/shm`` that the processes ``pids`` map or hold open now (``/proc/<pid>/maps``
    and ``fd``); a process gone meanwhile, or hidden from us, holds nothing. A name with a ``/``
    is a file in a directory there (the mirror's), never a segment of theirs; it is kept, and
    :func:`remove_shm_leftovers` takes only entries directly in ``/dev/shm``."""
    prefix, used = f"{SHM_DIR}/", set()
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile, or hidden from us
            with open(f"/proc/{pid}/maps", errors="replace") as maps:
                used.update(_shm_name(line[line.index(prefix):], prefix) for line in maps if prefix in line)
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd.path)).startswith(prefix):
                        used.add(_shm_name(target, prefix))
    return used


def _shm_name(path: str, prefix: str) -> str:
    return path.strip().removeprefix(prefix).removesuffix(" (deleted)")


def _unlink_if_unused(path: Path) -> bool:
    """Unlink ``path`` if no other open file (a mapping holds its file open) refers to it."""
    return under_write_lease(path, path.unlink)


def remove_shm_leftovers(before: set[str], held: Iterable[str] = (), *, owner: str = "") -> list[str]:
    """Remove the segments a stopped group left: in ``/dev/shm``, not there before the group was
    spawned (``before``), named as vLLM names them or ``held`` by a process of the group while it
    ran (whatever their name: vLLM's CPU tensor-parallel ``vllm_dist_*-cpushm_*``), owned by the
    daemon's user, open or mapped by no live process (``/proc``, then a write lease): one another
    live process uses is never removed. One INFO line per removal, with its size, for ``owner``."""
    me, found, held = os.geteuid(), {}, set(held)
    for name in sorted(shm_names() - before):
        if not (name in held or any(fnmatch.fnmatchcase(name, p) for p in SHM_PATTERNS)):
            continue
        with contextlib.suppress(OSError):
            st = (SHM_DIR / name).lstat()
            if st.st_uid == me and stat.S_ISREG(st.st_mode):
                found[name] = st.st_size
    if not found:
        return []
    used, removed = shm_in_use(), []
    for name, size in found.items():
        if name not in used and _unlink_if_unused(SHM_DIR / name):
            removed.append(name)
            log.info("clean %s: removed %s (%s)", owner or "shared memory", SHM_DIR / name, _size_text(size))
    return removed


def _size_text(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} bytes"


class Scratch:
    """One running server's own directory, ``<scratch dir>/<random>/`` (mode 0700), its ``TMPDIR``:
    vLLM leaves files there that nothing removes after a kill, some at every start
    (``vllm_dist_<uuid>``, torch.distributed's rendezvous store, also with one worker; its ZMQ
    sockets, ``<uuid>``). It also holds :attr:`HELD`, the ``/dev/shm`` names the server's processes
    were seen holding (:func:`shm_held_by`), for a daemon started after this one ended without
    stopping it (:meth:`ShmBaseline.clean_and_record`). Removed, whole, once the server's processes
    are gone; with it the directory its record :attr:`RPC` names, if any."""

    HELD = ".rolloutd-shm-held.json"
    # vLLM's ZMQ socket paths, <VLLM_RPC_BASE_PATH, else TMPDIR>/<uuid4>, must fit a UNIX socket's
    # (107 bytes); the name of the directory is short (8 characters) for that. Where a long
    # state_dir leaves no room, the sockets go to a directory of their own in the system's
    # temporary directory (mode 0700, like this one: no other user reaches vLLM's sockets), named
    # in the record RPC, so that it goes with this one, after a kill too.
    SOCKET_PATH_MAX = 107
    UUID_TAIL = len("/") + 36
    RPC = ".rolloutd-rpc-dir"
    RPC_PREFIX = "rolloutd-rpc-"

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def make(cls, parent: Path) -> Scratch:
        parent = Path(parent)
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        scratch = cls(Path(tempfile.mkdtemp(prefix="", dir=parent)))  # 8 characters, mode 0700; new per start
        if len(os.fsencode(scratch.path)) + cls.UUID_TAIL > cls.SOCKET_PATH_MAX:
            try:
                rpc = tempfile.mkdtemp(prefix=cls.RPC_PREFIX)
                try:
                    (scratch.path / cls.RPC).write_text(rpc)
                except OSError:
                    os.rmdir(rpc)  # named nowhere: nothing else would remove it
                    raise
            except OSError:
                scratch.remove()
                raise
        return scratch

    def rpc_dir(self) -> Path | None:
        """The directory of vLLM's sockets outside this one, if the record names one this class
        makes: a ``rolloutd-rpc-*`` directory right in the system's temporary directory (a record
        naming anything else is not followed)."""
        try:
            named = Path((self.path / self.RPC).read_text())
        except (OSError, ValueError):
            return None
        if named.parent != Path(tempfile.gettempdir()) or not named.name.startswith(self.RPC_PREFIX):
            return None
        return named

    def env(self) -> dict[str, str]:
        """The server's environment for it: TMPDIR; and VLLM_RPC_BASE_PATH where its sockets go
        elsewhere (:meth:`rpc_dir`)."""
        env = {"TMPDIR": str(self.path)}
        if (rpc := self.rpc_dir()) is not None:
            env["VLLM_RPC_BASE_PATH"] = str(rpc)
        return env

    def record_held(self, names: set[str]) -> None:
        try:
            _write_json(self.path / self.HELD, sorted(names))
        except OSError as e:  # a safety net for after a crash; the server runs on
            log.warning("record %s: cannot write the /dev/shm names its server holds: %s", self.path, e)

    def held(self) -> set[str]:
        """The names recorded; none for a missing or unreadable record (what is not known is kept)."""
        try:
            names = json.loads((self.path / self.HELD).read_text())
        except (OSError, ValueError):
            return set()
        return {n for n in names if isinstance(n, str) and "/" not in n} if isinstance(names, list) else set()

    def remove(self) -> None:
        if (rpc := self.rpc_dir()) is not None and not rpc.is_symlink():
            shutil.rmtree(rpc, ignore_errors=True)
        shutil.rmtree(self.path, ignore_errors=True)  # never follows a link out of it


def scratch_left(parent: Path) -> list[Scratch]:
    """Every server directory under ``parent`` (an earlier run's, once its processes are gone)."""
    try:
        return [Scratch(p) for p in sorted(Path(parent).iterdir()) if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


class ShmBaseline:
    """The names in ``/dev/shm`` when the daemon started, kept in ``path`` (JSON) until it stops
    cleanly. A daemon that finds the file knows the last one ended without its ordered stop
    (killed, crashed), and that its servers may have died by SIGKILL with it: systemd's
    KillMode=mixed kills what is left of the unit, and their resource trackers die too. Their
    segments would stay in memory for good; each start after such an end removes them as a
    server's own stop does (:func:`remove_shm_leftovers`: not there at the earlier start, vLLM's
    names, the daemon's user, used by no live process). Call it once the earlier run's processes
    are gone (:meth:`Containment.start`)."""

    def __init__(self, path: Path, scratch: Path | None = None):
        self.path = Path(path)
        self.scratch = Path(scratch) if scratch is not None else self.path.parent / SCRATCH  # Config.scratch_dir

    def clean_and_record(self) -> list[str]:
        """Remove what an earlier run's servers left (segments, also those only known because a
        server was seen holding them, and their :class:`Scratch` directories), then record this
        start's names. One line per thing done, for the log."""
        lines = []
        left = scratch_left(self.scratch)
        held = set().union(*(s.held() for s in left))
        try:
            before = self._read()
        except ValueError as e:
            lines.append(f"shared memory: {e}; nothing removed")
        else:
            if before is not None and (removed := remove_shm_leftovers(before, held)):
                lines.append(f"shared memory: removed {len(removed)} segment(s) the servers of an earlier run "
                             "left: " + ", ".join(removed))
        for s in left:
            s.remove()
        if left:
            lines.append(f"scratch: removed {len(left)} server directory(ies) an earlier run left: "
                         + ", ".join(s.path.name for s in left))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(self.path, sorted(shm_names()))
        return lines

    def forget(self) -> None:
        """The ordered stop is done: every server removed its own segments."""
        self.path.unlink(missing_ok=True)

    def _read(self) -> set[str] | None:
        """The names recorded by the earlier start; None without a record; ValueError for a bad one."""
        try:
            names = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"unreadable record {self.path}: {e}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"record {self.path} is not a list of names")
        return set(names)


def _write_json(path: Path, value: object) -> None:
    """Write ``path`` atomically (a temporary file, then rename): a reader sees the old record or
    the new one. No fsync: after a power loss, no process or segment it names survives either."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value) + "\n")
    os.replace(tmp, path)


# -- records of children, for the next daemon -----------------------------------------------------------
class ChildRecords:
    """``<directory>/<name>.json``: ``{"name", "pid", "pgid", "start_time", "argv"}`` for every
    child spawned and not yet reaped (``start_time``: :func:`started_s` of its leader), written
    atomically (temporary file, then rename)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} cannot name a child record")
        return self.dir / f"{name}.json"

    def add(self, child: Spawned) -> None:
        path = self._path(child.name)
        record = {"name": child.name, "pid": child.pid, "pgid": child.pgid, "start_time": started_s(child.pid),
                  "argv": child.argv}
        _write_json(path, record)

    def remove(self, name: str, *, pid: int | None = None) -> None:
        """Delete ``name``'s record; with ``pid``, only while the record is that process's."""
        path = self._path(name)
        if pid is not None:
            try:
                if json.loads(path.read_text()).get("pid") != pid:
                    return
            except (OSError, ValueError, AttributeError):
                pass  # missing or unreadable: nothing of a newer child to keep
        path.unlink(missing_ok=True)

    async def reap_leftovers(self, grace_s: float, kill_wait_s: float = 10.0) -> list[str]:
        """Stop every recorded group that is still alive and still the recorded one (all at once,
        so the whole takes one grace period); delete every record. One line per group stopped."""
        paths = sorted(self.dir.glob("*.json"))
        found = await asyncio.gather(*(self._reap_one(p, grace_s, kill_wait_s) for p in paths))
        return [d for d in found if d is not None]

    async def _reap_one(self, path: Path, grace_s: float, kill_wait_s: float) -> str | None:
        try:
            record = _read_record(path)
        except ValueError as e:
            log.warning("clean: removing corrupt child record %s: %s", path, e)
            path.unlink(missing_ok=True)
            return None
        try:
            pids = _leftover_pids(record)
            if not pids:
                return None
            return await _stop_leftover(record, len(pids), grace_s, kill_wait_s)
        finally:
            path.unlink(missing_ok=True)


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(str(e)) from None
    if not isinstance(record, dict):
        raise ValueError("not an object")
    for key, kinds in (("pid", int), ("pgid", int), ("start_time", (int, float))):
        if not isinstance(record.get(key), kinds) or isinstance(record[key], bool) or record[key] <= 0:
            raise ValueError(f"{key} is {record.get(key)!r}")
    if not may_signal(record["pgid"]):
        raise ValueError(f"process group {record['pgid']} may not be signalled")
    record["name"] = str(record.get("name") or path.stem)
    return record


def _leftover_pids(record: dict) -> list[int]:
    """The recorded group's live processes, if it is provably the recorded group; else none.

    While any process is in group ``pgid`` the kernel does not reuse that number as a pid, so the
    group is the recorded one when its leader has the recorded start time, or when the leader
    is gone and the members started no earlier than it did."""
    members = group_members(record["pgid"])
    leader_start = members.get(record["pid"])
    if leader_start is not None:
        ours = leader_start == record["start_time"]
    else:
        ours = bool(members) and all(t >= record["start_time"] for t in members.values())
    if members and not ours:
        log.info("clean %s: process group %d is not the recorded one (pid reused); left alone",
                 record["name"], record["pgid"])
    return sorted(members) if ours else []


async def _stop_leftover(record: dict, count: int, grace_s: float, kill_wait_s: float) -> str:
    head = (f"{record['name']}: process group {record['pgid']} ({count} process{'es' if count != 1 else ''}) "
            "left by an earlier run")
    return await stop_leftover(GroupScope(record["pgid"]), head, grace_s, kill_wait_s)
