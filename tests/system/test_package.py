"""The .deb on a clean Debian 12 booted with a real systemd (systemd-nspawn, no network).

The package is built by ``packaging/build-deb`` (twice: revisions 1 and 2, for the upgrade),
installed with apt into a fresh ``debootstrap`` root that has no network interface but
loopback, and walked through a user's life with it in order: install, ``enable --now``, the
admin API, reload, stop, upgrade with an edited config, remove, reinstall, purge. No vLLM is
installed in this root: the shipped config's servers are given up ("vllm: No such file or
directory"), which is what a user sees before pointing ``vllm.command`` at their vLLM; the unit
with a real vLLM is tests/system/test_systemd.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import yaml

from rolloutd.config import Shutdown
from tests.conftest import Debs
from tests.support.nspawn import ROOT, Machine, debian_root

pytestmark = [pytest.mark.timeout(900)]

UNIT = "rolloutd.service"
APT = {"DEBIAN_FRONTEND": "noninteractive"}


@pytest.fixture(scope="module")
def guest(tmp_path_factory, debs):
    log = tmp_path_factory.mktemp("guest") / "console.log"
    machine = Machine(debian_root(), log, private_network=True, binds_ro=[(debs["1"].parent, "/mnt/pkg")])
    machine.boot()
    try:
        yield machine
    finally:
        machine.halt()


def pkg(debs: Debs, revision: str) -> str:
    return f"/mnt/pkg/{debs[revision].name}"


def status(guest: Machine) -> dict:
    return json.loads(guest.run("curl", "-sSf", "--max-time", "5", "http://localhost:9100/status").stdout)


def wait_for(what: str, predicate, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.3)


def daemon_processes(guest: Machine) -> list[str]:
    return guest.run("ps", "-u", "rolloutd", "-o", "pid=,args=", check=False).stdout.splitlines()


# -- install ----------------------------------------------------------------------------------

def test_install_needs_no_network(guest, debs):
    links = guest.run("ip", "-o", "link").stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"], links

    started = time.monotonic()
    done = guest.run("apt-get", "install", "-y", pkg(debs, "1"), env=APT, timeout_s=300)
    print(f"apt-get install: {time.monotonic() - started:.1f} s")
    assert "installing rolloutd 0.1.0 into /opt/rolloutd/env." in done.stdout

    assert guest.run("dpkg-query", "-W", "-f=${Status} ${Version}", "rolloutd").stdout == \
        "install ok installed 0.1.0-1"
    conffiles = guest.run("dpkg-query", "-W", "-f=${Conffiles}", "rolloutd").stdout
    assert conffiles.split()[0] == "/etc/rolloutd.yaml"
    # The system user and its directories.
    user = guest.run("getent", "passwd", "rolloutd").stdout.strip().split(":")
    assert int(user[2]) < 1000 and user[5] == "/var/lib/rolloutd" and user[6] == "/usr/sbin/nologin"
    modes = guest.run("stat", "-c", "%n %U %G %a", "/var/lib/rolloutd", "/var/cache/rolloutd",
                      "/etc/rolloutd").stdout.splitlines()
    assert modes == ["/var/lib/rolloutd rolloutd rolloutd 750", "/var/cache/rolloutd rolloutd rolloutd 750",
                     "/etc/rolloutd root rolloutd 750"]
    # The daemon's environment, made from the package's wheels, and the command on PATH.
    assert guest.run("rolloutd", "--version").stdout.strip() == "rolloutd 0.1.0"
    target = guest.run("readlink", "/opt/rolloutd/venv").stdout.strip()
    assert re.fullmatch(r"env\.\w+", target)
    # The shipped config is valid as it is, and readable by the daemon's user.
    check = guest.run("runuser", "-u", "rolloutd", "--", "rolloutd", "check-config")
    assert "/etc/rolloutd.yaml is valid: 2 servers (gpu0, gpu1)" in check.stdout
    # Installed, not enabled nor started: the config names a registry that is not there yet.
    assert guest.run("systemctl", "is-enabled", UNIT, check=False).stdout.strip() == "disabled"
    assert guest.show(UNIT, "ActiveState")["ActiveState"] == "inactive"


def test_unit_passes_verify_silently(guest):
    done = guest.run("systemd-analyze", "verify", f"/lib/systemd/system/{UNIT}", check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    # The same check sees a mistake that systemd would otherwise ignore.
    guest.sh("sed 's/^Type=notify$/Type=notifyy/' /lib/systemd/system/rolloutd.service > /run/typo.service")
    typo = guest.run("systemd-analyze", "verify", "/run/typo.service", check=False)
    assert "notifyy" in typo.stdout + typo.stderr


def test_unit_settings_as_loaded(guest):
    props = guest.show(UNIT, "Type", "NotifyAccess", "KillMode", "Restart", "RestartUSec", "TimeoutStartUSec",
                       "TimeoutStopUSec", "LimitMEMLOCK", "User", "ExecReload",
                       "DevicePolicy", "DeviceAllow", "PrivateDevices", "RestartPreventExitStatus")
    assert props["Type"] == "notify" and props["NotifyAccess"] == "main"
    assert props["KillMode"] == "mixed" and props["Restart"] == "on-failure" and props["RestartUSec"] == "5s"
    assert props["TimeoutStartUSec"] == "1h"
    assert props["LimitMEMLOCK"] == "infinity" and props["User"] == "rolloutd"
    assert "/bin/kill -HUP $MAINPID" in props["ExecReload"].replace("argv[]=", "").replace(" ;", "")
    assert props["RestartPreventExitStatus"] == "2"
    # Stopping must outlast the daemon's own ordered stop with its default deadlines.
    assert _seconds(props["TimeoutStopUSec"]) > Shutdown().longest_s + 10
    # No device filter (ProtectClock= would add "DeviceAllow=char-rtc r" and close the rest):
    # /dev/nvidia* and every other GPU node stay reachable.
    assert (props["DevicePolicy"], props.get("DeviceAllow", ""), props["PrivateDevices"]) == ("auto", "", "no")


def _seconds(span: str) -> float:
    units = {"min": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(min|ms|s)", span))


def test_security_score_and_every_exposure_documented():
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                          str(ROOT / "systemd" / UNIT)], capture_output=True, text=True, check=True).stdout
    score = float(re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out).group(1))
    print(f"systemd-analyze security: {score}")
    assert score <= 2.0, out
    docs = (ROOT / "docs" / "systemd.md").read_text()
    open_items = {m.group(1).split("=")[0].split("~")[0]
                  for m in re.finditer(r"^✗ (\S+)", out, re.M)}
    undocumented = sorted(name for name in open_items if f"`{name}=" not in docs)
    assert not undocumented, f"docs/systemd.md does not explain: {undocumented}"


# -- run --------------------------------------------------------------------------------------

def test_enable_now_and_status(guest):
    started = time.monotonic()
    guest.run("systemctl", "enable", "--now", UNIT, timeout_s=300)
    print(f"systemctl enable --now: {time.monotonic() - started:.1f} s")
    # WatchdogUSec shows the running service's watchdog (infinity while stopped).
    assert guest.show(UNIT, "ActiveState", "WatchdogUSec") == {"ActiveState": "active", "WatchdogUSec": "30s"}
    st = status(guest)
    assert st["ready"] is True
    assert [(s["name"], s["state"]) for s in st["servers"]] == [("gpu0", "FATAL"), ("gpu1", "FATAL")]
    assert all("vllm: No such file or directory" in s["last_error"] for s in st["servers"])
    assert guest.show(UNIT, "StatusText")["StatusText"] == "gpu0 FATAL; gpu1 FATAL; registry unreachable"


def edited_config(guest: Machine, servers: int) -> str:
    cfg = yaml.safe_load(guest.run("cat", "/etc/rolloutd.yaml").stdout)
    cfg["restart"]["max_retries"] = 0
    cfg["servers"] = [{**cfg["servers"][0], "name": f"gpu{i}", "public_port": 9001 + i, "gpus": [i]}
                      for i in range(servers)]
    return "# edited by the node's operator\n" + yaml.safe_dump(cfg, sort_keys=False)


def test_reload_keeps_main_pid_and_applies(guest):
    pid = guest.show(UNIT, "MainPID")["MainPID"]
    guest.write("/etc/rolloutd.yaml", edited_config(guest, 3))
    guest.run("systemctl", "reload", UNIT)
    wait_for("gpu2 in /status", lambda: [s["name"] for s in status(guest)["servers"]] == ["gpu0", "gpu1", "gpu2"])
    assert guest.show(UNIT, "MainPID", "NRestarts") == {"MainPID": pid, "NRestarts": "0"}
    assert "reload: " in guest.journal(UNIT)


def test_stop_leaves_no_process(guest):
    guest.run("systemctl", "stop", UNIT, timeout_s=120)
    assert guest.show(UNIT, "ActiveState")["ActiveState"] == "inactive"
    assert daemon_processes(guest) == []
    assert guest.unit_pids(UNIT) == []


# -- upgrade, remove, purge -------------------------------------------------------------------

def test_upgrade_keeps_config_and_restarts(guest, debs):
    edited = guest.run("cat", "/etc/rolloutd.yaml").stdout
    guest.run("systemctl", "start", UNIT, timeout_s=120)
    old_pid = guest.show(UNIT, "MainPID")["MainPID"]
    old_env = guest.run("readlink", "/opt/rolloutd/venv").stdout.strip()

    guest.run("apt-get", "install", "-y", pkg(debs, "2"), env=APT, timeout_s=300)
    assert guest.run("dpkg-query", "-W", "-f=${Version}", "rolloutd").stdout == "0.1.0-2"
    assert guest.run("cat", "/etc/rolloutd.yaml").stdout == edited
    assert guest.run("sh", "-c", "ls /etc/rolloutd.yaml.dpkg-* 2>/dev/null", check=False).stdout == ""
    # The daemon restarted on the new environment; the old one is gone.
    new_env = guest.run("readlink", "/opt/rolloutd/venv").stdout.strip()
    assert new_env != old_env and guest.run("test", "-e", f"/opt/rolloutd/{old_env}", check=False).returncode == 1
    def restarted() -> bool:
        now = guest.show(UNIT, "ActiveState", "MainPID")
        return now["ActiveState"] == "active" and now["MainPID"] not in (old_pid, "0")
    wait_for("the daemon restarted by the upgrade", restarted)
    assert len(status(guest)["servers"]) == 3


def test_remove_keeps_config(guest, debs):
    edited = guest.run("cat", "/etc/rolloutd.yaml").stdout
    guest.run("apt-get", "remove", "-y", "rolloutd", env=APT, timeout_s=300)
    assert guest.run("dpkg-query", "-W", "-f=${Status}", "rolloutd").stdout == "deinstall ok config-files"
    assert guest.run("cat", "/etc/rolloutd.yaml").stdout == edited
    assert daemon_processes(guest) == []
    assert guest.show(UNIT, "LoadState")["LoadState"] == "not-found"
    assert guest.run("ls", "-A", "/opt", check=False).stdout.strip() == ""
    assert guest.run("test", "-e", "/etc/systemd/system/multi-user.target.wants/rolloutd.service",
                     check=False).returncode == 1

    # Installing again finds the operator's file and keeps it.
    guest.run("apt-get", "install", "-y", pkg(debs, "2"), env=APT, timeout_s=300)
    assert guest.run("cat", "/etc/rolloutd.yaml").stdout == edited

    guest.run("apt-get", "purge", "-y", "rolloutd", env=APT, timeout_s=300)
    gone = guest.run("sh", "-c", "ls -d /etc/rolloutd.yaml /etc/rolloutd /var/lib/rolloutd /var/cache/rolloutd "
                     "/opt/rolloutd 2>/dev/null", check=False).stdout
    assert gone == ""
    assert guest.run("dpkg", "-s", "rolloutd", check=False).returncode == 1
