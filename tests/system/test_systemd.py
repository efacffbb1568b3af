"""The shipped unit under a real systemd with a real CPU ``vllm serve`` child.

The guest is this machine's own root file system booted by systemd-nspawn through a throw-away
overlay (tests/support/nspawn.py), so vLLM's environment (.venv-vllm) is visible inside; the package is
installed in it with apt, exactly as on a node, and ``/etc/rolloutd.yaml`` names that vLLM. The
registry runs in this test process; the guest shares the network namespace and reaches it on
loopback. The tests walk one daemon through its life in order: start (``activating`` until the
server is SERVING), each server in its own cgroup, the vLLM group killed, the daemon frozen
(watchdog), the daemon killed (as shipped, and with systemd told to leave its servers, so that
the new daemon must find them by cgroup), reload, stop, and the journal of it all.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.conftest import free_port
from tests.support.daemon_harness import AS_NOBODY, config, socket_probe, vllm_server
from tests.support.nspawn import ROOT, Machine, enabled_host_units, host_root
from tests.support.vllm_server import VLLM, require_vllm, tiny_outputs

# Two files at a time, like the rest of the tier: the guest's server is on one core (the worker's:
# worker_cores), and every deadline here is far from a loaded machine's vLLM start (the unit's
# TimeoutStartSec=1h, the server's start_timeout_s 400, SERVING_S). Alone, the CPU was 40 % busy
# during this file (its guest starts vLLM on one core; bench/README.md). Beside test_parallel.py
# (TP ranks spinning on both cores) a guest restart once took over 240 s: that file stays alone.
pytestmark = [pytest.mark.timeout(900)]

SERVING_S = 450  # a vLLM (re)start in the guest: about 35 s alone; headroom for a loaded machine

UNIT = "rolloutd.service"
SEED_V1 = 11


class Node:
    """The guest, the registry on the host, and the daemon's config."""

    def __init__(self, machine: Machine, registry: EmbeddedRegistry, cfg: dict):
        self.machine = machine
        self.registry = registry
        self.cfg = cfg
        self.admin = f"http://127.0.0.1:{cfg['admin']['port']}"
        self.gateway = f"http://127.0.0.1:{cfg['servers'][0]['public_port']}"  # the network namespace is shared

    def status(self) -> dict:
        return httpx.get(self.admin + "/status", timeout=5).json()

    def server(self) -> dict:
        return self.status()["servers"][0]

    def unit(self, *props: str) -> dict[str, str]:
        return self.machine.show(UNIT, *props)

    def wait(self, what: str, predicate, timeout_s: float, every_s: float = 0.5):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if predicate():
                    return
            except (httpx.HTTPError, KeyError, IndexError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; unit "
                                     f"{self.unit('ActiveState', 'SubState', 'MainPID', 'NRestarts')}\n"
                                     f"{self.machine.journal(UNIT)[-4000:]}")
            time.sleep(every_s)

    def serving(self, incarnation: int | None = None) -> bool:
        s = self.server()
        return s["state"] == "SERVING" and s["version"] == 1 and incarnation in (None, s["incarnation"])

    def vllm_serve_processes(self) -> list[str]:
        """Every process in the guest running ``vllm serve`` (one per server, the API server)."""
        return self.machine.processes(f"{VLLM} serve")

    def vllm_segments(self) -> set[str]:
        """vLLM's shared-memory segments in the guest's own /dev/shm (Python's ``psm_*`` and
        multiprocessing's ``sem.mp-*``)."""
        return {n for n in self.machine.run("ls", "/dev/shm").stdout.split() if n.startswith(("psm_", "sem.mp-"))}

    def cgroup(self) -> str:
        """The unit's cgroup, as the guest names it."""
        return self.unit("ControlGroup")["ControlGroup"]

    def pull_workers(self) -> list[int]:
        """The daemon's pull workers: those of a pull in progress, or kept for the next one."""
        st = self.status()
        return sorted({*((st["pull"] or {}).get("workers") or []), *st["pull_workers_kept"]})

    def contained(self) -> dict[str, list[int]]:
        """Every process of the unit by cgroup; fails unless the daemon's leaf holds the daemon
        and its own pull workers (children of it) alone, and every other process is in the
        server's cgroup and process group."""
        main, server, workers = int(self.unit("MainPID")["MainPID"]), self.server(), self.pull_workers()
        where: dict[str, list[int]] = {}
        for pid in self.machine.unit_pids(UNIT):
            where.setdefault(self.machine.cgroup(pid) or "gone", []).append(pid)
        assert where == {f"{self.cgroup()}/daemon": sorted([main, *workers]),
                         f"{self.cgroup()}/server-gpu0": where.get(f"{self.cgroup()}/server-gpu0", [])}, where
        assert all(_ppid(self.machine, p) == main for p in workers), workers
        assert {_pgid(self.machine, p) for p in where[f"{self.cgroup()}/server-gpu0"]} == {server["pid"]}, where
        return where


