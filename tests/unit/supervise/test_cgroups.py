"""Servers held in a delegated cgroup each (rolloutd/supervise/cgroups.py), on this machine's real
cgroup v2 hierarchy: a cgroup made and marked as systemd's ``Delegate=yes`` marks one
(tests/support/cgroup_harness.py), a small daemon of the real classes started inside it. Where each
process is comes from ``/proc/<pid>/cgroup`` and liveness from ``ps``, independently of the
module under test. A fake cgroup tree in a temporary directory (named as a fake) stands in for
the kernel only where the kernel cannot be made to show a case: a kernel without ``cgroup.kill``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rolloutd.supervise import cgroups
from rolloutd.supervise.cgroups import CgroupScope, find_delegated
from tests.support.cgroup_harness import cgroup_of, delegated_cgroup, hierarchy, inside, kill_all, label

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]

# A daemon of the real classes: chooses its containment, stops what an earlier run left, spawns
# the servers named in argv[2] (JSON: name -> argv), says what it did as one JSON line, then
# stops them when told "stop" on stdin (or sleeps until killed).
DAEMON = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from rolloutd.supervise.cgroups import contain
    from rolloutd.supervise.child import Child

    async def main():
        containment = contain(Path(sys.argv[1]))
        clean = await containment.start(0.5, 5.0)
        servers = [Child(name, argv, {}, containment=containment) for name, argv in json.loads(sys.argv[2]).items()]
        for child in servers:
            await child.spawn()
        print(json.dumps({"containment": str(containment), "clean": sorted(clean),
                          "pids": {c.name: c.pid for c in servers}}), flush=True)
        if (await asyncio.to_thread(sys.stdin.readline)).strip() == "stop":
            print(json.dumps({c.name: await c.stop(0.5, 5.0) for c in servers}), flush=True)

    asyncio.run(main())
""")
# A server that forks at once (as fast as a shell can) and, a moment later, a child that leaves
# its session (out of the process group: only its cgroup still holds it); both ignore SIGTERM,
# the leader exits on it.
FORKS_AND_ESCAPES = ["sh", "-c", "trap '' TERM; sleep 60 & (sleep 0.2; exec setsid sleep 60) & trap - TERM; "
                                 "echo ready; wait"]
COOPERATIVE = ["sleep", "60"]


