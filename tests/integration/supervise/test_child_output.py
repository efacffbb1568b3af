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
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from rolloutd.supervise import child as child_module
from rolloutd.supervise import leftovers
from rolloutd.supervise.child import OutputLevels, is_stop_noise, vllm_header
from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups, ShmBaseline
from tests.support.fake_children import HOLDS_NAMED, IGNORES_TERM, held_decoy, lines_of, spawned_ready
from tests.support.processes import group_pids
from tests.support.waiting import until

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


# -- lines that would alarm for nothing -------------------------------------------------------------
ROTARY = "(Worker pid=14540) WARNING 12-06 05:27:06 [layerwise.py:266] RotaryEmbedding: Failed to load weights"
LM_HEAD = "(Worker pid=14540) WARNING 12-06 05:27:06 [layerwise.py:266] ParallelLMHead: Failed to load weights"


DEV_MODE = ("(APIServer pid=13695) WARNING 12-06 05:27:05 [__init__.py:44] SECURITY WARNING: Development endpoints "
            "are enabled! This should NOT be used in production!")


def test_an_expected_warning_is_debug_and_a_layer_that_missed_its_weights_stays_a_warning():
    levels = OutputLevels()
    assert (levels.level(ROTARY), levels.expected is not None) == (D, True)
    assert (levels.level(DEV_MODE), "rolloutd enables them" in levels.expected) == (D, True)
    assert (levels.level(LM_HEAD), levels.expected) == (W, None)  # a failed update: tied embeddings


async def test_an_expected_warning_is_explained_once_at_info(children, caplog, monkeypatch):
    monkeypatch.setattr(child_module, "_SAID", set())
    script = "".join(f"print({line!r})\n" for line in (ROTARY, LM_HEAD, ROTARY))
    kids = [children(f"r{i}", [sys.executable, "-c", script]) for i in range(2)]
    for kid in kids:  # one after the other: the second server's lines too are said once in all
        await kid.spawn()
        assert await kid.wait() == 0
    forwarded = [(r.getMessage().split(": ", 1)[1], r.levelno) for r in caplog.records
                 if r.name.startswith("rolloutd.server.r")]
    assert forwarded == [(ROTARY, D), (LM_HEAD, W), (ROTARY, D)] * 2
    said = [r for r in caplog.records if r.getMessage().startswith("lower r")]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (I, f"lower r0[{kids[0].pid}]: vLLM's warning 'RotaryEmbedding: Failed to load weights' at each update "
            "is expected (that layer holds only buffers it computes itself, which no checkpoint carries): logged "
            "at DEBUG from now on")]


