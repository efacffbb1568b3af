"""systemd's notify protocol (``Type=notify``), harmless outside systemd.

Contract: a :class:`Notifier` sends ``READY=1``, ``STATUS=``, ``RELOADING=1``, ``STOPPING=1``
and ``WATCHDOG=1`` datagrams to ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract
namespace). Without ``NOTIFY_SOCKET`` every call does nothing. No call ever raises: a failing
send is logged once, at debug, and later sends still try (systemd may come back).
``watchdog_interval_s`` says how often to call ``watchdog()``: half of ``WATCHDOG_USEC``, when
the watchdog is meant for this process.

Sending goes through the ``sdnotify`` package; it reads the socket's address from the process
environment, so the address is given to it here instead (which makes the environment injectable
for tests, and for a daemon that cleans its children's environment).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

import sdnotify

log = logging.getLogger("rolloutd.node.notify")


class _Socket(sdnotify.SystemdNotifier):
    """``sdnotify``'s sender, connected to a given address; raises on failure (we log it)."""

    def __init__(self, address: str):
        self.debug = True  # sdnotify swallows errors unless debug: we want to see them, once
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.socket.connect(_unix_address(address))
        except OSError:
            self.socket.close()
            raise

    def close(self) -> None:
        self.socket.close()


def _unix_address(address: str) -> str:
    """``@name`` is the abstract namespace: on the wire its first byte is NUL (sd_notify(3))."""
    if address.startswith("@"):
        return "\0" + address[1:]
    if not address.startswith("/"):
        raise OSError(f"NOTIFY_SOCKET={address!r}: only a path or @abstract name is supported")
    return address


class Notifier:
    def __init__(self, environ: Mapping[str, str] = os.environ):
        self._address = environ.get("NOTIFY_SOCKET") or None
        self.enabled = self._address is not None
        self._watchdog_s = _watchdog_interval(environ)
        self._sock: _Socket | None = None
        self._last_status: str | None = None
        self._failed = False

    def ready(self) -> None:
        self._send("READY=1")

    def status(self, line: str) -> None:
        """``STATUS=<line>``: one line (systemctl shows it), sent only when it changed."""
        line = " ".join(line.splitlines())
        if line == self._last_status:
            return
        self._last_status = line
        self._send(f"STATUS={line}")

    def reloading(self) -> None:
        # Type=notify-reload wants the time the reload began on CLOCK_MONOTONIC, in microseconds.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    @property
    def watchdog_interval_s(self) -> float | None:
        """Seconds between ``watchdog()`` calls (half the deadline), or None when no watchdog is asked."""
        return self._watchdog_s

    def close(self) -> None:
        """Close the socket to systemd if one is open (the daemon's run ends); a later message
        opens another."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, message: str) -> None:
        if not self.enabled:
            return
        try:
            if self._sock is None:
                self._sock = _Socket(self._address)
            # sdnotify encodes as latin-1; systemd reads UTF-8: hand it the UTF-8 bytes as latin-1 text.
            self._sock.notify(message.encode("utf-8").decode("latin-1"))
        except Exception as e:  # noqa: BLE001 - never let systemd's socket break the daemon
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if not self._failed:
                self._failed = True
                log.debug("notify systemd failed (%s); later messages may be lost: %s",
                          message.split("=", 1)[0], e)


def _watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Half of ``WATCHDOG_USEC`` when ``WATCHDOG_PID`` is unset or names this process (sd_watchdog_enabled)."""
    pid = environ.get("WATCHDOG_PID")
    if pid is not None and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 2e6
