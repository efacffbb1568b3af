"""Loopback is not a boundary: another user of the node reaches no vLLM route of a served child.

vLLM's pause and weight routes have no authentication, and any local user can connect to a
loopback TCP port. The daemon (``rolloutd run``, one real ``vllm serve``, CPU build) starts its
child on a UNIX socket in ``<state_dir>/sockets`` (mode 0700). A process of another uid
(nobody, through ``setpriv``) then finds no TCP port of vLLM's API server to talk to, is
refused by the socket, and still gets generation through the gateway (and 404 for ``/pause``
there); the daemon's own user reaches vLLM on the socket, and nothing the other user tried
paused it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SYSTEM_PYTHON = Path("/usr/bin/python3")  # nobody cannot run the test's own interpreter (under /root)


def listening_tcp_ports(pid: int) -> list[int]:
    """TCP ports process ``pid`` listens on (IPv4 and IPv6), from /proc: its socket inodes, matched
    against the kernel's table of listening sockets."""
    inodes = set()
    for fd in os.scandir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(fd.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


# Runs as nobody: what another local user can do to the server, as JSON on stdout.
OTHER_USER = textwrap.dedent("""
    import json, socket, sys, urllib.error, urllib.request
    probe, api_ports, gateway = json.loads(sys.argv[1])
    out = {}
    scope = {}
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()) as said:
        exec(probe, scope)
    out["socket"] = said.getvalue().strip()

    def http(url, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return [r.status, json.loads(r.read())]
        except urllib.error.HTTPError as e:
            return [e.code, None]
        except OSError as e:
            return [type(e).__name__, None]
    out["tcp"] = {str(p): http(f"http://127.0.0.1:{p}/is_paused") for p in api_ports}
    body = {"token_ids": [1, 5, 9], "stream": False, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    out["generate"] = http(gateway + "/inference/v1/generate", body)
    out["pause"] = http(gateway + "/pause?mode=abort", {})
    print(json.dumps(out))
""")


@pytest.mark.parallel  # the fake vLLM as child
def test_a_child_holds_no_listening_socket_of_the_daemon(daemons):
    """The daemon's own listeners (admin API, gateways) stay the daemon's: a child that inherited
    one would hold it open (and accept on it) for as long as it lives. The fake vLLM as child."""
    d = daemons(servers=2)
    st = d.wait(lambda s: all(x["state"] == "SERVING" for x in s["servers"]), 30, "both SERVING")
    daemon_ports = listening_tcp_ports(d.proc.pid)
    assert d.cfg["admin"]["port"] in daemon_ports
    assert {s["name"]: listening_tcp_ports(s["pid"]) for s in st["servers"]} == {"s0": [], "s1": []}
