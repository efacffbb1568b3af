"""Act on a file only while no other process can see it, with the kernel as the judge.

The kernel grants a write lease (``F_SETLEASE``, ``F_WRLCK``) on a file only while no other
open file refers to it, in any process; a mapping holds its file open, so a file mapped
anywhere is refused too. While the lease is held, any other open waits for it to be released.
Both the daemon's ``/dev/shm`` cleanup (a segment no live process maps) and the mirror's
recycling (a removed version's file no server maps) rest on this one proof.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from pathlib import Path


def under_write_lease(path: Path, action: Callable[[], object]) -> bool:
    """Run ``action`` while holding a write lease on ``path``. False, and ``action`` not run,
    when the lease is refused (in use, leases unsupported, another owner) or the file cannot
    be opened; False too when ``action`` raises ``OSError``. True once it has run."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        os.close(fd)
        return False
    try:
        action()
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)
