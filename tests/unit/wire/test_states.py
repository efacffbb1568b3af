"""The server lifecycle's arrows: every allowed one is taken, every other one refused."""

from __future__ import annotations

import logging

import pytest

from rolloutd.wire.states import ARROWS, BadTransition, Lifecycle, ServerState
from tests.conftest import FakeClock

S = ServerState
# one order in every process (the fast tier collects in several)
ALLOWED = [(a, b) for a, targets in ARROWS.items() for b in sorted(targets, key=lambda s: s.value)]
REFUSED = [(a, b) for a in S for b in S if b not in ARROWS[a]]

# How a server reaches each state from STOPPED (the path the supervisor takes).
PATH_TO = {
    S.STOPPED: [],
    S.STARTING: [S.STARTING],
    S.SYNCING: [S.STARTING, S.SYNCING],
    S.SERVING: [S.STARTING, S.SYNCING, S.SERVING],
    S.UPDATING: [S.STARTING, S.SYNCING, S.SERVING, S.UPDATING],
    S.BACKOFF: [S.STARTING, S.BACKOFF],
    S.FATAL: [S.STARTING, S.BACKOFF, S.FATAL],
    S.STOPPING: [S.STARTING, S.STOPPING],
}


def at(state: ServerState, **kw) -> Lifecycle:
    life = Lifecycle("gpu0", **kw)
    for s in PATH_TO[state]:
        life.set(s)
    return life


def test_the_table_is_what_the_design_says():
    assert len(ALLOWED) == 19
    assert ARROWS[S.SERVING] == {S.UPDATING, S.BACKOFF, S.STOPPING}
    assert ARROWS[S.STOPPING] == {S.STOPPED}
    assert S.SERVING not in ARROWS[S.STARTING], "a server must sync before it serves"
    assert S.SERVING not in ARROWS[S.BACKOFF]


@pytest.mark.parametrize("old, new", ALLOWED, ids=lambda s: s.name)
def test_transition_allowed(old, new, caplog):
    clock = FakeClock()
    seen = []
    life = at(old, clock=clock, on_change=lambda name, a, b: seen.append((name, a, b)))
    clock.advance(7)
    seen.clear()
    with caplog.at_level(logging.INFO, logger="rolloutd.server"):
        life.set(new, "because")
    assert life.state is new and life.since == clock() and life.age_s() == 0
    assert seen == [("gpu0", old, new)]
    assert f"state gpu0: {old.name} -> {new.name} (because)" in caplog.text


@pytest.mark.parametrize("old, new", REFUSED, ids=lambda s: s.name)
def test_transition_refused(old, new):
    seen = []
    life = at(old, on_change=lambda *a: seen.append(a))
    seen.clear()
    with pytest.raises(BadTransition, match=f"gpu0: {old.name} -> {new.name} is not allowed"):
        life.set(new)
    assert life.state is old and seen == []


def test_running_means_a_process_may_be_alive():
    assert {s for s in S if s.running} == {S.STARTING, S.SYNCING, S.SERVING, S.UPDATING, S.STOPPING}
