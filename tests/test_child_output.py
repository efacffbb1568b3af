"""The child's side of supervision that the daemon's logs and ``/dev/shm`` show: the level of each
forwarded output line (vLLM's own, so ``journalctl -p warning`` finds ``Failed to load weights``),
one stop task per child whatever the number of callers, the record of a newer child of the same
name, and the shared-memory segments a killed group leaves behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from rolloutd.supervise import leftovers
from rolloutd.supervise.child import OutputLevels
from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups, ShmBaseline

from .test_process import IGNORES_TERM, alive_in_group, lines_of, spawned_ready

pytestmark = pytest.mark.timeout(60)
I, W, E, D = logging.INFO, logging.WARNING, logging.ERROR, logging.DEBUG  # noqa: E741 - a table's columns


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.DEBUG)


# -- levels ----------------------------------------------------------------------------------------
VLLM_OUTPUT = [
    ("INFO 12-01 20:09:15 [api_server.py:1] Starting vLLM API server", I),
    ("(APIServer pid=4242) WARNING 12-01 20:09:16 [layer.py:266] ParallelLMHead: Failed to load weights", W),
    ("(EngineCore_DP0 pid=4300) ERROR 12-01 20:09:17 [core.py:900] EngineCore failed to start.", E),
    ("(EngineCore_DP0 pid=4300) Traceback (most recent call last):", E),
    ('(EngineCore_DP0 pid=4300)   File "core.py", line 1, in run', E),
    ("(EngineCore_DP0 pid=4300)     raise ValueError('boom')", E),
    ("(EngineCore_DP0 pid=4300) ValueError: boom", E),
    ("", E),
    ("During handling of the above exception, another exception occurred:", E),
    ("", E),
    ("Traceback (most recent call last):", E),
    ('  File "x.py", line 2, in <module>', E),
    ("RuntimeError: again", E),
    ("Loading safetensors checkpoint shards: 100% 1/1", I),          # not vLLM's format: INFO
    ("  an indented line after an unknown one", I),
    ("(Worker pid=77) DEBUG 12-01 20:09:18 [worker.py:5] step", D),
    ("INFO:     127.0.0.1:5000 - \"GET /health HTTP/1.1\" 200 OK", I),  # uvicorn's own format
    ("Traceback (most recent call last):", E),                      # a bare one: an uncaught exception
    ('  File "y.py", line 3, in <module>', E),
    ("KeyError: 'x'", E),
    ("WARNINGS are not a level", I),
    ("(APIServer pid=1) INFO 12-01 20:09:19 [launcher.py:9] Route: /health", I),
    ("/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear "
     "to be 1 leaked shared_memory objects to clean up at shutdown", W),  # Python's warnings module
    ("  warnings.warn('resource_tracker: There appear to be %d '", W),
]


def test_vllm_levels_are_carried_over_and_tracebacks_keep_theirs():
    levels = OutputLevels()
    got = [(line, levels.level(line)) for line, _ in VLLM_OUTPUT]
    assert got == VLLM_OUTPUT


async def test_forwarded_lines_reach_the_log_at_the_childs_level(children, caplog):
    script = "import sys\n" + "".join(f"print({line!r})\n" for line, _ in VLLM_OUTPUT)
    child = children("lv", [sys.executable, "-c", script])
    await child.spawn()
    assert await child.wait() == 0
    got = [(r.getMessage().removeprefix(f"lv[{child.pid}]: "), r.levelno) for r in caplog.records
           if r.name == "rolloutd.server.lv"]
    assert got == VLLM_OUTPUT


# -- one stop per child -------------------------------------------------------------------------------
async def test_every_stop_of_a_child_is_the_same_one_and_a_cancelled_caller_waits_for_it(children, caplog,
                                                                                          tmp_path):
    child = await spawned_ready(children, caplog, "deaf", IGNORES_TERM,
                                containment=ProcessGroups(ChildRecords(tmp_path)))
    first = asyncio.ensure_future(child.stop(30.0))
    await asyncio.sleep(0.3)
    second = asyncio.ensure_future(child.stop(0.1))  # a second stop joins the first: no grace of its own
    await asyncio.sleep(0.5)
    assert not second.done() and alive_in_group(child.pgid), "the second stop ran a stop of its own"
    first.cancel()  # hurries the one stop to SIGKILL; the cancelled caller waits for its end
    with pytest.raises(asyncio.CancelledError):
        await first
    assert alive_in_group(child.pgid) == [], "the cancelled caller returned before the group was gone"
    assert await second == "killed by SIGKILL"
    assert caplog.text.count(f"stop deaf[{child.pid}]: SIGTERM to process group") == 1
    assert "cancelled during the grace period" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_the_record_of_a_newer_child_of_the_same_name_is_kept(tmp_path):
    records = ChildRecords(tmp_path)
    (tmp_path / "gpu0.json").write_text(json.dumps({"name": "gpu0", "pid": 222, "pgid": 222, "start_time": 9}))
    records.remove("gpu0", pid=111)  # the stop of the older child, pid 111
    assert (tmp_path / "gpu0.json").exists()
    records.remove("gpu0", pid=222)
    assert not (tmp_path / "gpu0.json").exists()


# -- shared memory a killed group leaves ---------------------------------------------------------------
@pytest.fixture
def shm(monkeypatch):
    """A directory of its own on /dev/shm's tmpfs stands in for /dev/shm: other users' segments
    (a real vLLM test running beside this one) are never looked at."""
    d = Path("/dev/shm") / f"rolloutd-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        monkeypatch.setattr(leftovers, "SHM_DIR", d)
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


# A vLLM stand-in: creates a segment as multiprocessing.shared_memory does and a named semaphore's
# file as multiprocessing's locks do (each file stays open and mapped), in a process of its
# group that the test then kills with the group's leader.
MAKES_SEGMENT = textwrap.dedent("""
    import mmap, os, sys, time
    maps = []
    for prefix, size in (("psm_", 1 << 20), ("sem.mp-", 32)):
        fd = os.open(os.path.join(sys.argv[1], prefix + sys.argv[2]), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        maps.append(mmap.mmap(fd, size))
    print("ready", flush=True)
    time.sleep(60)
""")
HOLDS_SEGMENT = MAKES_SEGMENT  # the same, outside the group: another live user of /dev/shm


async def test_segments_left_by_a_killed_group_are_removed_and_no_other(children, caplog, shm):
    (shm / "psm_before").write_bytes(b"x")  # there before the spawn: not the group's
    child = await spawned_ready(children, caplog, "vllm", [sys.executable, "-c", MAKES_SEGMENT, str(shm), "ours"])
    other = subprocess.Popen([sys.executable, "-c", HOLDS_SEGMENT, str(shm), "theirs"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        (shm / "not_vllm").write_bytes(b"x")  # a name vLLM does not use
        (shm / "psm_closed").write_bytes(b"x")  # created meanwhile, used by nobody: left by the group
        os.killpg(child.pgid, signal.SIGKILL)  # no resource tracker survives to unlink it
        await child.wait()
        assert sorted(p.name for p in shm.iterdir()) == ["not_vllm", "psm_before", "psm_theirs", "sem.mp-theirs"]
        assert "clean vllm[" in caplog.text and "psm_closed, psm_ours, sem.mp-ours" in caplog.text
    finally:
        other.kill()
        other.wait(10)
        other.stdout.close()
    assert leftovers.remove_shm_leftovers(set()) == ["psm_before", "psm_theirs", "sem.mp-theirs"]  # unused now
    assert lines_of(caplog, "vllm")[0].endswith(": ready")


def test_segments_of_servers_killed_with_their_daemon_are_removed_at_the_next_start(shm, tmp_path):
    """systemd SIGKILLs what is left of the unit when the daemon dies: the next daemon's start
    removes what those servers left (the same rule as a server's own stop), and only that."""
    record = tmp_path / "state" / "shm-at-start.json"
    (shm / "psm_before").write_bytes(b"x")  # there before the earlier daemon started
    assert ShmBaseline(record).clean_and_record() == []  # a first start: nothing to clean
    server = subprocess.Popen([sys.executable, "-c", MAKES_SEGMENT, str(shm), "ours"], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", HOLDS_SEGMENT, str(shm), "theirs"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert server.stdout.readline().strip() == other.stdout.readline().strip() == "ready"
        os.killpg(server.pid, signal.SIGKILL)  # the earlier daemon's end: no resource tracker unlinks
        server.wait(10)
        (shm / "not_vllm").write_bytes(b"x")
        lines = ShmBaseline(record).clean_and_record()  # the next daemon's start
        assert lines == ["shared memory: removed 2 segment(s) the servers of an earlier run left: psm_ours, "
                         "sem.mp-ours"]
        assert sorted(p.name for p in shm.iterdir()) == ["not_vllm", "psm_before", "psm_theirs", "sem.mp-theirs"]
        assert set(json.loads(record.read_text())) == {"not_vllm", "psm_before", "psm_theirs", "sem.mp-theirs"}
    finally:
        for proc in (server, other):
            proc.kill()
            proc.wait(10)
            proc.stdout.close()


def test_after_an_ordered_stop_or_with_a_bad_record_the_next_start_removes_nothing(shm, tmp_path):
    record = tmp_path / "shm-at-start.json"
    baseline = ShmBaseline(record)
    baseline.clean_and_record()
    baseline.forget()  # the ordered stop: every server cleaned after itself
    (shm / "psm_someone_elses").write_bytes(b"x")  # unused, but no earlier run of ours is in question
    assert ShmBaseline(record).clean_and_record() == []
    record.write_text("{not json")
    (shm / "psm_later").write_bytes(b"x")
    [line] = ShmBaseline(record).clean_and_record()
    assert line.startswith(f"shared memory: unreadable record {record}: ") and line.endswith("; nothing removed")
    record.write_text(json.dumps({"psm_x": 1}))
    assert ShmBaseline(record).clean_and_record() == [f"shared memory: record {record} is not a list of names; "
                                                      "nothing removed"]
    assert sorted(p.name for p in shm.iterdir()) == ["psm_later", "psm_someone_elses"]
