"""Loopback is not a boundary: another user of the node reaches no vLLM route of a served child
(the test with a real vLLM: tests/system/test_private_socket.py).

vLLM's pause and weight routes have no authentication, and any local user can connect to a
loopback TCP port. The daemon (``rolloutd run``, one real ``vllm serve``, CPU build) starts its
child on a UNIX socket in ``<state_dir>/sockets`` (mode 0700). A process of another uid
(nobody, through ``setpriv``) then finds no TCP port of vLLM's API server to talk to, is
refused by the socket, and still gets generation through the gateway (and 404 for ``/pause``
there); the daemon's own user reaches vLLM on the socket, and nothing the other user tried
paused it.
"""

from __future__ import annotations

import pytest

from tests.support.processes import listening_tcp_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parallel  # the fake vLLM as child
def test_a_child_holds_no_listening_socket_of_the_daemon(daemons):
    """The daemon's own listeners (admin API, gateways) stay the daemon's: a child that inherited
    one would hold it open (and accept on it) for as long as it lives. The fake vLLM as child."""
    d = daemons(servers=2)
    st = d.wait(lambda s: all(x["state"] == "SERVING" for x in s["servers"]), 30, "both SERVING")
    daemon_ports = listening_tcp_ports(d.proc.pid)
    assert d.cfg["admin"]["port"] in daemon_ports
    assert {s["name"]: listening_tcp_ports(s["pid"]) for s in st["servers"]} == {"s0": [], "s1": []}
