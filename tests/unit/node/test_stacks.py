"""rolloutd/node/stacks.py: what SIGUSR1 writes. The chain of awaits of a suspended task, and the
threads' stacks of a process whose event loop is stuck (where the loop's own handler never runs)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

from rolloutd.node import stacks


async def _inner(gate: asyncio.Event) -> None:
    await gate.wait()


async def _outer(gate: asyncio.Event) -> None:
    await _inner(gate)


async def test_a_task_is_described_by_every_await_it_is_suspended_in_down_to_its_future():
    gate = asyncio.Event()
    task = asyncio.create_task(_outer(gate), name="waiter")
    await asyncio.sleep(0)
    text = stacks.describe(task)
    lines = text.splitlines()
    assert lines[0] == "task waiter:"
    assert [line.rsplit(" in ", 1)[1] for line in lines[1:-1]] == ["_outer", "_inner", "Event.wait"], text
    assert all("test_stacks.py:" in line for line in lines[1:3]), text
    assert lines[-1].startswith("  awaiting <Future pending"), text
    assert "task waiter:" in stacks.describe_tasks()
    gate.set()
    await task


async def test_a_task_awaiting_another_task_names_it():
    inner = asyncio.create_task(asyncio.Event().wait(), name="inner")
    outer = asyncio.create_task(_await(inner), name="outer")
    await asyncio.sleep(0)
    assert stacks.describe(outer).splitlines()[-1] == "  awaiting task inner"
    inner.cancel()
    await asyncio.gather(outer, return_exceptions=True)


async def _await(task: asyncio.Task) -> None:
    await task


STUCK = textwrap.dedent("""
    import asyncio, sys, time
    from rolloutd.node import stacks

    def stuck_for_good():
        time.sleep(30)

    async def main():
        stacks.install(asyncio.get_running_loop())
        print("ready", flush=True)
        stuck_for_good()  # the loop never runs again: only faulthandler can say where it is

    asyncio.run(main())
""")


def test_a_loop_stuck_in_a_call_still_shows_where_on_sigusr1():
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.2)  # inside time.sleep by now
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None, "SIGUSR1 ended the process"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert "line 6 in stuck_for_good" in err, err
    assert "Current thread" in err, err


AROUND_THE_LOOP = textwrap.dedent("""
    import asyncio, os, signal, sys, time
    from rolloutd.node import stacks

    def poke(when):
        print(f"poke {when}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)  # faulthandler writes from the handler; the loop's record needs the loop

    async def main():
        stacks.install(asyncio.get_running_loop())
        poke("while the loop runs")
        await asyncio.sleep(0.2)
        stacks.uninstall(asyncio.get_running_loop())

    stacks.threads_only()
    poke("before the loop")
    asyncio.run(main())
    poke("after the loop")
    print("alive", flush=True)
""")


def test_sigusr1_never_kills_the_process_before_during_or_after_its_loop():
    proc = subprocess.run([sys.executable, "-c", AROUND_THE_LOOP], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "alive\n"), proc.stderr
    err = proc.stderr
    sections = err.split("poke ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["before the loop", "while the loop runs", "after the loop"], err
    assert all("Current thread" in s for s in sections), err  # faulthandler each time
    # the tasks' record (logging's last resort writes it to stderr here) only while the loop runs
    assert ["tasks, on SIGUSR1" in s for s in sections] == [False, True, False], err
    assert "in main" in sections[1], err
