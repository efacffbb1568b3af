"""The tests of test_wakeup.py that run one at a time in the slow tier (slow by this folder);
the rest, and the helpers and fixtures they share, are in tests/integration/node/test_wakeup.py."""

from __future__ import annotations

from rolloutd.demo import tinymodel
from rolloutd.node.wakeup import SLICE_NS, current_slice_ns
from tests.support.daemon_harness import tagged_pids


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
