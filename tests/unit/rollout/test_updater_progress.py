"""What a pull's progress line adds when the pull's workers are starved of CPU: said only when
the same workers waited for a CPU more than they ran (at least a second) since the last line."""

from __future__ import annotations

from rolloutd.rollout.updater import _starved


def test_workers_that_waited_more_than_they_ran_are_called_starved_naming_the_priority():
    line = _starved(([7], (1.0, 2.0)), ([7], (1.2, 11.5)), "low")
    assert line == ("; its workers waited 9.5 s for a CPU and ran 0.2 s (pull.cpu_priority low: "
                    "the node's CPUs are busy)")


def test_nothing_is_said_of_workers_that_ran_as_much_or_waited_little_or_changed():
    assert _starved(None, ([7], (1.0, 2.0)), "low") == ""                   # the first line: no interval
    assert _starved(([7], (1.0, 2.0)), ([7], (6.0, 6.5)), "low") == ""      # ran more than it waited
    assert _starved(([7], (1.0, 2.0)), ([7], (1.1, 2.9)), "low") == ""      # under a second of waiting
    assert _starved(([7], (1.0, 2.0)), ([8], (1.1, 12.0)), "low") == ""     # another worker: no interval
    assert _starved(([], (0.0, 0.0)), ([], (0.0, 0.0)), "low") == ""        # no workers
