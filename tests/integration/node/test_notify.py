"""systemd notify: exact datagrams on a real AF_UNIX socket (path and abstract), nothing at all
without NOTIFY_SOCKET, never an exception, and the watchdog interval systemd asks for."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import uuid

import pytest

from rolloutd.node import notify
from rolloutd.node.notify import Notifier


class Listener:
    """What systemd does: a datagram socket that receives notify messages."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(2)

    def recv(self) -> bytes:
        return self.sock.recv(4096)

    def assert_empty(self) -> None:
        self.sock.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                self.sock.recv(4096)
        finally:
            self.sock.settimeout(2)


@pytest.fixture
def sock_path():
    # AF_UNIX paths are limited to 108 bytes: a short directory, not the test's tmp_path.
    with tempfile.TemporaryDirectory(prefix="rn") as d:
        yield os.path.join(d, "notify")


@pytest.fixture(params=["path", "abstract"])
def listener_and_address(request, sock_path):
    address = sock_path if request.param == "path" else f"@rolloutd-test-{uuid.uuid4().hex}"
    listener = Listener(address)
    yield listener, address
    listener.sock.close()


def test_each_message_arrives_exactly(listener_and_address):
    listener, address = listener_and_address
    n = Notifier({"NOTIFY_SOCKET": address})
    assert n.enabled
    n.ready()
    assert listener.recv() == b"READY=1"
    n.status("gpu0 SERVING v3\nregistry ok")
    assert listener.recv() == b"STATUS=gpu0 SERVING v3 registry ok"  # one line
    n.stopping()
    assert listener.recv() == b"STOPPING=1"
    n.watchdog()
    assert listener.recv() == b"WATCHDOG=1"
    listener.assert_empty()


def test_close_closes_the_socket_and_a_later_message_opens_another(listener_and_address):
    listener, address = listener_and_address
    n = Notifier({"NOTIFY_SOCKET": address})
    before = set(os.listdir("/proc/self/fd"))
    n.ready()
    assert listener.recv() == b"READY=1" and set(os.listdir("/proc/self/fd")) - before, "a socket is open"
    n.close()
    assert set(os.listdir("/proc/self/fd")) - before == set(), "the socket to systemd is closed"
    n.stopping()
    assert listener.recv() == b"STOPPING=1"
    n.close()


def test_status_is_sent_only_when_it_changed(listener_and_address):
    listener, address = listener_and_address
    n = Notifier({"NOTIFY_SOCKET": address})
    n.status("a")
    n.status("a")
    n.status("b")
    n.status("b")
    n.status("a")
    assert [listener.recv() for _ in range(3)] == [b"STATUS=a", b"STATUS=b", b"STATUS=a"]
    listener.assert_empty()


def test_status_is_utf8(listener_and_address):
    listener, address = listener_and_address
    Notifier({"NOTIFY_SOCKET": address}).status("version 3 — serving")
    assert listener.recv() == "STATUS=version 3 — serving".encode()


def test_reloading_carries_the_monotonic_clock(listener_and_address):
    listener, address = listener_and_address
    n = Notifier({"NOTIFY_SOCKET": address})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = listener.recv().decode().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC" and before <= int(value) <= after


def test_without_notify_socket_nothing_happens(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)

    def no_socket(*args):
        raise AssertionError("a socket was opened without NOTIFY_SOCKET")
    monkeypatch.setattr(notify, "_Socket", no_socket)
    for n in (Notifier(), Notifier({}), Notifier({"NOTIFY_SOCKET": ""})):
        assert not n.enabled
        n.ready()
        n.status("x")
        n.reloading()
        n.stopping()
        n.watchdog()


def test_a_failing_send_never_raises_is_logged_once_and_later_sends_retry(sock_path, caplog):
    n = Notifier({"NOTIFY_SOCKET": sock_path})  # nobody listens there yet
    with caplog.at_level(logging.DEBUG, logger="rolloutd.node.notify"):
        n.ready()
        n.watchdog()
        n.status("x")
        n.stopping()
    failures = [r for r in caplog.records if r.name == "rolloutd.node.notify"]
    assert len(failures) == 1 and failures[0].levelno == logging.DEBUG
    assert "READY" in failures[0].getMessage()
    listener = Listener(sock_path)  # systemd's socket appears: the next message gets through
    try:
        n.watchdog()
        assert listener.recv() == b"WATCHDOG=1"
    finally:
        listener.sock.close()


def test_an_unsupported_address_never_raises(caplog):
    n = Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert n.enabled
    with caplog.at_level(logging.DEBUG, logger="rolloutd.node.notify"):
        n.ready()
        n.ready()
    assert len([r for r in caplog.records if r.name == "rolloutd.node.notify"]) == 1


@pytest.mark.parametrize(("env", "expected"), [
    ({"WATCHDOG_USEC": "4000000"}, 2.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # meant for another process
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "abc"}, None),
    ({}, None),
    ({"WATCHDOG_PID": str(os.getpid())}, None),
    ({"WATCHDOG_USEC": ""}, None),
    ({"WATCHDOG_USEC": "abc"}, None),
    ({"WATCHDOG_USEC": "1.5"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
])
def test_watchdog_interval(env, expected):
    assert Notifier(env).watchdog_interval_s == expected
