"""The daemon's thread runs as soon as it wakes: a short scheduler slice for its event loop.

Everything latency-bound in the daemon (the gateway relaying tokens, heartbeats, the admin
API) runs on one thread that sleeps in epoll and wakes for a few tens of microseconds at a
time. On a node where pull workers, vLLM's processes and the trainer's clients keep every core
busy, the kernel's fair scheduler (EEVDF, Linux 6.6 and later) lets a task that is running
finish its slice before a woken one takes the core, so each wake-up of the gateway could wait
a slice (the kernel's default, longer on machines with more cores), several times per request
(docs/data-path.md, "The daemon's loop runs when it wakes", has what the short slice saves).

A task may ask for a shorter slice (``sched_setattr`` with ``sched_runtime``; Linux 6.12 and
later; no privilege needed). A shorter slice gives it an earlier deadline, so it preempts a
task with the default slice as it wakes. It costs the daemon nothing: the thread never uses a
slice in full. Only the calling thread gets it, and ``SCHED_FLAG_RESET_ON_FORK`` keeps it from
threads and processes started later: vLLM and the pull workers run with the default.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

SLICE_NS = 300_000  # the kernel accepts 0.1 to 100 ms
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SCHED_FLAG_RESET_ON_FORK = 0x01


def short_slice(slice_ns: int = SLICE_NS) -> bool:
    """Give the calling thread a scheduler slice of ``slice_ns`` (normal policy, nice kept).
    True if the kernel took it (read back from ``/proc/thread-self/sched``); False where it
    cannot (an older kernel, another architecture, a sandbox that forbids the call)."""
    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if number is None:
        return False
    # struct sched_attr: size, policy, flags, nice, priority, runtime, deadline, period,
    # util_min, util_max
    attr = struct.pack("IIQiIQQQII", 56, os.SCHED_OTHER, _SCHED_FLAG_RESET_ON_FORK, os.getpriority(
        os.PRIO_PROCESS, 0), 0, slice_ns, 0, 0, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, ctypes.create_string_buffer(attr, len(attr)), 0) != 0:
        return False
    return current_slice_ns() == slice_ns


def current_slice_ns(pid: int | None = None) -> int | None:
    """The scheduler slice (``se.slice`` in its ``sched`` file) of process ``pid``'s main
    thread, or of the calling thread; None where the kernel does not show one."""
    path = "/proc/thread-self/sched" if pid is None else f"/proc/{pid}/task/{pid}/sched"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        pass
    return None
