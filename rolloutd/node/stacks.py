"""SIGUSR1: what a running daemon is waiting on, written to its log, without stopping it.

``systemctl kill -s USR1 rolloutd`` (or ``kill -USR1 <pid>``) writes two things:

- every thread's Python stack, by :mod:`faulthandler`, to standard error (the journal). It is
  written from the signal handler itself, so it shows also a loop that is stuck in a call that
  never returns, where nothing else of the daemon runs;
- every asyncio task and the chain of awaits it is suspended in, down to the future it waits
  for, as one log record (``rolloutd.stacks``). A task's own ``get_stack()`` names only its
  outermost frame, which says little ("in keep"); the chain says "in Child.stop, awaiting
  ContainmentScope.wait_empty". Written by the loop, so only when the loop runs.

A stop that takes longer than its deadlines, or a pull that does not move, is diagnosed this way
on a node nobody can attach a debugger to.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from types import CoroutineType, GeneratorType

log = logging.getLogger("rolloutd.stacks")

SIGNAL = signal.SIGUSR1


def threads_only() -> None:
    """SIGUSR1 writes the threads' stacks: from the process's start (``rolloutd run``) to its end,
    before the loop runs and after it stops, so that the signal never kills it (its default)."""
    faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True)


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Dump threads and tasks on SIGUSR1 while ``loop`` runs. The loop's handler first,
    faulthandler's on top of it: faulthandler writes the threads' stacks, then hands the signal
    to the loop (``chain``). An earlier registration goes first: faulthandler keeps the action it
    replaced at its first registration, and would put that one back at the end."""
    faulthandler.unregister(SIGNAL)
    loop.add_signal_handler(SIGNAL, lambda: log.warning("tasks, on SIGUSR1:\n%s", describe_tasks()))
    faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True, chain=True)


def uninstall(loop: asyncio.AbstractEventLoop) -> None:
    faulthandler.unregister(SIGNAL)
    loop.remove_signal_handler(SIGNAL)
    threads_only()


def describe_tasks() -> str:
    """Each task of the running loop, a line each for the awaits it is suspended in."""
    return "\n".join(describe(task) for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()))


def describe(task: asyncio.Task) -> str:
    lines = [f"task {task.get_name()}:"]
    awaited = task.get_coro()
    while isinstance(awaited, (CoroutineType, GeneratorType)):  # a future's own iterator ends it
        frame = awaited.cr_frame if isinstance(awaited, CoroutineType) else awaited.gi_frame
        if frame is None:  # finished, or not started
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_qualname}")
        awaited = awaited.cr_await if isinstance(awaited, CoroutineType) else awaited.gi_yieldfrom
    waiter = getattr(task, "_fut_waiter", None)  # what the task's step is blocked on, if anything
    if isinstance(waiter, asyncio.Task):
        lines.append(f"  awaiting task {waiter.get_name()}")
    elif waiter is not None:
        lines.append(f"  awaiting {waiter!r}"[:300])
    return "\n".join(lines)
