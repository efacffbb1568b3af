"""A start of the daemon that fails at any step releases exactly what it made before that step, in
reverse, and nothing it did not make: every port it bound is free again, its record of shared
memory is gone (no server was spawned). In-process (``Daemon.run``
on the test's loop); each failure is a real one (a port another socket holds, a state_dir that is
a file, a token file that is gone); nothing is spawned and the registry is never reached."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from rolloutd.config import Config, ConfigError
from rolloutd.gateway.relay import GatewayError
from rolloutd.node.daemon import Daemon
from rolloutd.rollout.peerserve import PeerServerError
from tests.support.daemon_harness import config

pytestmark = pytest.mark.timeout(60)

# What a start makes, in order, and releases on the way out (each a "release ..." line at DEBUG).
MADE = ["the socket to systemd", "the record of shared memory", "the mirror", "the admin API", "the registry client",
        "the updater", "the gateway of s0", "the gateway of s1", "the peer listener"]


def listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def state_dir_is_a_file(raw: dict, tmp: Path, taken: socket.socket) -> None:
    Path(raw["state_dir"]).write_text("not a directory")


def admin_port_taken(raw: dict, tmp: Path, taken: socket.socket) -> None:
    raw["admin"]["port"] = taken.getsockname()[1]


def peer_token_gone(raw: dict, tmp: Path, taken: socket.socket) -> None:
    raw["peers"] = {"token_file": str(tmp / "gone.token")}  # read when the swarm is made


def second_public_port_taken(raw: dict, tmp: Path, taken: socket.socket) -> None:
    raw["servers"][1]["public_port"] = taken.getsockname()[1]


def peer_port_taken(raw: dict, tmp: Path, taken: socket.socket) -> None:
    raw["peers"] = {"enabled": True, "host": "127.0.0.1", "port": taken.getsockname()[1]}


@pytest.mark.parametrize(("fail", "made", "error"), [
    (state_dir_is_a_file, 1, OSError),
    (admin_port_taken, 3, OSError),
    (peer_token_gone, 5, ConfigError),
    (second_public_port_taken, 7, GatewayError),
    (peer_port_taken, 8, PeerServerError),
])
async def test_a_start_that_fails_releases_what_it_made_before_in_reverse(tmp_path, caplog, fail, made, error):
    raw = config(tmp_path, "http://127.0.0.1:9", [{"name": "s0", "model": "fake-model"},
                                                  {"name": "s1", "model": "fake-model"}], fake=True)
    with listening() as taken:
        fail(raw, tmp_path, taken)
        daemon = Daemon(Config.model_validate(raw))
        caplog.set_level(logging.DEBUG, logger="rolloutd")
        with pytest.raises(error) as failed:
            await daemon.run()
    released = [r.getMessage().removeprefix("release ") for r in caplog.records
                if r.name == "rolloutd" and r.getMessage().startswith("release ")]
    assert released == MADE[:made][::-1], failed.value
    # What it made is gone, not only said to be: every port it bound is free again...
    ports = [raw["admin"]["port"]] + [s["public_port"] for s in raw["servers"]]
    for port in ports if made > 3 else []:
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", port))  # OSError: the start left it bound
    # ...its record of shared memory is dropped (no server ran), no peer listener's thread is left.
    assert not Path(raw["state_dir"], "shm-at-start.json").is_file()
    assert "rolloutd-peers" not in {t.name for t in threading.enumerate()}
