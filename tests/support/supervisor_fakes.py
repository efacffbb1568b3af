"""Small named fakes of what a :class:`rolloutd.supervise.supervisor.Supervisor` talks to, for its
logic tests on the fake clock (tests/support/fake_time.py):

- :class:`FakeVllm`: one server as the supervisor reaches it, the client of its routes
  (:class:`rolloutd.rollout.vllm_http.VllmClient`'s interface) and the maker of its processes;
- :class:`FakeChild`: one of those processes (:class:`rolloutd.supervise.child.Child`'s interface);
- :class:`FakeUpdater`: the node's target (:class:`rolloutd.rollout.updater.Updater`'s interface);
- :class:`Arrows`: every state change, with the fake clock's time, that a test can wait for.

Everything here lives in the test's event loop and takes no real time: a route that hangs waits
out its timeout on the fake clock, a server that is healthy after 30 s is so 30 fake seconds
after its spawn.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from rolloutd.config import Config
from rolloutd.rollout.updater import Target
from rolloutd.rollout.vllm_http import VllmError
from rolloutd.supervise.child import ChildError, describe_exit
from rolloutd.wire.manifest import Canary, Manifest, build_manifest
from rolloutd.wire.states import ServerState

S = ServerState
UPDATE_ROUTES = ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/weight_info",
                 "/reset_prefix_cache", "/resume", "/v1/models", "/v1/completions")


def now() -> float:
    return asyncio.get_running_loop().time()


def config(**sections) -> Config:
    """A node of two servers with short, round timings (fake seconds); ``sections`` override them."""
    base = {"registry": {"url": "http://127.0.0.1:9"},
            "vllm": {"command": ["fake-vllm", "serve"]},
            "servers": [{"name": "s0", "model": "m", "public_port": 9001},
                        {"name": "s1", "model": "m", "public_port": 9002}],
            "health": {"interval_s": 1, "timeout_s": 1, "failures": 3},
            "restart": {"start_timeout_s": 60, "backoff_initial_s": 1, "backoff_factor": 2, "backoff_max_s": 4,
                        "max_retries": 4, "stable_after_s": 300, "failed_grace_s": 5},
            "shutdown": {"server_grace_s": 20, "kill_wait_s": 5}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return Config.model_validate(base)


# A canary the fake server passes: it serves -1.0 for every token (FakeVllm.prompt_logprobs).
CANARY = Canary(prompt_ids=[1, 2, 3], continuation_ids=[4, 5], logprobs=[-1.0, -1.0], tolerance=0.05)


def mirror_version(root: Path, version: int, instance: str = "inst-1", *, canary: Canary | None = None) -> Target:
    """A version complete in a mirror directory (its manifest, whose digest the gate checks, with
    ``canary`` if given); the same target again if the directory exists."""
    vdir = root / str(version)
    if not vdir.exists():
        vdir.mkdir(parents=True)
        (vdir / "model.safetensors").write_bytes(version.to_bytes(8, "little") * 64)
        manifest = build_manifest(version, [vdir / "model.safetensors"], chunk_bytes=4096, canary=canary)
        (vdir / "manifest.json").write_text(manifest.model_dump_json())
    manifest = Manifest.model_validate_json((vdir / "manifest.json").read_text())
    return Target(version, manifest.digest, vdir, instance)


class FakeChild:
    """One ``vllm serve`` process: spawned, alive until it exits or is stopped. How it behaves is
    its :class:`FakeVllm`'s settings at spawn time."""

    def __init__(self, server: FakeVllm, name: str, argv: list[str], env: dict[str, str], **_):
        self.server, self.name, self.argv, self.env = server, name, argv, env
        self.pid: int | None = None
        self.pgid: int | None = None
        self.scope = "a fake scope"  # where its processes are (Child: a cgroup or a process group)
        self.started_at: float | None = None
        self.returncode: int | None = None
        self.grace: float | None = None  # the grace period of its one stop (as Child: the first asked)
        self.shm_noted: list[float] = []  # when the supervisor had it learn its /dev/shm segments
        self.vital_lost: str | None = None  # what lost_vital() says: one of vLLM's titled processes gone
        self._sent: set[int] = set()
        self._exited = asyncio.Event()
        self._exit_timer: asyncio.TimerHandle | None = None

    async def spawn(self) -> None:
        if self.server.spawn_error:
            raise ChildError(self.server.spawn_error)
        self.server.children.append(self)
        self.pid = self.pgid = 1000 + len(self.server.children)
        self.started_at = now()
        self.server.label = None  # a new process holds its start model
        if self.server.exit_after is not None:
            after_s, code = self.server.exit_after
            self._exit_timer = asyncio.get_running_loop().call_later(after_s, self.exit, code)
        for hook in self.server.at_spawn:
            hook(self)

    @property
    def running(self) -> bool:
        return self.pid is not None and self.returncode is None

    def exit(self, code: int) -> None:
        """The process ends with ``code`` (negative: killed by that signal)."""
        if self.running:
            self.returncode = code
            self._exited.set()
        if self._exit_timer is not None:
            self._exit_timer.cancel()

    async def wait(self) -> int:
        await self._exited.wait()
        return self.returncode

    def describe_exit(self) -> str:
        return describe_exit(self.returncode, sent=self._sent)

    async def note_shm(self) -> None:
        self.shm_noted.append(now())

    def note_vital(self) -> None:
        pass

    def lost_vital(self) -> str | None:
        return self.vital_lost

    def kill_group(self, sig: int) -> None:
        self._sent.add(sig)
        if sig == signal.SIGKILL:
            self.exit(-signal.SIGKILL)

    async def stop(self, grace_s: float, kill_wait_s: float = 10.0) -> str:
        if self.grace is None:
            self.grace = grace_s
        if self.server.stop_error:
            raise OSError(self.server.stop_error)  # e.g. a look at its processes that failed
        if self.running:
            self._sent.add(signal.SIGTERM)
            if not self.server.ignores_term:
                self.exit(-signal.SIGTERM)
            else:
                try:
                    await asyncio.sleep(grace_s)
                finally:  # the grace ran out, or the stop was cancelled: SIGKILL either way
                    self._sent.add(signal.SIGKILL)
                    self.exit(-signal.SIGKILL)
        return self.describe_exit()