def open_for_service_user(machine: Machine, script: Path) -> None:
    """Let other users reach ``script`` and its interpreter inside the guest: the interpreter may
    sit under a private directory such as /root. Only the guest's overlay changes."""
    interpreter = Path(script.read_text().splitlines()[0].removeprefix("#!").split()[0])
    for target in (script, interpreter, interpreter.resolve()):
        for parent in reversed(target.parents):
            if not parent.stat().st_mode & 0o001:
                machine.run("chmod", "o+x", str(parent))


@pytest.fixture(scope="module")
def node(debs, tmp_path_factory):
    require_vllm()
    # Not under /tmp: the unit gives the daemon a private /tmp.
    work = ROOT / "build" / "test-systemd" / uuid.uuid4().hex[:8]
    model = tinymodel.build(work / "model", seed=0)
    registry = EmbeddedRegistry(port=free_port()).start()
    registry.publish(1, tinymodel.state_dict(tinymodel.TINY, SEED_V1), shard_bytes=600_000, chunk_bytes=1 << 16)
    cfg = config(work, registry.url, [vllm_server("gpu0", model, "0")],
                 shutdown={"server_grace_s": 10, "kill_wait_s": 10}, restart={"start_timeout_s": 400})
    del cfg["state_dir"], cfg["mirror"]  # the package's: /var/lib/rolloutd, /dev/shm/rolloutd
    log = tmp_path_factory.mktemp("guest") / "console.log"
    try:
        with host_root() as root:
            # The checkout (vLLM's environment, the model) at its own path: under /tmp it would be
            # hidden by the guest's own /tmp.
            machine = Machine(root, log, masked=enabled_host_units(),
                              binds_ro=[(debs["1"].parent, "/mnt/pkg"), (ROOT, str(ROOT))])
            machine.boot()
            try:
                machine.run("apt-get", "install", "-y", f"/mnt/pkg/{debs['1'].name}",
                            env={"DEBIAN_FRONTEND": "noninteractive"}, timeout_s=300)
                open_for_service_user(machine, VLLM)
                if ROOT.is_relative_to("/tmp"):
                    # The unit's PrivateTmp= hides a checkout under /tmp from the service: a
                    # drop-in shows it again (what an operator would do for such a vLLM).
                    machine.write("/etc/systemd/system/rolloutd.service.d/checkout.conf",
                                  f"[Service]\nBindReadOnlyPaths={ROOT}\n")
                    machine.run("systemctl", "daemon-reload")
                machine.write("/etc/rolloutd.yaml", yaml.safe_dump(cfg, sort_keys=False))
                machine.run("runuser", "-u", "rolloutd", "--", "rolloutd", "check-config")
                yield Node(machine, registry, cfg)
            finally:
                machine.halt()
    finally:
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_activating_until_the_server_is_serving(node):
    node.machine.run("systemctl", "start", "--no-block", UNIT)
    samples = []  # (unit state, server state) seen while starting
    deadline = time.monotonic() + SERVING_S
    while time.monotonic() < deadline:
        unit = node.unit("ActiveState")["ActiveState"]
        try:
            server = node.server()
            seen = (unit, server["state"], server["version"])
        except httpx.HTTPError:
            seen = (unit, None, None)
        samples.append(seen)
        if unit != "activating":
            break
        time.sleep(0.5)
    assert samples[-1] == ("active", "SERVING", 1), f"{samples[-5:]}\n{node.machine.journal(UNIT)[-5000:]}"
    assert ("activating", "STARTING", None) in samples
    # Never active before the server serves version 1.
    assert all(state == "SERVING" and version == 1 for unit, state, version in samples if unit == "active")
    assert node.unit("StatusText")["StatusText"] == "gpu0 SERVING v1; registry ok"
    outputs = tiny_outputs(node.gateway)
    assert all(spans[0]["version"] == "1" for _, spans in outputs), outputs


SOCKET = "/var/lib/rolloutd/sockets/gpu0.sock"


