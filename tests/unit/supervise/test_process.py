"""Child processes with real processes: output forwarding, exit descriptions, stopping a group
(cooperative, ignoring SIGTERM, with a grandchild, cancelled mid-grace), spawn errors, and the
records a crashed daemon leaves for the next one. The children are small fakes, each named for
what it fakes; liveness is checked with ``ps``, independently of the module under test.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import uvloop

from rolloutd.supervise.child import MAX_LINE_BYTES, Child, ChildError, describe_exit
from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups
from tests.support.fake_children import (
    COOPERATIVE,
    EXITS_3,
    GRANDCHILD_IGNORES_TERM,
    IGNORES_TERM,
    KILLED,
    PY,
    SEGFAULTS,
    TALKER,
    lines_of,
    spawned_ready,
)
from tests.support.processes import group_pids
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)

# -- helpers -------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def proc_start_time(pid: int) -> float:
    """Seconds from boot to the start of ``pid``: field 22 of ``/proc/<pid>/stat`` (clock ticks)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


# -- output --------------------------------------------------------------------------------------
async def test_output_lines_reach_the_logger_with_name_and_pid(children, caplog):
    child = children("talker", TALKER)
    await child.spawn()
    assert await child.wait() == 0
    prefix = f"talker[{child.pid}]: "
    lines = lines_of(caplog, "talker")
    assert all(line.startswith(prefix) for line in lines), lines[:3]
    bodies = [line[len(prefix):] for line in lines]
    assert bodies[0] == "first line"
    assert bodies[-2:] == ["bad \ufffd byte", "no newline at the end"]
    long = bodies[1:-2]  # 200 KiB, logged in pieces of at most 64 KiB
    assert [len(p) for p in long] == [MAX_LINE_BYTES] * 3 + [200 * 1024 - 3 * MAX_LINE_BYTES]
    assert "".join(long) == "x" * (200 * 1024)


# -- exits ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, code, words", [
    (["true"], 0, "exited with status 0"),
    (EXITS_3, 3, "exited with status 3"),
    (KILLED, -signal.SIGKILL, "killed by SIGKILL (out of memory?)"),
    (SEGFAULTS, -signal.SIGSEGV, "killed by SIGSEGV (crashed)"),
])
async def test_a_child_that_exits_at_once_is_reaped_and_described(children, argv, code, words):
    child = children("quick", argv)
    await child.spawn()
    assert await child.wait() == code
    assert await child.wait() == code  # idempotent
    assert child.returncode == code and not child.running
    assert child.describe_exit() == words
    assert not alive(child.pid) and not Path(f"/proc/{child.pid}").exists(), "not reaped"
    assert await child.stop(1.0) == words  # nothing left to stop: the description


def test_describe_exit_words():
    assert describe_exit(None) == "still running"
    assert describe_exit(1) == "exited with status 1"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(-signal.SIGABRT) == "killed by SIGABRT (crashed)"
    assert describe_exit(-signal.SIGKILL, sent={signal.SIGKILL}) == "killed by SIGKILL"  # ours: no guess
    assert describe_exit(-77) == "killed by signal 77"


# -- stop ----------------------------------------------------------------------------------------
async def test_stop_a_cooperative_child_with_sigterm(children, caplog):
    child = await spawned_ready(children, caplog, "coop", COOPERATIVE)
    t0 = time.monotonic()
    assert await child.stop(10.0) == "killed by SIGTERM"
    assert time.monotonic() - t0 < 2.0
    assert group_pids(child.pgid) == [] and not Path(f"/proc/{child.pid}").exists()
    assert f"stop coop[{child.pid}]: SIGTERM to process group {child.pgid}" in caplog.text


async def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace(children, caplog):
    child = await spawned_ready(children, caplog, "deaf", IGNORES_TERM)
    t0 = time.monotonic()
    assert await child.stop(1.0, kill_wait_s=5.0) == "killed by SIGKILL"
    took = time.monotonic() - t0
    assert 0.95 <= took < 2.0, took
    assert group_pids(child.pgid) == [] and not Path(f"/proc/{child.pid}").exists()
    assert f"stop deaf[{child.pid}]: SIGKILL to process group {child.pgid}" in caplog.text


