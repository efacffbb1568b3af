"""SIGUSR1 to a running daemon (fake vLLM servers, a real registry): every thread's stack and every
task's chain of awaits land in its log, and it goes on serving as before."""

from __future__ import annotations

import signal

import pytest

from tests.support.daemon_harness import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.parallel, pytest.mark.timeout(120)]  # fake vLLM: beside other such tests


def test_sigusr1_writes_the_stacks_to_the_log_and_changes_nothing(daemons):
    d = daemons()
    before = d.wait(lambda s: d.server("s0", s)["state"] == "SERVING", 30, "s0 serving")
    d.signal(signal.SIGUSR1)
    wait_until(lambda: "tasks, on SIGUSR1" in d.log_text() and "Current thread" in d.log_text(), 10, "the dump")
    text = d.log_text()
    dump = text[text.index("tasks, on SIGUSR1"):]
    for task in ("updater", "admin", "server-s0"):
        assert f"task {task}:\n" in dump, dump
    assert "in Supervisor.run" in dump and "in Updater.run" in dump, dump  # the chain below keep()
    assert 'File "' in text[text.index("Current thread"):], "faulthandler wrote no frame"
    after = d.status()
    assert (d.server("s0", after)["pid"], d.server("s0", after)["state"]) == (d.server("s0", before)["pid"], "SERVING")
    assert d.stop() == 0
