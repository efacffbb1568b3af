"""Many nodes on one machine, each its own host: network namespaces joined by veth links to a
bridge, the trainer's link shaped with ``tc`` so that its NIC, not the nodes, sets how fast a
version can leave it (as in a cluster). For the egress benchmark and its short run in the tests.

Hosts (one namespace each), all on one /24 through a bridge in a namespace of its own (so no
firewall of the machine's sees the traffic):

- ``trainer`` (``.2``): the registry (``rolloutd registry``), egress shaped to ``rate_mbit``
  with a token bucket (``tc qdisc ... tbf``);
- ``store`` (``.3``), when asked: a real S3 server (SeaweedFS), egress shaped the same way;
- ``node<i>`` (``.10 + i``): one ``rolloutd run`` each, with the **fake vLLM**
  (``tests/support/fake_vllm.py``: real servers do not fit eight times on this machine; the pull does
  not involve them), admin API on the node's address, peer listener on port 9300.

The machine's root namespace reaches every host through ``.1`` on the bridge (the harness
publishes, polls ``/status`` and reads ``/metrics`` from there). :meth:`Fleet.close` kills every
process and deletes every namespace and link, whatever state a run left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from tests.support.daemon_harness import DaemonProcess, config, tagged_pids, wait_until
from tests.support.tls import CONTEXT as TLS

PYTHON = sys.executable
REGISTRY_PORT, PEERS_PORT, ADMIN_PORT = 8700, 9300, 9100


def ip(*args: str) -> None:
    run = subprocess.run(["ip", *args], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")


class Fleet:
    def __init__(self, directory: Path, nodes: int, *, rate_mbit: float = 200.0, token: str = "fleet-token"):
        if nodes < 1 or nodes > 200:
            raise ValueError("1 to 200 nodes")
        self.dir, self.n, self.rate_mbit = Path(directory), nodes, rate_mbit
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = f"10.{150 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:4], 16)}"
        self.switch = f"rfs-{self.tag}"
        self.token_file = self.dir / "token"
        self.token_file.write_text(token + "\n")
        self.token = token
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.registry: subprocess.Popen | None = None
        self.daemons: list[DaemonProcess] = []
        self.s3 = None

    # -- hosts ------------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"rf{host[:6]}-{self.tag}"

    def address(self, host: str) -> str:
        if host == "root":
            return f"{self.subnet}.1"
        if host == "trainer":
            return f"{self.subnet}.2"
        if host == "store":
            return f"{self.subnet}.3"
        return f"{self.subnet}.{10 + int(host.removeprefix('node'))}"

    def setup(self, *, store: bool = False) -> Fleet:
        try:
            ip("netns", "add", self.switch)
            self.namespaces.append(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            self._link("root", None)
            hosts = ["trainer"] + (["store"] if store else []) + [f"node{i}" for i in range(self.n)]
            for host in hosts:
                ip("netns", "add", self.ns(host))
                self.namespaces.append(self.ns(host))
                self._link(host, self.ns(host))
            for host in ("trainer", "store") if store else ("trainer",):
                self._shape(host)
        except BaseException:
            self.close()
            raise
        return self

    def _link(self, host: str, ns: str | None) -> None:
        """A veth pair: one end on the bridge, the other in the host's namespace as eth0."""
        outer = f"rv{self.tag}{host[:1]}{host[4:] if host.startswith('node') else ''}"[:15]
        inner = f"ri{self.tag}" if ns else f"rr{self.tag}"  # renamed eth0 once in its namespace
        ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        ip("link", "set", outer, "netns", self.switch)
        ip("-n", self.switch, "link", "set", outer, "master", "br0")
        ip("-n", self.switch, "link", "set", outer, "up")
        where = ["-n", ns] if ns else []
        if ns:
            ip("link", "set", inner, "netns", ns)
            ip(*where, "link", "set", inner, "name", "eth0")
            inner = "eth0"
            ip(*where, "link", "set", "lo", "up")
        else:
            self.root_link = inner
        ip(*where, "addr", "add", f"{self.address(host)}/24", "dev", inner)
        ip(*where, "link", "set", inner, "up")

    def _shape(self, host: str) -> None:
        """What leaves ``host`` goes at ``rate_mbit`` at most: its NIC is the bottleneck."""
        run = subprocess.run(["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "add", "dev", "eth0", "root",
                              "tbf", "rate", f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "100ms"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"tc on {host}: {run.stderr.strip()}")

    def tx_bytes(self, host: str) -> int:
        """Bytes sent by ``host``'s link so far (every packet, headers included)."""
        out = subprocess.run(["ip", "-n", self.ns(host), "-s", "-j", "link", "show", "eth0"], capture_output=True,
                             text=True, check=True).stdout
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]

    def spawn(self, host: str, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        full_env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        full_env.update(env or {})
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    # -- the trainer's side -------------------------------------------------------------------------
    @property
    def registry_url(self) -> str:
        return f"http://{self.address('trainer')}:{REGISTRY_PORT}"

    def start_registry(self, *extra: str, data_dir: Path | None = None, token: bool = True) -> str:
        argv = [PYTHON, "-m", "rolloutd.cli", "registry", "--host", self.address("trainer"), "--port",
                str(REGISTRY_PORT), "--holder-ttl-s", "5", *extra]
        if token:
            argv += ["--token-file", str(self.token_file)]
        if data_dir is not None:
            argv += ["--data-dir", str(data_dir)]
        self.registry = self.spawn("trainer", argv, self.dir / "registry.log")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.registry.poll() is not None:
                raise RuntimeError(f"registry exited:\n{(self.dir / 'registry.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.registry_url + "/healthz", timeout=1, verify=TLS).status_code == 200:
                    return self.registry_url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("registry not healthy")

    def stop_registry(self) -> None:
        if self.registry is not None and self.registry.poll() is None:
            os.killpg(self.registry.pid, signal.SIGKILL)
            self.registry.wait(10)

    def served_bytes(self) -> int:
        """File bytes the registry sent (its own count, ``rolloutd_registry_served_bytes_total``)."""
        text = httpx.get(self.registry_url + "/metrics", headers=self.auth, timeout=10, verify=TLS).text
        for line in text.splitlines():
            if line.startswith("rolloutd_registry_served_bytes_total "):
                return int(float(line.split()[1]))
        return 0

    @property
    def auth(self) -> dict:
        return {"authorization": f"Bearer {self.token}"}

    def start_s3(self):
        """SeaweedFS on the ``store`` host (set up with ``store=True``), its link shaped."""
        from tests.support.s3_server import SeaweedS3
        self.s3 = SeaweedS3(self.dir / "s3", host=self.address("store"), prefix=["ip", "netns", "exec",
                                                                               self.ns("store")])
        return self.s3.start()

    def publish(self, version: int, directory: Path, *, chunk_bytes: int, to: str | None = None,
                hash_name: str = "blake3") -> float:
        """``rolloutd publish`` from the root namespace; returns when the version became visible.
        blake3 chunk digests by default: nodes take only such versions from their peers."""
        argv = [PYTHON, "-m", "rolloutd.cli", "publish", "--registry", self.registry_url, "--token-file",
                str(self.token_file), "--chunk-bytes", str(chunk_bytes), "--hash", hash_name, str(version),
                str(directory)]
        if to is not None:
            argv += ["--to", to, "--s3-endpoint", self.s3.endpoint, "--s3-credentials", str(self.s3.credentials_file)]
        visible: list[float] = []
        watcher = threading.Thread(target=self._watch_latest, args=(version, visible), daemon=True)
        watcher.start()
        run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            raise RuntimeError(f"publish failed: {run.stderr[-2000:]}")
        watcher.join(30)
        return visible[0] if visible else time.monotonic()

    def _watch_latest(self, version: int, visible: list[float]) -> None:
        """When the registry first answers ``version`` as its newest: the pull can start then
        (the publishing command itself returns a moment later)."""
        with httpx.Client(headers=self.auth, timeout=5, verify=TLS) as http:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                try:
                    if http.get(self.registry_url + "/v1/versions/latest").json().get("version") == version:
                        visible.append(time.monotonic())
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.01)

    # -- nodes ------------------------------------------------------------------------------------
    def start_nodes(self, count: int | None = None, *, first: int = 0, peers: bool = True,
                    object_store: bool = False) -> list[DaemonProcess]:
        started = []
        for i in range(first, first + (count if count is not None else self.n)):
            host = f"node{i}"
            d = self.dir / host
            d.mkdir(exist_ok=True)
            addr = self.address(host)
            sections = {
                "node": {"name": host, "advertise_host": addr},
                "admin": {"host": addr, "port": ADMIN_PORT, "token_file": str(self.token_file)},
                "registry": {"url": self.registry_url, "token_file": str(self.token_file), "long_poll_s": 5,
                             "retry_initial_s": 0.2, "retry_max_s": 1},
                "mirror": {"dir": str(d / "mirror"), "max_bytes": "64GiB"},
                "peers": {"enabled": peers, "host": addr, "port": PEERS_PORT, "announce_idle_s": 1.0},
                "pull": {"streams": 4, "request_bytes": "8MiB", "lease_ttl_s": 30},
                "restart": {"start_timeout_s": 60, "backoff_initial_s": 0.5, "backoff_max_s": 2, "max_retries": 3},
                "shutdown": {"server_grace_s": 2, "kill_wait_s": 5},
            }
            if object_store:
                sections["object_store"] = {"endpoint": self.s3.endpoint, "credentials_file":
                                            str(self.s3.credentials_file)}
            cfg = config(d, self.registry_url, [{"name": "s0", "model": "fake-model",
                                                 "public_port": 9001}], fake=True, **sections)
            daemon = DaemonProcess(cfg, d, prefix=["ip", "netns", "exec", self.ns(host)])
            daemon.start()
            self.daemons.append(daemon)
            started.append(daemon)
        return started

    def wait_mirrors(self, daemons: list[DaemonProcess], version: int, timeout_s: float) -> dict[str, float]:
        """When each daemon's mirror first held ``version`` (monotonic time, seen by polling)."""
        done: dict[str, float] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(daemons):
            if time.monotonic() > deadline:
                missing = [d.cfg["node"]["name"] for d in daemons if d.cfg["node"]["name"] not in done]
                raise TimeoutError(f"version {version} not in the mirror of {missing} after {timeout_s} s\n"
                                   + "\n".join(d.tail(15) for d in daemons if d.cfg["node"]["name"] in missing))
            for d in daemons:
                name = d.cfg["node"]["name"]
                if name in done:
                    continue
                try:
                    if version in d.status()["mirror"]["versions"]:
                        done[name] = time.monotonic()
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        return done

    def stop_nodes(self) -> None:
        for d in self.daemons:
            d.kill_everything()
        for d in self.daemons:
            wait_until(lambda d=d: tagged_pids(d.tag) == [], 20, "every process of a node gone")
        self.daemons = []

    def close(self) -> None:
        for d in self.daemons:
            d.kill_everything()
        if self.s3 is not None:
            self.s3.stop()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if getattr(self, "root_link", None):
            subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)
        self.namespaces = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
