"""The delegated-cgroup way of holding servers (the interface is containment.py), and the choice
between it and process groups at the daemon's start (:func:`contain`).

Under systemd with ``Delegate=yes`` the unit's cgroup (cgroup v2) is the daemon's to manage:
systemd marks it with the extended attribute ``user.delegate=1`` (``trusted.delegate`` when
the daemon runs as root) and gives it to the unit's user. The daemon then keeps this tree::

    <unit cgroup>/            the unit's, systemd's attributes; no process of its own
        daemon/               the daemon (moved here at start: cgroup v2 wants processes
                              in leaves only), and any helper process it starts
        server-<name>/        one server's vLLM: its API server, engine core, workers
        .control/             systemd's (ExecReload=); never touched here

- A server's leader is moved into its cgroup right after it is spawned (Python cannot spawn
  straight into a cgroup: ``clone3``'s ``CLONE_INTO_CGROUP`` is not exposed). Whatever it forked
  before the move is still in the daemon's cgroup, in the leader's process group: the move
  sweeps those over too, again until none is left. Only a process that both forked and left its
  session within that moment would stay out; vLLM forks nothing until its imports are done,
  seconds later.
- SIGKILL is one write to ``cgroup.kill`` (Linux 5.14 or later; before that, each process in
  ``cgroup.procs`` is sent SIGKILL in turn); other signals go to each process in ``cgroup.procs``.
  The cgroup is empty when ``cgroup.events`` says ``populated 0``.
- At start, every populated cgroup under the unit's but systemd's is what an earlier run left
  (systemd empties the unit when its main process dies; a process stuck in the kernel outlives
  that): each is stopped (SIGTERM, grace, ``cgroup.kill``) before the daemon moves into its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import psutil

from rolloutd.supervise.containment import Containment, Scope, Spawned, stop_leftover
from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups

log = logging.getLogger("rolloutd.supervise.cgroups")

DAEMON_LEAF = "daemon"
SERVER_PREFIX = "server-"
SYSTEMD_OWN = ".control"        # systemd's cgroup for ExecReload= and the like under Delegate=yes
DELEGATE_XATTRS = ("user.delegate", "trusted.delegate")
_SWEEPS = 10                    # passes of the move's sweep for processes forked before it


# -- the files of one cgroup ------------------------------------------------------------------------
def procs(path: Path) -> list[int]:
    """The processes in cgroup ``path`` itself (not in its children); [] once it is gone."""
    try:
        return sorted(int(p) for p in (path / "cgroup.procs").read_text().split())
    except FileNotFoundError:
        return []


def _tree(path: Path) -> list[Path]:
    """``path`` and every cgroup below it."""
    return [path, *(p for p in path.rglob("*") if p.is_dir())] if path.is_dir() else []


def members(path: Path) -> list[int]:
    """The processes in cgroup ``path`` and below it."""
    return sorted(pid for sub in _tree(path) for pid in procs(sub))


def populated(path: Path) -> bool:
    """Whether a live process is in ``path`` or below it."""
    try:
        lines = (path / "cgroup.events").read_text().splitlines()
    except FileNotFoundError:
        return False
    return "populated 1" in lines


def _write(file: Path, text: str) -> None:
    """Write to a kernel interface file, never creating one (a kernel that lacks it: ENOENT)."""
    fd = os.open(file, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def move(path: Path, pid: int) -> None:
    _write(path / "cgroup.procs", str(pid))


def kill_all(path: Path, *, kill=os.kill) -> None:
    """SIGKILL every process in ``path`` and below, including those forked meanwhile."""
    try:
        _write(path / "cgroup.kill", "1")
        return
    except FileNotFoundError:  # Linux < 5.14: no cgroup.kill (or the cgroup is gone)
        pass
    for sub in _tree(path):
        signal_each(sub, signal.SIGKILL, kill=kill)


def signal_each(path: Path, sig: int, *, kill=os.kill) -> None:
    """``sig`` to every process in ``path`` itself; never to the daemon."""
    for pid in procs(path):
        if pid == os.getpid():
            log.error("signal %s: the daemon itself is in %s; not signalled", signal.Signals(sig).name, path)
            continue
        with contextlib.suppress(ProcessLookupError):
            kill(pid, sig)


# -- one server's cgroup ----------------------------------------------------------------------------
class CgroupScope(Scope):
    def __init__(self, path: Path, label: str, daemon_cgroup: Path):
        self.path, self.label, self._daemon = path, label, daemon_cgroup

    def __str__(self) -> str:
        return f"cgroup {self.label}"

    def place(self, pid: int) -> None:
        move(self.path, pid)
        self._sweep(pid)

    def _sweep(self, pgid: int) -> None:
        """Move over what the leader forked before its own move: in the daemon's cgroup, in the
        leader's process group (which the daemon and its helpers are not in)."""
        for _ in range(_SWEEPS):
            moved = 0
            for pid in procs(self._daemon):
                with contextlib.suppress(ProcessLookupError):
                    if pid != os.getpid() and os.getpgid(pid) == pgid:
                        move(self.path, pid)
                        moved += 1
            if not moved:
                return
        log.warning("spawn: processes of group %d still forking outside %s", pgid, self)

    def pids(self) -> list[int]:
        return members(self.path)

    def empty(self) -> bool:
        return not populated(self.path)

    def signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            kill_all(self.path)
            return
        for sub in _tree(self.path):
            signal_each(sub, sig)

    def release(self) -> None:
        with contextlib.suppress(OSError):  # populated again, or gone already: it stays, or it is gone
            self.path.rmdir()


