"""Shared fixtures: registries served over real HTTP on loopback, and an injectable clock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rolloutd.trainer import EmbeddedRegistry
from tests.support.processes import group_pids
from tests.support.tls import CONTEXT as TLS


class FakeClock:
    """A monotonic clock the test moves by hand (lease expiry, replica age)."""

    def __init__(self, start: float = 1000.0):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock):
    """An embedded registry (bytes in memory) on a free port, with the fake clock."""
    with EmbeddedRegistry(port=0, clock=clock) as reg:
        yield reg


@pytest.fixture
def http(registry):
    with httpx.Client(base_url=registry.url, timeout=30, verify=TLS) as client:
        yield client


def _port_slice() -> range:
    """This process's own ports, below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(("", 0))`` is free only until its probe socket closes:
    another xdist worker's probe, or any process's outgoing connection, may take it before the test
    binds it (seen in CI: a daemon's gateway port taken between the two). Ports below the ephemeral
    range are never handed out by the kernel, and each worker of a run gets a slice of its own.
    [10000, 29000) leaves out 29500+, which torch and vLLM's data-parallel ranks take by default."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low, high = 10000, min(29000, ephemeral_low)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = (high - low) // workers
    return range(low + worker * size, low + (worker + 1) * size)


_PORTS = _port_slice()
_next_port = _PORTS.start + (os.getpid() % len(_PORTS))  # runs one after another start apart


def free_port() -> int:
    """A loopback port of this worker's slice, free now and not handed out again until the slice
    has gone round: one config never names a port twice (seen: a server's port equal to the admin
    API's), and no other worker or process is offered it meanwhile."""
    global _next_port
    for _ in range(len(_PORTS)):
        port, _next_port = _next_port, _next_port + 1 if _next_port + 1 < _PORTS.stop else _PORTS.start
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken, or still in TIME_WAIT from an earlier run
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(url + "/healthz", timeout=1, verify=TLS).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@pytest.fixture
def standalone(tmp_path):
    """Start ``rolloutd registry`` as its own process; yields a function (args) -> (url, proc)."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[str, subprocess.Popen]:
        port = free_port()
        log = open(tmp_path / f"registry-{port}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "registry", "--port", str(port),
                                 *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        return url, proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def run_cli(capsys, *argv: str) -> subprocess.CompletedProcess:
    """``rolloutd ARGV`` in this process: the command's own code (exit code, stdout, stderr) without
    the second or so a new Python takes to import it. Tests of the entry point as a process start
    ``python -m rolloutd.cli`` (slow tier)."""
    from rolloutd.cli import main
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["rolloutd", *argv], code, out.out, out.err)


def registry_log(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("registry-*.log"))


class Debs:
    """The .deb built by packaging/build-deb, by revision ("1"; "2" for upgrades), each built
    the first time a run asks for it (about 35 s of CPU), into one folder per state of the
    package's sources (tests.support.nspawn.deb_folder), kept for the next runs and workers: a
    guest that binds the folder sees a revision built after it booted."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __getitem__(self, revision: str) -> Path:
        from tests.support.nspawn import build_deb_once
        return build_deb_once(self.folder, revision)


@pytest.fixture(scope="session")
def debs() -> Debs:
    from tests.support.nspawn import deb_folder
    return Debs(deb_folder())


@pytest.fixture(scope="module")
def one_torch_thread():
    """transformers references of tiny models on one thread: next to running vLLM servers on a
    small machine, torch's thread pool only spins (about 100x slower, measured)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Cases:
    """How many cases a generated test tries: ``cases(n)`` is ``n`` in the thorough run and a
    tenth of it (at least 10) in the quick one; its minimum counts scale the same way."""

    def __init__(self, share: float):
        self.share = share

    def __call__(self, n: int) -> int:
        return n if self.share == 1 else max(10, int(n * self.share))

    def at_least(self, n: int) -> int:
        return int(n * self.share)


@pytest.fixture(params=[pytest.param(0.1, id="quick"),
                        pytest.param(1.0, id="thorough", marks=[pytest.mark.slow, pytest.mark.parallel])])
def cases(request) -> Cases:
    """Every fuzzer runs twice: ``[quick]`` in the fast tier, ``[thorough]`` (its full count) in the slow one,
    beside other such tests."""
    return Cases(request.param)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def pytest_configure(config):
    """SIGTERM (a CI job's timeout, ``kill``) stops a run as Ctrl-C does, its fixtures torn down:
    the daemons, servers and containers the tests start are in sessions of their own and would
    outlive a run that just died. In every process of a run, each xdist worker too."""
    signal.signal(signal.SIGTERM, _interrupted)


def pytest_collection_modifyitems(items):
    """A test that needs the module's real ``vllm serve`` (the ``vllm`` fixture) is slow, wherever
    it stands: ``-m "not slow"`` is the fast tier of pure logic, fakes and in-process servers."""
    for item in items:
        if "vllm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, config):
    """With ``--durations``: each file's seconds (its tests' setup, call and teardown, summed), the
    longest first. Within a run a file's tests run one after another, so this is the file's time
    there: what the system tier's order (tests/system/conftest.py, ``SECONDS``) should follow."""
    if config.option.durations is None:
        return
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport):
                name = r.nodeid.split("::")[0]
                seconds[name] = seconds.get(name, 0.0) + r.duration
    longest = sorted(seconds.items(), key=lambda kv: -kv[1])[:15]
    if longest:
        terminalreporter.write_sep("=", f"longest {len(longest)} files (seconds)")
        for name, s in longest:
            terminalreporter.write_line(f"{s:8.1f} {name}")


