"""Servers of several processes through the daemon: a real CPU ``vllm serve --tensor-parallel-size 2``
with the plugin, beside a one-worker server of the same model (docs/parallel.md).

One daemon runs for the module, its two servers shared by the tests, which run in file order: the
tied family updated A -> B -> C, each version's greedy outputs through both gateways equal to
transformers'; then one TP worker killed in the middle of an update.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rolloutd.demo import families
from rolloutd.registry import EmbeddedRegistry

from .daemon_harness import DaemonProcess, config, vllm_server, wait_until
from .test_engine_kill import shm_mapped
from .test_model_matrix import NEW_TOKENS, generate
from .vllm_server import group_pids, require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]

FAMILY = "qwen2"  # tied embeddings: the output head must follow the embedding on every worker
SEED = {1: 11, 2: 12, 3: 13}  # version -> weights seed; the servers start on seed 0 (A)
TP, ONE = "tp2", "tp1"


@dataclass
class Node:
    tmp: Path
    reg: EmbeddedRegistry
    daemon: DaemonProcess
    gateways: dict[str, str]
    paused_s: dict[str, dict[int, float]] = field(default_factory=lambda: {TP: {}, ONE: {}})


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("parallel")
    start = families.build(tmp / "A", FAMILY, seed=0)
    reg = EmbeddedRegistry(port=0).start()
    # The TP server's two workers on one core each (the daemon splits its cpus between them); the
    # one-worker server shares core 1.
    servers = [vllm_server(TP, start, "0-1", args=["--tensor-parallel-size", "2"], env={}),
               vllm_server(ONE, start, "1")]
    d = DaemonProcess(config(tmp, reg.url, servers, restart={"start_timeout_s": 400, "failed_grace_s": 2,
                                                             "backoff_initial_s": 0.5, "backoff_max_s": 2,
                                                             "max_retries": 3}), tmp)
    t0 = time.monotonic()
    d.start()
    try:
        st = d.wait(lambda s: all(x["state"] == "SERVING" for x in s["servers"]), 500, "both servers SERVING")
        print(f"both servers SERVING {time.monotonic() - t0:.1f} s after the daemon's start")
        yield Node(tmp, reg, d, {x["name"]: f"http://127.0.0.1:{x['public_port']}" for x in st["servers"]})
    finally:
        try:
            d.stop(90)
        finally:
            d.kill_everything()
            reg.stop()


def served_exactly(node: Node, version: int, want: list[list[int]]) -> None:
    st = node.daemon.wait_versions({TP: version, ONE: version}, 300)
    for name, url in node.gateways.items():
        got, labels = generate(url, families.PROMPTS)
        assert labels == {str(version)}, (name, labels)
        assert got == want, f"{name} on version {version}: served {got}, transformers {want}"
        node.paused_s[name][version] = node.daemon.server(name, st)["last_update"]["phases_s"]["paused"]


def test_a_tensor_parallel_server_is_updated_a_b_c_exactly(node):
    """Both workers load every version: a worker left on old weights (or an output head left on
    the old embedding) changes the greedy tokens."""
    with node.daemon.vllm(TP) as c:
        assert c.get("/get_world_size").json()["world_size"] == 2
    log = node.daemon.log_text()
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in log and "local_rank=1, core ids=[1]" in log, log[-3000:]
    a = families.greedy(families.hf_model(FAMILY, 0), families.PROMPTS, NEW_TOKENS)
    for name, url in node.gateways.items():
        assert generate(url, families.PROMPTS)[0] == a, f"{name}: the start model differs from transformers'"
    for version in (1, 2):  # B, C
        model = families.hf_model(FAMILY, SEED[version])
        want = families.greedy(model, families.PROMPTS, NEW_TOKENS)
        assert all(x != y for x, y in zip(a, want, strict=True)), "every output must change"
        node.reg.publish(version, model)
        served_exactly(node, version, want)
    print("pause window (s) per version:", {k: {v: round(s, 3) for v, s in d.items()} for k, d in
                                              node.paused_s.items()})


def _worker(pgid: int, rank: int) -> int:
    for pid in group_pids(pgid):
        try:
            if f"Worker_TP{rank}" in Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no Worker_TP{rank} in group {pgid}")


def test_a_tp_worker_killed_mid_update_is_in_backoff_within_seconds(node):
    """Worker TP1 is stopped before an update (the update's first route that needs every worker
    then waits), then killed once the daemon is UPDATING: the server is in BACKOFF within
    seconds, then SERVING the new version exactly; nothing of the old group is left, processes
    or /dev/shm segments."""
    d = node.daemon
    st = d.server(TP)
    pid = st["pid"]
    group = group_pids(pid)
    segments = {n for n in shm_mapped(group) if "/" not in n}
    assert segments, "the TP group holds no /dev/shm segment"
    worker = _worker(pid, 1)
    os.kill(worker, signal.SIGSTOP)
    model = families.hf_model(FAMILY, SEED[3])
    want = families.greedy(model, families.PROMPTS, NEW_TOKENS)
    node.reg.publish(3, model)
    d.wait(lambda s: d.server(TP, s)["state"] == "UPDATING", 120, "UPDATING")
    time.sleep(1.0)  # a route of the update is in flight, held by the stopped worker
    assert d.server(TP)["state"] == "UPDATING"
    t0 = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    d.wait(lambda s: d.server(TP, s)["state"] == "BACKOFF", 30, "BACKOFF")
    to_backoff = time.monotonic() - t0
    wait_until(lambda: not group_pids(pid), 30, "the old group gone")
    left = sorted(n for n in segments if (Path("/dev/shm") / n).exists())
    assert left == [], f"shared memory of the dead group left: {left}"
    served_exactly(node, 3, want)
    print(f"TP worker killed: BACKOFF after {to_backoff:.1f} s, SERVING v3 after {time.monotonic() - t0:.1f} s; "
          f"segments of the old group: {sorted(segments)}")
    assert to_backoff < 10, to_backoff
    assert d.server(TP)["incarnation"] == 2