# Recorded from vLLM 0.32 (CPU build) under rolloutd (its paths shortened): what it prints as
# rolloutd stops it (SIGTERM to its group), and the API server's record when its engine core
# died under it (a kill -9 of the engine core; the same record comes when a stop's SIGTERM
# reaches the engine core first). The last rows are not recorded: errors that are not the stop's.
# (line, level outside a stop rolloutd asked for, level during one)
VLLM_STOP = [
    ("(EngineCore pid=16043) INFO 12-06 05:28:02 [core.py:1454] [shutdown] EngineCore: trigger received "
     "signal=SIGTERM", I, I),
    ("(APIServer pid=15704) INFO 12-06 05:28:02 [launcher.py:254] [shutdown] API server: shutdown triggered", I, I),
    ("(APIServer pid=15704) WARNING 12-06 05:28:02 [utils.py:648] [shutdown] Process manager: force killing "
     "remaining processes count=1", W, I),
    ("(APIServer pid=15704) WARNING 12-06 05:28:02 [utils.py:653] [shutdown] Process manager: force killing "
     "remaining process EngineCore pid 16043", W, I),
    ("(APIServer pid=15704) WARNING 12-06 05:28:02 [system_utils.py:225] [shutdown] force killing sub process "
     "VLLM::Worker pid 16307", W, I),
    ("(APIServer pid=13695) WARNING 12-06 05:27:29 [core_client.py:817] [shutdown] MPClient: engine core exited "
     "unexpectedly; starting cleanup", W, I),
    ("(APIServer pid=13695) INFO 12-06 05:27:29 [core_client.py:777] [shutdown] MPClient: complete", I, I),
    ("(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906] AsyncLLM output_handler failed.", E, I),
    ("(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906] Traceback (most recent call last):", E, I),
    ('(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906]   File "/opt/vllm/v1/engine/async_llm.py", '
     "line 849, in output_handler", E, I),
    ("(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906]     outputs = await "
     "engine_core.get_output_async()", E, I),
    ("(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906]               "
     "^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^", E, I),
    ('(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906]   File "/opt/vllm/v1/engine/core_client.py", '
     "line 1235, in get_output_async", E, I),
    ("(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906]     raise self._format_exception(outputs) "
     "from None", E, I),
    ("(APIServer pid=13695) ERROR 12-06 05:27:29 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
     "EngineCore encountered an issue. See stack trace (above) for the root cause.", E, I),
    ("INFO:     Shutting down", I, I),
    ("/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear "
     "to be 2 leaked shared_memory objects to clean up at shutdown", W, I),
    ("  warnings.warn('resource_tracker: There appear to be %d '", W, I),
    ("/usr/lib/python3.11/multiprocessing/resource_tracker.py:267: UserWarning: resource_tracker: "
     "'/mp-x0k6r0r7': [Errno 2] No such file or directory", W, I),  # recorded at a reload's stop
    ("  warnings.warn('resource_tracker: %r: %s' % (name, e))", W, I),
    # not the stop's: kept as they are
    ("(EngineCore pid=16043) ERROR 12-06 05:28:02 [core.py:1100] EngineCore encountered a fatal error.", E, E),
    ("(EngineCore pid=16043) ERROR 12-06 05:28:02 [core.py:1100] Traceback (most recent call last):", E, E),
    ("(EngineCore pid=16043) ERROR 12-06 05:28:02 [core.py:1100] RuntimeError: CPU out of memory", E, E),
    ("(APIServer pid=15704) WARNING 12-06 05:28:02 [serving.py:262] a warning of its own", W, W),
    ("INFO:     Application shutdown complete.", I, I),
    ("Traceback (most recent call last):", E, E),
    ('  File "/opt/vllm/entrypoints/cli/main.py", line 9, in <module>', E, E),
    ("OSError: [Errno 28] No space left on device", E, E),
]


def test_stop_noise_is_an_engine_dead_record_and_nothing_else():
    levels = OutputLevels()
    levels.stopping = True
    assert [levels.level(line) for line, _, _ in VLLM_STOP[:7]] == [during for _, _, during in VLLM_STOP[:7]]
    assert is_stop_noise([line for line, _, _ in VLLM_STOP[7:15]])
    assert not is_stop_noise([line for line, _, _ in VLLM_STOP[20:23]])
    assert {vllm_header(line) for line, _, _ in VLLM_STOP[7:15]} == {"(APIServer pid=13695) [async_llm.py:906]"}


def _prints(lines: list[str], *, on_term: bool) -> list[str]:
    """A child that prints ``lines``: when SIGTERM comes (then exits 0), or at once."""
    body = "".join(f"    print({line!r})\n" for line in lines)
    if not on_term:
        return [sys.executable, "-c", f"if True:\n{body}"]
    return [sys.executable, "-c", "import signal, sys, time\n"
            f"def term(*_):\n{body}    sys.stdout.flush()\n    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\nprint('ready', flush=True)\ntime.sleep(60)\n"]


def _forwarded(caplog, name: str, pid: int) -> list[tuple[str, int]]:
    return [(r.getMessage().removeprefix(f"{name}[{pid}]: "), r.levelno) for r in caplog.records
            if r.name == f"rolloutd.server.{name}" and not r.getMessage().endswith(": ready")]


async def test_during_a_stop_rolloutd_asked_for_vllms_shutdown_noise_is_info_and_other_errors_stay(children,
                                                                                                  caplog):
    child = await spawned_ready(children, caplog, "st", _prints([line for line, _, _ in VLLM_STOP], on_term=True))
    assert await child.stop(10.0) == "exited with status 0"
    assert _forwarded(caplog, "st", child.pid) == [(line, during) for line, _, during in VLLM_STOP]


async def test_an_error_record_held_during_a_stop_is_bounded(children, caplog):
    """Held lines are memory: a record longer than the bound is logged as it is, the rest judged anew."""
    head = "(APIServer pid=9) ERROR 12-06 05:27:29 [async_llm.py:906]"
    n = child_module._HELD_LINES
    lines = [f"{head} line {i}" for i in range(n + 100)] + [f"{head} EngineDeadError: EngineCore encountered"]
    child = await spawned_ready(children, caplog, "long", _prints(lines, on_term=True))
    assert await child.stop(10.0) == "exited with status 0"
    assert [level for _, level in _forwarded(caplog, "long", child.pid)] == [E] * n + [I] * 101


