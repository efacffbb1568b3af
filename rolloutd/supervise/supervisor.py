"""One supervised ``vllm serve``: spawn, probe, sync, serve, update, restart, stop.

:meth:`Supervisor.run` is the server's whole life, owned by the daemon's task group:

- STARTING: spawn the child (own session, in its own cgroup or process group, listening on its
  private UNIX socket, the plugin on its import path) and wait until ``/health`` passes,
  within ``restart.start_timeout_s``.
- SYNCING: wait for the node's first decision, then load the node's target version into the
  server (the same sequence as an update). Only then is it SERVING.
- SERVING: probe ``/health`` every ``health.interval_s``; ``health.failures`` failed probes in
  a row, the process exiting, or one of the processes vLLM titled (an engine, a worker:
  :meth:`Child.note_vital`) exiting, is a failure. A new node target is applied (UPDATING) once a
  rollout slot is free (``max_unavailable`` when rolling, every server at once otherwise).
  The same watch runs beside every sync and update (:meth:`Supervisor._guarded`): a server whose
  engine dies mid-load is cancelled out of the load and goes to BACKOFF within a few probes.
  An update that failed and left the server serving untouched (a failed pause) is tried again
  after a growing delay (``restart.backoff_*``), the server still watched meanwhile.
- A failure goes to BACKOFF: the process group is stopped, then the server is started again
  after a growing delay; after ``restart.max_retries`` failures in a row, FATAL (a person
  restarts it through the admin API). Serving for ``restart.stable_after_s`` resets the count.
  FATAL is for a server that cannot start or cannot hold a version it held before, never for a
  bad version:
- A version that fails on the server (its load, ``/update_weights``, or its gate, after
  ``update.max_reapply`` re-applies; a failure of any other step is the server's) is given one
  restart when the failure could be the server's (a fresh process tells a broken server from a
  bad version; this restart does not count toward FATAL), none when it is the version's for
  certain (a canary the server cannot score). If it fails again,
  the node **refuses** it (:class:`~rolloutd.rollout.refusals.Refusals`: no server of the node
  loads it again) and the server goes back to its last good version (:attr:`Supervisor.good`,
  loaded again and gated; with none of its own, the node's last good version; with neither, its
  start model, by a restart, and probed: a server whose start model fails the gate's probe too
  is broken, toward FATAL); a process that dies
  twice while loading the same version refuses it too. The next version is taken as usual. If
  the last good version cannot be loaded again, the server restarts on its start model.
- A server whose plugin refuses to load anything into it (vLLM's CPU build and mixture-of-experts
  layers: ``vllm_plugin.engine.refuse_inexact_reload``) is untouched: each version is refused at
  once, the server resumed on what it holds, never restarted for it (a new process would refuse
  the same way, and going FATAL would take a healthy server out of traffic).
- Cancelling :meth:`run` is how a server is stopped: STOPPING, TERM to all its processes, grace, KILL,
  every process reaped, STOPPED; the child is never left behind on any path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NoReturn, TypeVar

from rolloutd.config import OMP_BIND, Config
from rolloutd.config import Server as ServerConfig
from rolloutd.gateway.relay import Gateway
from rolloutd.metrics import Metrics
from rolloutd.rollout.apply import Applier, ApplyFailed, UpdateRecord
from rolloutd.rollout.gate import GateFailed, run_gate
from rolloutd.rollout.refusals import Refusals
from rolloutd.rollout.slots import RolloutSlots
from rolloutd.rollout.updater import Target, Updater
from rolloutd.rollout.vllm_http import VllmClient
from rolloutd.supervise.child import Child, ChildError
from rolloutd.supervise.containment import Containment
from rolloutd.supervise.plugin_path import child_env
from rolloutd.supervise.sockets import SocketDirError, remove_stale
from rolloutd.wire.states import Lifecycle, ServerState
from rolloutd.wire.status import ServerSnapshot

log = logging.getLogger("rolloutd.server")
S = ServerState
T = TypeVar("T")

# The daemon's own systemd and socket-activation variables must not reach vLLM.
_PRIVATE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES",
                "INVOCATION_ID", "JOURNAL_STREAM")


class ServerFailed(Exception):
    pass


# Routes left out of vLLM's access log unless vllm.log_every_request: the ones answered once per
# generation request, probe or scrape (vLLM's filter matches whole paths). Every line of it would
# reach the journal through the daemon, which also spent its loop's time forwarding it.
QUIET_ROUTES = ("/health", "/ping", "/metrics", "/load", "/version", "/v1/models", "/v1/completions",
                "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/inference/v1/generate",
                "/tokenize", "/detokenize", "/v1/score", "/v1/rerank", "/rerank", "/score", "/pooling",
                "/classify")
_ACCESS_LOG_FLAGS = ("--disable-uvicorn-access-log", "--disable-access-log-for-endpoints", "--log-config-file")


def child_argv(cfg: Config, server: ServerConfig) -> list[str]:
    extra = [*cfg.vllm.args, *server.args]
    # vLLM's parser takes `_` for `-` in long flags: `--disable_uvicorn_access_log` is the operator's too.
    quiet = [] if cfg.vllm.log_every_request or any(a.split("=", 1)[0].replace("_", "-") in _ACCESS_LOG_FLAGS
                                                    for a in extra) else [
        "--disable-access-log-for-endpoints", ",".join(QUIET_ROUTES)]
    return [*cfg.vllm.command, server.model, "--uds", str(cfg.socket_path(server.name)),
            "--weight-transfer-config", json.dumps({"backend": "rolloutd"}), "--enable-scale-out",
            *quiet, *extra]


def child_environ(cfg: Config, server: ServerConfig, plugin_dir: Path, base: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _PRIVATE_ENV}
    env.update(cfg.vllm.env)
    env.update(server.env)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cfg.compile_cache_dir))  # not in its TMPDIR, gone at its stop
    if server.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = server.cuda_visible_devices
    if (bind := cfg.omp_threads_bind(server)) is not None:  # else every worker binds to the same cores
        env[OMP_BIND] = bind
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the pause and weight routes; only rolloutd's user reaches the socket
    return child_env(env, plugin_dir)


class Supervisor:
    def __init__(self, spec: ServerConfig, conf: Callable[[], Config], updater: Updater, *,
                 slots: Callable[[], RolloutSlots], containment: Containment, plugin_dir: Path, metrics: Metrics,
                 on_state: Callable[[str, ServerState, ServerState], None] | None = None,
                 gateway: Gateway | None = None, vllm: VllmClient | None = None, refusals: Refusals | None = None,
                 make_child: Callable[..., Child] = Child, clock: Callable[[], float] = time.monotonic):
        # vllm, make_child and clock are the seams of the OS and the server: tests pass fakes and the
        # event loop's clock, to walk every arrow of the lifecycle in milliseconds.
        self.spec, self._conf, self.updater, self.gateway = spec, conf, updater, gateway
        self._slots, self._containment, self._plugin_dir, self.metrics = slots, containment, plugin_dir, metrics
        self._make_child, self._clock = make_child, clock
        self.lifecycle = Lifecycle(spec.name, on_change=self._changed, log=log, clock=clock)
        self._on_state = on_state
        self.socket = conf().socket_path(spec.name)  # state_dir is fixed for the daemon's life
        self.vllm = vllm or VllmClient(self.socket)
        self.child: Child | None = None
        self.loaded: Target | None = None       # what the running process holds (None: its start model)
        self.loading: Target | None = None      # what it is moving to
        self.incarnation = 0                    # processes started so far
        self.restarts = 0                       # restarts after a failure (not counting the first start)
        self.failures = 0                       # failed starts in a row (toward FATAL)
        self.last_error: str | None = None
        self.last_update: UpdateRecord | None = None
        self.serving_since: float | None = None
        self.refusals = refusals if refusals is not None else Refusals(metrics)  # the node's, shared
        self.good: Target | None = None         # the last version it served, gate passed (None: its start model)
        self._suspect: Target | None = None     # the version it restarted for once (module docstring)
        self._free_restart = False              # the next restart is the version's doing: not toward FATAL
        self._died_loading: Target | None = None  # what it was loading when its process failed
        self._unloadable: Target | None = None  # a last good version it failed to load again: not tried twice
        metrics.server_state.labels(server=spec.name).state(S.STOPPED.name)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state(self) -> ServerState:
        return self.lifecycle.state

    def _changed(self, name: str, old: ServerState, new: ServerState) -> None:
        self.metrics.server_state.labels(server=name).state(new.name)
        if self.gateway is not None:
            self.gateway.on_state(new)
        if self._on_state is not None:
            self._on_state(name, old, new)

    # -- the whole life -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Supervise until cancelled; cancelling stops the server (ordered, with deadlines).

        A bug outside one process's life (``_live`` turns those inside it into a restart) stops
        the server's process group, leaves the server in BACKOFF and raises: the daemon's crash
        policy counts it and calls ``run`` again after a delay, which starts a new process."""
        try:
            while True:
                error = await self._live()
                self.last_error = error
                await self._back_off(error)
        except asyncio.CancelledError:
            child = self.child  # _stop forgets it, also when it fails
            try:
                await self._stop()
            except Exception:  # the stop itself failed: the group goes all the same, and so does the task
                log.exception("stop %s", self.name)
                self._kill_anyway(child)
            raise
        except Exception as e:
            await self._crashed(e)
            raise

    async def _crashed(self, error: Exception) -> None:
        """Leave nothing running behind a crashed ``run``: no process, a state ``_live`` starts from."""
        self.last_error = f"internal error: {error!r}"[:200]
        try:
            await self._terminate(self._conf().restart.failed_grace_s)
        except Exception:  # the same bug may be in the way: the group is killed all the same
            log.exception("stop %s after a crash", self.name)
            self._kill_anyway(self.child)
        if self.state.running:
            with contextlib.suppress(Exception):
                self.lifecycle.set(S.BACKOFF, self.last_error)

    def _kill_anyway(self, child: Child | None) -> None:
        """SIGKILL to a server's group after its ordered stop failed (nothing to reap it with)."""
        if child is None:
            return
        try:
            child.kill_group(signal.SIGKILL)
        except Exception:  # the caller goes on regardless: say so, and why
            log.exception("SIGKILL %s", self.name)

    async def _live(self) -> str:
        """One process, from spawn to failure; returns what failed."""
        self.lifecycle.set(S.STARTING, f"incarnation {self.incarnation + 1}")
        try:
            await self._spawn()
            await self._wait_healthy()
            self.lifecycle.set(S.SYNCING)
            await self._guarded(self._sync())
            self.lifecycle.set(S.SERVING, f"version {self._version_text()}")
            self.serving_since = self._clock()
            await self._serve()
            raise AssertionError("_serve returns only by raising")
        except (ServerFailed, ApplyFailed, ChildError) as e:
            log.error("fail %s[%s]: %s", self.name, self.child.pid if self.child else "-", e)
            if isinstance(e, ServerFailed):
                self._died_while_loading(str(e))
            return self._failed(str(e))
        except Exception as e:  # a bug: restart this server rather than take the daemon down
            log.exception("crash while supervising %s", self.name)
            return self._failed(f"internal error: {e!r}")

    def _failed(self, error: str) -> str:
        if self.state is S.SYNCING:  # the first sync of this process did not get it serving
            self.metrics.update_failures.labels(kind="sync").inc()
        self.lifecycle.set(S.BACKOFF, error[:200])
        return error

    async def _spawn(self) -> None:
        cfg = self._conf()
        self.incarnation += 1
        self._hold(None)
        self.loading = None
        try:
            if remove_stale(self.socket):  # vLLM cannot bind a path that exists
                log.info("clean %s: removed the socket %s an earlier process left", self.name, self.socket)
        except SocketDirError as e:
            raise ServerFailed(str(e)) from None
        self.child = self._make_child(self.name, child_argv(cfg, self.spec),
                                      child_environ(cfg, self.spec, self._plugin_dir), containment=self._containment,
                                      cpus=self.spec.cpus, log=logging.getLogger(f"rolloutd.server.{self.name}"),
                                      scratch=cfg.scratch_dir)
        await self.child.spawn()
        log.info("spawn %s[%d]: socket %s, gpus %s, cpus %s, incarnation %d, in %s", self.name, self.child.pid,
                 self.socket, self.spec.cuda_visible_devices or "-", ",".join(map(str, self.spec.cpus)) or "-",
                 self.incarnation, self.child.scope)

    async def _wait_healthy(self) -> None:
        cfg = self._conf()
        deadline = self._clock() + cfg.restart.start_timeout_s
        while self._clock() < deadline:
            if not self.child.running:
                await self.child.wait()
                raise ServerFailed(f"exited before it was healthy: {self.child.describe_exit()}")
            if await self.vllm.healthy(cfg.health.timeout_s):
                up_s = self._clock() - self.child.started_at
                log.info("healthy %s[%d] after %.1f s", self.name, self.child.pid, up_s)
                await self.child.note_shm()  # its segments are set up: whatever it leaves of them goes at its end
                await asyncio.to_thread(self.child.note_vital)  # its engines and workers run by now
                return
            await asyncio.sleep(min(0.5, cfg.health.interval_s))
        raise ServerFailed(f"not healthy within restart.start_timeout_s={cfg.restart.start_timeout_s:g}")

    async def _sync(self) -> None:
        """Hold the node's target before serving (nothing to hold: serve the start model); a
        target the node refused: the last good version (none: the start model it holds)."""
        await self.updater.settled.wait()
        target = self.updater.target
        if target is None:
            return
        if self.refusals.refused(target) is None:
            await self._take(target)
        elif (good := self._fallback()) is not None:
            await self._restore(good, f"version {target.version} is refused on this node")
        else:
            await self._probe_start_model(target)

    async def _probe_start_model(self, refused: Target) -> None:
        """The start model, the last good version after a refusal, gets the gate's probe: a
        server whose start model fails it too is broken (a failure toward FATAL), whatever the
        version it refused."""
        try:
            await run_gate(self.vllm, None, self._conf().update.finish_timeout_s,
                           engines=self._conf().shape(self.spec).data)
        except GateFailed as e:
            raise ServerFailed(f"its start model fails the gate's probe too ({e}): the server, not only "
                               f"version {refused.version}, is at fault") from None

    async def _serve(self) -> None:
        retries = 0  # updates in a row that failed and left the server serving as it was
        while True:
            target = self.updater.target
            if target is None or target == self.loaded or self.refusals.refused(target) is not None:
                retries = 0
                await self._watch(target)
                continue
            if await self._guarded(self._update(target)):
                retries = 0
                continue
            retries += 1
            delay = self._retry_delay(retries)
            log.warning("retry %s: update to version %d again in %.1f s (%d failed in a row)", self.name,
                        target.version, delay, retries)
            await self._guarded(self._target_within(target, delay))

    async def _update(self, target: Target) -> bool:
        """Load ``target`` when a rollout slot is free; False: it failed, the server serves on as it was."""
        async with self._slots():
            if self.refusals.refused(target) is not None:
                return True  # another server refused it while this one waited for a slot: nothing to load
            self.lifecycle.set(S.UPDATING, f"version {self._version_text()} -> {target.version}")
            try:
                await self._take(target)
                ok = True
            except ApplyFailed as e:
                if e.restart:
                    raise
                self.last_error, ok = str(e), False  # weights untouched and resumed
            self.lifecycle.set(S.SERVING, f"version {self._version_text()}")
            return ok

    # -- a version that fails: one restart at most, then refused; back to the last good version ----------
    async def _take(self, target: Target) -> None:
        """Load the node's ``target``. A failure that may have left weights it must not serve: a
        restart (ApplyFailed), once per version unless the version is at fault for certain; the
        next one refuses the version and goes back to the last good version."""
        try:
            await self._apply(target)
            return
        except ApplyFailed as e:
            if e.refused:  # the server is untouched and resumed: refuse the version, serve on, no restart
                self._refuse(target, str(e))
                await self.refusals.discard(target)
                return
            if not e.restart:
                raise  # the weights are untouched: tried again later
            if not e.maybe_version:
                raise  # a step the version plays no part in: the server's failure
            if not e.version_fault and self._suspect != target:
                self._suspect, self._free_restart = target, True
                raise ApplyFailed(f"{e}; restarting once: a new process tells a broken server from a bad "
                                  "version", restart=True) from None
            reason = str(e)
        self._refuse(target, reason)
        await self._back(target)

    def _refuse(self, target: Target, reason: str) -> None:
        self.refusals.refuse(target, reason, self.name)
        self.last_error = f"version {target.version} refused: {reason}"[:500]

    async def _back(self, refused: Target) -> None:
        """After refusing ``refused``, whose weights the process may hold: load the last good
        version again, or restart on the start model (the last good one, or the one left)."""
        if (good := self._fallback()) is None:
            self._free_restart = True
            await self.refusals.discard(refused)  # the process holds its weights, not its files
            raise ApplyFailed(f"version {refused.version} refused; restarting on the start model, the last "
                              "good version", restart=True)
        await self._restore(good, f"refused version {refused.version}")
        await self.refusals.discard(refused)

    def _fallback(self) -> Target | None:
        """Where to go back to from a refused version: this server's last good version; with none
        (restarted since), the node's, unless it failed to load here; None: the start model."""
        if self.good is not None:
            return self.good
        node = self.refusals.last_good
        return None if node is None or node == self._unloadable else node

    async def _restore(self, good: Target, why: str) -> None:
        """Load ``good`` (a version this server or the node served) again; if it cannot, it is
        forgotten here and the server restarts on its start model: a version that is good either way."""
        whose = "its" if good == self.good else "the node's"
        log.warning("back %s: to version %d, %s last good version (%s)", self.name, good.version, whose, why)
        try:
            await self._apply(good)
        except ApplyFailed as e:
            self.good, self._unloadable = None, good
            raise ApplyFailed(f"loading version {good.version} again ({why}) failed: {e}; restarting on the "
                              "start model", restart=True) from None

    def _died_while_loading(self, error: str) -> None:
        """The process failed while loading the node's target: the first time, a restart like any
        failure; the second time for the same version, that version is refused."""
        target, self._died_loading = self._died_loading, None
        if target is None or target != self.updater.target or target == self.good:
            return
        if self._suspect != target:
            self._suspect = target
            return
        self._free_restart = True
        self._refuse(target, f"the server failed twice while loading it: {error}")

    def _retry_delay(self, retries: int) -> float:
        policy = self._conf().restart
        return min(policy.backoff_initial_s * policy.backoff_factor ** (retries - 1), policy.backoff_max_s)

    async def _target_within(self, held: Target, seconds: float) -> None:
        """Sleep ``seconds``, or less if the node's target changes meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.updater.next_target(held)

    async def _watch(self, held: Target | None) -> None:
        """Probe health until the node's target changes; raise ServerFailed if the server fails."""
        await self._guarded(self.updater.next_target(held))

    async def _guarded(self, work: Awaitable[T]) -> T:
        """Run ``work`` while the server is watched: if its process exits or ``/health`` fails
        ``health.failures`` times in a row, ``work`` is cancelled and ServerFailed raised. Both
        tasks are owned here: cancelled and awaited on every path, cancellation included."""
        job, guard = asyncio.ensure_future(work), asyncio.ensure_future(self._guard())
        try:
            await asyncio.wait((job, guard), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _reap((job, guard))
        if not guard.cancelled() and guard.exception() is not None:
            raise guard.exception()
        return job.result()

    async def _guard(self) -> NoReturn:
        failed = 0
        while True:
            cfg = self._conf()
            await asyncio.sleep(cfg.health.interval_s)
            self._note_stable()
            if not self.child.running:
                await self.child.wait()
                self._died_loading = self.loading
                raise ServerFailed(f"exited{self._during()}: {self.child.describe_exit()}")
            if (lost := self.child.lost_vital()) is not None:  # its API may take several probes to say so
                self._died_loading = self.loading
                raise ServerFailed(f"its process {lost} exited{self._during()}")
            if await self.vllm.healthy(cfg.health.timeout_s):
                failed = 0
                continue
            failed += 1
            log.warning("probe %s[%d]: /health failed (%d of %d)%s", self.name, self.child.pid, failed,
                        cfg.health.failures, self._during())
            if failed >= cfg.health.failures:
                self._died_loading = self.loading
                raise ServerFailed(f"/health failed {failed} times in a row{self._during()}")

    def _during(self) -> str:
        if self.state is S.UPDATING or (self.state is S.SYNCING and self.loading is not None):
            target = self.loading.version if self.loading else "?"
            return f" while loading version {target}"
        return ""

    async def _apply(self, target: Target) -> None:
        record = UpdateRecord(target.version)
        self.last_update, self.loading = record, target
        applier = Applier(self.name, self.vllm, self._conf().update, self.metrics, verify=self.updater.verify,
                          quiet=self.gateway.quiet if self.gateway is not None else None,
                          recall=self.gateway.recall_unanswered if self.gateway is not None else None,
                          engines=self._conf().shape(self.spec).data)
        try:
            self._hold(await applier.apply(target, record))
            self.good = self.loaded
            self.refusals.served(target)
        except ApplyFailed as e:
            if e.restart:  # half-loaded, or weights that failed the gate: not what it held before
                self._hold(None)
            raise  # else the pause failed, or the plugin refused: the weights are untouched, it holds what it held
        finally:
            self.loading = None
        self.metrics.updates.labels(server=self.name).inc()
        log.info("update %s[%d]: version %d loaded, paused %.3f s (%s)", self.name, self.child.pid,
                 target.version, record.phases_s.get("paused", 0.0),
                 ", ".join(f"{k} {v:.3f}" for k, v in record.phases_s.items() if k != "paused"))
        self.updater.collect()

    def _hold(self, target: Target | None) -> None:
        """The one setter of what the running process holds (None: its start model, or unknown)."""
        self.loaded = target
        if self.gateway is not None:
            self.gateway.on_version(target.version if target else None)
        self.metrics.server_version.labels(server=self.name).set(target.version if target else -1)

    # -- failures, restarts, stop ------------------------------------------------------------------------
    def _note_stable(self) -> None:
        stable_s = self._conf().restart.stable_after_s
        if self.failures and self.serving_since is not None and self._clock() - self.serving_since >= stable_s:
            log.info("stable %s: serving for %.0f s, failure count reset", self.name, stable_s)
            self.failures = 0

    async def _back_off(self, error: str) -> None:
        policy = self._conf().restart
        await self._terminate(policy.failed_grace_s)
        free, self._free_restart = self._free_restart, False
        if free:  # asked for by a version's failure: not a failure of the server to start
            delay = policy.backoff_initial_s
            log.info("backoff %s: restart in %.1f s (for a version's failure; %d failure(s) in a row)", self.name,
                     delay, self.failures)
        else:
            self.failures += 1
            if self.failures > policy.max_retries:
                self.lifecycle.set(S.FATAL, f"{self.failures} failures in a row; last: {error[:150]}")
                await asyncio.Event().wait()  # until a person restarts it (the daemon cancels this task)
            delay = min(policy.backoff_initial_s * policy.backoff_factor ** (self.failures - 1),
                        policy.backoff_max_s)
            log.info("backoff %s: restart %d of %d in %.1f s", self.name, self.failures, policy.max_retries, delay)
        await asyncio.sleep(delay)
        self.restarts += 1
        self.metrics.restarts.labels(server=self.name).inc()

    async def _terminate(self, grace_s: float | None = None) -> None:
        """Stop the process group, if any, with ``grace_s`` (default ``shutdown.server_grace_s``)
        between SIGTERM and SIGKILL; reap it (also when cancelled meanwhile)."""
        child, self.serving_since = self.child, None
        if child is None or child.pid is None:
            return
        shutdown = self._conf().shutdown
        grace_s = shutdown.server_grace_s if grace_s is None else grace_s
        try:  # the child's one stop task; a cancellation here hurries it to SIGKILL and waits for it
            await child.stop(grace_s, shutdown.kill_wait_s)
        except ChildError as e:
            log.error("reap %s: %s", self.name, e)
        else:
            with contextlib.suppress(SocketDirError):
                remove_stale(self.socket)  # the group is gone: nothing listens on it any more
        finally:
            self._hold(None)

    async def _stop(self) -> None:
        if self.state in (S.STOPPED, S.STOPPING):
            return
        self.lifecycle.set(S.STOPPING)
        try:
            await self._terminate()
        finally:
            self.child = None
            self.lifecycle.set(S.STOPPED)
            await self.vllm.close()

    def reset_failures(self) -> None:
        self.failures = 0

    # -- for status and heartbeats ---------------------------------------------------------------------
    def _version_text(self) -> str:
        return str(self.loaded.version) if self.loaded else "of the start model"

    @property
    def endpoint(self) -> str:
        """Where the registry tells trainers to send this server's generation requests: its gateway."""
        return f"http://{self._conf().advertise_host}:{self.spec.public_port}"

    def snapshot(self) -> ServerSnapshot:
        target = self.loading or self.updater.target
        if self.loading is None and self.refusals.refused(target) is not None:
            target = self.loaded  # not moving: the node refused its target
        return ServerSnapshot(
            name=self.name, state=self.state, pid=self.child.pid if self.child and self.state.running else None,
            socket=str(self.socket), public_port=self.spec.public_port, gpus=list(self.spec.gpus),
            endpoint=self.endpoint, version=self.loaded.version if self.loaded else None,
            target=target.version if target else None, last_good=self.good.version if self.good else None,
            incarnation=self.incarnation, restarts=self.restarts, state_age_s=round(self.lifecycle.age_s(), 3),
            last_error=self.last_error,
            last_update=self.last_update.status() if self.last_update else None)


async def _reap(tasks: tuple[asyncio.Future, ...]) -> None:
    """Cancel ``tasks`` and wait until each has ended, also when the caller is cancelled meanwhile
    (the cancellation goes on afterwards): no task outlives its owner."""
    for task in tasks:
        task.cancel()
    cancelled = False
    while not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            cancelled = True
    for task in tasks:  # retrieved: an ended task's error is this owner's to report, not the loop's
        if not task.cancelled():
            task.exception()
    if cancelled:
        raise asyncio.CancelledError