async def test_stop_waits_for_the_whole_group_not_only_the_leader(children, caplog):
    child = await spawned_ready(children, caplog, "family", GRANDCHILD_IGNORES_TERM)
    group = group_pids(child.pgid)
    assert len(group) == 2 and child.group_pids() == sorted(group)
    t0 = time.monotonic()
    assert await child.stop(0.5) == "killed by SIGTERM"  # the leader's own exit
    assert time.monotonic() - t0 >= 0.45, "the grandchild's grace was not waited for"
    assert group_pids(child.pgid) == [], "a grandchild survived"
    assert not Path(f"/proc/{child.pid}").exists(), "the leader is a zombie"


async def test_stop_cancelled_mid_grace_still_kills_and_reaps(children, caplog):
    child = await spawned_ready(children, caplog, "deaf", IGNORES_TERM)
    stopping = asyncio.ensure_future(child.stop(30.0))
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert time.monotonic() - t0 < 5.0
    assert group_pids(child.pgid) == []
    assert child.returncode == -signal.SIGKILL and not Path(f"/proc/{child.pid}").exists()
    assert "cancelled during the grace period" in caplog.text


async def test_a_spawn_cancelled_midway_leaves_no_process_descriptor_or_directory(children, tmp_path):
    """A restart asked while the server is being spawned cancels the spawn: the leader already
    forked is killed and reaped (by asyncio), and its pipe and its own directory go with it."""
    scratch = tmp_path / "scratch"
    fds, kids = sorted(os.listdir("/proc/self/fd")), psutil.Process().children()
    child = children("cut", COOPERATIVE, scratch=scratch)
    spawning = asyncio.ensure_future(child.spawn())
    await asyncio.sleep(0)  # into create_subprocess_exec: the process forked, its pipes being connected
    spawning.cancel()
    with pytest.raises(asyncio.CancelledError):
        await spawning
    assert child.pid is None, "the spawn ended before the cancellation: nothing was checked"
    assert list(scratch.iterdir()) == [], "the spawn's own directory is left"
    assert sorted(os.listdir("/proc/self/fd")) == fds, "the output pipe's read end is left open"
    assert psutil.Process().children() == kids


def test_the_same_on_uvloop(tmp_path):
    """The daemon runs on uvloop: spawn, forward, stop a group with a deaf grandchild there too."""
    async def scenario() -> tuple[str, list[int], int]:
        child = Child("uv", GRANDCHILD_IGNORES_TERM, dict(os.environ),
                      containment=ProcessGroups(ChildRecords(tmp_path)))
        await child.spawn()
        await until(lambda: len(group_pids(child.pgid)) == 2, what="two processes")
        await asyncio.sleep(0.3)  # time for the grandchild to ignore SIGTERM
        assert (tmp_path / "uv.json").exists()
        return await child.stop(0.3), group_pids(child.pgid), child.pid

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        how, left, pid = runner.run(scenario())
    assert (how, left) == ("killed by SIGTERM", [])
    assert not Path(f"/proc/{pid}").exists() and not (tmp_path / "uv.json").exists()


# -- spawn errors ---------------------------------------------------------------------------------
async def test_a_missing_command_is_a_child_error_naming_it(children, tmp_path):
    with pytest.raises(ChildError, match="cannot start s0: /nonexistent/vllm: No such file"):
        await children("s0", ["/nonexistent/vllm", "serve"]).spawn()
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ChildError, match=f"{script}: Permission denied"):
        await children("s1", [str(script)]).spawn()


# -- CPUs ------------------------------------------------------------------------------------------
# Prints the CPUs its process, a thread of it and a process it starts may run on, as read from
# /proc (not from the module under test), then waits to be stopped.
AFFINITY_OF_ALL = [PY, "-c", textwrap.dedent("""
    import re, subprocess, sys, threading, time
    def allowed(path):
        return re.search(r"Cpus_allowed_list:\\s*(\\S+)", open(path).read()).group(1)
    seen = {}
    t = threading.Thread(target=lambda: seen.update(thread=allowed("/proc/thread-self/status")))
    t.start(); t.join()
    child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                           capture_output=True, text=True).stdout
    grandchild = re.search(r"Cpus_allowed_list:\\s*(\\S+)", child).group(1)
    print("affinity", allowed("/proc/self/status"), seen["thread"], grandchild, flush=True)
    time.sleep(60)
""")]