async def test_the_same_lines_without_a_stop_keep_their_levels(children, caplog):
    child = children("dead", _prints([line for line, _, _ in VLLM_STOP], on_term=False))
    await child.spawn()
    assert await child.wait() == 0
    assert _forwarded(caplog, "dead", child.pid) == [(line, outside) for line, outside, _ in VLLM_STOP]


async def test_a_stop_after_a_vital_process_died_on_its_own_keeps_vllms_levels(children, caplog):
    """A crash, then rolloutd's stop of what is left: vLLM's account of the death (its EngineDeadError
    record, its shutdown warnings), printed after the signal, is the crash's and keeps its level."""
    lines = [line for line, _, _ in VLLM_STOP]
    body = "".join(f"    print({line!r})\n" for line in lines)
    leader = [sys.executable, "-c", "import signal, subprocess, sys, time\n"
              "core = subprocess.Popen(['bash', '-c', 'exec -a VLLM::EngineCore sleep 60'])\n"
              f"def term(*_):\n{body}    sys.stdout.flush()\n    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, term)\nprint('ready', flush=True)\ntime.sleep(60)\n"]
    child = await spawned_ready(children, caplog, "crash", leader)
    core = await wait_for_title(child, "VLLM::EngineCore")
    child.note_vital()
    os.kill(core, signal.SIGKILL)
    await until(lambda: child.lost_vital() is not None, what="the engine core gone")
    assert await child.stop(10.0) == "exited with status 0"
    assert _forwarded(caplog, "crash", child.pid) == [(line, outside) for line, outside, _ in VLLM_STOP]


async def wait_for_title(child, title: str) -> int:
    """The pid of the child's process whose command line starts with ``title``."""
    def found() -> int | None:
        for pid in child.group_pids():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    return pid
            except OSError:
                pass
        return None
    await until(lambda: found() is not None, what=title)
    return found()


# -- one stop per child -------------------------------------------------------------------------------
async def test_every_stop_of_a_child_is_the_same_one_and_a_cancelled_caller_waits_for_it(children, caplog,
                                                                                          tmp_path):
    child = await spawned_ready(children, caplog, "deaf", IGNORES_TERM,
                                containment=ProcessGroups(ChildRecords(tmp_path)))
    first = asyncio.ensure_future(child.stop(30.0))
    await asyncio.sleep(0.3)
    second = asyncio.ensure_future(child.stop(0.1))  # a second stop joins the first: no grace of its own
    await asyncio.sleep(0.5)
    assert not second.done() and group_pids(child.pgid), "the second stop ran a stop of its own"
    first.cancel()  # hurries the one stop to SIGKILL; the cancelled caller waits for its end
    with pytest.raises(asyncio.CancelledError):
        await first
    assert group_pids(child.pgid) == [], "the cancelled caller returned before the group was gone"
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
        removals = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"clean vllm[{child.pid}]")]
        assert removals == [f"clean vllm[{child.pid}]: removed {shm / 'psm_closed'} (1 bytes)",
                            f"clean vllm[{child.pid}]: removed {shm / 'psm_ours'} (1.0 MiB)",
                            f"clean vllm[{child.pid}]: removed {shm / 'sem.mp-ours'} (32 bytes)"]
    finally:
        other.kill()
        other.wait(10)
        other.stdout.close()
    assert leftovers.remove_shm_leftovers(set()) == ["psm_before", "psm_theirs", "sem.mp-theirs"]  # unused now
    assert lines_of(caplog, "vllm")[0].endswith(": ready")





