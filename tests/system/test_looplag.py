"""The tests of test_looplag.py that run one at a time in the slow tier (slow by this folder);
the rest, and the helpers and fixtures they share, are in tests/integration/node/test_looplag.py."""

from __future__ import annotations

import re
import time

import httpx

from rolloutd.demo import tinymodel


def test_a_running_daemon_samples_its_loop(daemons, registry):
    registry.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
    d = daemons()
    d.wait_versions({"s0": 1}, 30)

    def count() -> float:
        text = httpx.get(d.url + "/metrics", timeout=10).text
        assert re.search(r"^rolloutd_loop_lag_max_seconds \S+$", text, re.M), text
        return float(re.search(r"^rolloutd_loop_lag_seconds_count (\S+)$", text, re.M).group(1))

    first = count()
    deadline = time.monotonic() + 15
    while count() < first + 5:  # four samples a second
        assert time.monotonic() < deadline, "the loop-lag probe does not run"
        time.sleep(0.1)