# -- the unit's cgroup ------------------------------------------------------------------------------
class DelegatedCgroups(Containment):
    """Servers in cgroups under ``top``, the delegated cgroup the daemon was started in (``label``:
    its path in the hierarchy, for log lines)."""

    def __init__(self, top: Path, label: str):
        self.top, self.label = top, label
        self.leaf = top / DAEMON_LEAF
        self._daemon = top  # where the daemon is; its leaf once start() moved it there

    def __str__(self) -> str:
        return f"each server in its own cgroup under {self.label} (delegated)"

    def scope(self, name: str) -> CgroupScope:
        path = self.top / f"{SERVER_PREFIX}{name}"
        path.mkdir(exist_ok=True)
        scope = CgroupScope(path, f"{self.label}/{path.name}", self._daemon)
        if left := scope.pids():  # they outlived SIGKILL at the last stop: a stuck process, not ours to hide
            log.warning("spawn %s: %s still holds pids %s of an earlier process", name, scope, left)
        return scope

    async def start(self, grace_s: float, kill_wait_s: float) -> list[str]:
        """Stop every populated cgroup an earlier run left (all at once), remove the empty ones, then
        move the daemon into its leaf."""
        left = [p for p in sorted(self.top.iterdir()) if p.is_dir() and p.name != SYSTEMD_OWN and populated(p)]
        left = [p for p in left if not (p == self.leaf and os.getpid() in procs(p))]  # ours since an earlier start()
        lines = await asyncio.gather(*(self._stop_leftover(p, grace_s, kill_wait_s) for p in left))
        for p in self.top.glob(f"{SERVER_PREFIX}*"):
            with contextlib.suppress(OSError):  # populated still: it stays
                p.rmdir()
        self.leaf.mkdir(exist_ok=True)
        move(self.leaf, os.getpid())
        self._daemon = self.leaf
        return list(lines)

    def record(self, child: Spawned) -> None:
        pass  # the cgroup is the record: a daemon started after a crash finds it populated

    def forget(self, child: Spawned) -> None:
        pass

    async def _stop_leftover(self, path: Path, grace_s: float, kill_wait_s: float) -> str:
        scope = CgroupScope(path, f"{self.label}/{path.name}", self._daemon)
        count = len(members(path))
        processes = f"{count} process{'es' if count != 1 else ''}"
        head = f"{path.name.removeprefix(SERVER_PREFIX)}: {scope} ({processes}) left by an earlier run"
        return await stop_leftover(scope, head, grace_s, kill_wait_s)



# -- which way ----------------------------------------------------------------------------------------
def own_cgroup(proc_file: Path = Path("/proc/self/cgroup")) -> str | None:
    """The daemon's cgroup in the v2 hierarchy (``0::<path>``), None if it is in none."""
    with contextlib.suppress(OSError):
        for line in proc_file.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    return None


def cgroup2_mounts() -> list[Path]:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``; ``/sys/fs/cgroup/unified``
    on a hybrid system), shortest first: binds of one of its subtrees come later."""
    found = {Path(p.mountpoint) for p in psutil.disk_partitions(all=True) if p.fstype == "cgroup2"}
    return sorted(found, key=lambda p: len(p.parts))


def delegated(path: Path) -> bool:
    for name in DELEGATE_XATTRS:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name) == b"1":
                return True
    return False


def find_delegated(cgroup: str | None, mounts: list[Path]) -> tuple[Path | None, str]:
    """The directory of cgroup ``cgroup`` under one of ``mounts`` if it is delegated to the daemon
    and writable; else None and why not."""
    if cgroup is None or not mounts:
        return None, "no cgroup v2 hierarchy"
    if cgroup == "/":
        return None, "the daemon is in the root cgroup"
    top = next((m / cgroup.lstrip("/") for m in mounts if (m / cgroup.lstrip("/")).is_dir()), None)
    if top is None:
        return None, f"its cgroup {cgroup} is not under {', '.join(map(str, mounts))}"
    if not delegated(top):
        return None, f"its cgroup {cgroup} is not delegated to it (systemd: Delegate=yes)"
    if not (os.access(top, os.W_OK) and os.access(top / "cgroup.procs", os.W_OK)):
        why = "read-only" if os.statvfs(top).f_flag & os.ST_RDONLY else "not its user's"
        return None, (f"its delegated cgroup {cgroup} is {why} (systemd: ProtectControlGroups= needs "
                      "ReadWritePaths= for it)")
    return top, ""


def contain(state_dir: Path) -> Containment:
    """A delegated cgroup when the daemon has one; else process groups, with records under
    ``state_dir/children`` for a daemon started after a crash of this one."""
    cgroup = own_cgroup()
    top, why = find_delegated(cgroup, cgroup2_mounts())
    if top is not None:
        return DelegatedCgroups(top, cgroup)
    return ProcessGroups(ChildRecords(state_dir / "children"), reason=why)
