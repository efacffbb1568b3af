"""A real ``vllm serve`` (CPU build) whose engine core dies in the middle of a weight update.

vLLM's API process then goes into graceful shutdown: its port closes and the update request in
flight is never answered, so only that route's timeout (``update.*_timeout_s``, up to 10 min)
would end the update. The supervisor watches the server during every phase of an update, and
the processes vLLM titled (its engine core among them), so the server is in BACKOFF at the next
probe, serving the new version again after one vLLM start,
and the shared-memory segments of the dead group are gone from ``/dev/shm``.

To hold a request in flight whatever the timing, the engine core is stopped (SIGSTOP) before the
update begins: the API process stays healthy, and the first route that needs the engine waits.
Once the daemon has sent it, the engine core is killed (SIGKILL), as in the issue.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.support.daemon_harness import DaemonProcess, config, vllm_server, wait_until
from tests.support.processes import group_pids
from tests.support.vllm_server import engine_core, shm_mapped

# alone: the server must be back within 15 s of its vLLM's start, a deadline raced against the machine
pytestmark = [pytest.mark.timeout(600), pytest.mark.alone]


def test_an_engine_core_killed_mid_update_is_in_backoff_within_seconds(tmp_path):
    start = tinymodel.build(tmp_path / "start", seed=0)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 11), shard_bytes=600_000, chunk_bytes=1 << 16)
        cfg = config(tmp_path, reg.url, [vllm_server("gpu0", start, "0")],
                     update={"pause_timeout_s": 300, "start_timeout_s": 300, "load_timeout_s": 300,
                             "finish_timeout_s": 300},
                     restart={"failed_grace_s": 2}, shutdown={"server_grace_s": 20, "kill_wait_s": 10})
        d = DaemonProcess(cfg, tmp_path).start()
        try:
            st = d.wait_versions({"gpu0": 1}, 300)["servers"][0]
            pid, t_start = st["pid"], None
            t_start = float(re.search(r"healthy gpu0\[\d+\] after ([\d.]+) s", d.log_text()).group(1))
            group = group_pids(pid)
            segments = {n for n in shm_mapped(group) if "/" not in n}  # whatever their names; not the mirror's files
            core = engine_core(pid)
            os.kill(core, signal.SIGSTOP)  # the next route that needs the engine waits
            reg.publish(2, tinymodel.state_dict(tinymodel.TINY, 12), shard_bytes=600_000, chunk_bytes=1 << 16)
            d.wait(lambda s: s["servers"][0]["state"] == "UPDATING", 60, "UPDATING")
            time.sleep(1.0)  # a request of the update is in flight, held by the stopped engine
            assert d.server("gpu0")["state"] == "UPDATING"
            t0 = time.monotonic()
            os.kill(core, signal.SIGKILL)
            d.wait(lambda s: s["servers"][0]["state"] == "BACKOFF", 30, "BACKOFF")
            to_backoff = time.monotonic() - t0
            st = d.wait(lambda s: s["servers"][0]["state"] == "SERVING" and s["servers"][0]["version"] == 2,
                        300, "SERVING version 2")["servers"][0]
            to_serving = time.monotonic() - t0
            t_start2 = float(re.findall(r"healthy gpu0\[\d+\] after ([\d.]+) s", d.log_text())[-1])
            print(f"engine core killed: BACKOFF after {to_backoff:.1f} s, SERVING v2 after {to_serving:.1f} s "
                  f"(vLLM start {t_start:.1f} s, then {t_start2:.1f} s); segments of the old group: "
                  f"{sorted(segments)}")
            assert to_backoff < 10, to_backoff
            assert to_serving < t_start2 + 15, (to_serving, t_start2)
            assert st["incarnation"] == 2 and not group_pids(pid)
            log = d.log_text()
            # seen at the next probe from the processes vLLM titled, not three failed /health later
            assert f"its process VLLM::EngineCore (pid {core}) exited while loading version 2" in log, log[-3000:]
            left = sorted(n for n in segments if (Path("/dev/shm") / n).exists())
            assert left == [], f"shared memory of the dead group left: {left}"
        finally:
            d.stop(60)
            wait_until(lambda: not group_pids(pid) if "pid" in locals() else True, 20, "the group gone")
