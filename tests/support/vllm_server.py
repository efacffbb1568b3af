"""Real ``vllm serve`` processes (CPU build, from .venv-vllm) with rolloutd's plugin, for tests
and benchmarks.

Each server runs in its own session (process group): API server, engine core and workers go
together, and :meth:`VllmServer.stop` signals the whole group (TERM, grace, KILL), checks
that nothing of it is left, and removes the shared memory it left as the daemon does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rolloutd.demo.cpu_vllm import CPU_ENV, cpu_args
from rolloutd.supervise.leftovers import remove_shm_leftovers, shm_held_by, shm_names
from tests.support.processes import group_pids
from tests.support.tls import CONTEXT as TLS

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
# Flags that start a small model fast on CPU (docs/plugin.md, "Testing on a machine without a GPU").
FAST_CPU_FLAGS = cpu_args()


def worker_cores(cpus: str) -> str:
    """The cores a test asking for ``cpus`` gets: scripts/test runs the system tier two files at a
    time, and its second worker swaps cores 0 and 1, so that two tests side by side, each with a
    server on "core 0", take a core each. Other specs ("0-1") are kept."""
    if os.environ.get("PYTEST_XDIST_WORKER") != "gw1":
        return cpus
    return {"0": "1", "1": "0"}.get(cpus, cpus)


def require_vllm() -> None:
    if not VLLM.exists():
        raise RuntimeError(f"{VLLM} is missing: run scripts/bootstrap (it installs vLLM's CPU build)")


def engine_core(pgid: int) -> int:
    """The pid of vLLM's engine-core process in group ``pgid``, which must be alive."""
    for pid in group_pids(pgid):
        try:
            if "EngineCore" in Path(f"/proc/{pid}/comm").read_text() + Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no EngineCore process in group {pgid}")