def test_the_servers_socket_is_the_service_users_alone(node):
    """Under the unit's hardening, vLLM listens on a socket in a 0700 directory of the user rolloutd:
    that user reaches it; another (nobody) is refused."""
    node.wait("gpu0 SERVING", node.serving, SERVING_S)
    assert node.machine.run("stat", "-c", "%a %U", str(Path(SOCKET).parent)).stdout.split() == ["700", "rolloutd"]
    probe = socket_probe(SOCKET)
    as_service = node.machine.run("runuser", "-u", "rolloutd", "--", "/usr/bin/python3", "-c", probe)
    as_nobody = node.machine.run(*AS_NOBODY, "/usr/bin/python3", "-c", probe)
    assert (as_service.stdout.strip(), as_nobody.stdout.strip()) == ("HTTP/1.1 200 OK", "PermissionError")


def test_each_server_is_in_its_own_cgroup(node):
    """Delegate=yes: the daemon in <unit>/daemon with the pull workers it keeps for the next
    pull, vLLM's processes (its API server, engine core) in <unit>/server-gpu0, none in the
    unit's own cgroup."""
    node.wait("gpu0 SERVING", node.serving, SERVING_S)
    where = node.contained()
    assert node.pull_workers(), "the first pull's workers are kept for the next one"
    assert len(where[f"{node.cgroup()}/server-gpu0"]) >= 2, where  # vLLM's API server and its engine core
    assert node.machine.run("cat", f"/sys/fs/cgroup{node.cgroup()}/cgroup.procs").stdout == ""
    assert f"contain: each server in its own cgroup under {node.cgroup()} (delegated)" in node.machine.journal(UNIT)
    assert f"in cgroup {node.cgroup()}/server-gpu0" in node.machine.journal(UNIT)


def test_killed_vllm_group_comes_back_without_restarting_the_daemon(node):
    before = node.unit("MainPID", "NRestarts")
    old = node.server()
    node.machine.run("kill", "-9", "--", f"-{old['pid']}")  # the server's whole process group
    node.wait("gpu0 SERVING at incarnation 2", lambda: node.serving(incarnation=old["incarnation"] + 1), 240)
    assert node.unit("MainPID", "NRestarts") == before
    assert node.machine.run("ps", "-o", "pid=", "-g", str(old["pid"]), check=False).stdout.strip() == ""
    assert len(node.vllm_serve_processes()) == 1


def test_frozen_daemon_is_restarted_by_the_watchdog(node):
    before = node.unit("MainPID", "NRestarts")
    old_server = node.server()
    node.machine.run("kill", "-STOP", before["MainPID"])
    node.wait("a restart by the watchdog",
              lambda: node.unit("NRestarts")["NRestarts"] == str(int(before["NRestarts"]) + 1), 120)
    node.wait("the new daemon active and serving",
              lambda: node.unit("ActiveState")["ActiveState"] == "active" and node.serving(), SERVING_S)
    after = node.unit("MainPID", "NRestarts")
    assert after["MainPID"] != before["MainPID"]
    journal = node.machine.journal(UNIT)
    assert "Watchdog timeout" in journal
    assert "Fatal Python error: Aborted" in journal  # the frozen daemon's stacks, for a post-mortem
    # Exactly one vLLM for the one configured server; nothing of the old daemon's is left in
    # the unit: every process is the new daemon, its pull workers, or in its server's process group.
    server = node.server()
    assert server["pid"] != old_server["pid"]
    assert len(node.vllm_serve_processes()) == 1, node.vllm_serve_processes()
    own = {int(after["MainPID"]), *node.pull_workers()}
    groups = {pid: _pgid(node.machine, pid) for pid in node.machine.unit_pids(UNIT)}
    assert {g for p, g in groups.items() if p not in own} == {server["pid"]}, groups
    node.contained()


def test_killed_daemon_is_restarted_with_one_vllm(node):
    """kill -9 of the daemon: systemd SIGKILLs the rest of the unit (KillMode=mixed) and starts a
    new daemon, which starts one vLLM, in its cgroup."""
    node.machine.run("systemctl", "start", "--no-block", UNIT)  # a no-op after the tests before it
    node.wait("the daemon serving", node.serving, SERVING_S)
    before = node.unit("MainPID", "NRestarts")
    old_server = node.server()
    old_vllm = node.vllm_serve_processes()
    old_segments = node.vllm_segments()
    assert old_segments, "the serving vLLM has no shared memory: nothing to check below"
    node.machine.run("kill", "-9", before["MainPID"])
    node.wait("a restart by systemd",
              lambda: node.unit("NRestarts")["NRestarts"] == str(int(before["NRestarts"]) + 1), 120)
    node.wait("the new daemon active and serving",
              lambda: node.unit("ActiveState")["ActiveState"] == "active" and node.serving(), SERVING_S)
    assert node.unit("MainPID")["MainPID"] != before["MainPID"]
    assert node.server()["pid"] != old_server["pid"]
    assert len(node.vllm_serve_processes()) == 1 and node.vllm_serve_processes() != old_vllm
    node.contained()
    journal = node.machine.journal(UNIT)
    assert "Main process exited, code=killed, status=9/KILL" in journal
    # SIGKILLed with the daemon, the old vLLM's resource tracker could not unlink its segments:
    # the new daemon did, and left the new vLLM's alone
    assert not old_segments & node.vllm_segments(), sorted(old_segments & node.vllm_segments())
    assert node.vllm_segments(), "the new vLLM's segments are there"
    assert "removed" in journal and "segment(s) the servers of an earlier run left" in journal, journal[-4000:]


