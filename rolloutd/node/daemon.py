"""``rolloutd run``: the node daemon, wiring every part together under one task group.

Start: read the tokens, choose how servers are held (a delegated cgroup each, or a process
group each: ``supervise/cgroups.py``), stop what a crashed earlier run left behind (the
populated cgroups, or the recorded process groups), make the directory of the servers' sockets
(mode 0700), clean the mirror's partial pulls, put the plugin
where children import it, bind the admin API
(an address in use fails here, before anything is spawned), open the registry client, the
updater (which owns the pull workers), each server's gateway and the peer listener, then run
under one ``asyncio.TaskGroup``: the admin API, the updater, the main loop, and per server a
supervisor and a heartbeat task. Each release is registered on one ``AsyncExitStack`` as its
resource is made, so a start that fails at any step (a port in use, say), a crash and the
ordered stop all release exactly what was made, in reverse.

The main loop ticks the systemd watchdog (so a frozen loop is restarted by systemd) and
keeps ``READY=1`` / ``STATUS=`` true; it never waits on anything else, so ``/healthz`` and the
watchdog stay true while servers stop. Signal handlers only set events: SIGTERM or SIGINT asks
for the ordered shutdown, a second one kills every server's process group at once; SIGHUP asks
the reloader task for a reload; SIGUSR1 writes every thread's and task's stack to the log
(:mod:`rolloutd.node.stacks`).

A probe of the loop's own lateness (:mod:`rolloutd.node.looplag`) runs beside them.

Crash policy: every long-lived task (the admin API, the updater, the peer announcer, the
reloader, the loop-lag probe, and per server its supervisor and its heartbeats) runs under
:func:`keep`: a crash (a bug, or a reply nobody expected) is logged with its traceback, counted
in ``rolloutd_task_errors_total{task}``, and the loop is started again after a growing delay; a
crashed supervisor first stops its server's process group, and the admin API binds its address
again. Only shutdown ends the task group.

Shutdown, each step bounded by a ``shutdown.*`` deadline: wait for a reload in progress,
deregister every replica (the trainer stops routing to a server before it stops answering),
stop every server at once (TERM to each group, grace, KILL, reap), stop the updater (its lease
is released, its pull workers reaped), stop the admin API. The stop wins over every other
task: a pull that meets a failure while it is cancelled still ends cancelled (no next pull
starts), and an updater not gone ``UPDATER_STOP_S`` after its cancellation has its pull workers
killed and is cancelled again, every second, until it is gone.

Reload: a bad new file keeps the old configuration running and says so. A server restarts
only when its own entry or the ``vllm`` section changed (changed and removed servers are
deregistered and stopped all at once, so a reload takes one stop grace, not one per server);
servers are added and removed;
``update``, ``pull.timeout_s``, ``heartbeat``, ``health``, ``restart`` and ``shutdown`` apply
at once. ``node``, ``registry``, ``admin``, ``mirror``, ``state_dir`` and the rest of ``pull``
need a restart of the daemon: a reload that changes them keeps the running values and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rolloutd import __version__
from rolloutd.config import Config, ConfigError, load_config, read_token
from rolloutd.gateway.relay import Gateway, GatewayError
from rolloutd.metrics import Metrics
from rolloutd.node import stacks
from rolloutd.node.admin import AdminServer, action_token, create_app
from rolloutd.node.heartbeat import Heartbeater
from rolloutd.node.looplag import LoopLag
from rolloutd.node.notify import Notifier
from rolloutd.objstore import ObjectStoreSettings
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.peerserve import PeerServer
from rolloutd.rollout.refusals import Refusals
from rolloutd.rollout.registry_client import RegistryClient, Timeouts
from rolloutd.rollout.slots import RolloutSlots
from rolloutd.rollout.swarm import Swarm, SwarmSettings, peer_token
from rolloutd.rollout.updater import Target, Updater
from rolloutd.supervise.cgroups import contain
from rolloutd.supervise.leftovers import ShmBaseline
from rolloutd.supervise.plugin_path import install_plugin
from rolloutd.supervise.sockets import prepare_socket_dir
from rolloutd.supervise.supervisor import Supervisor
from rolloutd.units import size
from rolloutd.wire.states import ServerState
from rolloutd.wire.status import (
    MirrorStatus,
    NodeStatus,
    PullSources,
    ReloadStatus,
    ServerStatus,
    TargetStatus,
)

log = logging.getLogger("rolloutd")
S = ServerState

UPDATER_STOP_S = 10.0  # the updater's own stop is bounded (workers 2 s + KILL 5 s, lease release 5 s in parallel)

# Sections a running daemon cannot change: they name its identity, its sockets and its files.
FIXED_SECTIONS = ("node", "registry", "admin", "gateway", "mirror", "state_dir", "peers", "object_store")


@dataclass
class Running:
    """One configured server: its supervisor, its heartbeats, and their tasks."""

    supervisor: Supervisor
    heartbeater: Heartbeater
    gateway: Gateway
    task: asyncio.Task | None = None
    beats: asyncio.Task | None = None


@dataclass
class LastReload:
    """The last reload asked for: ``/status`` shows it, and ``STATUS=`` names its error until a
    reload succeeds (a refused file stays visible to monitoring, not only in the log)."""

    attempt_unix: float | None = None
    ok: bool | None = None
    error: str | None = None
    where: str | None = None  # FILE:LINE of the first problem (the file alone when it names no line)
    needs_restart: list[str] = field(default_factory=list)  # changed in the file, kept running as they were

    def status(self) -> ReloadStatus:
        return ReloadStatus(last_attempt_unix=self.attempt_unix, ok=self.ok, error=self.error, where=self.where,
                            needs_restart=list(self.needs_restart))


class Daemon:
    def __init__(self, cfg: Config, config_path: Path | None = None, *, notifier: Notifier | None = None):
        self.cfg, self.config_path = cfg, config_path
        self.notifier = notifier or Notifier()
        self.metrics = Metrics()
        self.started = time.monotonic()
        self.servers: dict[str, Running] = {}
        self.ready = False
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._changing = asyncio.Lock()  # reloads and restarts change self.servers
        self._terms = 0
        self._tick = time.monotonic()
        self._slots = RolloutSlots(1)  # one for the daemon's life: a reload resizes it (rollout/slots.py)
        self._tg: asyncio.TaskGroup | None = None
        self._spawning = False  # servers were started and not yet all stopped in order
        self.last_reload = LastReload()

    def conf(self) -> Config:
        return self.cfg

    # -- start ------------------------------------------------------------------------------------------
    async def run(self) -> int:
        # Every resource's release is registered on the stack as it is made: a start that fails
        # at any step, a crash, and the ordered stop all release exactly what was made, in reverse.
        async with contextlib.AsyncExitStack() as stack:
            gateways = await self._start(stack)
            await self._serve(stack, gateways)
        log.info("stop rolloutd: every server stopped")
        return 0

    async def _start(self, stack: contextlib.AsyncExitStack) -> dict[str, Gateway]:
        """Make what the daemon runs on, in order, each release on ``stack`` as it is made; the
        public ports (gateways, peers) are bound here, before anything is spawned."""
        cfg = self.cfg
        _release(stack, "the socket to systemd", self.notifier.close)  # opened at the first message
        registry_token, admin_token = read_token(cfg.registry.token_file), action_token(cfg)
        self.gateway_token = read_token(cfg.gateway.token_file)
        self.containment = contain(cfg.state_dir)
        log.info("contain: %s", self.containment)
        for line in await self.containment.start(cfg.shutdown.server_grace_s, cfg.shutdown.kill_wait_s):
            log.warning("clean %s", line)
        self.shm = ShmBaseline(cfg.state_dir / "shm-at-start.json")
        for line in await asyncio.to_thread(self.shm.clean_and_record):  # the earlier run's processes are gone
            log.warning("clean %s", line)
        _release(stack, "the record of shared memory", self._forget_shm)
        prepare_socket_dir(cfg.socket_dir)  # before any child binds its socket there
        self.mirror = Mirror(cfg.mirror.dir, int(cfg.mirror.max_bytes), recycle=cfg.mirror.recycle)
        _release(stack, "the mirror", lambda: asyncio.to_thread(self.mirror.close))  # a gc asked for ends first
        self.mirror.clean_partials()
        self._check_mirror_room()
        self.plugin_dir = install_plugin(cfg.state_dir / "plugin")
        self.admin = AdminServer(create_app(self, admin_token), cfg.admin.host, cfg.admin.port)
        _release(stack, "the admin API", self.admin.stop)
        self.client = RegistryClient(cfg.registry.url, registry_token, timeouts=Timeouts(
            connect_s=cfg.registry.connect_timeout_s, request_s=cfg.registry.request_timeout_s,
            read_s=cfg.pull.read_timeout_s))
        _release(stack, "the registry client", self.client.close)
        self.swarm = Swarm(swarm_settings(cfg, registry_token), self.client, self.mirror, node=cfg.node_name,
                           object_store=ObjectStoreSettings(**cfg.object_store.model_dump()),
                           read_timeout_s=cfg.pull.read_timeout_s)
        self.refusals = Refusals(self.metrics, discard=self._discard_refused)
        self.updater = Updater(self.conf, self.client, self.mirror, self.metrics, in_use=self._in_use,
                               swarm=self.swarm)
        _release(stack, "the updater", self.updater.close)  # its pull workers, on every path
        gateways = {}
        for spec in cfg.servers:  # every public port bound before anything is spawned
            gateways[spec.name] = gateway = await self._open_gateway(spec)
            _release(stack, f"the gateway of {spec.name}", gateway.stop)
        self.peer_server = None
        if cfg.peers.enabled:
            self.peer_server = PeerServer(self.mirror, self.swarm.ledger, cfg.peers.host, cfg.peers.port,
                                          self.swarm.settings.token, head_timeout_s=cfg.peers.head_timeout_s,
                                          max_connections=cfg.peers.max_connections).start()
            _release(stack, "the peer listener", self.peer_server.stop)
        if self.gateway_token is None and cfg.gateway.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("gateway: no token_file: generation on %s is open to anyone who can reach this node",
                        cfg.gateway.host)
        log.info("start rolloutd %s: node %s, %d server(s) (%s), registry %s, admin on %s:%d, mirror %s",
                 __version__, cfg.node_name, len(cfg.servers), ", ".join(s.name for s in cfg.servers),
                 cfg.registry.url, cfg.admin.host, self.admin.port, cfg.mirror.dir)
        self._handle_signals()
        _release(stack, "the signal handlers", self._unhandle_signals)
        return gateways

    async def _serve(self, stack: contextlib.AsyncExitStack, gateways: dict[str, Gateway]) -> None:
        """Run every long-lived task under one task group until the ordered stop is done."""
        # Those a reload opened too (the ordered stop stopped them already; a crash did not).
        _release(stack, "the servers' gateways", self._stop_gateways)
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            admin = tg.create_task(keep("admin", self.admin.serve, self.metrics, done=lambda: self.admin.stopped),
                                   name="admin")
            updater = tg.create_task(keep("updater", self.updater.run, self.metrics), name="updater")
            announcer = tg.create_task(keep("announcer", self.swarm.run_announcer, self.metrics), name="announcer")
            reloader = tg.create_task(keep("reload", self._reloader, self.metrics), name="reloader")
            lag = tg.create_task(keep("loop_lag", LoopLag(self.metrics).run, self.metrics), name="loop-lag")
            self._spawning = True
            for spec in self.cfg.servers:
                self._start_server(spec, gateways[spec.name])
            await self._main()
            await self._shutdown(updater, reloader, admin, announcer)
            await _cancel(lag)
        self._spawning = False  # every server stopped in order: their segments are gone with them

    def _forget_shm(self) -> None:
        """Drop the record of the shared memory at start, unless a server may have left segments
        (a crash, not the ordered stop): then the next start removes them by it."""
        if not self._spawning:
            self.shm.forget()

    async def _stop_gateways(self) -> None:
        await asyncio.gather(*(r.gateway.stop() for r in self.servers.values()))

    def _handle_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload.set)
        stacks.install(loop)

    def _unhandle_signals(self) -> None:
        loop = asyncio.get_running_loop()
        stacks.uninstall(loop)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    def request_stop(self) -> None:
        """Ask for the ordered shutdown; asked again, kill every server's process group now."""
        self._terms += 1
        self._stop.set()
        if self._terms > 1:
            log.warning("stop asked again: killing every server's process group now")
            for r in self.servers.values():
                child = r.supervisor.child
                if child is not None and child.pid is not None:
                    child.kill_group(signal.SIGKILL)

    # -- the main loop ------------------------------------------------------------------------------------
    async def _main(self) -> None:
        """Tick until a stop is asked; never await anything slow here: the watchdog and /healthz
        read this loop's liveness, and a stuck tick gets the daemon (and every server) killed."""
        period = min(self.notifier.watchdog_interval_s or 1.0, 1.0)
        due = time.monotonic()
        while not self._stop.is_set():
            self._tick = time.monotonic()
            self.notifier.watchdog()
            self._report()
            # A fixed rate, not a fixed sleep: a tick delayed by a busy loop does not push every
            # later one back, and one that falls a whole period behind starts afresh, no burst.
            due = max(due + period, time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(due - time.monotonic()):
                    await self._stop.wait()

    async def _reloader(self) -> None:
        """SIGHUP reloads, beside the main loop: one may wait out several servers' stop grace."""
        while True:
            await self._reload.wait()
            self._reload.clear()
            await self.reload()

    def _report(self) -> None:
        """READY=1 once the API is bound and every server is SERVING or gave up; STATUS= always."""
        self.notifier.status(self._status_line())
        states = [r.supervisor.state for r in self.servers.values()]
        if not self.ready and self.admin.started and all(s in (S.SERVING, S.FATAL) for s in states):
            self.ready = True
            self.notifier.ready()
            log.info("ready: %s", self._status_line())

    def _status_line(self) -> str:
        parts = []
        if self.last_reload.ok is False:  # first: systemctl shows the start of the line
            parts.append(f"configuration error at {self.last_reload.where}, running the previous one")
        for r in self.servers.values():
            s = r.supervisor
            version = f" v{s.loaded.version}" if s.loaded else ""
            moving = f"->v{s.loading.version}" if s.loading else ""
            parts.append(f"{s.name} {s.state.name}{version}{moving}")
        registry = "registry ok" if self.updater.registry.reachable else "registry unreachable"
        return "; ".join(parts + [registry])

    def _on_state(self, name: str, old: ServerState, new: ServerState) -> None:
        if self._tg is not None and not self._stop.is_set():
            self._report()
        if (running := self.servers.get(name)) is not None:
            running.heartbeater.state_changed()

    # -- servers ----------------------------------------------------------------------------------------
    async def _open_gateway(self, spec) -> Gateway:
        gateway = Gateway(spec.name, self.cfg.socket_path(spec.name), spec.public_port, self.cfg.gateway,
                          self.gateway_token, self.metrics)
        await gateway.start()
        return gateway

    def _start_server(self, spec, gateway: Gateway) -> Running:
        sup = Supervisor(spec, self.conf, self.updater, slots=self._rollout_slots, containment=self.containment,
                         plugin_dir=self.plugin_dir, metrics=self.metrics, on_state=self._on_state,
                         gateway=gateway, refusals=self.refusals)
        running = Running(sup, Heartbeater(sup, self.conf, self.client, self.updater), gateway)
        running.task = self._tg.create_task(keep("supervisor", sup.run, self.metrics), name=f"server-{spec.name}")
        running.beats = self._tg.create_task(keep("heartbeat", running.heartbeater.run, self.metrics),
                                             name=f"heartbeat-{spec.name}")
        self.servers[spec.name] = running
        return running

    async def _stop_server(self, running: Running) -> None:
        await _cancel(running.beats)  # deregistered first: the trainer stops routing to it, then it stops
        await _cancel(running.task)
        await running.gateway.stop()

    def _rollout_slots(self) -> RolloutSlots:
        """Servers updating at once: ``max_unavailable`` when rolling, all of them otherwise. The
        same slots before and after a reload, with the limit of the configuration running now."""
        u = self.cfg.update
        self._slots.resize(u.max_unavailable if u.strategy == "rolling" else max(1, len(self.cfg.servers)))
        return self._slots

    def _in_use(self) -> set[int]:
        """Versions the mirror keeps: what each server holds or loads, its last good version and
        the node's, to go back to from a refused version."""
        used = {self.refusals.last_good.version} if self.refusals.last_good is not None else set()
        for r in self.servers.values():
            for t in (r.supervisor.loaded, r.supervisor.loading, r.supervisor.good):  # good: to go back to
                if t is not None:
                    used.add(t.version)
        return used

    async def _discard_refused(self, target: Target) -> None:
        """Free a refused version's room in the mirror once no server holds it: kept as the
        mirror's newest, it would leave a mirror sized for two versions no room for the next."""
        if target.version not in self._in_use():
            await asyncio.to_thread(self._remove_refused, target)

    def _remove_refused(self, target: Target) -> None:
        if self.mirror.has(target.version, target.digest):
            self.mirror.remove(target.version, "refused on this node", digest=target.digest)

    # -- admin actions ----------------------------------------------------------------------------------
    async def restart_server(self, name: str) -> str:
        async with self._changing:
            running = self.servers[name]  # KeyError: unknown server (the API answers 404)
            if self._stop.is_set():  # shutdown held the lock: the server is stopped, and stays so
                return f"server {name} not restarted: rolloutd is stopping"
            log.info("restart %s: asked through the admin API", name)
            await _cancel(running.task)
            running.supervisor.reset_failures()
            running.task = self._tg.create_task(keep("supervisor", running.supervisor.run, self.metrics),
                                                name=f"server-{name}")
        return f"server {name} restarted"

    async def update_now(self) -> str:
        self.updater.poke(asked=True)
        return "the updater is checking the registry now"

    async def reload(self) -> dict:
        """Re-read the config file; apply what changed (see the module docstring)."""
        async with self._changing:  # a SIGHUP and an admin reload, or a restart, one at a time
            if self._stop.is_set():  # shutdown holds the lock from here on; this reload came too late
                return {"ok": False, "message": "rolloutd is stopping"}
            return await self._reload_now()

    async def _reload_now(self) -> dict:
        if self.config_path is None:
            return {"ok": False, "message": "no config file to reload (started with an embedded config)"}
        self.last_reload.attempt_unix = time.time()
        try:
            new = await asyncio.to_thread(load_config, self.config_path)
        except (ConfigError, RecursionError, MemoryError) as e:  # a reload never takes the daemon down
            self._reload_refused(e)
            return {"ok": False, "message": f"the running configuration stays: {e}"}
        self.notifier.reloading()
        old = self.cfg
        kept = [s for s in FIXED_SECTIONS if getattr(old, s) != getattr(new, s)]
        if old.pull.model_copy(update={"timeout_s": 0}) != new.pull.model_copy(update={"timeout_s": 0}):
            kept.append("pull (all but timeout_s)")  # the puller and the client are built at start
        if kept:
            log.warning("reload: %s changed; these take effect when rolloutd restarts", ", ".join(kept))
            new = new.model_copy(update={s: getattr(old, s) for s in FIXED_SECTIONS})
        self.cfg = new
        self._rollout_slots()  # a larger limit lets waiting servers in now
        message = await self._apply_servers(old, new)
        if kept:
            message += f"; needs a restart of rolloutd: {', '.join(kept)}"
        log.info("reload: %s", message)
        self.last_reload.ok, self.last_reload.error, self.last_reload.where = True, None, None
        self.last_reload.needs_restart = kept
        self._check_mirror_room()
        self.metrics.reload_ok.set(1)
        self.notifier.ready()
        self.notifier.status(self._status_line())
        return {"ok": True, "message": message}

    def _check_mirror_room(self) -> None:
        """Say once, at start and at each reload, when ``mirror.max_bytes`` is more than the mirror's
        filesystem can give it: pulls then fail for lack of room long before the mirror is full."""
        try:
            st = os.statvfs(self.mirror.dir)
        except OSError as e:
            log.warning("check mirror: cannot read the size of the filesystem holding %s: %s", self.mirror.dir, e)
            return
        free, whole = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        held = self.mirror.usage_bytes()
        if self.mirror.max_bytes > free + held:
            log.warning("check mirror: mirror.max_bytes is %s but the filesystem holding %s can give it %s (%s "
                        "free + %s it holds, of %s in all): a version that does not fit fails its pull; set "
                        "mirror.max_bytes to at most %s", size(self.mirror.max_bytes), self.mirror.dir,
                        size(free + held), size(free), size(held), size(whole), size(free + held))

    def _reload_refused(self, e: Exception) -> None:
        """Log it, and keep it visible until a reload succeeds: ``/status``, the metrics, ``STATUS=``."""
        log.error("reload failed, the running configuration stays: %s", e)
        r = self.last_reload
        r.ok, r.error = False, str(e) or type(e).__name__
        r.where = (e.where if isinstance(e, ConfigError) else None) or str(self.config_path)
        self.metrics.reload_failures.inc()
        self.metrics.reload_ok.set(0)
        self.notifier.status(self._status_line())

    async def _apply_servers(self, old: Config, new: Config) -> str:
        before = {name: r.supervisor.spec for name, r in self.servers.items()}  # what runs (a failed start: not)
        after = {s.name: s for s in new.servers}
        removed = [n for n in before if n not in after]
        added = [n for n in after if n not in before]
        changed = [n for n in after if n in before and (after[n] != before[n] or old.vllm != new.vllm)]
        # All at once, each bounded by its own stop grace; kept in self.servers meanwhile, so a
        # second SIGTERM still reaches their process groups.
        await asyncio.gather(*(self._stop_server(self.servers[n]) for n in removed + changed))
        # A restarted server is the same server: its count of processes started goes on (the
        # registry and the fleet view tell a new process by a new incarnation).
        started = {n: self.servers[n].supervisor.incarnation for n in changed}
        for n in removed + changed:
            del self.servers[n]
        for n in removed:
            self.metrics.forget_server(n)
        failed = []
        for n in changed + added:
            try:
                running = self._start_server(after[n], await self._open_gateway(after[n]))
                running.supervisor.incarnation = started.get(n, 0)
            except GatewayError as e:
                log.error("reload: server %s not started: %s", n, e)
                failed.append(f"{n} ({e})")
        message = (f"servers added {added or 'none'}, removed {removed or 'none'}, restarted {changed or 'none'}, "
                   f"unchanged {[n for n in after if n not in added and n not in changed] or 'none'}")
        return message + (f"; not started: {', '.join(failed)}" if failed else "")

    # -- shutdown ---------------------------------------------------------------------------------------
    async def _shutdown(self, updater: asyncio.Task, reloader: asyncio.Task, admin: asyncio.Task,
                        announcer: asyncio.Task) -> None:
        self.notifier.stopping()
        self.updater.stop()  # from here no pull starts, and a pull cancelled ends cancelled whatever it meets
        log.info("stop: deregister %d server(s), then stop them, the updater and the admin API", len(self.servers))
        async with self._changing:  # a reload or restart in progress ends first (its steps have deadlines)
            await _cancel(reloader)
            await asyncio.gather(*(_cancel(r.beats) for r in self.servers.values()))  # trainers look away first
            await asyncio.gather(*(_cancel(r.task) for r in self.servers.values()))
            await asyncio.gather(*(r.gateway.stop() for r in self.servers.values()))
            await self._stop_updater(updater)
            await asyncio.to_thread(self.updater.discard_kept)  # a pull cut short kept its chunks
            await _cancel(announcer)  # the tracker forgets this node's chunks
            self.admin.stop()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.shutdown.admin_grace_s):
                    await asyncio.shield(admin)
            await _cancel(admin)

    async def _stop_updater(self, updater: asyncio.Task) -> None:
        """Cancel the updater and wait until it is gone; one that outlives its bound (a pull
        stuck in a way nobody foresaw) has its pull workers killed and is cancelled again."""
        updater.cancel()
        done, _ = await asyncio.wait({updater}, timeout=UPDATER_STOP_S)
        while not done:
            log.error("stop: the updater still runs %g s after it was cancelled; kill its pull workers and "
                      "cancel it again", UPDATER_STOP_S)
            await self.updater.close()
            updater.cancel()
            done, _ = await asyncio.wait({updater}, timeout=1.0)
        await _cancel(updater)  # done: collects its outcome

    # -- for the admin API ----------------------------------------------------------------------------------
    def healthz(self) -> tuple[bool, str]:
        age = time.monotonic() - self._tick
        limit = 3 * max(self.notifier.watchdog_interval_s or 1.0, 1.0)
        return (age < limit, f"main loop ticked {age:.1f} s ago")

    def status(self) -> NodeStatus:
        now = time.monotonic()
        target, progress = self.updater.target, self.updater.progress
        servers = []
        for r in self.servers.values():
            age = r.heartbeater.age_s()
            servers.append(ServerStatus(**dict(r.supervisor.snapshot()),
                                        heartbeat_age_s=None if age is None else round(age, 3)))
        return NodeStatus(
            node=self.cfg.node_name, rolloutd_version=__version__, pid=os.getpid(),
            uptime_s=round(now - self.started, 3), ready=self.ready, registry=self.updater.registry.status(now),
            target=TargetStatus(version=target.version, digest=target.digest) if target else None,
            pull=progress.status() if progress is not None else None,
            pull_workers_kept=self.updater.kept_worker_pids, pull_sources=self._pull_sources(),
            reload=self.last_reload.status(),
            mirror=MirrorStatus(dir=str(self.mirror.dir), max_bytes=self.mirror.max_bytes,
                                usage_bytes=self.mirror.usage_bytes(), spare_bytes=self.mirror.spare_bytes(),
                                versions=self.mirror.versions()),
            servers=servers, last_good=self.refusals.last_good.version if self.refusals.last_good else None,
            refused=self.refusals.status())

    def _pull_sources(self) -> PullSources:
        """Bytes of the last pull by kind of source, and what this node served its peers."""
        plan = self.swarm.last_plan  # a delta pull's plan of its delta files too (the puller's is the version's)
        sources = PullSources(last_pull=dict(plan.bytes_from) if plan is not None else {}, peers=self.cfg.peers.enabled)
        if self.peer_server is not None:
            sources = sources.model_copy(update={"url": self.swarm.settings.url,
                                                 "served_bytes": self.peer_server.served_bytes,
                                                 "served_requests": self.peer_server.requests})
        return sources


