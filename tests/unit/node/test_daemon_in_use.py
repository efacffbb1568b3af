"""What the daemon tells the mirror to keep (``Daemon._in_use``): each server's version, the one it
is loading, its last good version, and the node's last good version, which a server with none of
its own goes back to after a refusal (rollout/refusals.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

from rolloutd.node.daemon import Daemon
from rolloutd.rollout.refusals import Refusals
from rolloutd.rollout.updater import Target
from tests.support.supervisor_fakes import config


def version(v: int) -> Target:
    return Target(version=v, digest=f"{v:064x}", path=Path(f"/mirror/{v}"), instance="inst-1")


def server(loaded=None, loading=None, good=None) -> SimpleNamespace:
    """A stand-in for a configured server: only the fields ``_in_use`` reads."""
    return SimpleNamespace(supervisor=SimpleNamespace(loaded=loaded, loading=loading, good=good))


def test_the_mirror_keeps_the_nodes_last_good_version_when_no_server_holds_it():
    daemon = Daemon(config())
    daemon.refusals = Refusals()
    daemon.servers = {"s0": server(loaded=version(5), good=version(5)), "s1": server(loading=version(6))}
    assert daemon._in_use() == {5, 6}
    daemon.refusals.served(version(4))  # say the server that served 4 was removed by a reload since
    assert daemon._in_use() == {4, 5, 6}
    again = dataclasses.replace(version(4), copy="pulled-again")  # the same bytes, another mirror copy
    daemon.refusals.refuse(again, "failed its gate", "s1")  # a refused version is nobody's to go back to
    assert daemon.refusals.last_good is None and daemon._in_use() == {5, 6}
