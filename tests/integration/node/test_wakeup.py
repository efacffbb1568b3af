"""The daemon's loop thread asks the kernel for a short scheduler slice, and nothing it starts
inherits it (rolloutd/node/wakeup.py). The latency it buys is measured in bench/gateway.py
--during-pull; here, that the kernel holds the setting where it should and nowhere else."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from rolloutd.node.wakeup import SLICE_NS


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
