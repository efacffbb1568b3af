"""The node's update loop (:class:`rolloutd.rollout.updater.Updater`) in milliseconds, on the fake
clock (tests/support/fake_time.py), against small named fakes of the registry client, the puller and the
mirror: the first decision, long-polls, a deferred update and its deadline, the trainer's demand, an
update asked for, the registry unreachable (retries growing to a cap), pulls failing or too slow, a
registry that restarted as a new instance, a damaged mirror copy pulled again, a bug in a step.

The policy itself (:func:`decide`) is in test_decide.py; the loop against a real registry over
HTTP, with real pulls, in test_daemon.py (slow tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from rolloutd.metrics import Metrics
from rolloutd.rollout import updater as updater_module
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.puller import PullError, PullProgress, PullResult, PullState
from rolloutd.rollout.updater import Target, Updater
from rolloutd.wire import errors
from rolloutd.wire.messages import Demand, HeartbeatReply, LatestInfo
from tests.support.fake_time import run
from tests.support.mirror_versions import payload, put
from tests.support.supervisor_fakes import config, now

pytestmark = pytest.mark.timeout(30)


class FakeRegistry:
    """The registry as the updater's client calls it (``RegistryClient.latest``): live versions, an
    instance id, reachable or not. A long-poll waits on the fake clock for a newer version."""

    def __init__(self, *versions: int, instance: str = "inst-1"):
        self.versions, self.instance = list(versions), instance
        self.down = False
        self.calls: list[tuple[float, int, str | None, float]] = []  # (when, after, instance, wait_s)
        self._changed = asyncio.Condition()

    @property
    def newest(self) -> int | None:
        return max(self.versions) if self.versions else None

    async def latest(self, after: int = 0, instance: str | None = None, wait_s: float = 0.0) -> LatestInfo:
        self.calls.append((now(), after, instance, wait_s))
        if not self.down:
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await self._changed.wait_for(lambda: self.down or (self.newest or 0) > after
                                                     or bool(instance and instance != self.instance))
        if self.down:
            raise errors.RegistryUnavailable("registry http://trainer:8700 unreachable: connection refused")
        return LatestInfo(instance=self.instance, version=self.newest, digest=None, total_bytes=None)

    async def change(self, *, publish: int | None = None, instance: str | None = None,
                     versions: list[int] | None = None, down: bool | None = None) -> None:
        async with self._changed:
            if publish is not None:
                self.versions.append(publish)
            if instance is not None:
                self.instance, self.versions = instance, list(versions or [])
            if down is not None:
                self.down = down
            self._changed.notify_all()


class FakePuller:
    """The puller as the updater calls it: ``pull(version)`` takes ``pull_s`` fake seconds and
    returns the registry's version, or fails (``failures`` next pulls, ``hang``, ``raises``)."""

    def __init__(self, registry: FakeRegistry, root: Path):
        self.registry, self.root = registry, root
        self.pulls: list[tuple[float, int | str]] = []
        self.pull_s = 2.0
        self.failures = 0
        self.hang = False
        self.raises: Exception | None = None
        self.progress = None
        self.priority = "low"
        self.no_room_again = False  # its failures are never a lack of room said before
        self.result: dict = {}  # fields of the results it returns (a delta pull's, say)

    async def pull(self, version: int | str = "latest") -> PullResult:
        self.pulls.append((now(), version))
        await asyncio.sleep(self.pull_s)
        if self.hang:
            await asyncio.Event().wait()
        if self.raises is not None:
            error, self.raises = self.raises, None
            raise error
        if self.failures:
            self.failures -= 1
            raise PullError(f"pull {version}: chunk 3 of model.safetensors failed 4 times")
        v = self.registry.newest if version == "latest" else version
        if v not in self.registry.versions:
            raise PullError(f"version {v} is retired")
        return PullResult(version=v, path=self.root / str(v), digest=digest(self.registry.instance, v), bytes=1000,
                          seconds=self.pull_s, retries=0, **self.result)


