"""A delegated cgroup (cgroup v2) on this machine, as systemd's ``Delegate=yes`` makes one, for
tests of rolloutd's cgroup containment without systemd: a new cgroup under the hierarchy's root,
marked ``trusted.delegate=1`` as systemd marks a root service's, and commands started in it.

Needs root and a writable cgroup v2 hierarchy; a test that asks for one without them fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from rolloutd.supervise.cgroups import cgroup2_mounts


def hierarchy() -> Path:
    mounts = cgroup2_mounts()
    if not mounts:
        raise RuntimeError("no cgroup v2 hierarchy is mounted: the cgroup tests need one")
    if os.geteuid() != 0:
        raise RuntimeError("making a delegated cgroup needs root")
    return mounts[0]


@contextlib.contextmanager
def delegated_cgroup() -> Iterator[Path]:
    """A fresh delegated cgroup; everything left in it is killed and it is removed afterwards."""
    path = hierarchy() / f"rolloutd-cgtest-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        os.setxattr(path, "trusted.delegate", b"1")
        yield path
    finally:
        remove(path)


def remove(path: Path, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    subs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
    for cg in [*subs, path]:
        with contextlib.suppress(OSError):
            (cg / "cgroup.kill").write_text("1")
        while time.monotonic() < deadline:
            try:
                cg.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # still populated a moment after the kill
                time.sleep(0.02)


def inside(path: Path) -> list[str]:
    """A command prefix that runs the command in cgroup ``path`` from its first instruction."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path)]


def cgroup_of(pid: int) -> str | None:
    """The cgroup v2 path of a process (``/proc/<pid>/cgroup``), None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line[3:] for line in lines if line.startswith("0::")), None)


def label(path: Path) -> str:
    """``path`` as the hierarchy names it (what ``/proc/<pid>/cgroup`` shows)."""
    return "/" + str(path.relative_to(hierarchy()))


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
