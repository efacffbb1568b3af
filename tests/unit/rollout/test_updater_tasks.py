"""The updater's loop owns everything it starts: a long-poll in flight is no task of its own
(a wake ends it through a cancel scope), and a pull's rate reporter is awaited once cancelled.
The one set of tasks that outlives a pull is its puller's: the workers kept for the next pull
(their keepers, the idle timer), stopped by ``Puller.close``. A real registry (embedded, in its
own thread) and a real mirror; also a registry restarted as a new instance that numbers its
versions again, with a mirror sized for two versions."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from rolloutd.config import Config
from rolloutd.demo import tinymodel
from rolloutd.metrics import Metrics
from rolloutd.rollout import mirror as mirror_module
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.updater import Updater
from rolloutd.trainer import EmbeddedRegistry
from tests.support.waiting import until

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
                assert updater.kept_worker_pids and kept()
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                await updater.close()  # as the daemon's stop does
        mirror.close()
    assert others() == set() and kept() == set()


def publish(reg: EmbeddedRegistry, version: int, seed: int) -> str:
    sd = tinymodel.state_dict(tinymodel.TINY, seed)
    return reg.publish(version, sd, shard_bytes=600_000, chunk_bytes=1 << 16).digest


async def test_a_registry_restarted_numbering_again_moves_the_node_through_a_mirror_for_two_versions(tmp_path):
    """The trainer crashed and resumed: the new registry instance publishes 1, 2, 3 again. The
    old instance's version 3 must not hold a place in a mirror sized for two versions (it did:
    every pull from the new instance's version 2 on failed MirrorFull)."""
    mirror = Mirror(tmp_path / "mirror", 1 << 30)
    reg = EmbeddedRegistry(port=0).start()
    port = reg.port
    cfg = Config.model_validate({"registry": {"url": reg.url, "long_poll_s": 30, "retry_initial_s": 0.1,
                                              "retry_max_s": 0.2},
                                 "pull": {"workers": 1},
                                 "servers": [{"name": "s0", "model": "/m", "public_port": 9001}]})
    async with RegistryClient(reg.url) as client:
        # Every server holds the node's target (what it loads next counts too, once published).
        updater = Updater(lambda: cfg, client, mirror, Metrics(),
                          in_use=lambda: {updater.target.version} if updater.target else set())
        run = asyncio.ensure_future(updater.run())
        run.set_name("updater")

        async def target(version: int, instance: str) -> None:
            await until(lambda: updater.target is not None and updater.target.version == version
                        and updater.target.instance == instance, 30, f"target {instance} v{version}")

        try:
            publish(reg, 1, seed=11)
            await target(1, reg.service.store.instance)
            mirror.max_bytes = 2 * mirror.usage_bytes() + 100_000  # two versions, not three
            for v in (2, 3):
                publish(reg, v, seed=10 + v)
                await target(v, reg.service.store.instance)
            old = reg.service.store.instance
            reg.stop()
            reg = EmbeddedRegistry(port=port).start()  # the same address, a new instance
            new = reg.service.store.instance
            assert new != old
            for v in (1, 2, 3):
                digest = publish(reg, v, seed=20 + v)
                await target(v, new)
            # The old instance's copies go once the new one's version 3 is the target: wait for the
            # removal, which runs on in a thread (read meanwhile, a copy being removed has no record).
            await until(lambda: {mirror.record(v).instance for v in mirror.versions()} == {new}, 10,
                        "only the new instance's versions in the mirror")
            assert mirror.versions()[-1] == 3
            assert updater.target.digest == digest
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await updater.close()
            with contextlib.suppress(Exception):
                reg.stop()
    mirror.close()