def swarm_settings(cfg: Config, registry_token: str | None) -> SwarmSettings:
    p = cfg.peers
    token = read_token(p.token_file) if p.token_file is not None else registry_token
    if token is not None and token == registry_token:  # never hand the registry's token to a peer URL
        token = peer_token(token)
    return SwarmSettings(enabled=p.enabled, url=cfg.peers_url, token=token, announce_every_s=p.announce_every_s,
                         announce_idle_s=p.announce_idle_s, peer_timeout_s=p.peer_timeout_s,
                         peer_chunk_timeout_s=p.peer_chunk_timeout_s, origin_wait_s=p.origin_wait_s)


def _release(stack: contextlib.AsyncExitStack, what: str, release: Callable[[], object]) -> None:
    """Have ``release`` (a function, or one returning an awaitable) run when ``stack`` unwinds."""
    async def run() -> None:
        log.debug("release %s", what)
        if inspect.isawaitable(done := release()):
            await done
    stack.push_async_callback(run)


async def keep(task: str, run: Callable[[], Awaitable[None]], metrics: Metrics, *,
               initial_s: float = 1.0, max_s: float = 30.0, done: Callable[[], bool] | None = None) -> None:
    """Run the long-lived loop ``run`` until cancelled (or until it returns when ``done()`` says
    it was asked to). A crash is a bug or a peer's surprise, never a reason to take every server
    down with the daemon: log it with its traceback, count it in ``task_errors_total{task}``, wait
    (``initial_s`` doubling up to ``max_s``), start it again. Never once it is being cancelled
    (the daemon stops): a loop whose cleanup fails then is logged and counted, and the
    cancellation goes on, so the stop is never held up by a loop started again."""
    delay = initial_s
    while True:
        started = time.monotonic()
        try:
            await run()
            if done is not None and done():
                return
            raise RuntimeError("returned")  # these loops end only by being cancelled
        except Exception:
            name = asyncio.current_task().get_name()
            if asyncio.current_task().cancelling():
                log.exception("crash in task %s while it was stopped", name)
                metrics.task_errors.labels(task=task).inc()
                raise asyncio.CancelledError() from None
            if time.monotonic() - started > max_s:  # it had run well for a while: back to the short delay
                delay = initial_s
            log.exception("crash in task %s; starting it again in %g s", name, delay)
        metrics.task_errors.labels(task=task).inc()
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_s)


async def _cancel(task: asyncio.Task | None) -> None:
    """Cancel a task and wait until it has finished its cleanup."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # we are being cancelled ourselves
            raise


def run_daemon(cfg: Config, config_path: Path | None) -> int:
    from rolloutd.httpserver import run
    from rolloutd.node.wakeup import short_slice
    if not short_slice():  # the loop's thread, before any other starts: none inherits it
        log.debug("the kernel keeps the default scheduler slice for the daemon's loop")
    return run(Daemon(cfg, config_path).run())