class FakeVllm:
    """One server as the supervisor reaches it: the client of its routes, and ``make_child`` for its
    processes. Settings apply to the processes spawned next; ``faults`` to the routes called next
    (``route: "fail" | "fail_once" | "hang" | "nan"``, ``"nan"`` for the gate's logprobs).
    ``bad_versions``: what the gate meets on a version's weights, in every process (``"wrong"``:
    logprobs off the canary's; ``"refuse"``: HTTP 400, as vLLM answers a canary it cannot score;
    ``"load"``: its load fails; ``"die"``: the process dies while loading it)."""

    def __init__(self) -> None:
        self.children: list[FakeChild] = []
        self.calls: list[tuple[int, str]] = []   # (pid, route) of every route called, health aside
        self.probes = 0
        self.faults: dict[str, str] = {}
        self.start_s = 2.0             # spawn to /health passing; None: never
        self.exit_after: tuple[float, int] | None = None  # (seconds after spawn, exit status)
        self.health_ok = True          # False: a live process that fails /health
        self.spawn_error: str | None = None
        self.ignores_term = False
        self.stop_error: str | None = None  # a stop of its processes raises OSError with this
        self.load_s = 0.5              # /update_weights takes this long
        self.label: str | None = None  # /weight_info of the current process
        self.at_spawn: list = []       # hooks(child), e.g. to clear faults for the next process
        self.bad_versions: dict[str, str] = {}  # version -> "wrong" | "refuse" | "load" | "die"
        self.loaded: list[str | None] = []  # the label of each finished load, in order
        self.closed = 0

    def make_child(self, name: str, argv: list[str], env: dict[str, str], **kw) -> FakeChild:
        return FakeChild(self, name, argv, env, **kw)

    @property
    def child(self) -> FakeChild | None:
        return self.children[-1] if self.children else None

    def routes(self, pid: int | None = None) -> list[str]:
        return [r for p, r in self.calls if pid is None or p == pid]

    async def close(self) -> None:
        self.closed += 1

    async def healthy(self, timeout_s: float) -> bool:
        self.probes += 1
        child = self.child
        if child is None or not child.running or not self.health_ok or self.start_s is None:
            return False
        return now() - child.started_at >= self.start_s

    async def _route(self, route: str, timeout_s: float) -> None:
        child = self.child
        self.calls.append((child.pid if child else 0, route))
        if child is None or not child.running:
            raise VllmError(route, "ClientConnectorError: Connect call failed")
        fault = self.faults.get(route)
        if fault == "fail_once":
            del self.faults[route]
        if fault in ("fail", "fail_once"):
            raise VllmError(route, "HTTP 500: a fault of the fake", status=500)

        if fault == "hang":
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.Event().wait()
            except TimeoutError:
                raise VllmError(route, f"no answer within {timeout_s:g} s", timed_out=True) from None

    async def pause(self, mode: str, timeout_s: float, *, clear_cache: bool = True) -> None:
        await self._route("/pause", timeout_s)

    async def resume(self, timeout_s: float) -> None:
        await self._route("/resume", timeout_s)

    async def start_weight_update(self, timeout_s: float) -> None:
        await self._route("/start_weight_update", timeout_s)

    async def update_weights(self, update_info: dict, timeout_s: float) -> None:
        await self._route("/update_weights", timeout_s)
        bad = self.bad_versions.get(Path(update_info["path"]).name)
        if bad == "load":
            raise VllmError("/update_weights", "HTTP 500: a fault of the fake's version", status=500)
        if bad == "die":
            self.child.exit(-9)
            await asyncio.Event().wait()  # no answer: the supervisor's probes see the exit
        await asyncio.sleep(self.load_s)

    async def finish_weight_update(self, label: str, timeout_s: float) -> None:
        await self._route("/finish_weight_update", timeout_s)
        self.label = label
        self.loaded.append(label)

    async def drop_kv_cache(self, timeout_s: float) -> None:
        await self._route("/reset_prefix_cache", timeout_s)

    async def weight_version(self, timeout_s: float) -> str:
        await self._route("/weight_info", timeout_s)
        return str(self.label)

    async def served_model(self, timeout_s: float) -> str:
        await self._route("/v1/models", timeout_s)
        return "m"

    async def prompt_logprobs(self, token_ids: list[int], timeout_s: float, *, model: str | None = None) -> list[float]:
        if model is None:  # as the real client: the model's name, then the request
            await self.served_model(timeout_s)
        await self._route("/v1/completions", timeout_s)
        bad = self.bad_versions.get(str(self.label))
        if bad == "refuse":
            raise VllmError("/v1/completions", "HTTP 400: token id 99999 is out of vocabulary", status=400)
        value = float("nan") if self.faults.get("/v1/completions") == "nan" else -5.0 if bad == "wrong" else -1.0
        return [value] * (len(token_ids) - 1)