@pytest.mark.parametrize("end", ["crash", "stop"])
async def test_segments_the_group_held_are_removed_at_its_end_whatever_their_names(children, caplog, shm, end):
    """Learnt once healthy (a crash then leaves them) or at the stop, before its SIGTERM; removed
    once the group is gone: only names its processes held, created after its spawn, used by no one."""
    (shm / "mirror").mkdir()
    (shm / "there_before").write_bytes(b"x")  # another program's, opened by the server too
    decoys = [held_decoy(shm, "vllm_dist_theirs-cpushm_0")]
    ours = ["vllm_dist_ours-cpushm_0", "vllm_dist_ours-cpushm_1"]
    try:
        child = await spawned_ready(children, caplog, "vllm", [sys.executable, "-c", HOLDS_NAMED, str(shm), *ours,
                                                               "shared", "mirror/v1.safetensors", "there_before"])
        (shm / "unheld").write_bytes(b"x")  # created meanwhile by someone, never held by the group
        decoys.append(held_decoy(shm, "shared"))  # the group's, but another process maps it too and lives on
        if end == "crash":
            await child.note_shm()
            os.killpg(child.pgid, signal.SIGKILL)
            await child.wait()
        else:
            await child.stop(grace_s=10)
        assert sorted(p.name for p in shm.iterdir()) == ["mirror", "shared", "there_before", "unheld",
                                                          "vllm_dist_theirs-cpushm_0"]
        assert (shm / "mirror" / "v1.safetensors").exists()
        removals = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"clean vllm[{child.pid}]")]
        assert removals == [f"clean vllm[{child.pid}]: removed {shm / n} (4.0 MiB)" for n in ours]
    finally:
        for decoy in decoys:
            decoy.kill()
            decoy.wait(10)
            decoy.stdout.close()
        (shm / "mirror" / "v1.safetensors").unlink(missing_ok=True)
        (shm / "mirror").rmdir()


