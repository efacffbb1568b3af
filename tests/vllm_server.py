"""Real ``vllm serve`` processes (CPU build, from .venv-vllm) with rolloutd's plugin, for tests
and benchmarks.

Each server runs in its own session (process group): API server, engine core and workers go
together, and :meth:`VllmServer.stop` signals the whole group (TERM, grace, KILL) and checks
that nothing of it is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
# Flags that start a small model fast on CPU (docs/plugin.md, "Testing on a machine without a GPU").
FAST_CPU_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager",
                  "--kv-cache-memory-bytes", str(64 << 20)]


def require_vllm() -> None:
    if not VLLM.exists():
        raise RuntimeError(f"{VLLM} is missing: run scripts/bootstrap (it installs vLLM's CPU build)")


def group_pids(pgid: int) -> list[int]:
    """Live processes of a group (zombies are dead: whoever adopted them has yet to reap them)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, g, stat in (line.split() for line in out.splitlines())
            if int(g) == pgid and not stat.startswith("Z")]


class VllmServer:
    """One ``vllm serve`` on a loopback port, with the plugin reached through ``pythonpath``;
    ``cpus`` are the cores its compute threads are bound to (``"0"``, ``"0-1"``)."""

    def __init__(self, model: Path, port: int, log: Path, *, pythonpath: list[Path], cpus: str = "0",
                 extra_args: list[str] = (), extra_env: dict[str, str] | None = None):
        require_vllm()
        self.model, self.port, self.log = model, port, log
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_CPU_OMP_THREADS_BIND=cpus, PYTHONPATH=os.pathsep.join(map(str, pythonpath)),
                   **(extra_env or {}))
        self.cmd = [str(VLLM), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                    *FAST_CPU_FLAGS, "--weight-transfer-config", '{"backend": "rolloutd"}',
                    "--enable-scale-out", *extra_args]
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 240.0) -> VllmServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before it was healthy:\n"
                                   + self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """TERM the group, KILL it after ``grace_s``, and check that no process of it is left."""
        pgid = self.proc.pid
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


def client(url: str) -> httpx.Client:
    """No keep-alive: vLLM closes the connection after a route raised (HTTP 500), and a reused
    connection would then fail the next call."""
    return httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0))


def pip_install_rolloutd(target: Path) -> Path:
    """rolloutd installed by pip (no dependencies) into ``target``, for vLLM's interpreter."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    return target
