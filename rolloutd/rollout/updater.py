"""The node's update loop: watch the registry, decide, pull once per node, publish the target.

Contract:

- One :class:`Updater` per node. It long-polls the registry for a version newer than the
  newest it has seen, and decides with :func:`decide` (newest, ``min_version_lag``,
  ``max_update_delay_s``, the trainer's demand, a person's "update now").
- When it decides to move, it pulls ``"latest"`` (the registry leases the newest live version
  atomically, so a version retired between the decision and the lease is simply skipped) into
  the mirror while every server keeps generating, then publishes the result as the node's
  :class:`Target`. Servers wait on :meth:`Updater.next_target` and apply it themselves.
- A registry that restarted (its ``instance`` changed) is resynchronised: numbers from the old
  instance mean nothing, so the node moves to the new instance's newest version whatever its
  number. The mirror is told which instance the node follows (:meth:`Mirror.follow`) and which
  instance each copy is the node's for (:meth:`Mirror.claim`): its "newest" is that
  instance's. Targets are compared by version, digest and mirror copy, never by number alone:
  the digest names the bytes, so the same copy reused for a new instance is not loaded again,
  while a copy pulled again (the last one was damaged) is a new target that every server loads.
- The registry unreachable, or a pull failing: the servers keep serving what they hold; the
  loop retries with a growing delay (``registry.retry_initial_s`` .. ``retry_max_s``). Unreachable
  before the first decision (a restart during an outage): servers wait in SYNCING, unless
  ``update.serve_mirror_when_registry_down``, which makes the newest version of the registry
  instance the node followed last the target, once its copy is read back and checked chunk by
  chunk (from no registry instance: the registry's newest replaces it once it answers).
- :meth:`verify` re-checks a target's mirror copy chunk by chunk when a server failed to load
  it; a damaged copy is removed and pulled again, unless the node's target has moved on
  meanwhile: then the server is given the new target, and the node's target never goes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rolloutd.config import Config
from rolloutd.metrics import Metrics
from rolloutd.rollout.fetch_pool import cpu_times
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.puller import Puller, PullError, PullProgress, PullResult, PullSettings, PullState
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.swarm import Swarm
from rolloutd.wire import errors
from rolloutd.wire.messages import HeartbeatReply, LatestInfo
from rolloutd.wire.status import RegistryStatus

log = logging.getLogger("rolloutd.rollout.updater")
PROGRESS_EVERY_S = 10  # a long pull logs its progress this often


@dataclass(frozen=True)
class Target:
    """A version complete in the mirror, that every server on the node should hold."""

    version: int
    digest: str
    path: Path
    instance: str | None = field(compare=False)  # the registry's that named it; None: the mirror's own
    copy: str | None = None  # the mirror copy's id (Mirror.record): a copy pulled again is a new target

    def update_info(self) -> dict:
        return {"path": str(self.path), "digest": self.digest}


@dataclass(frozen=True)
class Decision:
    update: bool
    reason: str
    wake_in_s: float | None = None  # look again this soon even if nothing changes


def decide(*, newest: int | None, held: int | None, pending_s: float, demand: int | None, asked: bool,
           min_version_lag: int, max_update_delay_s: float) -> Decision:
    """Whether the node should move to the registry's newest version now.

    ``held`` is the version the node's target holds (None: nothing from this registry yet);
    ``pending_s`` how long a version newer than ``held`` has been known.
    """
    if newest is None:
        return Decision(False, "nothing published")
    if held is not None and newest <= held:
        return Decision(False, f"version {held} is the newest")
    if held is None:
        return Decision(True, f"version {newest} is the newest and nothing is loaded from this registry")
    if asked:
        return Decision(True, "an update was asked for")
    if demand is not None and demand > held:
        return Decision(True, f"the trainer demands version {demand} or newer")
    if newest - held >= min_version_lag:
        return Decision(True, f"version {newest} is {newest - held} ahead of {held}")
    if pending_s >= max_update_delay_s:
        return Decision(True, f"version {newest} has waited {pending_s:.0f} s")
    return Decision(False, f"version {newest} is {newest - held} ahead (lag {min_version_lag}); "
                    f"waiting up to {max_update_delay_s - pending_s:.0f} s more",
                    wake_in_s=max_update_delay_s - pending_s)


@dataclass
class RegistryView:
    """What the node knows about the registry, for status and decisions."""

    url: str
    reachable: bool = False
    instance: str | None = None
    latest: int | None = None
    demand: int | None = None
    last_error: str | None = None
    last_contact: float | None = None
    contacted: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first answer

    def status(self, now: float) -> RegistryStatus:
        age = None if self.last_contact is None else round(now - self.last_contact, 3)
        return RegistryStatus(url=self.url, reachable=self.reachable, instance=self.instance, latest=self.latest,
                              demand=self.demand, last_error=self.last_error, last_contact_age_s=age)


class Updater:
    def __init__(self, conf: Callable[[], Config], client: RegistryClient, mirror: Mirror, metrics: Metrics, *,
                 in_use: Callable[[], set[int]], clock: Callable[[], float] = time.monotonic,
                 swarm: Swarm | None = None, puller: Puller | None = None):
        self._conf, self._client, self.mirror, self._metrics = conf, client, mirror, metrics
        self._in_use, self._clock = in_use, clock
        cfg = conf()
        self.registry = RegistryView(cfg.registry.url)
        # Owned here (a test may hand in a fake): closed by close(); nobody else reaches into it.
        if puller is None:
            puller = Puller(client, mirror, PullSettings.from_config(cfg), swarm=swarm, in_use=in_use,
                            on_worker_restart=metrics.pull_worker_restarts.inc)
        self._puller = puller
        self.target: Target | None = None
        self.settled = asyncio.Event()   # the first decision was made (a target, or nothing to load)
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()     # a heartbeat reply, or a person, asks to look again
        self._polling: asyncio.Timeout | None = None  # the long-poll in flight, which a wake ends
        self._verifying = asyncio.Lock()
        self._pulling = asyncio.Lock()
        self._asked = False
        self._pending_since: float | None = None
        self._no_mirror_said = False
        self.stopping = False  # the daemon stops: no pull starts, and a pull's failure is its cancellation

    # -- inputs from elsewhere ------------------------------------------------------------------
    def stop(self) -> None:
        """The daemon stops: from now on the loop starts nothing, and whatever a pull meets as
        it is cancelled ends it cancelled (never a failure to retry)."""
        self.stopping = self._puller.stopping = True

    async def close(self) -> None:
        """Stop every pull worker: those kept for a next pull, and those of a pull still running
        (the daemon calls it on every path out, and on an updater that outlived its stop bound)."""
        await self._puller.close()

    def discard_kept(self) -> None:
        """Remove what a pull cut short kept for its next try (at the ordered stop; blocking)."""
        self._puller.discard_kept()

    @property
    def progress(self) -> PullProgress | None:
        """The current or last pull, for status, metrics and heartbeats."""
        return self._puller.progress

    @property
    def kept_worker_pids(self) -> list[int]:
        """The pull workers kept idle for the next pull."""
        return self._puller.kept_worker_pids

    def poke(self, asked: bool = True) -> None:
        """Look at the registry again now (``asked``: update even below the lag threshold)."""
        self._asked = self._asked or asked
        self._wake_up()

    def note_reply(self, reply: HeartbeatReply) -> None:
        """A heartbeat reply carries the registry's newest version and the trainer's demand."""
        self._contact(reply.instance, reply.latest)
        demand = reply.demand.min_version
        if demand != self.registry.demand:
            self.registry.demand = demand
            held = self._held()
            if demand is not None and (held is None or demand > held):
                log.info("demand: the trainer asks for version %d or newer", demand)
                self._wake_up()

    def note_unreachable(self, error: str) -> None:
        self.registry.reachable, self.registry.last_error = False, error
        self._metrics.registry_reachable.set(0)

    # -- for servers ------------------------------------------------------------------------------
    async def next_target(self, held: Target | None) -> Target:
        """Wait until the node has a target other than ``held``."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.target is not None and self.target != held)
            return self.target

    async def verify(self, target: Target) -> Target:
        """Check the mirror copy of ``target`` chunk by chunk; pull it again if it is damaged.
        Returns the target to use (the same one if the copy was sound)."""
        async with self._verifying:  # several servers may fail on the same copy at once
            current = self.target
            if (current is not None and current != target and current.version == target.version
                    and current.digest == target.digest):
                return current  # another server's check already replaced the copy
            return await self._verify(target)

    async def _verify(self, target: Target) -> Target:
        problems = await asyncio.to_thread(self.mirror.damage, target.version, target.digest, recheck=True)
        if not problems:
            return target
        self._metrics.update_failures.labels(kind="mirror").inc()
        # Only that copy goes: the version's directory may hold another instance's by now.
        await asyncio.to_thread(self.mirror.remove, target.version, "damaged", digest=target.digest)
        if self.target is not None and self.target != target:  # a newer target came meanwhile
            log.warning("verify version %d: the mirror copy is damaged (%s); the node's target is version %d "
                        "now: load that instead", target.version, "; ".join(problems)[:300], self.target.version)
            return self.target
        log.warning("verify version %d: the mirror copy is damaged (%s); pulling it again",
                    target.version, "; ".join(problems)[:300])
        result = await self._pull(target.version)
        if result is None or result.digest != target.digest:
            raise PullError(f"version {target.version} could not be pulled again")
        record = await asyncio.to_thread(self.mirror.claim, result.version, result.digest, target.instance)
        fresh = Target(result.version, result.digest, result.path, target.instance, record and record.copy)
        if self.target != target:  # the node moved on during the pull: never back
            return self.target
        await self._publish(fresh)  # a new copy: every server holding the damaged one loads it again
        return fresh

    def collect(self) -> None:
        """Remove mirror versions no server holds (the target is always kept), on the mirror's
        worker thread: deleting gigabytes must not stall the loop that relays every token."""
        keep = self._in_use() | ({self.target.version} if self.target else set())
        self.mirror.collect_soon(keep, done=self._metrics.set_mirror)

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        delay = self._conf().registry.retry_initial_s
        while True:
            if self.stopping:  # a cancellation swallowed below (a library's bug) still ends the loop
                raise asyncio.CancelledError()
            try:
                info = await self._watch()
            except (errors.RegistryUnavailable, errors.RegistryError) as e:
                self._failed_contact(str(e))
                if isinstance(e, errors.RegistryUnavailable):
                    await self._serve_mirror()
                await self._sleep(delay)
                delay = min(delay * 2, self._conf().registry.retry_max_s)
                continue
            try:
                stepped = await self._step(info)
            except Exception:  # a bug here must not take the node's servers down with the daemon
                if self.stopping:  # the daemon stops: no next step, whatever this one met
                    raise asyncio.CancelledError() from None
                log.exception("crash in the update step; retrying in %g s", delay)
                self._metrics.task_errors.labels(task="updater").inc()
                stepped = False
            if stepped:
                delay = self._conf().registry.retry_initial_s
                continue
            await self._sleep(delay)
            delay = min(delay * 2, self._conf().registry.retry_max_s)
            # Retry the failed step now: a long-poll would wait for a version newer than the one
            # that failed, up to registry.long_poll_s.
            self._wake.set()

    async def _watch(self) -> LatestInfo:
        """Long-poll for a version newer than the newest seen, or until poked or a deadline."""
        cfg = self._conf()
        wait_s = 0.0 if self._wake.is_set() or not self.settled.is_set() else cfg.registry.long_poll_s
        if self._pending_since is not None:  # a deferred update has a deadline of its own
            due = self._pending_since + cfg.update.max_update_delay_s - self._clock()
            wait_s = max(0.0, min(wait_s, due))
        self._wake.clear()
        after = self.registry.latest or 0
        instance = self.target.instance if self.target else self.registry.instance
        # No task of its own: a wake meanwhile (_wake_up) moves this scope's deadline to now,
        # which cancels the long-poll right here.
        self._polling = polling = asyncio.timeout(None)
        try:
            async with polling:
                info = await self._client.latest(after=after, instance=instance, wait_s=wait_s)
        except TimeoutError:
            self._polling = None  # an exited scope cannot be moved
            if not polling.expired():
                raise  # the client's own timeout, not a wake
            info = await self._client.latest(after=after, instance=instance, wait_s=0)  # ask again at once
        finally:
            self._polling = None
        self._contact(info.instance, info.version)
        return info

    def _wake_up(self) -> None:
        """Look at the registry again now: end the long-poll in flight, or the wait between tries."""
        self._wake.set()
        if self._polling is not None and not self._polling.expired():
            self._polling.reschedule(asyncio.get_running_loop().time())

    async def _serve_mirror(self) -> None:
        """No registry before the first decision: with ``update.serve_mirror_when_registry_down``,
        the target is the mirror's newest version of the registry instance the node followed
        last (:meth:`Mirror.newest`), once its copy is read back and checked chunk by chunk (as
        any copy reused from the mirror is). A damaged copy is removed; the next try takes the
        one before it."""
        if self.settled.is_set() or not self._conf().update.serve_mirror_when_registry_down:
            return
        version = await asyncio.to_thread(self.mirror.newest)
        manifest = None if version is None else await asyncio.to_thread(self.mirror.manifest, version)
        if manifest is None:
            if not self._no_mirror_said:
                self._no_mirror_said = True
                log.warning("the registry is unreachable and the mirror holds no complete version of the registry "
                            "instance followed last: servers wait for the registry")
            return
        if problems := await asyncio.to_thread(self.mirror.damage, version, manifest.digest):
            log.warning("verify version %d: the mirror copy is damaged (%s); not serving it", version,
                        "; ".join(problems)[:300])
            self._metrics.update_failures.labels(kind="mirror").inc()
            await asyncio.to_thread(self.mirror.remove, version, "damaged", digest=manifest.digest)
            return
        record = await asyncio.to_thread(self.mirror.record, version)
        log.warning("serve version %d from the mirror: the registry is unreachable at start "
                    "(update.serve_mirror_when_registry_down; the version of registry instance %s)", version,
                    record.instance)
        await self._publish(Target(version, manifest.digest, self.mirror.path(version), None, record.copy))
        self.settled.set()

    async def _step(self, info: LatestInfo) -> bool:
        """Decide and, if so, pull and publish. False when a pull failed (retry later)."""
        cfg = self._conf()
        held = self._held()
        newest = info.version
        if newest is not None and (held is None or newest > held):
            self._pending_since = self._pending_since or self._clock()
        decision = decide(newest=newest, held=held, demand=self.registry.demand, asked=self._asked,
                          pending_s=self._clock() - (self._pending_since or self._clock()),
                          min_version_lag=cfg.update.min_version_lag,
                          max_update_delay_s=cfg.update.max_update_delay_s)
        self._asked = False
        if not decision.update:
            if newest is None or (held is not None and newest <= held):
                self._pending_since = None
            self.settled.set()
            log.debug("decide: stay (%s)", decision.reason)
            return True
        log.info("decide: update (%s)", decision.reason)
        result = await self._pull("latest")
        if result is None:
            return False
        if held is None or self.target is None or result.version > held or self.target.instance != info.instance:
            # The copy is the node's for this instance now (reused or committed while the view changed).
            record = await asyncio.to_thread(self.mirror.claim, result.version, result.digest, info.instance)
            await self._publish(Target(result.version, result.digest, result.path, info.instance,
                                       record and record.copy))
        self._pending_since = None
        self.settled.set()
        return True

    async def _pull(self, version: int | str) -> PullResult | None:
        async with self._pulling:  # one pull at a time: the loop's, or a re-pull after damage
            return await self._pull_once(version)

    async def _pull_once(self, version: int | str) -> PullResult | None:
        cfg = self._conf()
        async with asyncio.TaskGroup() as tg:  # owns the rate reporter: awaited once cancelled
            rate = tg.create_task(self._report_rate(), name="pull-rate")
            try:
                async with asyncio.timeout(cfg.pull.timeout_s):
                    result = await self._puller.pull(version)
            except (PullError, TimeoutError, errors.RegistryError) as e:
                if self.stopping:  # a stop is not a failed pull to be tried again
                    raise asyncio.CancelledError() from e
                what = f"no result within pull.timeout_s={cfg.pull.timeout_s:g}" if isinstance(e, TimeoutError) else e
                # no room on the mirror's filesystem again: said at start and at the first failure
                log.log(logging.DEBUG if self._puller.no_room_again and isinstance(e, PullError) else logging.ERROR,
                        "pull %s failed: %s", version, what)
                self._metrics.pulls.labels(result="failed").inc()
                self._metrics.update_failures.labels(kind="pull").inc()
                result = None
            finally:
                rate.cancel()
                self._metrics.pull_rate.set(0)
        if result is None:
            return None
        if result.reused:
            self._metrics.pulls.labels(result="reused").inc()
        else:
            self._metrics.pulled(result.kind, result.bytes_fetched, result.seconds, result.reconstruct_s)
        return result

    async def _report_rate(self) -> None:
        """The pull's rate in the metrics every second; a progress line every PROGRESS_EVERY_S."""
        ticks = 0
        cpu: tuple[list[int], tuple[float, float]] | None = None  # the workers' CPU times at the last line
        while True:
            await asyncio.sleep(1.0)
            p = self._puller.progress
            if p is None:
                continue
            self._metrics.pull_rate.set(p.rate_bytes_per_s)
            ticks += 1
            if ticks % PROGRESS_EVERY_S == 0 and p.state is PullState.PULLING and p.bytes_total:
                eta = f"ETA {p.eta_s:.0f} s" if p.eta_s is not None else "ETA unknown"
                now = (list(p.worker_pids), cpu_times(p.worker_pids))
                starved = _starved(cpu, now, self._puller.priority)
                cpu = now
                log.info("pull version %s: %.0f%% (%.1f of %.1f MiB), %.1f MiB/s, %s%s", p.version,
                         100 * p.bytes_done / p.bytes_total, p.bytes_done / 2**20, p.bytes_total / 2**20,
                         p.rate_bytes_per_s / 2**20, eta, starved)

    async def _publish(self, target: Target) -> None:
        async with self._changed:
            self.target = target
            self._changed.notify_all()
        log.info("target version %d (digest %s...) for every server", target.version, target.digest[:12])
        self.collect()

    # -- helpers ----------------------------------------------------------------------------------
    def _held(self) -> int | None:
        """The target's version, if it came from the registry instance seen now."""
        if self.target is None or self.target.instance != self.registry.instance:
            return None
        return self.target.version

    def _contact(self, instance: str, latest: int | None) -> None:
        view = self.registry
        if view.instance is not None and instance != view.instance:
            log.warning("resync: the registry restarted (instance %s -> %s)", view.instance, instance)
            view.latest = None
            self._pending_since = None
            self._wake_up()
        if not view.reachable:
            log.info("reach registry %s (instance %s, newest version %s)", view.url, instance, latest)
        view.instance, view.reachable, view.last_error, view.latest = instance, True, None, latest
        self.mirror.follow(instance)  # its versions are the ones the mirror keeps and counts as newest
        view.last_contact = self._clock()
        view.contacted.set()
        self._metrics.registry_reachable.set(1)

    def _failed_contact(self, error: str) -> None:
        if self.registry.reachable or self.registry.last_error is None:
            log.warning("lose registry %s: %s (servers keep serving; retrying)", self.registry.url, error)
        self.note_unreachable(error)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()


def _starved(before: tuple[list[int], tuple[float, float]] | None, now: tuple[list[int], tuple[float, float]],
             priority: str) -> str:
    """What a progress line adds when the pull's workers waited for a CPU more than they ran
    since the last line (the same workers, at least a second of waiting): a pull held back by
    ``pull.cpu_priority`` on a node whose CPUs are all busy, not by its sources."""
    if before is None or before[0] != now[0] or not now[0]:
        return ""
    ran, waited = now[1][0] - before[1][0], now[1][1] - before[1][1]
    if waited < 1.0 or waited <= ran:
        return ""
    return (f"; its workers waited {waited:.1f} s for a CPU and ran {ran:.1f} s (pull.cpu_priority {priority}: "
            "the node's CPUs are busy)")
