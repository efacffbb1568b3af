"""A supervisor in the test's own event loop (the fake vLLM as its child): every task it starts has
an owner. Cancelling it while it stops a server that ignores SIGTERM hurries that stop and waits
for its end: when the cancellation returns, the process group is gone, and closing the loop
finds no task left pending ("Task was destroyed but it is pending!") nor an error never retrieved.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from rolloutd.config import Config
from rolloutd.metrics import Metrics
from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups
from rolloutd.supervise.sockets import prepare_socket_dir
from rolloutd.supervise.supervisor import Supervisor
from rolloutd.wire.states import ServerState
from tests.conftest import free_port
from tests.support.processes import group_pids
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)
FAKE = Path(__file__).parents[2] / "support" / "fake_vllm.py"


class NoTarget:
    """The updater, as far as a supervisor sees it: decided, and nothing to load."""

    target = None

    def __init__(self) -> None:
        self.settled = asyncio.Event()
        self.settled.set()

    async def next_target(self, held):
        await asyncio.Event().wait()


def supervisor(tmp_path: Path, faults: str) -> Supervisor:
    cfg = Config.model_validate({
        "registry": {"url": "http://127.0.0.1:9"}, "state_dir": str(tmp_path / "state"),
        "vllm": {"command": [sys.executable, str(FAKE), "serve"], "env": {"FAKE_VLLM_FAULTS": faults}},
        "servers": [{"name": "s0", "model": "fake-model", "public_port": free_port()}],
        "health": {"interval_s": 0.2, "timeout_s": 1, "failures": 2},
        "restart": {"start_timeout_s": 10, "backoff_initial_s": 0.2, "max_retries": 3, "failed_grace_s": 20},
        "shutdown": {"server_grace_s": 20, "kill_wait_s": 5}})
    sem = asyncio.Semaphore(1)
    prepare_socket_dir(cfg.socket_dir)
    return Supervisor(cfg.servers[0], lambda: cfg, NoTarget(), slots=lambda: sem,
                      containment=ProcessGroups(ChildRecords(tmp_path / "children")), plugin_dir=tmp_path,
                      metrics=Metrics())


def test_cancelling_a_supervisor_mid_stop_waits_for_the_stop_and_leaves_no_task(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    found: dict = {}

    async def scenario() -> None:
        sup = supervisor(tmp_path, "ignore_term")
        task = asyncio.ensure_future(sup.run())
        await until(lambda: sup.state is ServerState.SERVING, 20, "SERVING")
        pgid = found["pgid"] = sup.child.pgid
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sup.socket))) as http:
            await http.post("http://localhost/fake/health", json={"ok": False})  # the supervisor stops it (20 s grace)
        await until(lambda: f"stop s0[{pgid}]: SIGTERM" in caplog.text, 10, "the stop's SIGTERM")
        t0 = loop.time()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        found["took"] = loop.time() - t0
        found["left"] = group_pids(pgid)
        found["state"] = sup.state

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), 40))
    finally:
        loop.close()
        gc.collect()
        for pid in group_pids(found["pgid"]) if "pgid" in found else []:  # a failed test's leftovers
            os.kill(pid, signal.SIGKILL)
    assert found["left"] == [], "the cancellation returned while the server's group was alive"
    assert caplog.text.count("SIGTERM to process group") == 1, "a second stop ran beside the first"
    assert found["took"] < 5, f"{found['took']:.1f} s: the stop was not hurried to SIGKILL"
    assert found["state"] is ServerState.STOPPED
    assert "cancelled during the grace period" in caplog.text
    for bad in ("Task was destroyed but it is pending", "exception was never retrieved"):
        assert bad not in caplog.text, bad