class FakeUpdater:
    """The node's target as a supervisor sees it: decided (``settled``) or not, the target, a
    re-check of the mirror copy after a failed load (counted), the mirror's collection (counted)."""

    def __init__(self, target: Target | None = None, *, settled: bool = True):
        self.target = target
        self.settled = asyncio.Event()
        if settled:
            self.settled.set()
        self.verified: list[int] = []
        self.collected = 0
        self._changed = asyncio.Condition()

    async def next_target(self, held: Target | None) -> Target:
        async with self._changed:
            await self._changed.wait_for(lambda: self.target is not None and self.target != held)
            return self.target

    async def publish(self, target: Target | None) -> None:
        async with self._changed:
            self.target = target
            self._changed.notify_all()
        self.settled.set()

    async def verify(self, target: Target) -> Target:
        self.verified.append(target.version)
        return target

    def collect(self) -> None:
        self.collected += 1


class Arrows:
    """The supervisor's ``on_state``: every arrow taken, at which fake time; tests wait on it."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, ServerState, ServerState]] = []
        self._wake: asyncio.Future | None = None

    def __call__(self, name: str, old: ServerState, new: ServerState) -> None:
        self.seen.append((now(), old, new))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    @property
    def taken(self) -> list[tuple[ServerState, ServerState]]:
        return [(a, b) for _, a, b in self.seen]

    @property
    def states(self) -> list[ServerState]:
        return [b for _, _, b in self.seen]

    def times(self, state: ServerState) -> list[float]:
        """When the server entered ``state``, each time."""
        return [t for t, _, b in self.seen if b is state]

    async def reach(self, state: ServerState, nth: int = 1, within_s: float = 3600) -> float:
        """Wait until the server entered ``state`` ``nth`` times (at most ``within_s`` fake seconds);
        returns the fake time it did."""
        async with asyncio.timeout(within_s):
            while len(self.times(state)) < nth:
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
        return self.times(state)[nth - 1]