class FakeMirror:
    """The mirror as the updater uses it: what collections keep, a damage check, removals, the
    instance followed and each copy's record (a version pulled again after a removal is a new
    copy)."""

    def __init__(self) -> None:
        self.kept: list[set[int]] = []
        self.damaged: dict[int, list[str]] = {}
        self.removed: list[int] = []
        self.following: str | None = None
        self.pulled_again: dict[int, int] = {}  # version -> removals so far

    def collect_soon(self, keep: set[int], done=None) -> None:
        self.kept.append(set(keep))

    def damage(self, version: int, digest: str, recheck: bool = False) -> list[str]:
        return self.damaged.pop(version, [])

    def remove(self, version: int, why: str, *, digest: str | None = None) -> None:
        self.removed.append(version)
        self.pulled_again[version] = self.pulled_again.get(version, 0) + 1

    def follow(self, instance: str | None) -> None:
        self.following = instance

    def claim(self, version: int, digest: str, instance: str | None) -> FakeRecord:
        return FakeRecord(instance, f"copy-{version}-{self.pulled_again.get(version, 0)}")


@dataclass(frozen=True)
class FakeRecord:
    """What ``Mirror.claim`` returns, as the updater reads it."""

    instance: str | None
    copy: str


def digest(instance: str, version: int) -> str:
    return f"{instance}-{version}".ljust(64, "0")


class Node:
    """An updater with its fakes; ``node.cfg`` may be replaced."""

    def __init__(self, tmp_path: Path, *versions: int, in_use: set[int] | None = None, **sections):
        self.cfg = config(**{"registry": {"long_poll_s": 30, "retry_initial_s": 1, "retry_max_s": 8}, **sections})
        self.registry = FakeRegistry(*versions)
        self.mirror = FakeMirror()
        self.metrics = Metrics()
        self.in_use = in_use if in_use is not None else set()
        self.puller = FakePuller(self.registry, tmp_path / "mirror")
        self.updater = Updater(lambda: self.cfg, self.registry, self.mirror, self.metrics, in_use=lambda: self.in_use,
                               clock=asyncio.get_running_loop().time, puller=self.puller)
        self.targets: list[tuple[float, int, str]] = []  # (when, version, instance) of each target published
        self.task: asyncio.Task | None = None

    def start(self) -> Node:
        self.task = asyncio.ensure_future(self.updater.run())
        self._follower = asyncio.ensure_future(self._follow())
        return self

    async def _follow(self) -> None:
        """Wait for each new target, as a server does."""
        held = None
        while True:
            held = await self.updater.next_target(held)
            self.targets.append((now(), held.version, held.instance))

    async def target(self, version: int, within_s: float = 3600) -> float:
        """Wait until the node's target is ``version``; the fake time it became so."""
        async with asyncio.timeout(within_s):
            while not self.targets or self.targets[-1][1] != version:
                await asyncio.sleep(0.25)
        return self.targets[-1][0]

    async def stop(self) -> None:
        for task in (self.task, self._follower):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels)


# -- deciding and pulling ---------------------------------------------------------------------------------

def test_the_first_decision_pulls_the_newest_version_once_and_makes_it_the_target(tmp_path):
    async def scenario():
        node = Node(tmp_path, 1, 2, 3, in_use={2}).start()
        t = await node.target(3)
        await asyncio.sleep(100)
        await node.stop()
        return node, t

    node, t = run(scenario())
    u = node.updater
    assert u.settled.is_set() and u.target == Target(3, digest("inst-1", 3), tmp_path / "mirror" / "3", "inst-1",
                                               "copy-3-0")
    assert node.mirror.following == "inst-1", "the mirror is told which registry instance the node follows"
    assert t == 2.0 and node.puller.pulls == [(0.0, "latest")], "one pull of 'latest', 2 s long"
    assert node.mirror.kept == [{2, 3}], "collected: what servers hold and the target stay"
    assert node.sample("rolloutd_pulls_total", result="ok") == 1 and node.sample("rolloutd_registry_reachable") == 1
    assert u.registry.reachable and u.registry.instance == "inst-1" and u.registry.latest == 3


def test_with_nothing_published_the_node_settles_and_a_publish_wakes_its_long_poll(tmp_path):
    async def scenario():
        node = Node(tmp_path).start()
        await asyncio.sleep(45)
        settled, target = node.updater.settled.is_set(), node.updater.target
        await node.registry.change(publish=1)
        published = now()
        t = await node.target(1)
        await node.stop()
        return node, settled, target, published, t

    node, settled, target, published, t = run(scenario())
    assert settled and target is None, "decided: nothing to load"
    assert t == published + 2.0, "the long-poll returned at the publish; then a 2 s pull"
    calls = node.registry.calls
    assert calls[0][1:] == (0, None, 0.0), "the first look does not wait"
    assert calls[1][1:] == (0, "inst-1", 30.0), "then long-polls of registry.long_poll_s"
    assert [c[0] for c in calls[:3]] == [0.0, 0.0, 30.0]


