"""The event loop's lateness: the probe sees a blocked loop, and a running daemon exposes it."""

from __future__ import annotations

import asyncio
import time

from rolloutd.metrics import Metrics
from rolloutd.node.looplag import LoopLag
from tests.support.metric_samples import samples


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
