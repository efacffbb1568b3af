"""The event loop's lateness: the probe sees a blocked loop, and a running daemon exposes it."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.metrics import Metrics
from rolloutd.node.looplag import LoopLag
from tests.unit.test_metrics import samples


async def test_a_blocked_loop_shows_as_lag_and_the_longest_is_kept():
    m = Metrics()
    lag = LoopLag(m, interval_s=0.02)
    probe = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.1)
        assert lag.longest_s < 0.2  # an idle loop wakes about on time
        time.sleep(0.4)  # a blocking call on the loop, as a deletion or a hash would be
        await asyncio.sleep(0.1)
        longest = lag.longest_s
        assert 0.35 <= longest < 1.0, longest
        await asyncio.sleep(0.1)  # a loop on time again lowers nothing
        assert lag.longest_s == longest
    finally:
        probe.cancel()
    s = samples(m)
    assert s[("rolloutd_loop_lag_max_seconds", ())] == longest
    assert s[("rolloutd_loop_lag_seconds_bucket", (("le", "0.25"),))] < s[("rolloutd_loop_lag_seconds_count", ())]
    assert s[("rolloutd_loop_lag_seconds_count", ())] >= 5


@pytest.mark.slow
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