def test_a_version_below_the_lag_waits_until_max_update_delay_s(tmp_path):
    async def scenario():
        node = Node(tmp_path, 1, update={"min_version_lag": 3, "max_update_delay_s": 100}).start()
        await node.target(1)
        await node.registry.change(publish=2)
        t2 = now()
        await asyncio.sleep(50)
        waited = node.updater.target.version
        moved = await node.target(2)
        await node.stop()
        return moved - t2, waited

    delay, waited = run(scenario())
    assert waited == 1
    assert delay == 100.0 + 2.0, "moved at max_update_delay_s (not at the next 30 s long-poll), then pulled"


def test_a_version_lag_ahead_moves_the_node_at_once(tmp_path):
    async def scenario():
        node = Node(tmp_path, 1, update={"min_version_lag": 3, "max_update_delay_s": 1000}).start()
        await node.target(1)
        await node.registry.change(publish=2)
        await node.registry.change(publish=3)
        await asyncio.sleep(5)
        await node.registry.change(publish=4)
        t4 = now()
        moved = await node.target(4)
        await node.stop()
        return node, moved - t4

    node, delay = run(scenario())
    assert delay == 2.0 and [v for _, v, _ in node.targets] == [1, 4]


def test_the_trainers_demand_in_a_heartbeat_reply_moves_the_node_below_the_lag(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def scenario():
        node = Node(tmp_path, 1, update={"min_version_lag": 5, "max_update_delay_s": 1000}).start()
        await node.target(1)
        await node.registry.change(publish=2)
        await asyncio.sleep(5)
        node.updater.note_reply(HeartbeatReply(instance="inst-1", latest=2, demand=Demand(min_version=2)))
        asked = now()
        moved = await node.target(2)
        await node.stop()
        return node, moved - asked

    node, delay = run(scenario())
    assert delay == 2.0 and node.updater.registry.demand == 2
    assert "demand: the trainer asks for version 2 or newer" in caplog.text


def test_an_update_asked_for_moves_the_node_below_the_lag(tmp_path):
    async def scenario():
        node = Node(tmp_path, 1, update={"min_version_lag": 5, "max_update_delay_s": 1000}).start()
        await node.target(1)
        await node.registry.change(publish=2)
        await asyncio.sleep(5)
        node.updater.poke(asked=True)
        asked = now()
        moved = await node.target(2)
        await node.stop()
        return moved - asked

    assert run(scenario()) == 2.0


# -- failures ---------------------------------------------------------------------------------------------

def test_an_unreachable_registry_is_retried_with_growing_delays_to_a_cap(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def scenario():
        node = Node(tmp_path, 1)
        node.registry.down = True
        node.start()
        await asyncio.sleep(40)
        view = {**dict(node.updater.registry.status(now())), "settled": node.updater.settled.is_set()}
        await node.registry.change(down=False)
        t = await node.target(1)
        await node.stop()
        return node, view, t

    node, view, t = run(scenario())
    tries = [c[0] for c in node.registry.calls]
    assert [b - a for a, b in zip(tries, tries[1:5], strict=False)] == [1.0, 2.0, 4.0, 8.0]
    assert tries[5] - tries[4] == 8.0, "capped at registry.retry_max_s"
    assert view["reachable"] is False and "connection refused" in view["last_error"]
    assert view["settled"] is False, "no decision without the registry: servers wait in SYNCING"
    assert caplog.text.count("lose registry http://127.0.0.1:9") == 1, "said once, not at every retry"
    assert "reach registry http://127.0.0.1:9 (instance inst-1, newest version 1)" in caplog.text
    assert node.sample("rolloutd_registry_reachable") == 1 and t <= 40.0 + 8.0 + 2.0


def test_a_failed_pull_keeps_the_target_and_is_retried_with_growing_delays(tmp_path, caplog):
    async def scenario():
        node = Node(tmp_path, 1).start()
        await node.target(1)
        node.puller.failures = 3
        await node.registry.change(publish=2)
        await node.target(2)
        await node.stop()
        return node

    node = run(scenario())
    starts = [t for t, _ in node.puller.pulls[1:]]
    ends = [t + 2.0 for t in starts]  # each pull takes 2 s
    assert [round(b - a, 6) for a, b in zip(ends, starts[1:], strict=False)] == [1.0, 2.0, 4.0]
    assert [v for _, v, _ in node.targets] == [1, 2], "the target stayed on 1 while the pulls failed"
    assert node.sample("rolloutd_update_failures_total", kind="pull") == 3
    assert node.sample("rolloutd_pulls_total", result="failed") == 3
    assert "pull latest failed: pull latest: chunk 3 of model.safetensors failed 4 times" in caplog.text


def test_a_long_pull_whose_workers_wait_for_a_cpu_says_so_in_its_progress_lines(tmp_path, caplog, monkeypatch):
    """Every 10 s a progress line; from the second on, one whose workers waited for a CPU more
    than they ran since the line before says how long, naming pull.cpu_priority. The workers'
    CPU times are a fake (a starved worker cannot be made to order): 9 s waited, 0.1 s run per 10 s."""
    readings = iter([(0.1 * n, 9.0 * n) for n in range(1, 100)])
    monkeypatch.setattr(updater_module, "cpu_times", lambda pids: next(readings) if pids == [4242] else (0.0, 0.0))
    caplog.set_level(logging.INFO)

    async def scenario():
        node = Node(tmp_path, 1)
        node.puller.pull_s = 35.0
        node.puller.progress = PullProgress(target="latest", version=1, bytes_total=1 << 20, state=PullState.PULLING,
                                            worker_pids=[4242], clock=asyncio.get_running_loop().time)
        node.start()
        await node.target(1)
        await node.stop()

    run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pull version 1: 0%")]
    assert len(lines) == 3, lines
    assert "waited" not in lines[0], "the first line has no interval to speak of"
    for line in lines[1:]:
        assert line.endswith("; its workers waited 9.0 s for a CPU and ran 0.1 s (pull.cpu_priority low: "
                             "the node's CPUs are busy)"), line


def test_a_pull_is_counted_by_kind_and_a_delta_s_rebuild_is_timed(tmp_path):
    async def scenario():
        node = Node(tmp_path, 1).start()
        await node.target(1)
        node.puller.result = {"kind": "delta", "base": 1, "bytes_fetched": 21 << 10, "version_bytes": 1 << 30,
                              "reconstruct_s": 0.25}
        await node.registry.change(publish=2)
        await node.target(2)
        await node.stop()
        return node

    node = run(scenario())
    assert node.sample("rolloutd_pull_bytes_total", kind="delta") == 21 << 10
    assert node.sample("rolloutd_pull_bytes_total", kind="full") == 0  # the first pull's result fetched nothing
    assert node.sample("rolloutd_pull_reconstruct_seconds_count") == 1
    assert node.sample("rolloutd_pull_reconstruct_seconds_sum") == 0.25
    assert node.sample("rolloutd_pulls_total", result="ok") == 2


def test_a_pull_longer_than_pull_timeout_s_fails_and_is_retried(tmp_path, caplog):
    async def scenario():
        node = Node(tmp_path, 1, pull={"timeout_s": 120})
        node.puller.hang = True
        node.start()
        await asyncio.sleep(125)
        node.puller.hang = False
        await node.target(1)
        await node.stop()
        return node

    node = run(scenario())
    assert node.puller.pulls[1][0] == 120.0 + 1.0, "timed out at pull.timeout_s, retried after retry_initial_s"
    assert "pull latest failed: no result within pull.timeout_s=120" in caplog.text


def test_a_registry_restarted_as_a_new_instance_moves_the_node_to_its_newest_whatever_its_number(tmp_path,
                                                                                                caplog):
    async def scenario():
        node = Node(tmp_path, 5).start()
        await node.target(5)
        await node.registry.change(instance="inst-2", versions=[1])
        await node.target(1)
        await node.stop()
        return node

    node = run(scenario())
    assert [(v, i) for _, v, i in node.targets] == [(5, "inst-1"), (1, "inst-2")]
    assert node.updater.target.digest == digest("inst-2", 1)
    assert "resync: the registry restarted (instance inst-1 -> inst-2)" in caplog.text


def test_a_bug_in_an_update_step_is_logged_counted_and_retried(tmp_path, caplog):
    async def scenario():
        node = Node(tmp_path, 1)
        node.puller.raises = RuntimeError("a bug")
        node.start()
        await node.target(1)
        await node.stop()
        return node

    node = run(scenario())
    assert "crash in the update step; retrying in 1 s" in caplog.text
    assert node.sample("rolloutd_task_errors_total", task="updater") == 1
    assert [t for t, _ in node.puller.pulls] == [0.0, 2.0 + 1.0]


# -- re-checking a mirror copy ---------------------------------------------------------------------------

def test_verify_keeps_a_sound_copy_and_pulls_a_damaged_one_again_once_for_every_server(tmp_path, caplog):
    async def scenario():
        node = Node(tmp_path, 1).start()
        await node.target(1)
        target = node.updater.target
        sound = await node.updater.verify(target)
        pulls = len(node.puller.pulls)
        node.mirror.damaged[1] = ["model.safetensors: chunk 0 does not match its digest"]
        fresh = await asyncio.gather(node.updater.verify(target), node.updater.verify(target))
        await node.stop()
        return node, target, sound, pulls, fresh

    node, target, sound, pulls, fresh = run(scenario())
    assert sound is target and pulls == 1, "a sound copy is used as it is"
    assert fresh[0] == fresh[1] == node.updater.target and fresh[0].digest == target.digest
    assert node.mirror.removed == [1] and [v for _, v in node.puller.pulls] == ["latest", 1], "pulled again once"
    assert node.sample("rolloutd_update_failures_total", kind="mirror") == 1
    assert "verify version 1: the mirror copy is damaged (model.safetensors: chunk 0" in caplog.text


def test_a_copy_pulled_again_is_a_new_target_that_every_server_loads_again(tmp_path):
    """The same version and digest, but another copy: a server that loaded the damaged one
    must load this one (an equal target would leave it on the bad bytes)."""
    async def scenario():
        node = Node(tmp_path, 1).start()
        await node.target(1)
        target = node.updater.target
        node.mirror.damaged[1] = ["model.safetensors: chunk 0 does not match its digest"]
        fresh = await node.updater.verify(target)
        await asyncio.sleep(1)
        await node.stop()
        return node, target, fresh

    node, target, fresh = run(scenario())
    assert [v for _, v, _ in node.targets] == [1, 1], "published again: every server loads the new copy"
    assert fresh != target and fresh.digest == target.digest and fresh.copy != target.copy


def test_a_damaged_copy_of_a_target_the_node_has_left_is_not_pulled_again_and_the_target_never_moves_back(
        tmp_path, caplog):
    async def scenario():
        node = Node(tmp_path, 1).start()
        await node.target(1)
        old = node.updater.target
        await node.registry.change(publish=2)
        await node.target(2)
        node.mirror.damaged[1] = ["model.safetensors: chunk 0 does not match its digest"]
        given = await node.updater.verify(old)  # a server still loading version 1 failed meanwhile
        await asyncio.sleep(60)
        await node.stop()
        return node, given

    node, given = run(scenario())
    assert given == node.updater.target and given.version == 2, "the failed server is given the newest target"
    assert [v for _, v, _ in node.targets] == [1, 2], "the node's target never goes back"
    assert [v for _, v in node.puller.pulls] == ["latest", "latest"], "version 1 is not pulled again"
    assert node.mirror.removed == [1]
    assert "the node's target is version 2 now: load that instead" in caplog.text


def test_the_mirror_served_while_the_registry_is_down_is_the_last_instances_newest_checked_first(tmp_path, caplog):
    """A restart while the registry is down: the newest version of the instance the node followed
    last (not the highest number in the mirror, an older instance's), read back chunk by chunk
    before it is served; a damaged copy is removed and the one before it served."""
    mirror = Mirror(tmp_path / "real-mirror", 1 << 20)
    mirror.follow("inst-0")
    for v in (7, 8):  # the registry's instance before its last restart: higher numbers
        put(mirror, v)
    mirror.follow("inst-1")
    good = put(mirror, 1)
    put(mirror, 2)
    victim = mirror.path(2) / sorted(payload(2))[0]
    with open(victim, "r+b") as f:  # one byte flipped, the size kept: only a chunk check sees it
        f.write(b"\xff")
    restarted = Mirror(mirror.dir, 1 << 20)  # the daemon restarted

    async def scenario():
        node = Node(tmp_path, update={"serve_mirror_when_registry_down": True})
        node.registry.down = True
        node.mirror = node.updater.mirror = restarted
        node.start()
        await node.target(1, within_s=10)
        await asyncio.sleep(5)
        await node.stop()
        return node

    node = run(scenario())
    assert [(v, i) for _, v, i in node.targets] == [(1, None)]
    assert node.updater.target.digest == good.digest and node.updater.target.copy == restarted.record(1).copy
    assert 2 not in restarted.versions(), "the damaged copy is removed"
    assert "verify version 2: the mirror copy is damaged" in caplog.text
    assert node.sample("rolloutd_update_failures_total", kind="mirror") == 1
    restarted.close()
    mirror.close()
