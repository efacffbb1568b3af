"""The updater's loop owns everything it starts: a long-poll in flight is no task of its own
(a wake ends it through a cancel scope), and a pull's rate reporter is awaited once cancelled.
The one set of tasks that outlives a pull is its puller's: the workers kept for the next pull
(their keepers, the idle timer), stopped by ``Puller.close``. A real registry (embedded, in its
own thread) and a real mirror."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.config import Config
from rolloutd.demo import tinymodel
from rolloutd.node.metrics import Metrics
from rolloutd.registry import EmbeddedRegistry
from rolloutd.registry.client import RegistryClient
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.updater import Updater

from .waiting import until

pytestmark = pytest.mark.timeout(60)


KEPT_WORKERS = ("pull-worker-", "pull-workers-idle")  # the puller's, while it keeps its workers


def others() -> set[asyncio.Task]:
    """Tasks of the loop other than the test's own, the updater's and its puller's kept workers'."""
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t.get_name() != "updater"
            and not t.get_name().startswith(KEPT_WORKERS)}


def kept() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t.get_name().startswith(KEPT_WORKERS)}


async def test_a_long_poll_is_no_task_of_its_own_and_a_poke_ends_it(tmp_path):
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
        cfg = Config.model_validate({"registry": {"url": reg.url, "long_poll_s": 30},
                                     "servers": [{"name": "s0", "model": "/m", "public_port": 9001}]})
        mirror = Mirror(tmp_path / "mirror", 1 << 30)
        async with RegistryClient(reg.url) as client:
            updater = Updater(lambda: cfg, client, mirror, Metrics(), in_use=set)
            run = asyncio.ensure_future(updater.run())
            run.set_name("updater")
            try:
                await until(lambda: updater.target is not None and updater.target.version == 1, 30, "version 1 pulled")
                for _ in range(3):  # a long-poll for anything newer than 1 (30 s) is in flight meanwhile
                    contact = updater.registry.last_contact
                    await asyncio.sleep(0.3)
                    assert others() == set(), f"tasks nobody owns: {others()}"
                    updater.poke(asked=True)  # a person's "update now": the long-poll ends at once
                    await until(lambda c=contact: updater.registry.last_contact != c, 5, "asked again")
                assert not run.done()
                assert updater.puller.kept_worker_pids and kept()
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                await updater.puller.close()  # as the daemon's stop does
        mirror.close()
    assert others() == set() and kept() == set()