@pytest.fixture
def children():
    """Children (:class:`rolloutd.supervise.child.Child`) a test spawns; whatever is left of their groups
    is killed afterwards."""
    from rolloutd.supervise.child import Child
    made = []

    def make(name: str, argv: list[str], **kw):
        made.append(Child(name, argv, dict(os.environ), **kw))
        return made[-1]

    yield make
    for child in made:
        for pid in group_pids(child.pgid) if child.pgid else []:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def daemons(tmp_path, registry):
    """Start ``rolloutd run`` processes whose servers are the fake vLLM (with ``faults``), on the
    module's ``registry``; whatever a test leaves is killed and must be gone."""
    from tests.support.daemon_harness import DaemonProcess, config, tagged_pids, wait_until
    started = []

    def start(faults: str | tuple[str, ...] = "", *, servers: int = 1, directory=None,
              registry_url: str | None = None, env: dict | None = None, **sections):
        """``faults``: every server's, or a tuple of one per server."""
        d = directory or tmp_path / f"d{len(started)}"
        d.mkdir(exist_ok=True)
        each = faults if isinstance(faults, tuple) else (faults,) * servers
        specs = [{"name": f"s{i}", "model": "fake-model", "env": {"FAKE_VLLM_FAULTS": each[i]}}
                 for i in range(servers)]
        sections = {"restart": {"start_timeout_s": 10, "backoff_initial_s": 0.2, "backoff_max_s": 0.5,
                                "max_retries": 2}, "shutdown": {"server_grace_s": 1, "kill_wait_s": 5}, **sections}
        daemon = DaemonProcess(config(d, registry_url or registry.url, specs, fake=True, **sections), d)
        started.append(daemon.start(**(env or {})))
        return daemon

    yield start
    for daemon in started:
        daemon.kill_everything()
        wait_until(lambda d=daemon: tagged_pids(d.tag) == [], 10, "every process of the daemon gone")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS, ``weed mini``) on loopback free ports, one bucket, credentials
    in ``s3.credentials_file``; stopped after the module."""
    from tests.support.s3_server import SeaweedS3
    with SeaweedS3(tmp_path_factory.mktemp("s3")) as server:
        yield server
