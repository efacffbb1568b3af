"""The daemon's loop thread asks the kernel for a short scheduler slice, and nothing it starts
inherits it (rolloutd/node/wakeup.py). The latency it buys is measured in bench/gateway.py
--during-pull; here, that the kernel holds the setting where it should and nowhere else."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rolloutd.demo import tinymodel
from rolloutd.node.wakeup import SLICE_NS, current_slice_ns
from tests.support.daemon_harness import tagged_pids


def test_the_calling_thread_gets_the_slice_and_no_thread_or_child_started_after_it():
    code = textwrap.dedent("""
        import json, subprocess, sys, threading
        from rolloutd.node.wakeup import current_slice_ns, short_slice
        before = current_slice_ns()
        took = short_slice()
        seen = {}
        t = threading.Thread(target=lambda: seen.update(thread=current_slice_ns()))
        t.start(); t.join()
        child = subprocess.run([sys.executable, "-c", "from rolloutd.node.wakeup import current_slice_ns as c; "
                                "print(c())"], capture_output=True, text=True, check=True).stdout
        print(json.dumps({"before": before, "took": took, "after": current_slice_ns(), "thread": seen["thread"],
                          "child": int(child)}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["took"] is True and got["after"] == SLICE_NS, got
    assert got["before"] != SLICE_NS, got  # the default, which the thread and the child keep
    assert got["thread"] == got["before"] and got["child"] == got["before"], got


@pytest.mark.slow
def test_a_running_daemon_has_the_short_slice_on_its_loop_alone(daemons, registry):
    registry.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
    d = daemons()
    d.wait_versions({"s0": 1}, 30)
    pid = d.proc.pid
    assert current_slice_ns(pid) == SLICE_NS  # the main thread runs the loop
    children = [p for p in tagged_pids(d.tag) if p != pid]
    assert children, "the daemon's fake vLLM server is not running"
    default = current_slice_ns(children[0])
    assert default is not None and default != SLICE_NS