def test_held_names_come_from_the_maps_and_descriptors_of_the_given_processes_only(shm):
    (shm / "sub").mkdir()
    held = subprocess.Popen([sys.executable, "-c", HOLDS_NAMED, str(shm), "a", "sub/b"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    other = held_decoy(shm, "c")
    try:
        assert held.stdout.readline().strip() == "ready"
        assert leftovers.shm_held_by([held.pid]) == {"a", "sub/b"}
        assert leftovers.shm_held_by([held.pid, other.pid, 1 << 30]) == {"a", "sub/b", "c"}  # a pid gone: nothing
    finally:
        for proc in (held, other):
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
        (shm / "sub" / "b").unlink(missing_ok=True)
        (shm / "sub").rmdir()


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


# A server that leaves a file in its temporary directory at every start, as vLLM does
# (torch.distributed's rendezvous store, /tmp/vllm_dist_<uuid>, never removed), then holds a segment.
LEAVES_TMP = textwrap.dedent("""
    import mmap, os, sys, tempfile, time
    open(os.path.join(tempfile.gettempdir(), "vllm_dist_0123"), "w").write("store")
    fd = os.open(os.path.join(sys.argv[1], sys.argv[2]), os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4 << 20)
    m = mmap.mmap(fd, 4 << 20)
    print("tmp", tempfile.gettempdir(), flush=True)
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("end", ["crash", "stop"])
async def test_a_server_has_a_tmpdir_of_its_own_removed_once_it_is_gone(children, caplog, shm, tmp_path, end):
    """Its TMPDIR is a directory of its own under the scratch directory, with the record of the
    segments it was seen holding; both go once its processes are gone, however it ended."""
    scratch = tmp_path / "scratch"
    child = await spawned_ready(children, caplog, "vllm", [sys.executable, "-c", LEAVES_TMP, str(shm), "held_seg"],
                                scratch=scratch)
    [own] = scratch.iterdir()
    assert len(own.name) == 8 and (own.stat().st_mode & 0o777) == 0o700
    assert f"vllm[{child.pid}]: tmp {own}" in lines_of(caplog, "vllm")
    assert (own / "vllm_dist_0123").read_text() == "store"
    await child.note_shm()
    assert json.loads((own / ".rolloutd-shm-held.json").read_text()) == ["held_seg"]
    if end == "crash":
        os.killpg(child.pgid, signal.SIGKILL)
        await child.wait()
    else:
        await child.stop(grace_s=10)
    assert list(scratch.iterdir()) == [] and not (shm / "held_seg").exists()


async def test_what_servers_killed_with_their_daemon_held_is_removed_at_the_next_start(children, shm, tmp_path):
    """Segments no pattern knows, only known because the server was seen holding them, and the
    server's scratch directory: a daemon that ended without stopping its servers left both; the
    next start removes them, and a segment another program holds stays."""
    record, scratch = tmp_path / "state" / "shm-at-start.json", tmp_path / "state" / "scratch"
    assert ShmBaseline(record).clean_and_record() == []  # the earlier daemon's start
    child = children("vllm", [sys.executable, "-c", HOLDS_NAMED, str(shm), "vllm_dist_a-cpushm_0", "shared"],
                     scratch=scratch)
    await child.spawn()
    await until(lambda: "shared" in leftovers.shm_held_by(child.group_pids()), what="its segments")
    await child.note_shm()
    decoy = held_decoy(shm, "shared")
    try:
        os.killpg(child.pgid, signal.SIGKILL)  # with its daemon, which never reaps it
        await until(lambda: not group_pids(child.pgid), what="the group gone")
        [left] = scratch.iterdir()
        lines = ShmBaseline(record).clean_and_record()  # the next daemon's start
        assert lines == ["shared memory: removed 1 segment(s) the servers of an earlier run left: "
                         "vllm_dist_a-cpushm_0", "scratch: removed 1 server directory(ies) an earlier run left: "
                         f"{left.name}"]
        assert sorted(p.name for p in shm.iterdir()) == ["shared"] and list(scratch.iterdir()) == []
    finally:
        decoy.kill()
        decoy.wait(10)
        decoy.stdout.close()


def test_vllms_sockets_stay_in_the_servers_tmpdir_while_their_paths_fit_a_unix_socket(tmp_path):
    """vLLM's ZMQ sockets are <TMPDIR>/<uuid4> (37 bytes more); past 107 bytes they cannot be
    bound, so they go to a directory of their own in the system's temporary directory (mode 0700),
    which goes with the server's directory: at its stop, or at the next daemon's start after a kill."""
    with tempfile.TemporaryDirectory(prefix="s") as short:  # /tmp/sXXXXXXXX/XXXXXXXX: room left
        fits = leftovers.Scratch.make(Path(short))
        assert fits.env() == {"TMPDIR": str(fits.path)} and fits.rpc_dir() is None
    deep = tmp_path / ("d" * (leftovers.Scratch.SOCKET_PATH_MAX - len(os.fsencode(tmp_path))))
    too_long = leftovers.Scratch.make(deep)
    rpc = too_long.rpc_dir()
    assert too_long.env() == {"TMPDIR": str(too_long.path), "VLLM_RPC_BASE_PATH": str(rpc)}
    assert rpc.parent == Path(tempfile.gettempdir()) and stat.S_IMODE(rpc.stat().st_mode) == 0o700
    assert len(os.fsencode(rpc)) + leftovers.Scratch.UUID_TAIL <= leftovers.Scratch.SOCKET_PATH_MAX
    (rpc / "a-socket").touch()
    too_long.remove()
    assert not rpc.exists() and not too_long.path.exists()

    left = leftovers.Scratch.make(deep)  # a server killed with its daemon: the next start removes both
    rpc = left.rpc_dir()
    ShmBaseline(tmp_path / "shm-at-start.json", scratch=deep).clean_and_record()
    assert not rpc.exists() and list(deep.iterdir()) == []


def test_a_record_naming_another_directory_is_not_followed(tmp_path):
    """Only a ``rolloutd-rpc-*`` directory right in the temporary directory is ever removed."""
    victim = Path(tempfile.mkdtemp(prefix="not-ours-"))
    try:
        for named in (victim, tmp_path / "rolloutd-rpc-x"):
            (tmp_path / "rolloutd-rpc-x").mkdir(exist_ok=True)
            scratch = leftovers.Scratch(tmp_path / "s")
            scratch.path.mkdir()
            (scratch.path / leftovers.Scratch.RPC).write_text(str(named))
            assert scratch.rpc_dir() is None and scratch.env() == {"TMPDIR": str(scratch.path)}
            scratch.remove()
            assert named.exists()
    finally:
        shutil.rmtree(victim)


def test_a_server_directory_that_cannot_be_made_whole_leaves_nothing(tmp_path, monkeypatch):
    """Its record not written (a full disk, faked: root writes anywhere): neither directory is left."""
    deep = tmp_path / ("d" * (leftovers.Scratch.SOCKET_PATH_MAX - len(os.fsencode(tmp_path))))
    made, mkdtemp = [], tempfile.mkdtemp

    def recorded(*args, **kwargs):
        made.append(Path(mkdtemp(*args, **kwargs)))
        return str(made[-1])

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space"):
        leftovers.Scratch.make(deep)
    monkeypatch.undo()
    assert len(made) == 2 and made[1].name.startswith(leftovers.Scratch.RPC_PREFIX), made
    assert [p for p in made if p.exists()] == []
