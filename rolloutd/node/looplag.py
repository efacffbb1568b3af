"""How late the daemon's event loop runs: the gateways relay every token on it, so a callback
that blocks it (a deletion, a hash, a slow parse) delays every request in flight.

A probe sleeps ``interval_s`` again and again and records how much later than asked it woke:
``rolloutd_loop_lag_seconds`` (a histogram of every sample) and ``rolloutd_loop_lag_max_seconds``
(the longest since the daemon started, what a soak or an alert reads). A stall of ``d`` seconds
overlaps at least one wake-up when ``d > interval_s``, so it shows as at least
``d - interval_s``. The lateness also counts time the process was not scheduled at all (a loaded
host): to a request waiting on the loop, both are the same delay.
"""

from __future__ import annotations

import asyncio

from rolloutd.metrics import Metrics

# Every wake-up of an idle loop costs CPU and the probe is most of an idle daemon's wake-ups: this
# interval keeps it well inside the idle budget (bench/README.md, "The daemon's own footprint",
# has the cost of shorter ones). A stall shorter than this is still seen,
# only not always and not whole; the histogram shows how often.
INTERVAL_S = 0.25


class LoopLag:
    def __init__(self, metrics: Metrics, interval_s: float = INTERVAL_S):
        self.metrics, self.interval_s = metrics, interval_s
        self.longest_s = 0.0  # kept here, not in the task: a restarted probe keeps the figure

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.note(loop.time() - due)

    def note(self, late_s: float) -> None:
        late_s = max(0.0, late_s)
        self.metrics.loop_lag.observe(late_s)
        if late_s > self.longest_s:
            self.longest_s = late_s
            self.metrics.loop_lag_max.set(late_s)
