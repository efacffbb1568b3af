"""Applying the node's target version to one running server.

The sequence, each phase under its own timeout (``update.*_timeout_s``)::

    pause (mode) -> start_weight_update -> update_weights -> finish_weight_update(label)
                 -> check /weight_info == label -> resume -> gate

The gate (:mod:`rolloutd.rollout.gate`) scores the version's canary, or a probe, on the resumed server
while the supervisor still holds it out of traffic (UPDATING or SYNCING). A server that fails it
is an update failure (``update_failures_total{kind="gate"}``): the whole load is applied again
(pause -> ... -> gate) up to ``update.max_reapply`` times, then :class:`ApplyFailed` with
``restart=True``; it is never reported SERVING with a failing gate.

A gate failure that is the version's fault for certain (:attr:`GateFailed.version_fault`: a
canary the server cannot score) is not applied again: :class:`ApplyFailed` with
``version_fault`` at once, and the supervisor refuses the version (it never re-hashes or
reloads a version for an answer that cannot change).

A failure before ``start_weight_update`` leaves the server's weights untouched: it is resumed
and the error reported. So does a refusal by the plugin before it touched the model, whatever
the step: this server cannot reload in place, or this version lacks tensors of the served model.
The same answer would come at every attempt: the server is resumed on the weights it holds and
:class:`ApplyFailed` says ``refused``; the supervisor refuses the version, no restart.

Any other failure from ``start_weight_update`` on may leave a half-loaded model: the server is
**never resumed** as it is. The load is re-applied (start → update → finish)
up to ``update.max_reapply`` times, after the mirror copy was re-checked (``verify``); if it
still fails, :class:`ApplyFailed` with ``restart=True`` tells the supervisor to restart the
server, which then loads the target during its sync, before it is reported as serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rolloutd.config import Update
from rolloutd.metrics import Metrics
from rolloutd.rollout.gate import GateFailed, GateResult, read_canary, run_gate
from rolloutd.rollout.updater import Target
from rolloutd.rollout.vllm_http import VllmClient, VllmError
from rolloutd.wire.status import LastUpdate

log = logging.getLogger("rolloutd.rollout.apply")

# With pause_mode abort, how long the answers of the requests vLLM aborted may take to begin:
# one not begun by then was queued by the paused engine, not aborted, and is taken back.
RECALL_GRACE_S = 1.0


class ApplyFailed(Exception):
    """``restart``: the server may hold weights it must never serve (half-loaded, or failing the
    gate). Whose fault, by the step that failed: ``version_fault``, the version's for certain (a
    canary the server cannot score: neither loading it again nor a restart can help);
    ``maybe_version``, the version's or the server's (its bytes loaded, ``/update_weights``, or
    its gate, answered); neither, the server's (pause, start, finish, check, resume: steps the
    version's bytes play no part in; or no answer in time). ``refused``: the plugin refused the
    version before touching the model (this server cannot reload in place, or the version lacks
    tensors of the served model), and the server is resumed on what it holds: the version is
    refused, the server serves on."""

    def __init__(self, message: str, *, restart: bool, version_fault: bool = False, maybe_version: bool = False,
                 refused: bool = False):
        super().__init__(message)
        self.restart, self.version_fault, self.refused = restart, version_fault, refused
        self.maybe_version = maybe_version or version_fault


@dataclass
class UpdateRecord:
    """The last update of one server, for status and heartbeats."""

    version: int
    ok: bool = False
    at_unix: float = field(default_factory=time.time)
    phases_s: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    gate: GateResult | None = None  # the last gate run for this update

    def status(self) -> LastUpdate:
        return LastUpdate(version=self.version, ok=self.ok, at_unix=self.at_unix,
                          phases_s={k: round(v, 4) for k, v in self.phases_s.items()}, error=self.error,
                          gate=self.gate.status() if self.gate else None)


class Applier:
    """Runs the update sequence on one server, timing each phase."""

    def __init__(self, name: str, vllm: VllmClient, policy: Update, metrics: Metrics, *,
                 verify: Callable[[Target], Awaitable[Target]],
                 quiet: Callable[[float], Awaitable[bool]] | None = None,
                 recall: Callable[[float], Awaitable[int]] | None = None, engines: int = 1):
        self.name, self.vllm, self.policy, self.metrics = name, vllm, policy, metrics
        self.engines = engines  # the server's data-parallel engines: the gate scores each
        self._verify = verify
        self._quiet = quiet  # the gateway's: no request of it still unanswered by vLLM
        self._recall = recall  # the gateway's: take back requests vLLM has not begun to answer

    async def apply(self, target: Target, record: UpdateRecord) -> Target:
        """Load ``target``; returns the target actually loaded (a re-pulled copy, possibly).
        Returns only once the server holds it, resumed, and passed the gate."""
        p = self.policy
        attempts = 1 + p.max_reapply
        paused_s = 0.0
        for attempt in range(1, attempts + 1):
            started = time.perf_counter()
            if p.pause_mode == "wait" and self._quiet is not None and not await self._quiet(p.pause_timeout_s):
                log.warning("apply %s: requests sent before the update still unanswered after %g s; pausing "
                            "anyway", self.name, p.pause_timeout_s)
            try:
                await self._phase(record, "pause", self.vllm.pause(p.pause_mode, p.pause_timeout_s,
                                                                   clear_cache=not p.keep_kv_cache))
            except VllmError as e:
                self._failed("pause", e)
                if attempt > 1:  # it runs weights that failed the gate: never serve them
                    raise ApplyFailed(f"pause failed before loading version {target.version} again: {e}",
                                      restart=True) from None
                record.error = f"pause failed: {e}"
                log.error("apply %s: version %d: %s; resuming it on the weights it holds", self.name,
                          target.version, record.error)
                await self._resume_untouched(record)
                raise ApplyFailed(f"pause failed: {e}", restart=False) from None
            if p.pause_mode == "abort" and self._recall is not None:
                if taken := await self._recall(min(RECALL_GRACE_S, p.pause_timeout_s)):
                    log.warning("apply %s: %d request(s) reached vLLM as it paused and were not begun; taken "
                                "back, to be sent again after the update", self.name, taken)
            target = await self._load(target, record)
            try:
                await self._phase(record, "check", self._check(target))
            except (VllmError, ApplyFailed) as e:
                self._failed("check", e)
                raise ApplyFailed(f"checking the loaded version failed: {e}", restart=True) from None
            if not p.keep_kv_cache:
                try:  # the prefix cache, and the KV of requests frozen by "keep", hold the old weights' work
                    await self._phase(record, "resume", self.vllm.drop_kv_cache(p.resume_timeout_s))
                except VllmError as e:
                    self._failed("resume", e)
                    raise ApplyFailed(f"dropping the KV cache of the old weights failed: {e}", restart=True) from None
            try:
                await self._phase(record, "resume", self.vllm.resume(p.resume_timeout_s))
            except VllmError as e:
                self._failed("resume", e)
                raise ApplyFailed(f"resume failed after loading version {target.version}: {e}",
                                  restart=True) from None
            paused_s += time.perf_counter() - started
            record.phases_s["paused"] = paused_s
            try:
                await self._phase(record, "gate", self._gate(target, record))
            except GateFailed as e:
                self.metrics.update_failures.labels(kind="gate").inc()
                if e.version_fault:  # the same answer at every attempt: not loaded again, never served
                    record.error = str(e)
                    log.error("gate %s: version %d failed: %s; held out of traffic", self.name, target.version, e)
                    raise ApplyFailed(f"version {target.version} failed the gate: {e}", restart=True,
                                      version_fault=True) from None
                target = await self._again(target, record, e, attempt, attempts, step="gate",
                                           failed=f"version {target.version} failed the gate",
                                           meanwhile="held out of traffic", maybe_version=not e.no_answer)
                continue
            self.metrics.pause_seconds.labels(server=self.name).observe(paused_s)
            record.ok = True
            return target
        raise AssertionError("unreachable")

    async def _gate(self, target: Target, record: UpdateRecord) -> None:
        """Score the version's canary (or the probe) on the resumed server; GateFailed if it fails."""
        gauge = self.metrics.gate_max_abs_dlogprob.labels(server=self.name)
        try:
            canary = await asyncio.to_thread(read_canary, target.path, target.digest)
        except (OSError, ValueError) as e:
            record.gate = GateResult(canary=False, error=f"gate: the version's manifest is unreadable: {e}")
            gauge.set(math.nan)
            raise GateFailed(record.gate.error, record.gate) from None
        try:
            record.gate = await run_gate(self.vllm, canary, self.policy.finish_timeout_s, engines=self.engines)
        except GateFailed as e:
            record.gate = e.result
            raise
        finally:
            figure = record.gate.max_abs_dlogprob if record.gate else None
            gauge.set(math.nan if figure is None else figure)
        log.info("gate %s: version %d passed (%s%s)", self.name, target.version,
                 f"canary, max |dlogprob| {record.gate.max_abs_dlogprob:.3g} <= {record.gate.tolerance:g}"
                 if record.gate.canary else "probe only: the version has no canary",
                 f"; each of {self.engines} data-parallel engines" if self.engines > 1 else "")

    async def _load(self, target: Target, record: UpdateRecord) -> Target:
        """start → update → finish, re-applied after a failure; never returns half-loaded."""
        attempts = 1 + self.policy.max_reapply
        for attempt in range(1, attempts + 1):
            if (failed := await self._load_once(target, record)) is None:
                return target
            step, e = failed
            self._failed(step, e)
            if e.untouched:  # the same answer at every attempt, and nothing touched
                await self._refused(target, record, e)
            target = await self._again(target, record, e, attempt, attempts, step="apply",
                                       failed=f"loading version {target.version} failed",
                                       meanwhile="the server stays paused",
                                       maybe_version=step == "load" and not e.timed_out)
        raise AssertionError("unreachable")

    async def _load_once(self, target: Target, record: UpdateRecord) -> tuple[str, VllmError] | None:
        """start → update → finish once; None, or the step that failed (the one this ran, whatever
        route the error names) and its error."""
        p = self.policy
        steps = (("start", lambda: self.vllm.start_weight_update(p.start_timeout_s)),
                 ("load", lambda: self.vllm.update_weights(target.update_info(), p.load_timeout_s)),
                 ("finish", lambda: self.vllm.finish_weight_update(str(target.version), p.finish_timeout_s)))
        for step, call in steps:
            try:
                await self._phase(record, step, call())
            except VllmError as e:
                return step, e
        return None

    async def _again(self, target: Target, record: UpdateRecord, error: Exception, attempt: int, attempts: int, *,
                     step: str, failed: str, meanwhile: str, maybe_version: bool) -> Target:
        """After a failed attempt: recorded and logged; after the last one, ApplyFailed (restart);
        else the target for the next attempt, its mirror copy re-checked (pulled again if damaged)."""
        record.error = f"{error} (attempt {attempt} of {attempts})"
        log.error("%s %s: version %d failed: %s; %s", step, self.name, target.version, record.error, meanwhile)
        if attempt == attempts:
            raise ApplyFailed(f"{failed} {attempts} time(s): {error}", restart=True,
                              maybe_version=maybe_version) from None
        try:
            return await self._verify(target)
        except Exception as e:  # noqa: BLE001 - any failure to re-pull ends in a restart
            raise ApplyFailed(f"version {target.version} could not be re-checked or pulled again: {e}",
                              restart=True) from None

    async def _check(self, target: Target) -> None:
        label = await self.vllm.weight_version(self.policy.finish_timeout_s)
        if label != str(target.version):
            raise ApplyFailed(f"/weight_info says {label!r} after loading version {target.version}", restart=True)

    async def _refused(self, target: Target, record: UpdateRecord, error: VllmError) -> None:
        """The plugin refused before touching the model: resume the server on the weights it
        holds, and say so (ApplyFailed ``refused``); a resume that fails leaves it paused: a restart."""
        why = ("this server cannot load versions in place" if error.reload_unsupported
               else f"the plugin refused version {target.version}")
        record.error = str(error)
        log.error("apply %s: %s: %s; resuming it on the weights it holds", self.name, why, error)
        try:
            await self.vllm.resume(self.policy.resume_timeout_s)
        except VllmError as e:
            self._failed("resume", e)
            raise ApplyFailed(f"resume after a refused load failed: {e}", restart=True) from None
        raise ApplyFailed(f"{why}: {error}", restart=False, refused=True)

    async def _resume_untouched(self, record: UpdateRecord) -> None:
        try:
            await self.vllm.resume(self.policy.resume_timeout_s)
        except VllmError as e:
            self._failed("resume", e)
            record.error = f"resume after a failed pause: {e}"

    def _failed(self, kind: str, error: Exception) -> None:
        """Count a failed step; a step that got no answer in time counts as ``timeout``."""
        timed_out = isinstance(error, VllmError) and error.timed_out
        self.metrics.update_failures.labels(kind="timeout" if timed_out else kind).inc()

    async def _phase(self, record: UpdateRecord, name: str, step: Awaitable) -> None:
        t0 = time.perf_counter()
        try:
            await step
        finally:
            seconds = time.perf_counter() - t0
            record.phases_s[name] = record.phases_s.get(name, 0.0) + seconds
            self.metrics.update_phase_seconds.labels(phase=name).observe(seconds)
