"""The update policy (pure): when the node moves to the registry's newest version."""

from __future__ import annotations

import pytest

from rolloutd.rollout.updater import decide


def d(newest=5, held=4, pending_s=0.0, demand=None, asked=False, lag=1, delay=300.0):
    return decide(newest=newest, held=held, pending_s=pending_s, demand=demand, asked=asked,
                  min_version_lag=lag, max_update_delay_s=delay)


@pytest.mark.parametrize("kw, update, reason", [
    ({"newest": None, "held": None}, False, "nothing published"),
    ({"newest": 4, "held": 4}, False, "version 4 is the newest"),
    ({"newest": 3, "held": 4}, False, "version 4 is the newest"),       # a retired newest: never go back
    ({"newest": 1, "held": None}, True, "nothing is loaded from this registry"),
    ({"newest": 5, "held": 4}, True, "version 5 is 1 ahead of 4"),
    ({"newest": 6, "held": 4, "lag": 3}, False, "waiting up to 300 s more"),
    ({"newest": 7, "held": 4, "lag": 3}, True, "version 7 is 3 ahead of 4"),
    ({"newest": 5, "held": 4, "lag": 3, "pending_s": 300}, True, "has waited 300 s"),
    ({"newest": 5, "held": 4, "lag": 3, "demand": 5}, True, "demands version 5"),
    ({"newest": 5, "held": 4, "lag": 3, "demand": 4}, False, "waiting"),  # demand already met
    ({"newest": 5, "held": 4, "lag": 3, "asked": True}, True, "asked for"),
    ({"newest": 4, "held": 4, "asked": True}, False, "is the newest"),   # asked, but nothing newer
])
def test_decide(kw, update, reason):
    got = d(**kw)
    assert got.update is update and reason in got.reason, got


def test_a_deferred_update_says_when_to_look_again():
    got = d(newest=5, held=4, lag=3, delay=60, pending_s=45)
    assert not got.update and got.wake_in_s == pytest.approx(15)
