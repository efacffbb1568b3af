"""The node seen from another host: a network namespace made by the test (``ip netns``, a veth
pair), reaching the daemon's gateway the way a trainer does, through the endpoint the registry
lists.

The daemon (``rolloutd run``) runs one real ``vllm serve`` (CPU build), its gateway on all
addresses with a token. From the other host: the allow-listed routes work with the token and
fail without it; every vLLM dev route is 404; the admin API's port refuses the connection (vLLM
listens on no port at all: tests/system/test_private_socket.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid

import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry
from tests.conftest import free_port
from tests.support.daemon_harness import DaemonProcess, config, vllm_server
from tests.support.gateway_clients import DEV_ROUTES, TRICKS

pytestmark = [pytest.mark.timeout(600)]

TOKEN = "netns-gw-token-91c2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def remove_stale_namespaces() -> None:
    """Remove the namespaces of test runs that were killed before their fixture's end (SIGKILL):
    ``rtest-<pid>-<tag>`` whose pid is gone. Deleting a namespace deletes the veth pair with it."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in names:
        if (m := re.fullmatch(r"rtest-(\d+)-[0-9a-f]+", name)) and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def other_host():
    """A network namespace linked to this host by a veth pair: (namespace, host address)."""
    if sys.platform != "linux":
        pytest.fail("network namespaces need Linux")
    remove_stale_namespaces()
    tag = uuid.uuid4().hex[:6]
    # The creator's pid in the name: a later run removes what a killed one left (remove_stale_namespaces).
    ns, here, there = f"rtest-{os.getpid()}-{tag}", f"vh-{tag}", f"vn-{tag}"
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    ip("netns", "add", ns)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", f"{subnet}.1/24", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_the_namespaces_of_a_killed_run_are_removed_and_a_live_runs_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone (reaped): a run killed before its fixture's end
    stale, live = f"rtest-{dead.pid}-0badc0", f"rtest-{os.getpid()}-0badc1"
    for ns in (stale, live):
        ip("netns", "add", ns)
    try:
        remove_stale_namespaces()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert stale not in names and live in names, names
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# Runs inside the other namespace: every probe, results as JSON on stdout.
CLIENT = textwrap.dedent("""
    import json, socket, sys
    import httpx
    endpoint, token, admin_port, dev_routes, tricks = json.loads(sys.argv[1])
    host = endpoint.split("//")[1].split(":")[0]
    auth = {"Authorization": f"Bearer {token}"}
    body = {"token_ids": [1, 5, 9], "stream": False, "sampling_params": {"max_tokens": 8, "temperature": 0}}
    out = {}
    with httpx.Client(timeout=60) as c:
        r = c.post(endpoint + "/inference/v1/generate", json=body, headers=auth)
        out["generate"] = [r.status_code, r.json()["choices"][0]["weight_versions"] if r.status_code == 200 else r.text]
        out["generate_no_token"] = c.post(endpoint + "/inference/v1/generate", json=body).status_code
        out["models"] = c.get(endpoint + "/v1/models", headers=auth).status_code
        out["health"] = c.get(endpoint + "/health", headers=auth).status_code
        with c.stream("POST", endpoint + "/inference/v1/generate", headers=auth,
                      json={**body, "stream": True}) as s:
            out["stream"] = [s.status_code, s.headers.get("content-type"), sum(1 for _ in s.iter_raw())]
        out["dev"] = {f"{m} {p}": c.request(m, endpoint + p, headers=auth).status_code for m, p in dev_routes}

    def raw(path):
        s = socket.create_connection((host, int(endpoint.rsplit(":", 1)[1])), timeout=10)
        s.sendall(f"POST {path} HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 0\\r\\n"
                  f"Authorization: Bearer {token}\\r\\nConnection: close\\r\\n\\r\\n".encode())
        status = int(s.recv(100).split()[1]); s.close(); return status
    out["tricks"] = {p: raw(p) for p in tricks}

    def connect(port):
        try:
            socket.create_connection((host, port), timeout=5).close()
            return "connected"
        except OSError as e:
            return type(e).__name__
    out["admin_port"] = connect(admin_port)
    print(json.dumps(out))
""")


def test_from_another_host_only_the_gateway_answers(tmp_path, other_host):
    ns, host_address = other_host
    (tmp_path / "gateway.token").write_text(TOKEN + "\n")
    model = tinymodel.build(tmp_path / "model", seed=0)
    with EmbeddedRegistry(port=free_port()) as registry:
        registry.publish(1, tinymodel.state_dict(tinymodel.TINY, 11), shard_bytes=600_000, chunk_bytes=1 << 16)
        server = vllm_server("gpu0", model, "0")
        cfg = config(tmp_path, registry.url, [server], node={"name": "node-a", "advertise_host": host_address},
                     gateway={"host": "0.0.0.0", "token_file": str(tmp_path / "gateway.token")})
        daemon = DaemonProcess(cfg, tmp_path).start()
        try:
            daemon.wait(lambda st: st["servers"][0]["state"] == "SERVING", 300, "gpu0 SERVING")
            endpoint = registry.replicas()[0]["endpoint"]
            assert endpoint == f"http://{host_address}:{server['public_port']}"
            args = json.dumps([endpoint, TOKEN, cfg["admin"]["port"], DEV_ROUTES, TRICKS])
            run = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, args],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr
            seen = json.loads(run.stdout)
            log = daemon.log.read_text()
        finally:
            daemon.stop()
    assert seen["generate"] == [200, [{"version": "1", "start": 0, "end": 8}]], seen["generate"]
    assert seen["generate_no_token"] == 401
    assert seen["models"] == seen["health"] == 200
    assert seen["stream"][0] == 200 and seen["stream"][1].startswith("text/event-stream") and seen["stream"][2] > 1
    assert set(seen["dev"].values()) == {404}, seen["dev"]
    assert set(seen["tricks"].values()) == {404}, seen["tricks"]
    assert seen["admin_port"] == "ConnectionRefusedError", seen
    assert TOKEN not in log