async def test_a_child_and_all_it_starts_run_on_its_cpus_only(children, caplog):
    ours = sorted(os.sched_getaffinity(0))
    assert len(ours) >= 2, "needs two CPUs to tell a pinned child from an unpinned one"
    cpu = ours[-1]
    child = children("s0", AFFINITY_OF_ALL, cpus=[cpu])
    await child.spawn()
    await until(lambda: any("affinity" in line for line in lines_of(caplog, "s0")), 20, "its report")
    line = next(line for line in lines_of(caplog, "s0") if "affinity" in line)
    assert line.split("affinity ")[1].split() == [str(cpu)] * 3  # the leader, a thread, a process it started
    await child.stop(1)


async def test_cpus_it_cannot_run_on_are_a_child_error_and_nothing_runs(children):
    child = children("s0", AFFINITY_OF_ALL, cpus=[4095])
    with pytest.raises(ChildError, match=r"cannot start s0: cannot place it on CPUs \[4095\]: Invalid argument"):
        await child.spawn()
    assert child.returncode is not None and group_pids(child.pgid) == []


# -- records ---------------------------------------------------------------------------------------
async def test_a_record_is_written_at_spawn_and_removed_at_stop(children, caplog, tmp_path):
    records = ChildRecords(tmp_path / "children")
    child = await spawned_ready(children, caplog, "gpu0", COOPERATIVE, containment=ProcessGroups(records))
    record = json.loads((tmp_path / "children" / "gpu0.json").read_text())
    assert record == {"name": "gpu0", "pid": child.pid, "pgid": child.pid,
                      "start_time": pytest.approx(proc_start_time(child.pid), abs=1e-6), "argv": COOPERATIVE}
    await child.stop(5.0)
    assert list((tmp_path / "children").iterdir()) == []


