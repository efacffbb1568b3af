"""``rolloutd run`` as a real process, for tests: its config, its admin API, its process tree.

Every child the daemon starts carries ``ROLLOUTD_TEST_TAG=<tag>`` in its environment (through
the config's ``vllm.env``), so a test can find every process of a daemon in the process
table, whatever process group or parent it ended up with.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import yaml

from rolloutd.config import SCRATCH
from rolloutd.demo.cpu_vllm import CPU_ENV
from rolloutd.supervise.leftovers import scratch_left
from tests.support.tls import CONTEXT as TLS
from tests.support.vllm_server import FAST_CPU_FLAGS, ROOT, VLLM, client, worker_cores

FAKE_VLLM = ROOT / "tests" / "support" / "fake_vllm.py"


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment holds ``ROLLOUTD_TEST_TAG=<tag>`` (zombies excluded)."""
    needle = f"ROLLOUTD_TEST_TAG={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if needle in Path(entry.path, "environ").read_bytes().split(b"\0") and not _zombie(entry.path):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return not _zombie(f"/proc/{pid}")
    except OSError:
        return False


def _zombie(proc_dir: str) -> bool:
    stat = Path(proc_dir, "stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"


def vllm_server(name: str, model: Path, cpus: str, **extra) -> dict:
    """A config entry for a real ``vllm serve`` (CPU build) on ``cpus`` ("0", "0-1"): its worker
    threads bound there, and all its processes kept there. Unconfined, its engine core's polling
    loop takes whatever core is left, and the daemon and the test wait behind it for seconds."""
    cpus = worker_cores(cpus)
    return {"name": name, "model": str(model), "public_port": _free_port(), "cpus": cpu_list(cpus),
            "env": {"VLLM_CPU_OMP_THREADS_BIND": cpus}, **extra}


def cpu_list(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the kernel's cpulist format, as VLLM_CPU_OMP_THREADS_BIND takes)."""
    out: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def uds_client(socket: Path | str, **kw) -> httpx.Client:
    """An HTTP client of a server on a UNIX socket (a vLLM child, or the fake)."""
    return client(Path(socket), **kw)


# Runs a command as another user of the machine (nobody), with no supplementary group.
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def socket_probe(socket: str | Path) -> str:
    """A standard-library Python script that asks the server on the UNIX socket ``socket`` for
    ``GET /is_paused`` and prints the answer's status line, or the name of the error it got."""
    return textwrap.dedent(f"""
        import socket
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({str(socket)!r})
            s.sendall(b"GET /is_paused HTTP/1.0\\r\\n\\r\\n")
            print(s.recv(100).split(b"\\r\\n")[0].decode())
        except OSError as e:
            print(type(e).__name__)
    """)


def config(tmp: Path, registry_url: str, servers: list[dict], *, fake: bool = False, tag: str | None = None,
           **sections) -> dict:
    """A daemon config: real vLLM (or the fake with ``fake=True``), state and mirror under ``tmp``."""
    tag = tag or uuid.uuid4().hex[:12]
    command = [sys.executable, str(FAKE_VLLM), "serve"] if fake else [str(VLLM), "serve"]
    cfg = {
        "node": {"name": "node-a", "advertise_host": "node-a.test"},
        "registry": {"url": registry_url, "long_poll_s": 5, "retry_initial_s": 0.2, "retry_max_s": 2},
        "admin": {"host": "127.0.0.1", "port": _free_port()},
        "gateway": {"host": "127.0.0.1"},
        "state_dir": str(tmp / "state"),
        "mirror": {"dir": str(tmp / "mirror"), "max_bytes": "1GiB"},
        "heartbeat": {"interval_s": 0.5, "timeout_s": 2},
        # A real vLLM's /health can wait seconds behind a first request on a busy machine: 2 s
        # three times restarted a healthy server in the middle of a test. The fake answers at once.
        "health": {"interval_s": 0.5, "timeout_s": 2 if fake else 10, "failures": 3},
        "restart": {"start_timeout_s": 240, "backoff_initial_s": 0.5, "backoff_max_s": 2, "max_retries": 3},
        "shutdown": {"server_grace_s": 10, "kill_wait_s": 10},
        "vllm": {"command": command, "args": [] if fake else list(FAST_CPU_FLAGS),
                 "env": {"ROLLOUTD_TEST_TAG": tag, **CPU_ENV}},
        "servers": [{"public_port": _free_port(), **s} for s in servers],
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    return cfg


def _free_port() -> int:
    from tests.conftest import free_port
    return free_port()


class DaemonProcess:
    """``python -m rolloutd.cli run -c CONFIG`` in its own session, output in ``log``."""

    def __init__(self, cfg: dict, directory: Path, *, prefix: list[str] = ()):
        self.cfg, self.dir = cfg, directory
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NS]: run it on another host
        self.path = directory / "rolloutd.yaml"
        self.write(cfg)
        self.tag = cfg["vllm"]["env"]["ROLLOUTD_TEST_TAG"]
        host = cfg["admin"].get("host", "127.0.0.1")
        host = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
        self.url = f"http://{host}:{cfg['admin']['port']}"
        self.log = directory / "rolloutd.log"
        self.proc: subprocess.Popen | None = None

    def write(self, cfg: dict) -> None:
        self.cfg = cfg
        self.path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    def start(self, **extra_env: str) -> DaemonProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(extra_env)
        with open(self.log, "ab") as out:
            argv = [*self.prefix, sys.executable, "-m", "rolloutd.cli", "run", "-c", str(self.path)]
            self.proc = subprocess.Popen(argv,
                                         cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def status(self) -> dict:
        r = httpx.get(self.url + "/status", timeout=10, verify=TLS)
        r.raise_for_status()
        return r.json()

    def socket(self, name: str) -> Path:
        """Where server ``name``'s vLLM listens (only this user can reach it)."""
        return Path(self.cfg["state_dir"]) / "sockets" / f"{name}.sock"

    def vllm(self, name: str, **kw) -> httpx.Client:
        """A client straight to server ``name``'s vLLM, on its socket (not through its gateway)."""
        return uds_client(self.socket(name), **kw)

    def server(self, name: str, status: dict | None = None) -> dict:
        return next(s for s in (status or self.status())["servers"] if s["name"] == name)

    def wait(self, predicate: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
        """Poll /status until ``predicate`` holds; fail with the last status and the log's tail."""
        deadline = time.monotonic() + timeout_s
        last: dict | str = "no answer"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"rolloutd exited with {self.proc.returncode} waiting for {what}\n{self.tail()}")
            try:
                last = self.status()
                if predicate(last):
                    return last
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.2)
        raise AssertionError(f"not {what} after {timeout_s} s; last status: {last}\n{self.tail()}")

    def wait_versions(self, versions: dict[str, int], timeout_s: float = 120) -> dict:
        """Every named server SERVING with its version."""
        def ok(st: dict) -> bool:
            got = {s["name"]: (s["state"], s["version"]) for s in st["servers"]}
            return all(got.get(n) == ("SERVING", v) for n, v in versions.items())
        return self.wait(ok, timeout_s, f"serving {versions}")

    def action(self, path: str, token: str | None = None) -> httpx.Response:
        """POST an admin action; without ``token``, the one the daemon wrote (no admin.token_file
        in the config), as the rolloutd CLI sends it."""
        token = token or self.generated_token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.post(self.url + path, headers=headers, timeout=120, verify=TLS)

    def generated_token(self) -> str | None:
        admin = self.cfg.get("admin", {})
        if admin.get("token_file") or admin.get("allow_unauthenticated"):
            return None
        try:
            return (Path(self.cfg["state_dir"]) / "admin.token").read_text().strip()
        except FileNotFoundError:
            return None

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, and wait for the exit; KILL (and fail) if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGUSR1)  # its threads' and tasks' stacks, into the log (node/stacks.py)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(3)
            self.kill_everything()
            # The daemon's own lines first: the servers' output would push them out of a CI excerpt.
            raise AssertionError(f"rolloutd did not stop within {timeout_s} s\n{self.own_lines()}\n"
                                 f"--- the log's last lines:\n{self.tail()}") from None

    def kill_everything(self) -> None:
        """Last resort for a failed test: nothing of this daemon outlives it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in tagged_pids(self.tag):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Its servers' own directories, as the next daemon's start would remove them: vLLM's
        # sockets, some in a directory of /tmp (leftovers.Scratch).
        if state := self.cfg.get("state_dir"):
            for scratch in scratch_left(Path(state) / SCRATCH):
                scratch.remove()

    def tail(self, lines: int = 60) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def own_lines(self, lines: int = 80) -> str:
        """The daemon's last lines without its servers' output (``rolloutd.server.<name>``), and
        whatever it wrote that is not a log record (a stack dump), in order."""
        if not self.log.exists():
            return ""
        own = [line for line in self.log.read_text(errors="replace").splitlines()
               if not re.match(r"\S+ \S+ \w+ rolloutd\.server\.", line)]
        return "\n".join(own[-lines:])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every_s)
    raise AssertionError(f"not {what} after {timeout_s} s")


@contextlib.contextmanager
def failed_closes(pid: int, trace: Path) -> Iterator[list[str]]:
    """strace attached to process ``pid``, every thread and child, for the block, which must end
    with the process gone. Yields a list that gets every ``close`` that failed with EBADF: a
    descriptor closed twice. Between two closes of one number another thread can open a file under
    it and lose it to the second (uvloop did that with pipes)."""
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-Z", "-e", "trace=close", "-o", str(trace), "-p", str(pid)],
                              stderr=subprocess.DEVNULL)
    failed: list[str] = []
    try:
        wait_until(lambda: _tracer_of(pid) != 0, 10, "strace attached")
        yield failed
        assert tracer.wait(30) == 0, "strace did not end with the traced process"
    finally:
        tracer.kill()
    failed.extend(line for line in trace.read_text().splitlines() if "EBADF" in line)


def _tracer_of(pid: int) -> int:
    """The pid tracing ``pid`` (0: none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    return 0