async def test_no_room_on_the_mirrors_filesystem_is_said_once_not_at_every_retry(tmp_path, monkeypatch, caplog):
    """mirror.max_bytes larger than its filesystem: a version that does not fit fails its pull, said
    once (the updater's ERROR, the puller's WARNING); every retry after it fails the same way at
    DEBUG. Room again: the version is pulled."""
    room = {"free_bytes": 4096}
    monkeypatch.setattr(mirror_module, "_free_bytes", lambda path: room["free_bytes"])  # fake: a full tmpfs
    caplog.set_level(logging.DEBUG)
    with EmbeddedRegistry(port=0) as reg:
        publish(reg, 1, seed=1)
        cfg = Config.model_validate({"registry": {"url": reg.url, "retry_initial_s": 0.05, "retry_max_s": 0.05},
                                     "servers": [{"name": "s0", "model": "/m", "public_port": 9001}]})
        mirror, metrics = Mirror(tmp_path / "mirror", 1 << 40), Metrics()
        async with RegistryClient(reg.url) as client:
            updater = Updater(lambda: cfg, client, mirror, metrics, in_use=set)
            run = asyncio.ensure_future(updater.run())
            run.set_name("updater")
            try:
                failed = metrics.pulls.labels(result="failed")
                await until(lambda: failed._value.get() >= 4, 30, "four failed pulls")
                about = [r for r in caplog.records if "No space left" in r.getMessage() or "[Errno 28]" in
                         r.getMessage()]
                said = [(r.levelname, r.getMessage().split(":")[0]) for r in about if r.levelno > logging.DEBUG]
                assert said == [("WARNING", "abandon pull of 1"), ("ERROR", "pull latest failed")], said
                assert len(about) >= 2 * 4, [r.getMessage() for r in about]
                room["free_bytes"] = 1 << 40
                await until(lambda: updater.target is not None and updater.target.version == 1, 30, "version 1")
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                await updater.close()
        mirror.close()


async def test_a_delta_pull_is_counted_by_kind_and_said_in_the_heartbeat(tmp_path):
    """Real pulls from a registry that publishes version 2 as a delta on version 1: the pull
    bytes metric by kind, the rebuild's histogram and the heartbeat's report say how each version
    came and what it fetched against its size."""
    from rolloutd.node.heartbeat import pull_report

    sd = tinymodel.state_dict(tinymodel.TINY, 1)
    with EmbeddedRegistry(port=0) as reg:
        full = reg.publish(1, sd, shard_bytes=600_000, chunk_bytes=1 << 16)
        cfg = Config.model_validate({"registry": {"url": reg.url, "long_poll_s": 30},
                                     "servers": [{"name": "s0", "model": "/m", "public_port": 9001}]})
        mirror, metrics = Mirror(tmp_path / "mirror", 1 << 30), Metrics()
        async with RegistryClient(reg.url) as client:
            updater = Updater(lambda: cfg, client, mirror, metrics, in_use=set)
            run = asyncio.ensure_future(updater.run())
            run.set_name("updater")
            try:
                await until(lambda: updater.target is not None and updater.target.version == 1, 30, "version 1")
                first = pull_report(updater.progress)
                name = next(iter(sd))
                sd[name] = sd[name].copy()
                sd[name].reshape(-1)[:8] += 1  # a step that changed a few elements
                await asyncio.to_thread(reg.publish, 2, sd, shard_bytes=600_000, chunk_bytes=1 << 16)
                delta = reg.service.store.get(2).manifest
                assert delta.delta is not None and delta.delta.base_version == 1
                await until(lambda: updater.target is not None and updater.target.version == 2, 30, "version 2")
                second = pull_report(updater.progress)
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                await updater.close()
        mirror.close()
    sample = metrics.registry.get_sample_value
    assert (first.kind, first.base, first.bytes_fetched, first.version_bytes) == ("full", None, full.total_bytes,
                                                                                  full.total_bytes)
    assert (second.kind, second.base, second.version_bytes) == ("delta", 1, delta.total_bytes)
    assert 0 < second.bytes_fetched < delta.total_bytes / 10 and second.reconstruct_s is not None
    assert sample("rolloutd_pull_bytes_total", {"kind": "full"}) == full.total_bytes
    assert sample("rolloutd_pull_bytes_total", {"kind": "delta"}) == second.bytes_fetched
    assert sample("rolloutd_pull_reconstruct_seconds_count", {}) == 1