def shm_mapped(pids: list[int]) -> set[str]:
    """``/dev/shm`` names that the given processes map or hold open."""
    names = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("/dev/shm/"):
                    names.add(target.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
        except OSError:
            continue
    return names


class VllmServer:
    """One ``vllm serve`` with the plugin reached through ``pythonpath``, listening where ``listen``
    says: a loopback port (an int), or a UNIX socket (a Path: ``--uds``, as rolloutd starts its
    servers); ``cpus`` are the cores its compute threads are bound to (``"0"``, ``"0-1"``)."""

    def __init__(self, model: Path, listen: int | Path, log: Path, *, pythonpath: list[Path], cpus: str = "0",
                 extra_args: list[str] = (), extra_env: dict[str, str] | None = None):
        require_vllm()
        cpus = worker_cores(cpus)
        self.model, self.log = model, log
        if isinstance(listen, Path):
            self.port, self.socket, self.url = None, listen, "http://localhost"
            where = ["--uds", str(listen)]
        else:
            self.port, self.socket, self.url = listen, None, f"http://127.0.0.1:{listen}"
            where = ["--host", "127.0.0.1", "--port", str(listen)]
        # Its own TMPDIR, as the daemon gives each server: vLLM's ZMQ sockets and rendezvous files,
        # which a killed server leaves, go with it at stop().
        self.tmp = Path(tempfile.mkdtemp(prefix="vllm-"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(CPU_ENV, VLLM_SERVER_DEV_MODE="1", TMPDIR=str(self.tmp),
                   VLLM_CPU_OMP_THREADS_BIND=cpus, PYTHONPATH=os.pathsep.join(map(str, pythonpath)),
                   **(extra_env or {}))
        self.cmd = [str(VLLM), "serve", str(model), *where,
                    *FAST_CPU_FLAGS, "--weight-transfer-config", '{"backend": "rolloutd"}',
                    "--enable-scale-out", *extra_args]
        self._log = open(log, "ab")
        self._shm_before = shm_names()
        try:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._log.close()
            raise

    def wait_healthy(self, timeout_s: float = 240.0) -> VllmServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before it was healthy:\n"
                                   + self.log_tail())
            try:
                with self.client(timeout=2) as c:
                    if c.get("/health").status_code == 200:
                        return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s} s:\n{self.log_tail()}")

    def client(self, **kw) -> httpx.Client:
        """A client of this server (on its socket or its port), as :func:`client` makes them."""
        return client(self.socket or self.url, **kw)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """TERM the group, KILL it after ``grace_s``, and check that no process of it is left."""
        pgid = self.proc.pid
        held = shm_held_by(group_pids(pgid))  # as the daemon learns them: what no name gives away goes too
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()
                if not group_pids(pgid):
                    break
                time.sleep(0.1)
            if not group_pids(pgid):
                break
        self.proc.wait(5)
        self._log.close()
        if left := group_pids(pgid):
            raise RuntimeError(f"processes {left} of vllm serve's group outlived SIGKILL")
        remove_shm_leftovers(self._shm_before, held)  # a SIGKILLed group's resource tracker unlinked nothing
        shutil.rmtree(self.tmp, ignore_errors=True)


def client(url: str | Path, **kw) -> httpx.Client:
    """A client of a server at ``url``, or on the UNIX socket ``url`` when it is a Path. No
    keep-alive: vLLM closes the connection after a route raised (HTTP 500), and a reused
    connection would then fail the next call."""
    kw.setdefault("timeout", 120)
    if isinstance(url, Path):
        kw["transport"], url = httpx.HTTPTransport(uds=str(url)), "http://localhost"
    return httpx.Client(base_url=url, limits=httpx.Limits(max_keepalive_connections=0), verify=TLS, **kw)


def pip_install_rolloutd(target: Path) -> Path:
    """rolloutd installed by pip (no dependencies) into ``target``, for vLLM's interpreter."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    return target


# -- the plugin's update cycle over HTTP, on the tiny model (rolloutd.demo.tinymodel) ------------------
TINY_PROMPTS = [[1, 5, 9, 13, 40], [1, 300, 22], [1, 7, 7, 7, 100, 250, 31]]
CYCLE = ("pause", "start_weight_update", "update_weights", "finish_weight_update", "resume")


def tiny_outputs(url: str) -> list[tuple[list[int], list[dict]]]:
    """Greedy outputs for TINY_PROMPTS: (token ids, weight_versions spans) each."""
    out = []
    with client(url) as c:
        for prompt in TINY_PROMPTS:
            r = c.post("/inference/v1/generate", json={
                "token_ids": prompt, "stream": False,
                "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["token_ids"], choice["weight_versions"]))
    return out


def tiny_tokens(url: str) -> list[list[int]]:
    """The token ids of :func:`tiny_outputs`."""
    return [t for t, _ in tiny_outputs(url)]


def tiny_reference(seed: int) -> list[list[int]]:
    """What :func:`tiny_tokens` must be on the tiny model of ``seed`` (``tinymodel.state_dict(TINY,
    seed)``): transformers' greedy decoding of TINY_PROMPTS, 16 new tokens each, in float32 as the
    servers run it. Seeds whose outputs hold a near tie are refused: token equality would not be
    a fair test there."""
    import torch
    import transformers

    from rolloutd.demo import families, tinymodel

    config = {k: v for k, v in tinymodel.config(tinymodel.TINY).items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tinymodel.state_dict(tinymodel.TINY, seed).items()})
    outputs, margins = families.greedy_and_margins(model.eval(), TINY_PROMPTS, 16)
    assert min(margins) > 1e-3, f"seed {seed}: a near tie in its greedy outputs ({min(margins)}): pick another"
    return outputs


def plugin_cycle(url: str, path: Path | str, digest: str, label: str, *,
                 resume: bool = True) -> dict[str, tuple[int, str]]:
    """The HTTP cycle pause → start → update → finish(label) → resume; (status, body) per step."""
    bodies = {"update_weights": {"update_info": {"path": str(path), "digest": digest}},
              "finish_weight_update": {"weight_version": label}}
    out = {}
    with client(url) as c:
        for step in CYCLE if resume else CYCLE[:-1]:
            r = c.post(f"/{step}", params={"mode": "abort"} if step == "pause" else None, json=bodies.get(step))
            out[step] = (r.status_code, r.text)
    return out


def put_on(url: str, versions, v: int) -> None:
    """Version ``v`` of ``versions`` (version -> (path, digest)) loaded by the whole cycle."""
    steps = plugin_cycle(url, *versions[v], str(v))
    assert all(status == 200 for status, _ in steps.values()), steps
