"""The tests of test_private_socket.py that run one at a time in the slow tier (slow by this folder):
another local user against a real vLLM served by the daemon; the rest is in
tests/integration/node/test_private_socket.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.support.daemon_harness import AS_NOBODY, DaemonProcess, config, socket_probe, vllm_server
from tests.support.processes import listening_tcp_ports

pytestmark = [pytest.mark.timeout(900)]

SYSTEM_PYTHON = Path("/usr/bin/python3")  # nobody cannot run the test's own interpreter (under /root)
# Runs as nobody: what another local user can do to the server, as JSON on stdout.
OTHER_USER = textwrap.dedent("""
    import json, socket, sys, urllib.error, urllib.request
    probe, api_ports, gateway = json.loads(sys.argv[1])
    out = {}
    scope = {}
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()) as said:
        exec(probe, scope)
    out["socket"] = said.getvalue().strip()

    def http(url, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return [r.status, json.loads(r.read())]
        except urllib.error.HTTPError as e:
            return [e.code, None]
        except OSError as e:
            return [type(e).__name__, None]
    out["tcp"] = {str(p): http(f"http://127.0.0.1:{p}/is_paused") for p in api_ports}
    body = {"token_ids": [1, 5, 9], "stream": False, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    out["generate"] = http(gateway + "/inference/v1/generate", body)
    out["pause"] = http(gateway + "/pause?mode=abort", {})
    print(json.dumps(out))
""")


def test_another_user_reaches_no_vllm_route_while_the_gateway_serves(tmp_path):
    assert SYSTEM_PYTHON.exists(), f"{SYSTEM_PYTHON} is needed to run a process as another user"
    model = tinymodel.build(tmp_path / "model", seed=0)
    with EmbeddedRegistry(port=0) as registry:
        registry.publish(1, tinymodel.state_dict(tinymodel.TINY, 11), shard_bytes=600_000, chunk_bytes=1 << 16)
        # vLLM's start: about 30 s alone, many minutes on a busy machine
        cfg = config(tmp_path, registry.url, [vllm_server("gpu0", model, "0")], restart={"start_timeout_s": 600})
        daemon = DaemonProcess(cfg, tmp_path).start()
        try:
            st = daemon.wait_versions({"gpu0": 1}, 660)
            server = daemon.server("gpu0", st)
            sock = daemon.socket("gpu0")
            assert server["socket"] == str(sock)
            directory = sock.parent.stat()
            assert (stat.S_IMODE(directory.st_mode), directory.st_uid) == (0o700, os.geteuid())
            api_ports = listening_tcp_ports(server["pid"])  # vLLM's API server: the process with the routes
            args = json.dumps([socket_probe(sock), api_ports, f"http://127.0.0.1:{server['public_port']}"])
            mine = subprocess.run([str(SYSTEM_PYTHON), "-c", socket_probe(sock)], capture_output=True, text=True,
                                  timeout=60, cwd="/")
            other = subprocess.run([*AS_NOBODY, str(SYSTEM_PYTHON), "-c", OTHER_USER, args], capture_output=True,
                                   text=True, timeout=120, cwd="/")
            assert other.returncode == 0, other.stderr
            seen = json.loads(other.stdout)
            with daemon.vllm("gpu0") as c:
                paused = c.get("/is_paused").json()
        finally:
            daemon.stop()
    assert mine.stdout.strip() == "HTTP/1.1 200 OK", mine  # the daemon's user reaches vLLM on the socket
    assert (api_ports, seen["tcp"]) == ([], {}), seen["tcp"]  # no TCP port to try
    assert seen["socket"] == "PermissionError", seen
    status, answer = seen["generate"]
    assert status == 200 and answer["choices"][0]["weight_versions"][0]["version"] == "1", seen["generate"]
    assert seen["pause"][0] == 404, seen["pause"]
    assert paused == {"is_paused": False}
