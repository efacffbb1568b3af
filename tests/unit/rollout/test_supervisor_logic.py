"""The supervisor's logic in milliseconds: one :class:`Supervisor` against small named fakes of its
child process, its vLLM client and its updater (tests/support/supervisor_fakes.py), on an event loop whose
clock jumps from timer to timer (tests/support/fake_time.py). Every arrow of the server lifecycle is
taken for its reason, with exact fake timings: backoff delays growing to a cap, FATAL after the
retries, probes failing while SERVING and while UPDATING, a failed load re-applied or the server
restarted, a failed pause keeping the version, stops from every state, a restart and a reload.

The same paths with real processes (the fake vLLM as a child of a real daemon) are in
test_supervise_faults.py and test_daemon_faults.py (slow tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from pathlib import Path

import pytest

from rolloutd.metrics import Metrics
from rolloutd.rollout.refusals import Refusals
from rolloutd.rollout.updater import Target
from rolloutd.rollout.vllm_http import VllmError
from rolloutd.supervise.leftovers import ChildRecords, ProcessGroups
from rolloutd.supervise.supervisor import QUIET_ROUTES, Supervisor, child_argv, child_environ
from rolloutd.wire.states import ARROWS, ServerState
from tests.support.fake_time import run
from tests.support.supervisor_fakes import (
    CANARY,
    UPDATE_ROUTES,
    Arrows,
    FakeUpdater,
    FakeVllm,
    config,
    mirror_version,
    now,
)
from tests.support.waiting import until

S = ServerState
pytestmark = pytest.mark.timeout(30)


class Rig:
    """One supervisor, its fakes and its config (``rig.cfg`` may be replaced: a reload)."""

    def __init__(self, tmp_path: Path, *, version: int | None = 1, settled: bool = True,
                 updater: FakeUpdater | None = None, slots: asyncio.Semaphore | None = None, index: int = 0,
                 canary: bool = False, **sections):
        self.tmp_path, self.canary = tmp_path, CANARY if canary else None
        self.cfg = config(**sections)
        self.vllm = FakeVllm()
        self.updater = updater or FakeUpdater(self.version(version) if version else None, settled=settled)
        self.arrows = Arrows()
        self.metrics = Metrics()
        sem = slots or asyncio.Semaphore(2)
        self.sup = Supervisor(self.cfg.servers[index], lambda: self.cfg, self.updater, slots=lambda: sem,
                              containment=ProcessGroups(ChildRecords(tmp_path / "children")), plugin_dir=tmp_path,
                              metrics=self.metrics, on_state=self.arrows, vllm=self.vllm,
                              make_child=self.vllm.make_child, clock=asyncio.get_running_loop().time)
        self.task: asyncio.Task | None = None

    def version(self, v: int) -> Target:
        return mirror_version(self.tmp_path / "mirror", v, canary=self.canary)

    def start(self) -> Rig:
        self.task = asyncio.ensure_future(self.sup.run())
        return self

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def publish(self, v: int) -> None:
        await self.updater.publish(self.version(v))

    def failures(self, kind: str) -> float:
        return self.metrics.registry.get_sample_value("rolloutd_update_failures_total", {"kind": kind})

    def metric(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"server": self.sup.name})


async def serving(rig: Rig, version: int | None, nth: int = 1) -> float:
    t = await rig.arrows.reach(S.SERVING, nth)
    assert rig.sup.loaded == (rig.version(version) if version else None)
    return t


def gaps(starts: list[float], ends: list[float]) -> list[float]:
    """Fake seconds from each entry into one state to the next entry into another."""
    return [round(b - a, 6) for a, b in zip(starts, ends, strict=False)]


# -- scenarios: each takes some arrows; the tests below check them in detail --------------------------------

async def serve_update_stop(tmp_path: Path) -> Rig:
    """Start on version 1, update to 2, stop."""
    rig = Rig(tmp_path).start()
    await serving(rig, 1)
    await rig.publish(2)
    await serving(rig, 2, nth=2)
    await rig.stop()
    return rig


async def never_healthy_until_fatal(tmp_path: Path, **sections) -> Rig:
    rig = Rig(tmp_path, **sections)
    rig.vllm.start_s = None
    rig.start()
    await rig.arrows.reach(S.FATAL)
    await asyncio.sleep(1000)  # FATAL stays FATAL: a person restarts it
    await rig.stop()
    return rig


async def dies_while_syncing(tmp_path: Path) -> Rig:
    rig = Rig(tmp_path, settled=False).start()  # no first decision yet: SYNCING waits for it
    await rig.arrows.reach(S.SYNCING)
    await asyncio.sleep(10)
    rig.vllm.child.exit(-9)
    await rig.arrows.reach(S.BACKOFF)
    await rig.stop()
    return rig


async def unhealthy_while_serving(tmp_path: Path) -> Rig:
    rig = Rig(tmp_path).start()
    await serving(rig, 1)
    rig.vllm.at_spawn.append(lambda child: setattr(rig.vllm, "health_ok", True))
    await asyncio.sleep(10.25)
    rig.vllm.health_ok = False
    await rig.arrows.reach(S.BACKOFF)
    await serving(rig, 1, nth=2)
    await rig.stop()
    return rig


async def unhealthy_while_updating(tmp_path: Path, how: str = "unhealthy") -> Rig:
    """The load hangs (``update.load_timeout_s`` 600 s); the server fails its probes, or exits."""
    rig = Rig(tmp_path, update={"load_timeout_s": 600}).start()
    await serving(rig, 1)
    rig.vllm.faults["/update_weights"] = "hang"
    rig.vllm.at_spawn.append(lambda child: (rig.vllm.faults.clear(), setattr(rig.vllm, "health_ok", True)))
    await rig.publish(2)
    await rig.arrows.reach(S.UPDATING)
    await asyncio.sleep(1)
    if how == "unhealthy":
        rig.vllm.health_ok = False
    else:
        rig.vllm.child.exit(-9)
    await rig.arrows.reach(S.BACKOFF)
    await serving(rig, 2, nth=2)
    await rig.stop()
    return rig


def hold(state: ServerState):
    """A scenario that brings a server to ``state``, leaves it there 5 s, then stops it."""

    async def scenario(tmp_path: Path) -> Rig:
        rig = Rig(tmp_path, version=1, settled=state is not S.SYNCING,
                  restart={"backoff_initial_s": 30, "backoff_max_s": 30}, update={"load_timeout_s": 600})
        if state is S.STARTING:
            rig.vllm.start_s = None
        if state is S.BACKOFF:
            rig.vllm.exit_after = (0.1, 1)
        rig.start()
        if state is S.UPDATING:
            await serving(rig, 1)
            rig.vllm.faults["/update_weights"] = "hang"
            await rig.publish(2)
        await rig.arrows.reach(state)
        await asyncio.sleep(5)
        assert rig.sup.state is state
        rig.stopped_at = now()
        await rig.stop()
        return rig

    scenario.__name__ = f"hold_{state.name.lower()}"
    return scenario


ARROW_SCENARIO = {
    (S.STOPPED, S.STARTING): serve_update_stop,
    (S.STARTING, S.SYNCING): serve_update_stop,
    (S.STARTING, S.BACKOFF): never_healthy_until_fatal,
    (S.STARTING, S.STOPPING): hold(S.STARTING),
    (S.SYNCING, S.SERVING): serve_update_stop,
    (S.SYNCING, S.BACKOFF): dies_while_syncing,
    (S.SYNCING, S.STOPPING): hold(S.SYNCING),
    (S.SERVING, S.UPDATING): serve_update_stop,
    (S.SERVING, S.BACKOFF): unhealthy_while_serving,
    (S.SERVING, S.STOPPING): serve_update_stop,
    (S.UPDATING, S.SERVING): serve_update_stop,
    (S.UPDATING, S.BACKOFF): unhealthy_while_updating,
    (S.UPDATING, S.STOPPING): hold(S.UPDATING),
    (S.BACKOFF, S.STARTING): never_healthy_until_fatal,
    (S.BACKOFF, S.FATAL): never_healthy_until_fatal,
    (S.BACKOFF, S.STOPPING): hold(S.BACKOFF),
    (S.FATAL, S.STOPPING): never_healthy_until_fatal,
    (S.STOPPING, S.STOPPED): serve_update_stop,
}
# The table allows FATAL -> STARTING, but the supervisor never takes it: a restart asked for a
# FATAL server cancels its run (FATAL -> STOPPING -> STOPPED) and starts a new one (see
# test_a_restart_of_a_fatal_server_goes_through_stopped_and_counts_afresh).
NOT_TAKEN = {(S.FATAL, S.STARTING)}


def test_every_arrow_of_the_table_has_a_scenario():
    allowed = {(a, b) for a, targets in ARROWS.items() for b in targets}
    assert set(ARROW_SCENARIO) | NOT_TAKEN == allowed
    assert not set(ARROW_SCENARIO) & NOT_TAKEN


@pytest.mark.parametrize("arrow", list(ARROW_SCENARIO), ids=lambda a: f"{a[0].name}->{a[1].name}")
def test_the_supervisor_takes_the_arrow(arrow, tmp_path):
    rig = run(ARROW_SCENARIO[arrow](tmp_path))
    assert arrow in rig.arrows.taken, rig.arrows.taken
    assert rig.task.done() and rig.sup.state is S.STOPPED
    assert all(not c.running for c in rig.vllm.children), "a process outlived its supervisor"


# -- starting, syncing, serving, updating ------------------------------------------------------------------

def test_a_server_serves_once_healthy_and_on_the_target_then_updates_and_stops(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def scenario():
        rig = Rig(tmp_path).start()
        synced = await rig.arrows.reach(S.SYNCING)
        serving_at = await serving(rig, 1)
        first = rig.vllm.routes()
        snap = rig.sup.snapshot()
        await rig.publish(2)
        updating = await rig.arrows.reach(S.UPDATING)
        await serving(rig, 2, nth=2)
        update = rig.vllm.routes()[len(first):]
        await rig.stop()
        return rig, synced, serving_at, first, snap, updating, update

    rig, synced, serving_at, first, snap, updating, update = run(scenario())
    assert rig.arrows.states == [S.STARTING, S.SYNCING, S.SERVING, S.UPDATING, S.SERVING, S.STOPPING, S.STOPPED]
    assert synced == 2.0, "healthy at its first probe after start_s (probes every 0.5 s while starting)"
    assert serving_at == 2.5, "SERVING only once the first sync loaded version 1 (a 0.5 s load)"
    assert first == list(UPDATE_ROUTES) and update == list(UPDATE_ROUTES)
    assert updating == serving_at  # a new target is applied at once
    assert snap.state == "SERVING" and snap.version == 1 and snap.target == 1 and snap.incarnation == 1
    assert snap.last_update.ok is True and snap.last_update.gate.ok is True
    assert rig.metric("rolloutd_updates_total") == 2 and rig.metric("rolloutd_server_version") == -1
    assert rig.updater.collected == 2, "the mirror is collected after each load"
    child = rig.vllm.children[0]
    assert len(rig.vllm.children) == 1 and child.grace == 20.0, "stopped with shutdown.server_grace_s"
    assert child.shm_noted == [2.0], "its /dev/shm segments learnt once healthy, to remove what it leaves"
    assert rig.sup.snapshot().pid is None and rig.vllm.closed == 1
    assert "healthy s0[1001] after 2.0 s" in caplog.text
    assert "state s0: SERVING -> UPDATING (version 1 -> 2)" in caplog.text


def test_a_server_waits_in_syncing_for_the_first_decision_and_serves_its_start_model(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, version=None, settled=False).start()
        await rig.arrows.reach(S.SYNCING)
        await asyncio.sleep(100)
        waited = rig.sup.state
        await rig.updater.publish(None)  # decided: nothing to load
        t = await serving(rig, None)
        await rig.stop()
        return rig, waited, t

    rig, waited, t = run(scenario())
    assert waited is S.SYNCING and t == 102.0
    assert rig.vllm.routes() == [], "nothing to load: no update route called"
    assert rig.sup.snapshot().version is None


def test_rolling_slots_let_one_server_update_at_a_time(tmp_path):
    async def scenario(slots: int):
        updater = FakeUpdater()
        sem = asyncio.Semaphore(slots)
        rigs = [Rig(tmp_path / str(slots), updater=updater, slots=sem, index=i) for i in (0, 1)]
        for rig in rigs:
            rig.vllm.load_s = 3.0
            rig.start()
        await updater.publish(rigs[0].version(1))
        for rig in rigs:
            await serving(rig, 1)
        await updater.publish(rigs[0].version(2))
        for rig in rigs:
            await serving(rig, 2, nth=2)
            await rig.stop()
        return [(r.arrows.times(S.UPDATING)[0], r.arrows.times(S.SERVING)[1]) for r in rigs]

    (a0, a1), (b0, b1) = run(scenario(1))
    assert a1 <= b0 or b1 <= a0, f"both paused at once: {a0}-{a1} and {b0}-{b1}"
    (a0, a1), (b0, b1) = run(scenario(2))
    assert a0 == b0, "all at once: both servers update together"


# -- failed starts: backoff, FATAL ----------------------------------------------------------------------------

def test_a_server_never_healthy_backs_off_with_growing_delays_to_a_cap_then_is_fatal(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    rig = run(never_healthy_until_fatal(tmp_path))
    a = rig.arrows
    assert a.states == [S.STARTING, S.BACKOFF] * 5 + [S.FATAL, S.STOPPING, S.STOPPED]
    assert gaps(a.times(S.STARTING), a.times(S.BACKOFF)) == [60.0] * 5, "each start given restart.start_timeout_s"
    assert gaps(a.times(S.BACKOFF), a.times(S.STARTING)[1:]) == [1.0, 2.0, 4.0, 4.0], "growing, capped at 4 s"
    snap = rig.sup.snapshot()
    assert snap.restarts == 4 and snap.incarnation == 5, "max_retries=4: four restarts, then FATAL"
    assert "not healthy within restart.start_timeout_s=60" in rig.sup.last_error
    assert [c.grace for c in rig.vllm.children] == [5.0] * 5, "a failed server gets restart.failed_grace_s"
    assert rig.metric("rolloutd_server_restarts_total") == 4
    assert "state s0: BACKOFF -> FATAL (5 failures in a row; last: not healthy" in caplog.text
    assert re.findall(r"backoff s0: restart (\d) of 4 in ([\d.]+) s", caplog.text) == [
        ("1", "1.0"), ("2", "2.0"), ("3", "4.0"), ("4", "4.0")]


def test_a_failed_server_that_ignores_sigterm_is_killed_after_failed_grace_s(tmp_path):
    async def scenario():
        rig = Rig(tmp_path)
        rig.vllm.exit_after = None
        rig.vllm.start_s = None
        rig.vllm.ignores_term = True
        rig.start()
        await rig.arrows.reach(S.STARTING, 2)
        await rig.stop()
        return rig

    rig = run(scenario())
    a = rig.arrows
    assert gaps(a.times(S.BACKOFF), a.times(S.STARTING)[1:]) == [5.0 + 1.0], "failed_grace_s, then the backoff"
    assert rig.vllm.children[0].describe_exit() == "killed by SIGKILL"


def test_a_server_that_exits_at_once_is_named_in_words(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, restart={"max_retries": 1})
        rig.vllm.exit_after = (0.0, 3)
        rig.start()
        await rig.arrows.reach(S.FATAL)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.sup.last_error == "exited before it was healthy: exited with status 3"
    assert rig.sup.incarnation == 2


def test_a_command_that_cannot_be_spawned_is_a_failure_not_a_crash(tmp_path, caplog):
    async def scenario():
        rig = Rig(tmp_path, restart={"max_retries": 2})
        rig.vllm.spawn_error = "cannot start s0: [Errno 2] No such file or directory: 'fake-vllm'"
        rig.start()
        await rig.arrows.reach(S.FATAL)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert "No such file or directory: 'fake-vllm'" in rig.sup.last_error
    assert rig.arrows.states[:7] == [S.STARTING, S.BACKOFF] * 3 + [S.FATAL]
    assert "crash while supervising" not in caplog.text


def test_a_bug_while_supervising_restarts_the_server_not_the_daemon(tmp_path, caplog):
    async def scenario():
        rig = Rig(tmp_path)
        healthy = rig.vllm.healthy

        async def buggy(timeout_s):
            rig.vllm.healthy = healthy  # once
            raise RuntimeError("a bug")

        rig.vllm.healthy = buggy
        rig.start()
        await serving(rig, 1)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.arrows.states[:4] == [S.STARTING, S.BACKOFF, S.STARTING, S.SYNCING]
    assert rig.sup.last_error == "internal error: RuntimeError('a bug')"
    assert "crash while supervising s0" in caplog.text


@pytest.mark.parametrize("stable_after_s, fatal", [(30, False), (300, True)])
def test_serving_for_stable_after_s_resets_the_failure_count(tmp_path, stable_after_s, fatal):
    """Every process serves about 100 s, then exits. Serving past stable_after_s forgives the
    failures before: the server is never given up, and each restart waits the initial delay."""
    async def scenario():
        rig = Rig(tmp_path, restart={"max_retries": 1, "stable_after_s": stable_after_s})
        rig.vllm.exit_after = (100.0, 1)
        rig.start()
        with contextlib.suppress(TimeoutError):
            await rig.arrows.reach(S.STARTING, 6, within_s=1000)
        await rig.stop()
        return rig

    rig = run(scenario())
    a = rig.arrows
    assert (S.FATAL in a.states) is fatal
    if fatal:
        assert rig.sup.incarnation == 2
    else:
        assert rig.sup.incarnation == 6 and gaps(a.times(S.BACKOFF), a.times(S.STARTING)[1:]) == [1.0] * 5


# -- failures while syncing and serving -----------------------------------------------------------------------

def test_a_server_that_dies_while_waiting_for_its_first_sync_is_restarted_and_counted(tmp_path):
    rig = run(dies_while_syncing(tmp_path))
    assert rig.arrows.taken[:3] == [(S.STOPPED, S.STARTING), (S.STARTING, S.SYNCING), (S.SYNCING, S.BACKOFF)]
    backoff = rig.arrows.times(S.BACKOFF)[0]
    assert backoff - rig.arrows.times(S.SYNCING)[0] <= 11.0, "seen at the next probe (1 s) after its exit"
    assert rig.sup.last_error == "exited: killed by SIGKILL (out of memory?)"
    assert rig.failures("sync") == 1


def test_a_first_sync_that_fails_is_counted_and_the_server_restarted(tmp_path):
    async def scenario():
        rig = Rig(tmp_path)
        rig.vllm.faults["/update_weights"] = "fail"
        rig.vllm.at_spawn.append(lambda child: rig.vllm.faults.clear() if child.pid == 1002 else None)
        rig.start()
        await serving(rig, 1)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.arrows.taken[2] == (S.SYNCING, S.BACKOFF)
    assert rig.failures("sync") == 1 and rig.failures("load") == 2
    assert "/resume" not in rig.vllm.routes(1001), "a half-loaded server was resumed"
    assert rig.sup.incarnation == 2


def test_a_probe_failing_while_serving_restarts_the_server_after_health_failures(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    rig = run(unhealthy_while_serving(tmp_path))
    a = rig.arrows
    failed_at = a.times(S.SERVING)[0] + 10.25
    assert 2.0 <= a.times(S.BACKOFF)[0] - failed_at <= 3.0, "three failed probes, one a second"
    assert rig.sup.last_error == "/health failed 3 times in a row"
    for n in (1, 2, 3):
        assert f"probe s0[1001]: /health failed ({n} of 3)" in caplog.text
    assert rig.vllm.children[0].grace == 5.0 and rig.sup.incarnation == 2 and rig.sup.restarts == 1
    assert rig.vllm.routes(1002) == list(UPDATE_ROUTES), "the new process loads the target before serving"


def test_an_engine_of_the_server_gone_is_a_failure_at_the_next_probe_whatever_health_says(tmp_path, caplog):
    """A dead DP engine or TP worker: vLLM's API answers /health for a while (and a route that
    needs the engine hangs), but the server is broken; the watch sees the process gone at its next
    tick, while serving and while loading."""
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        await asyncio.sleep(10)
        rig.vllm.children[0].vital_lost = "VLLM::EngineCore_DP1 (pid 7)"
        lost_at = now()
        await rig.arrows.reach(S.BACKOFF)
        serving_to_backoff = now() - lost_at
        await serving(rig, 1, nth=2)
        rig.vllm.faults["/update_weights"] = "hang"
        await rig.publish(2)
        await rig.arrows.reach(S.UPDATING)
        await asyncio.sleep(5)
        rig.vllm.children[1].vital_lost = "VLLM::Worker_TP1 (pid 8)"
        lost_at = now()
        await rig.arrows.reach(S.BACKOFF, 2)
        updating_to_backoff = now() - lost_at
        await rig.stop()
        return rig, serving_to_backoff, updating_to_backoff

    caplog.set_level(logging.INFO)
    rig, serving_to_backoff, updating_to_backoff = run(scenario())
    assert serving_to_backoff <= 1.0 and updating_to_backoff <= 1.0, (serving_to_backoff, updating_to_backoff)
    assert rig.vllm.health_ok and "/health failed" not in caplog.text
    assert "its process VLLM::EngineCore_DP1 (pid 7) exited" in caplog.text
    assert rig.sup.last_error == "its process VLLM::Worker_TP1 (pid 8) exited while loading version 2"


def test_probes_that_fail_fewer_times_than_health_failures_change_nothing(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        for _ in range(5):  # two probes fail, one passes, again and again
            rig.vllm.health_ok = False
            await asyncio.sleep(2)
            rig.vllm.health_ok = True
            await asyncio.sleep(1)
        state = rig.sup.state
        await rig.stop()
        return rig, state

    rig, state = run(scenario())
    assert state is S.SERVING and rig.sup.incarnation == 1 and S.BACKOFF not in rig.arrows.states


def test_a_process_that_exits_while_serving_is_restarted_at_the_next_probe(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        await asyncio.sleep(10.25)
        exited = now()
        rig.vllm.child.exit(-9)
        await rig.arrows.reach(S.BACKOFF)
        await rig.stop()
        return rig, exited

    rig, exited = run(scenario())
    assert rig.arrows.times(S.BACKOFF)[0] - exited <= 1.0
    assert rig.sup.last_error == "exited: killed by SIGKILL (out of memory?)"


# -- failures while updating ----------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["unhealthy", "exits"])
def test_a_server_failing_while_updating_is_restarted_within_its_probes_not_the_load_timeout(tmp_path, how):
    rig = run(unhealthy_while_updating(tmp_path, how))
    a = rig.arrows
    failed_at = a.times(S.UPDATING)[0] + 1
    limit = 4.0 if how == "unhealthy" else 1.0  # three failed probes; or the exit, seen at the next probe
    assert a.times(S.BACKOFF)[0] - failed_at <= limit, "not update.load_timeout_s=600"
    error = rig.sup.last_error
    assert error == ("/health failed 3 times in a row while loading version 2" if how == "unhealthy" else
                     "exited while loading version 2: killed by SIGKILL (out of memory?)"), error
    first = rig.vllm.routes(1001)
    assert first.count("/resume") == 1, "the process that failed mid-load was resumed"
    assert rig.vllm.routes(1002) == list(UPDATE_ROUTES) and rig.sup.incarnation == 2


def test_a_failed_load_is_reapplied_and_the_server_resumed_only_once_it_holds_the_version(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        before = len(rig.vllm.routes())
        rig.vllm.faults["/update_weights"] = "fail_once"
        await rig.publish(2)
        await serving(rig, 2, nth=2)
        await rig.stop()
        return rig, rig.vllm.routes()[before:]

    rig, routes = run(scenario())
    assert routes == ["/pause", "/start_weight_update", "/update_weights",  # failed: never resumed as it is
                      "/start_weight_update", "/update_weights", "/finish_weight_update", "/weight_info",
                      "/reset_prefix_cache", "/resume", "/v1/models", "/v1/completions"]
    assert rig.updater.verified == [2], "the mirror copy is re-checked before the second attempt"
    assert rig.sup.incarnation == 1 and rig.failures("load") == 1
    assert "loading version 2 failed" not in (rig.sup.last_error or "")


def test_a_load_that_keeps_failing_restarts_the_server_which_loads_it_before_serving(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        before = len(rig.vllm.routes())
        rig.vllm.faults["/update_weights"] = "fail"
        rig.vllm.at_spawn.append(lambda child: rig.vllm.faults.clear())
        await rig.publish(2)
        await rig.arrows.reach(S.BACKOFF)
        in_backoff = rig.sup.snapshot()
        await serving(rig, 2, nth=2)
        await rig.stop()
        return rig, rig.vllm.routes(1001)[before:], in_backoff

    rig, routes, in_backoff = run(scenario())
    assert routes == ["/pause", "/start_weight_update", "/update_weights", "/start_weight_update",
                      "/update_weights"], "update.max_reapply=1: two attempts, never resumed"
    assert (S.UPDATING, S.BACKOFF) in rig.arrows.taken
    assert rig.sup.last_error.startswith("loading version 2 failed 2 time(s): /update_weights: HTTP 500")
    assert in_backoff.version is None, "a half-loaded server holds no version"
    assert rig.vllm.routes(1002) == list(UPDATE_ROUTES) and rig.failures("load") == 2


def test_a_failed_pause_keeps_the_version_and_retries_with_growing_delays_to_a_cap(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        rig.vllm.faults["/pause"] = "fail"
        await rig.publish(2)
        await rig.arrows.reach(S.UPDATING, 6)
        held = (rig.sup.loaded.version, rig.metric("rolloutd_server_version"), rig.sup.state)
        del rig.vllm.faults["/pause"]
        await serving(rig, 2, nth=8)
        await rig.stop()
        return rig, held

    rig, held = run(scenario())
    a = rig.arrows
    assert held[:2] == (1, 1), "the weights are untouched: it holds version 1"
    retries = a.times(S.UPDATING)
    assert gaps(retries, retries[1:]) == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0], "growing, capped at backoff_max_s"
    assert a.states.count(S.BACKOFF) == 0 and rig.sup.incarnation == 1, "a failed pause restarts nothing"
    assert rig.vllm.routes().count("/resume") == 8, "resumed on its weights after each failed pause, then once"
    assert rig.failures("pause") == 6
    assert rig.sup.last_error.startswith("pause failed: /pause: HTTP 500")
    assert "retry s0: update to version 2 again in 4.0 s (4 failed in a row)" in caplog.text


def test_a_new_target_cuts_a_retry_delay_short(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, restart={"backoff_initial_s": 30, "backoff_max_s": 30}).start()
        await serving(rig, 1)
        rig.vllm.faults["/pause"] = "fail_once"
        await rig.publish(2)
        await rig.arrows.reach(S.SERVING, 2)  # the pause failed: 30 s until the next try
        await asyncio.sleep(3)
        published = now()
        await rig.publish(3)
        await serving(rig, 3, nth=3)
        await rig.stop()
        return rig, published

    rig, published = run(scenario())
    assert rig.arrows.times(S.UPDATING)[1] == published


def test_a_version_that_fails_the_gate_is_loaded_again_then_the_server_restarted(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        rig.vllm.faults["/v1/completions"] = "nan"
        rig.vllm.at_spawn.append(lambda child: rig.vllm.faults.clear())
        await rig.publish(2)
        await serving(rig, 2, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.arrows.taken[3:6] == [(S.SERVING, S.UPDATING), (S.UPDATING, S.BACKOFF), (S.BACKOFF, S.STARTING)]
    assert rig.vllm.routes(1001).count("/v1/completions") == 1 + 2, "the first sync's gate, then two attempts"
    assert rig.failures("gate") == 2 and "failed the gate 2 time(s)" in rig.sup.last_error


# -- a bad version: refused, the last good version served again ------------------------------------------------

def refused(rig: Rig) -> list[tuple[int, str]]:
    return [(r.version, r.reason) for r in rig.sup.refusals.status()]


def test_a_canary_the_server_cannot_score_refuses_the_version_at_once_and_the_server_serves_the_last_good_one(
        tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True)
        discarded = []  # the daemon's: the refused version's mirror copy removed once nobody holds it

        async def discard(target):
            discarded.append((target.version, rig.sup.loaded.version))
        rig.sup.refusals = Refusals(rig.metrics, discard=discard)
        rig.start()
        await serving(rig, 1)
        rig.vllm.bad_versions["2"] = "refuse"
        await rig.publish(2)
        await serving(rig, 1, nth=2)
        seen = (refused(rig), rig.sup.snapshot(), list(rig.vllm.loaded))
        assert discarded == [(2, 1)], "discarded once the server is back on version 1"
        await rig.publish(3)
        await serving(rig, 3, nth=3)
        await rig.stop()
        return rig, seen

    rig, (refusals, snap, loads) = run(scenario())
    assert loads == ["1", "2", "1"], "version 2 loaded once (never re-applied nor re-hashed), then 1 again"
    assert rig.sup.incarnation == 1 and S.BACKOFF not in rig.arrows.states, "no restart"
    assert [v for v, _ in refusals] == [2] and "cannot score the canary" in refusals[0][1], refusals
    assert "HTTP 400" in refusals[0][1]
    assert (snap.state, snap.version, snap.target, snap.last_good) == ("SERVING", 1, 1, 1)
    assert rig.failures("gate") == 1 and rig.sup.failures == 0
    assert rig.vllm.loaded[-1] == "3" and rig.sup.good == rig.version(3), "the next version is taken as usual"
    assert rig.metrics.registry.get_sample_value("rolloutd_versions_refused_total") == 1
    assert rig.metrics.registry.get_sample_value("rolloutd_refused_version") == 2


def test_a_canary_whose_tolerance_would_pass_anything_is_refused_without_scoring(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True).start()
        await serving(rig, 1)
        wide = CANARY.model_copy(update={"tolerance": 50.0})  # from a registry that did not check it
        await rig.updater.publish(mirror_version(tmp_path / "mirror", 2, canary=wide))
        await serving(rig, 1, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.vllm.loaded == ["1", "2", "1"] and rig.vllm.routes(1001).count("/v1/completions") == 2
    assert "tolerance 50 is above 1 nats" in refused(rig)[0][1]


def test_a_version_failing_its_gate_gets_one_restart_then_is_refused_and_never_makes_the_server_fatal(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True, restart={"max_retries": 0}).start()
        await serving(rig, 1)
        rig.vllm.bad_versions["2"] = "wrong"  # in every process: the version, not the server
        await rig.publish(2)
        await serving(rig, 1, nth=2)
        held = (rig.sup.state, rig.sup.incarnation, refused(rig), list(rig.vllm.loaded))
        await rig.publish(3)
        await serving(rig, 3, nth=3)
        await rig.stop()
        return rig, held

    rig, (state, incarnation, refusals, loads) = run(scenario())
    assert S.FATAL not in rig.arrows.states and state is S.SERVING
    assert incarnation == 2 and rig.arrows.states.count(S.BACKOFF) == 1, "one restart, for the version"
    # the update and its re-apply; in the new process the sync and its re-apply; then version 1 again
    assert loads == ["1", "2", "2", "2", "2", "1"] and rig.failures("gate") == 4
    assert [v for v, _ in refusals] == [2] and "failed the gate 2 time(s): gate: canary mismatch" in refusals[0][1]
    assert rig.sup.failures == 0, "a restart for a version's failure is not the server failing"
    assert rig.vllm.loaded[-1] == "3"


def test_a_refused_version_with_no_good_version_before_it_restarts_the_server_on_its_start_model(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, version=None, canary=True).start()
        await serving(rig, None)
        rig.vllm.bad_versions["2"] = "refuse"
        await rig.publish(2)
        await serving(rig, None, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.sup.incarnation == 2 and rig.vllm.loaded == ["2"], "the second process holds its start model"
    assert rig.vllm.routes(1002) == ["/v1/models", "/v1/completions"], "its start model gets the probe"
    assert refused(rig)[0][0] == 2
    assert rig.sup.failures == 0 and rig.sup.snapshot().version is None


def test_a_last_good_version_that_cannot_be_loaded_again_leaves_the_start_model(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True).start()
        await serving(rig, 1)
        rig.vllm.bad_versions.update({"2": "refuse", "1": "load"})  # version 1 is gone from the mirror, say
        await rig.publish(2)
        await serving(rig, None, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert [v for v, _ in refused(rig)] == [2], "the version that failed is refused, not the last good one"
    assert rig.sup.good is None and rig.sup.incarnation == 2
    assert rig.vllm.routes(1002) == ["/v1/models", "/v1/completions"]
    assert rig.sup.last_error.startswith("loading version 1 again (refused version 2) failed"), rig.sup.last_error
    assert rig.sup.failures == 1, "a server that cannot load a version it held counts as failing"


def test_a_server_whose_start_model_fails_the_probe_too_is_broken_and_ends_fatal(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, version=None, restart={"max_retries": 1}).start()
        await serving(rig, None)
        rig.vllm.faults["/v1/completions"] = "nan"  # in every process, whatever it holds
        await rig.publish(2)
        await rig.arrows.reach(S.FATAL)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert [v for v, _ in refused(rig)] == [2], "the version failed twice: refused"
    assert rig.sup.incarnation == 4 and "its start model fails the gate's probe too" in rig.sup.last_error
    assert rig.arrows.states.count(S.SERVING) == 1, "never served again"


def test_a_version_refused_by_one_server_is_never_loaded_by_another_waiting_for_a_slot(tmp_path):
    async def scenario():
        updater, sem, refusals = FakeUpdater(), asyncio.Semaphore(1), Refusals()
        rigs = [Rig(tmp_path, updater=updater, slots=sem, index=i, canary=True) for i in (0, 1)]
        for rig in rigs:
            rig.sup.refusals = refusals  # the node's, shared
            rig.vllm.bad_versions["2"] = "refuse"
            rig.start()
        await updater.publish(rigs[0].version(1))
        for rig in rigs:
            await serving(rig, 1)
        await updater.publish(rigs[0].version(2))
        await until(lambda: refusals.status() and all(r.sup.state is S.SERVING for r in rigs), 10, "refused")
        await asyncio.sleep(30)
        held = [r.sup.loaded.version for r in rigs]
        for rig in rigs:
            await rig.stop()
        return rigs, refusals, held

    rigs, refusals, held = run(scenario())
    assert sorted(r.vllm.loaded.count("2") for r in rigs) == [0, 1], "loaded by the first server only"
    assert [r.version for r in refusals.status()] == [2] and held == [1, 1]


async def refused_on_the_node(tmp_path: Path, late: dict[str, str]) -> tuple[Rig, Rig]:
    """Server 0 serves version 1 and refuses version 2; then server 1 starts, with no good version
    of its own (``late``: its fake vLLM's bad versions)."""
    updater, refusals = FakeUpdater(), Refusals()
    first, late_one = (Rig(tmp_path, updater=updater, index=i, canary=True) for i in (0, 1))
    for rig in (first, late_one):
        rig.sup.refusals = refusals  # the node's, shared
    first.vllm.bad_versions["2"] = "refuse"
    late_one.vllm.bad_versions.update(late)
    first.start()
    await updater.publish(first.version(1))
    await serving(first, 1)
    await updater.publish(first.version(2))
    await serving(first, 1, nth=2)
    assert [r.version for r in refusals.status()] == [2] and refusals.last_good == first.version(1)
    late_one.start()
    return first, late_one


def test_a_server_starting_while_the_newest_version_is_refused_serves_the_nodes_last_good_version(tmp_path):
    """Not its start model: the node would serve two policies, one of them older than any version
    it served, because one server restarted between a refusal and the next version."""
    async def scenario():
        first, late = await refused_on_the_node(tmp_path, {"2": "refuse"})
        await serving(late, 1)  # fails if it serves its start model
        snap = late.sup.snapshot()
        await late.updater.publish(first.version(3))
        for rig in (first, late):
            await serving(rig, 3, nth=3 if rig is first else 2)
            await rig.stop()
        return first, late, snap

    first, late, snap = run(scenario())
    assert late.vllm.loaded == ["1", "3"], "version 2 never loaded there; the node's last good one, then the next"
    assert (snap.state, snap.version, snap.target, snap.last_good) == ("SERVING", 1, 1, 1)
    assert late.sup.incarnation == 1 and S.BACKOFF not in late.arrows.states, "no restart"
    assert late.sup.refusals.last_good == first.version(3)


def test_a_server_that_cannot_load_the_nodes_last_good_version_serves_its_start_model_without_looping(tmp_path):
    async def scenario():
        first, late = await refused_on_the_node(tmp_path, {"1": "load"})
        await serving(late, None)
        await asyncio.sleep(60)  # long enough for any restart loop to show
        await first.stop()
        await late.stop()
        return late

    late = run(scenario())
    assert late.vllm.loaded == [] and "/update_weights" in late.vllm.routes(1001)
    assert late.sup.incarnation == 2 and late.arrows.states.count(S.SERVING) == 1
    assert late.vllm.routes(1002) == ["/v1/models", "/v1/completions"], "no load tried again; the probe"
    assert late.sup.last_error.startswith("loading version 1 again (version 2 is refused on this node) failed")


def test_a_step_the_version_plays_no_part_in_is_the_servers_failure_never_a_refusal(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True, restart={"max_retries": 1}).start()
        await serving(rig, 1)
        rig.vllm.faults["/weight_info"] = "fail"  # in every process: a broken server
        await rig.publish(2)
        await rig.arrows.reach(S.FATAL)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert refused(rig) == [] and rig.sup.incarnation == 2 and rig.failures("check") == 2


def fake_routes_behind_a_prefix(vllm: FakeVllm, prefix: str = "/engine") -> None:
    """The fake's errors name its routes under ``prefix`` (a vLLM mounted behind a path, a route
    renamed): the step that failed is the one the daemon ran, not a route it recognises."""
    def behind(step):
        async def call(*args, **kw):
            try:
                return await step(*args, **kw)
            except VllmError as e:
                raise VllmError(prefix + e.route, str(e), status=e.status, timed_out=e.timed_out) from None
        return call

    for name in ("start_weight_update", "update_weights", "finish_weight_update", "served_model", "prompt_logprobs"):
        setattr(vllm, name, behind(getattr(vllm, name)))


def test_a_failed_load_step_is_counted_as_the_step_that_ran_whatever_route_its_error_names(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        fake_routes_behind_a_prefix(rig.vllm)
        await serving(rig, 1)
        rig.vllm.faults["/start_weight_update"] = "fail_once"
        await rig.publish(2)
        await serving(rig, 2, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert (rig.failures("start"), rig.failures("load")) == (1, 0)
    assert rig.sup.incarnation == 1, "re-applied, not restarted"


def test_a_version_failing_its_load_in_every_process_is_refused_whatever_route_its_error_names(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, restart={"max_retries": 0}).start()
        fake_routes_behind_a_prefix(rig.vllm)
        await serving(rig, 1)
        rig.vllm.bad_versions["2"] = "load"  # in every process: the version's bytes, maybe
        await rig.publish(2)
        await serving(rig, 1, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert [v for v, _ in refused(rig)] == [2] and "/engine/update_weights" in refused(rig)[0][1]
    assert S.FATAL not in rig.arrows.states and rig.failures("load") == 4


def test_a_canary_the_server_refuses_to_score_is_the_version_s_fault_whatever_route_its_error_names(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True).start()
        fake_routes_behind_a_prefix(rig.vllm)
        await serving(rig, 1)
        rig.vllm.bad_versions["2"] = "refuse"  # the scoring request answered 400
        await rig.publish(2)
        await serving(rig, 1, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert [v for v, _ in refused(rig)] == [2] and "cannot score the canary" in refused(rig)[0][1]
    assert rig.sup.incarnation == 1 and rig.vllm.loaded == ["1", "2", "1"], "refused at once: no re-apply, no restart"


def test_a_process_that_dies_twice_loading_the_same_version_refuses_it(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, canary=True, restart={"max_retries": 1}).start()
        await serving(rig, 1)
        rig.vllm.bad_versions["2"] = "die"
        await rig.publish(2)
        await serving(rig, 1, nth=2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert S.FATAL not in rig.arrows.states and rig.sup.incarnation == 3
    assert [v for v, _ in refused(rig)] == [2] and "failed twice while loading it" in refused(rig)[0][1]
    assert rig.vllm.loaded == ["1", "1"], "the third process loads the last good version"


# -- stops, restarts, reloads ----------------------------------------------------------------------------------

@pytest.mark.parametrize("state", [S.STARTING, S.SYNCING, S.UPDATING, S.BACKOFF], ids=lambda s: s.name)
def test_a_stop_from_any_state_ends_the_process_and_the_run(tmp_path, state):
    rig = run(hold(state)(tmp_path))
    assert rig.arrows.taken[-2:] == [(state, S.STOPPING), (S.STOPPING, S.STOPPED)]
    child = rig.vllm.children[-1]
    assert child.grace == (5.0 if state is S.BACKOFF else 20.0), "stopped with the grace of why it stopped"
    assert rig.arrows.times(S.STOPPED)[0] == rig.stopped_at, "a process that takes SIGTERM ends at once"
    assert rig.sup.snapshot().pid is None and rig.vllm.closed == 1


def test_a_stop_of_a_server_that_ignores_sigterm_waits_server_grace_s_then_kills(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        rig.vllm.ignores_term = True
        t0 = now()
        await rig.stop()
        return rig, now() - t0

    rig, took = run(scenario())
    assert took == 20.0 and rig.vllm.child.describe_exit() == "killed by SIGKILL"


def test_a_stop_that_fails_as_the_daemon_stops_kills_the_group_and_ends_the_run(tmp_path, caplog):
    """The daemon's stop cancels the supervisor; if the ordered stop of its processes raises, the
    group still gets SIGKILL and the cancellation goes on (an error instead would have the crash
    policy start the server again while the daemon stops)."""
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        rig.vllm.stop_error = "a look at its processes failed"
        rig.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rig.task
        return rig

    rig = run(scenario())
    child = rig.vllm.children[-1]
    assert not child.running and child.describe_exit() == "killed by SIGKILL"
    assert rig.sup.state is S.STOPPED and "stop s0" in caplog.text


def test_a_restart_of_a_fatal_server_goes_through_stopped_and_counts_afresh(tmp_path):
    async def scenario():
        rig = Rig(tmp_path, restart={"max_retries": 1})
        rig.vllm.start_s = None
        rig.start()
        await rig.arrows.reach(S.FATAL)
        await rig.stop()  # as the daemon's restart_server: cancel, forget the failures, run again
        rig.sup.reset_failures()
        rig.start()
        await rig.arrows.reach(S.FATAL, 2)
        await rig.stop()
        return rig

    rig = run(scenario())
    assert rig.arrows.states == ([S.STARTING, S.BACKOFF] * 2 + [S.FATAL, S.STOPPING, S.STOPPED]) * 2
    assert rig.sup.incarnation == 4, "the restarted server had its own max_retries"


def test_a_reload_changes_the_probes_and_backoff_of_a_running_server_without_restarting_it(tmp_path):
    async def scenario():
        rig = Rig(tmp_path).start()
        await serving(rig, 1)
        rig.cfg = config(health={"interval_s": 2, "failures": 1}, restart={"backoff_initial_s": 7, "backoff_max_s": 7})
        await asyncio.sleep(10)
        kept = (rig.sup.incarnation, rig.sup.state)
        failed_at = now()
        rig.vllm.health_ok = False
        rig.vllm.at_spawn.append(lambda child: setattr(rig.vllm, "health_ok", True))
        await rig.arrows.reach(S.STARTING, 2)
        await rig.stop()
        return rig, kept, failed_at

    rig, kept, failed_at = run(scenario())
    a = rig.arrows
    assert kept == (1, S.SERVING), "a reload of the policy restarts nothing"
    assert a.times(S.BACKOFF)[0] - failed_at <= 2.0, "health.failures=1 at the new 2 s interval"
    assert rig.sup.last_error == "/health failed 1 times in a row"
    assert gaps(a.times(S.BACKOFF), a.times(S.STARTING)[1:]) == [7.0], "the new restart.backoff_initial_s"


def test_vllm_logs_no_line_per_request_unless_asked_and_the_operators_own_flags_win():
    """The command line a server starts with: vLLM's access log leaves out the routes answered once
    per generation request, probe or scrape; vllm.log_every_request keeps them all; an access-log
    flag of the operator's own (vllm.args or the server's args) is left alone."""
    quiet = ["--disable-access-log-for-endpoints", ",".join(QUIET_ROUTES)]

    def argv(**sections) -> list[str]:
        cfg = config(**sections)
        return child_argv(cfg, cfg.servers[0])

    default = argv()
    assert default[:2] == ["fake-vllm", "serve"] and default[-2:] == quiet
    assert {"/health", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"} <= set(QUIET_ROUTES)
    assert not {"/pause", "/resume", "/start_weight_update", "/update_weights"} & set(QUIET_ROUTES)
    assert "--disable-access-log-for-endpoints" not in argv(vllm={"log_every_request": True})
    own = argv(vllm={"args": ["--disable-uvicorn-access-log"]})
    assert own[-1] == "--disable-uvicorn-access-log" and "--disable-access-log-for-endpoints" not in own
    own = argv(vllm={"args": ["--log_config_file=/etc/vllm-log.json"]})  # vLLM's parser takes `_` for `-`
    assert "--disable-access-log-for-endpoints" not in own
    servers = [{"name": "s0", "model": "m", "public_port": 9001, "args": ["--disable-access-log-for-endpoints=/x"]}]
    assert argv(servers=servers).count("--disable-access-log-for-endpoints=/x") == 1
    assert "--disable-access-log-for-endpoints" not in argv(servers=servers)


def test_each_worker_of_a_server_gets_its_own_cores():
    """With cpus, every worker's threads are bound to their own share of them (vLLM's CPU build
    binds all of a server's workers to the same cores by default); an operator's own binding in
    env wins, and so does its absence without cpus."""
    servers = [{"name": "s0", "model": "m", "public_port": 9001, "cpus": [2, 3], "args": ["-tp", "2"]},
               {"name": "s1", "model": "m", "public_port": 9002, "cpus": [0, 1]},
               {"name": "s2", "model": "m", "public_port": 9003, "args": ["-tp", "2"]},
               {"name": "s3", "model": "m", "public_port": 9004, "cpus": [0, 1], "args": ["-tp", "2"],
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}]
    cfg = config(servers=servers)
    binds = [child_environ(cfg, s, Path("/p"), base={"VLLM_CPU_OMP_THREADS_BIND": "daemon's"}).get(
        "VLLM_CPU_OMP_THREADS_BIND") for s in cfg.servers]
    assert binds == ["2|3", "0,1", "daemon's", "nobind"]


def test_every_server_keeps_torchs_compile_cache_in_the_state_dir_unless_its_env_says_otherwise():
    """torch's compile cache defaults to TMPDIR, which is each server's own scratch directory,
    removed at its stop: without a cache of its own every start would compile again."""
    servers = [{"name": "s0", "model": "m", "public_port": 9001},
               {"name": "s1", "model": "m", "public_port": 9002, "env": {"TORCHINDUCTOR_CACHE_DIR": "/c/s1"}}]
    cfg = config(servers=servers)
    dirs = [child_environ(cfg, s, Path("/p"), base={}).get("TORCHINDUCTOR_CACHE_DIR") for s in cfg.servers]
    assert dirs == [str(cfg.state_dir / "compile-cache"), "/c/s1"]
    assert cfg.scratch_dir not in Path(dirs[0]).parents