def test_what_a_killed_daemon_left_is_found_by_cgroup(node):
    """The same with systemd told to leave the servers alone (KillMode=process; as when a process
    stuck in the kernel outlives systemd's SIGKILL): the new daemon finds the old vLLM in its
    cgroup, with no record of it, stops it, and starts one vLLM."""
    dropin = "/etc/systemd/system/rolloutd.service.d/leave-servers.conf"
    node.machine.write(dropin, "[Service]\nKillMode=process\n")
    node.machine.run("systemctl", "daemon-reload")
    try:
        before = node.unit("MainPID", "NRestarts")
        old_server = node.server()
        old_group = node.machine.run("ps", "-o", "pid=", "-g", str(old_server["pid"])).stdout.split()
        node.machine.run("kill", "-9", before["MainPID"])
        node.wait("a restart by systemd",
                  lambda: node.unit("NRestarts")["NRestarts"] == str(int(before["NRestarts"]) + 1), 120)
        node.wait("the new daemon active and serving",
                  lambda: node.unit("ActiveState")["ActiveState"] == "active" and node.serving(), SERVING_S)
        journal = node.machine.journal(UNIT)
        head = f"clean gpu0: cgroup {node.cgroup()}/server-gpu0 ({len(old_group)} processes) left by an earlier run"
        assert head in journal, journal[-4000:]
        assert node.machine.run("ps", "-o", "pid=", "-g", str(old_server["pid"]), check=False).stdout.strip() == ""
        assert len(node.vllm_serve_processes()) == 1, node.vllm_serve_processes()
        node.contained()
    finally:
        node.machine.run("rm", "-f", dropin)
        node.machine.run("systemctl", "daemon-reload")
    assert node.unit("KillMode")["KillMode"] == "mixed"


def _pgid(machine: Machine, pid: int) -> int:
    out = machine.run("ps", "-o", "pgid=", "-p", str(pid), check=False).stdout.strip()
    return int(out) if out else -1


def _ppid(machine: Machine, pid: int) -> int:
    out = machine.run("ps", "-o", "ppid=", "-p", str(pid), check=False).stdout.strip()
    return int(out) if out else -1


def test_reload_keeps_the_daemon_and_its_server(node):
    pid = node.unit("MainPID")["MainPID"]
    server = node.server()
    node.machine.run("systemctl", "reload", UNIT)
    node.wait("the reload in the journal", lambda: "reload: " in node.machine.journal(UNIT), 30)
    assert node.unit("MainPID", "ActiveState") == {"MainPID": pid, "ActiveState": "active"}
    now = node.server()
    assert (now["pid"], now["incarnation"], now["state"]) == (server["pid"], server["incarnation"], "SERVING")


def test_stop_leaves_no_vllm_process(node):
    assert node.registry.replicas()
    node.machine.run("systemctl", "stop", UNIT, timeout_s=120)
    assert node.unit("ActiveState")["ActiveState"] == "inactive"
    assert node.vllm_serve_processes() == []
    assert node.machine.processes("vllm") == []
    assert node.machine.unit_pids(UNIT) == []
    assert node.registry.replicas() == []
    assert node.vllm_segments() == set(), "a stopped vLLM's shared memory is left"


def test_journal_tells_the_lifecycle(node):
    journal = node.machine.journal(UNIT)
    for line in ["state gpu0: STOPPED -> STARTING (incarnation 1)", "state gpu0: STARTING -> SYNCING",
                 "state gpu0: SYNCING -> SERVING (version 1)", "state gpu0: SERVING -> BACKOFF",
                 "state gpu0: SERVING -> STOPPING", "state gpu0: STOPPING -> STOPPED"]:
        assert line in journal, line
    # Priorities reach the journal: -p err has the failure lines and none of the INFO ones.
    errors = node.machine.run("journalctl", "-u", UNIT, "-p", "err", "--no-pager", "-o", "cat").stdout
    assert "fail gpu0" in errors and "state gpu0:" not in errors