# A daemon (the real classes) that spawns a server ignoring SIGTERM with a deaf grandchild, and a
# cooperative one, says their pids, and sleeps until it is killed.
DAEMON = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from rolloutd.supervise.child import Child
    from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups

    async def main():
        groups = ProcessGroups(ChildRecords(Path(sys.argv[1])))
        deaf = Child("gpu0", sys.argv[2:], {}, containment=groups)
        coop = Child("gpu1", ["sleep", "60"], {}, containment=groups)
        for child in (deaf, coop):
            await child.spawn()
        await asyncio.sleep(0.5)  # time for the deaf ones to ignore SIGTERM
        print(deaf.pid, coop.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_leftovers_of_a_killed_daemon_are_cleaned(tmp_path, caplog):
    rec_dir = tmp_path / "children"
    daemon = subprocess.Popen([PY, "-c", DAEMON, str(rec_dir), *GRANDCHILD_IGNORES_TERM], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    deaf = coop = None
    try:
        deaf, coop = map(int, (await asyncio.to_thread(daemon.stdout.readline)).split())
        daemon.kill()  # no chance to clean up
        await asyncio.to_thread(daemon.wait, 10)
        assert len(group_pids(deaf)) == 2 and alive(coop), "the children should outlive a killed daemon"
        t0 = time.monotonic()
        done = await ChildRecords(rec_dir).reap_leftovers(0.5, kill_wait_s=5.0)
        assert time.monotonic() - t0 < 2.0, "groups are cleaned at once, not one after the other"
        assert sorted(done) == [
            f"gpu0: process group {deaf} (2 processes) left by an earlier run: killed with SIGKILL",
            f"gpu1: process group {coop} (1 process) left by an earlier run: stopped with SIGTERM"]
        assert group_pids(deaf) == [] and not alive(coop)
        assert list(rec_dir.iterdir()) == []
        assert f"clean gpu0: process group {deaf}" in caplog.text
    finally:
        daemon.kill()
        daemon.wait(10)
        daemon.stdout.close()
        for pgid in (deaf, coop):
            for pid in group_pids(pgid) if pgid else []:
                os.kill(pid, signal.SIGKILL)


def forge(rec_dir: Path, name: str, pid: int, start_time: float, pgid: int | None = None) -> None:
    rec_dir.mkdir(exist_ok=True)
    (rec_dir / f"{name}.json").write_text(json.dumps({"name": name, "pid": pid, "pgid": pgid or pid,
                                                      "start_time": start_time, "argv": ["vllm"]}))


async def test_a_recycled_pid_is_never_signalled(tmp_path):
    rec_dir = tmp_path / "children"
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    member = None
    # an orphaned group: its leader has exited, a member (started after it) lives on
    orphans = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        member = int(orphans.stdout.readline())
        leader_start = proc_start_time(orphans.pid)
        orphans.wait(10)
        forge(rec_dir, "gpu0", unrelated.pid, proc_start_time(unrelated.pid) - 1)  # the pid now names another
        forge(rec_dir, "gpu1", orphans.pid, proc_start_time(member) + 100)  # members older than the record
        assert await ChildRecords(rec_dir).reap_leftovers(0.2, kill_wait_s=1.0) == []
        assert alive(unrelated.pid) and alive(member), "a process that is not ours was signalled"
        assert list(rec_dir.iterdir()) == []
        forge(rec_dir, "gpu1", orphans.pid, leader_start)  # the same group, recorded truly: ours
        assert await ChildRecords(rec_dir).reap_leftovers(0.2, kill_wait_s=1.0) == [
            f"gpu1: process group {orphans.pid} (1 process) left by an earlier run: stopped with SIGTERM"]
        assert not alive(member) and alive(unrelated.pid)
    finally:
        orphans.stdout.close()
        unrelated.kill()
        unrelated.wait(10)
        if member is not None and alive(member):
            os.kill(member, signal.SIGKILL)


async def test_corrupt_and_dangerous_records_are_removed_with_a_warning(tmp_path, caplog):
    rec_dir = tmp_path / "children"
    rec_dir.mkdir()
    (rec_dir / "gpu0.json").write_text("{not json")
    forge(rec_dir, "gpu1", 1, 1)                                    # init
    forge(rec_dir, "gpu2", os.getpid(), proc_start_time(os.getpid()), pgid=os.getpgrp())  # our own group
    (rec_dir / "gpu3.json").write_text(json.dumps({"name": "gpu3", "pid": "12", "pgid": 12, "start_time": 5}))
    forge(rec_dir, "gpu4", 4_000_000, 5)  # gone long ago (beyond any pid)
    assert await ChildRecords(rec_dir).reap_leftovers(0.2) == []
    assert list(rec_dir.iterdir()) == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("removing corrupt child record" in w for w in warned) == 4, warned


# A vLLM stand-in whose group holds processes titled as vLLM titles its engines and workers
# (``VLLM::<role>`` in their command line) and an untitled helper; it prints their pids.
TITLED = textwrap.dedent("""
    import subprocess, sys, time
    sleep = ["-c", "import time; time.sleep(60)"]
    kids = [subprocess.Popen([title, *sleep], executable=sys.executable)
            for title in ("VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1", "helper")]
    print("pids", *[k.pid for k in kids], flush=True)
    print("ready", flush=True)
    time.sleep(60)
""")


async def test_a_titled_process_of_the_group_gone_is_reported_an_untitled_one_is_not(children, caplog):
    child = await spawned_ready(children, caplog, "vllm", [PY, "-c", TITLED])
    line = next(m for m in lines_of(caplog, "vllm") if ": pids " in m)
    dp0, dp1, helper = map(int, line.split(": pids ")[1].split())
    await asyncio.to_thread(child.note_vital)
    assert child.lost_vital() is None
    os.kill(helper, signal.SIGKILL)  # a helper that comes and goes is no part of the server
    await until(lambda: helper not in child.group_pids(), what="the helper gone")
    assert child.lost_vital() is None
    os.kill(dp1, signal.SIGKILL)  # a zombie until its parent reaps it: gone all the same
    await until(lambda: child.lost_vital() is not None, what="the engine seen gone")
    assert child.lost_vital() == f"VLLM::EngineCore_DP1 (pid {dp1})"
    assert dp0 in child.group_pids()
    await child.stop(grace_s=5)