class Daemon:
    """The DAEMON script run inside cgroup ``top``."""

    def __init__(self, top: Path, state: Path, servers: dict[str, list[str]]):
        self.proc = subprocess.Popen([*inside(top), PY, "-c", DAEMON, str(state), json.dumps(servers)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        line = self.proc.stdout.readline()
        assert line, f"the daemon said nothing (exit {self.proc.wait(10)})"
        self.said = json.loads(line)

    def stop_servers(self) -> dict:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.proc.stdin.close()
        self.proc.stdout.close()


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process under it, from ``ps``."""
    rows = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,stat="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for p, pp, st in (line.split()[:3] for line in rows.splitlines()):
        if not st.startswith("Z"):
            children.setdefault(int(pp), []).append(int(p))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return sorted(found)


def alive(pid: int) -> bool:
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


def until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.02)


def family_of(leader: int, size: int) -> list[int]:
    """The leader of FORKS_AND_ESCAPES and its ``size - 1`` processes, once all are there (the one
    that leaves its session does so 0.2 s after the start)."""
    def escaped() -> bool:
        pids = descendants(leader)
        return len(pids) == size and any(os.getsid(p) != leader for p in pids)
    until(escaped, what=f"{size} processes under {leader}, one in a session of its own")
    return descendants(leader)


@pytest.fixture
def top():
    with delegated_cgroup() as path:
        yield path


# -- the choice ----------------------------------------------------------------------------------------
def test_only_a_delegated_writable_cgroup_is_used(top):
    mounts = [hierarchy()]
    plain = hierarchy() / f"{top.name}-plain"
    plain.mkdir()
    try:
        assert find_delegated(label(top), mounts) == (top, "")
        assert find_delegated(label(plain), mounts) == (None, f"its cgroup {label(plain)} is not delegated to it "
                                                              "(systemd: Delegate=yes)")
        assert find_delegated("/", mounts) == (None, "the daemon is in the root cgroup")
        assert find_delegated(f"{label(top)}/nothing", mounts)[0] is None
        assert find_delegated(None, []) == (None, "no cgroup v2 hierarchy")
    finally:
        plain.rmdir()


# -- one server ----------------------------------------------------------------------------------------
def test_a_server_and_all_it_forks_are_in_its_cgroup_and_stop_with_it(top, tmp_path):
    daemon = Daemon(top, tmp_path, {"gpu0": FORKS_AND_ESCAPES})
    family = []
    try:
        assert daemon.said["containment"] == f"each server in its own cgroup under {label(top)} (delegated)"
        assert cgroup_of(daemon.proc.pid) == f"{label(top)}/daemon"  # a leaf: the unit's own cgroup stays empty
        family = family_of(daemon.said["pids"]["gpu0"], 3)
        assert {p: cgroup_of(p) for p in family} == {p: f"{label(top)}/server-gpu0" for p in family}
        assert (top / "cgroup.procs").read_text() == ""
        t0 = time.monotonic()
        assert daemon.stop_servers() == {"gpu0": "killed by SIGTERM"}  # the leader's own end
        assert time.monotonic() - t0 >= 0.45, "the grace for the two that ignore SIGTERM was not waited for"
        assert [p for p in family if alive(p)] == [], "a process of the server outlived its stop"
        assert not (top / "server-gpu0").exists(), "its cgroup is removed once empty"
    finally:
        daemon.close()
        kill_all(family)


def test_the_move_sweeps_in_what_the_leader_forked_before_it(top):
    """A leader that forked before it was moved (the moment between spawn and move): its process
    group's members still in the daemon's cgroup are moved too; other processes there are not."""
    daemon_leaf, server = top / "daemon", top / "server-gpu0"
    daemon_leaf.mkdir()
    server.mkdir()
    leader = subprocess.Popen([*inside(daemon_leaf), "sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    bystander = subprocess.Popen([*inside(daemon_leaf), "sleep", "60"], start_new_session=True)
    family = []
    try:
        until(lambda: len(descendants(leader.pid)) == 3, what="the leader's two children")
        family = descendants(leader.pid)
        until(lambda: cgroup_of(bystander.pid) == label(daemon_leaf), what="the bystander in place")
        CgroupScope(server, label(server), daemon_leaf).place(leader.pid)
        assert {p: cgroup_of(p) for p in family} == {p: label(server) for p in family}
        assert cgroup_of(bystander.pid) == label(daemon_leaf)
    finally:
        kill_all([*family, bystander.pid])
        leader.wait(10)
        bystander.wait(10)


# -- after a crash ---------------------------------------------------------------------------------------
def test_what_a_killed_daemon_left_is_found_by_cgroup_and_stopped(top, tmp_path):
    first = Daemon(top, tmp_path, {"gpu0": FORKS_AND_ESCAPES, "gpu1": COOPERATIVE})
    second = None
    left = []
    try:
        left = [*family_of(first.said["pids"]["gpu0"], 3), first.said["pids"]["gpu1"]]
        first.kill()  # no chance to clean up; nothing was recorded anywhere
        assert all(alive(p) for p in left), "the servers should outlive a killed daemon"
        assert list(tmp_path.iterdir()) == [], "the cgroup way writes no record"
        second = Daemon(top, tmp_path, {})
        assert sorted(second.said["clean"]) == [
            f"gpu0: cgroup {label(top)}/server-gpu0 (3 processes) left by an earlier run: killed with SIGKILL",
            f"gpu1: cgroup {label(top)}/server-gpu1 (1 process) left by an earlier run: stopped with SIGTERM"]
        assert [p for p in left if alive(p)] == []  # the one that left its session too
        assert sorted(p.name for p in top.iterdir() if p.is_dir()) == ["daemon"]
        assert cgroup_of(second.proc.pid) == f"{label(top)}/daemon"
    finally:
        first.close()
        if second is not None:
            second.close()
        kill_all(left)


# -- a kernel without cgroup.kill (a fake tree) ----------------------------------------------------------
def fake_cgroup(path: Path, pids: list[int]) -> Path:
    path.mkdir(parents=True)
    (path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (path / "cgroup.events").write_text(f"populated {int(bool(pids))}\nfrozen 0\n")
    return path


def test_fake_tree_without_cgroup_kill_every_process_is_sent_sigkill(tmp_path):
    server = fake_cgroup(tmp_path / "server-gpu0", [101, 102])
    fake_cgroup(server / "inner", [103])
    sent = []
    cgroups.kill_all(server, kill=lambda pid, sig: sent.append((pid, sig)))
    assert sorted(sent) == [(101, signal.SIGKILL), (102, signal.SIGKILL), (103, signal.SIGKILL)]


def test_fake_tree_the_daemon_itself_is_never_signalled(tmp_path, caplog):
    server = fake_cgroup(tmp_path / "server-gpu0", [101, os.getpid()])
    sent = []
    cgroups.signal_each(server, signal.SIGTERM, kill=lambda pid, sig: sent.append(pid))
    assert sent == [101]
    assert "the daemon itself is in" in caplog.text


def test_fake_tree_cgroup_kill_is_one_write(tmp_path):
    server = fake_cgroup(tmp_path / "server-gpu0", [101])
    (server / "cgroup.kill").write_text("")
    cgroups.kill_all(server, kill=lambda pid, sig: pytest.fail("signalled one by one"))
    assert (server / "cgroup.kill").read_text() == "1"


def test_fake_tree_a_removed_cgroup_is_empty(tmp_path):
    gone = tmp_path / "server-gone"
    assert (cgroups.procs(gone), cgroups.populated(gone)) == ([], False)
    cgroups.kill_all(gone, kill=lambda pid, sig: pytest.fail("signalled"))
