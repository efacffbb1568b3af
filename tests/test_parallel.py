"""Servers of several processes through the daemon: a real CPU ``vllm serve`` with the plugin,
tensor-parallel (``--tensor-parallel-size 2``) beside a one-worker server of the same model, then
data-parallel (``--data-parallel-size 2``: two engines, two API server processes on one UNIX
socket); docs/parallel.md.

One daemon at a time, shared by the tests of its shape, which run in file order: the tied
family updated A -> B -> C, each version's greedy outputs through every gateway equal to
transformers'; for DP, the prompts sent until each engine answered several of them (vLLM counts
the requests of each engine in ``/metrics``), so an engine left on old weights cannot hide. Then
one TP worker, or one DP engine, killed in the middle of an update.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rolloutd.demo import families
from rolloutd.trainer import EmbeddedRegistry

from .daemon_harness import DaemonProcess, config, vllm_server, wait_until
from .test_engine_kill import shm_mapped
from .test_model_matrix import NEW_TOKENS, generate
from .vllm_server import group_pids, require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]

FAMILY = "qwen2"  # tied embeddings: the output head must follow the embedding on every worker
SEED = {1: 11, 2: 12, 3: 13}  # version -> weights seed; the servers start on seed 0 (A)
TP, ONE, DP = "tp2", "tp1", "dp2"
ROUNDS = 3  # the DP server's prompts are sent this many times: each engine answers some of them


@dataclass
class Node:
    tmp: Path
    reg: EmbeddedRegistry
    daemon: DaemonProcess
    gateways: dict[str, str]
    paused_s: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def scratch(self) -> list[Path]:
        """The servers' own directories (each one's TMPDIR), gone once its processes are."""
        d = self.tmp / "state" / "scratch"
        return sorted(d.iterdir()) if d.exists() else []

    def close(self) -> None:
        try:
            assert self.daemon.stop(90) == 0
            assert self.scratch == [], "a stopped server's TMPDIR is left"
        finally:
            self.daemon.kill_everything()
            self.reg.stop()


def start_node(tmp: Path, servers: list[dict]) -> Node:
    start = families.build(tmp / "A", FAMILY, seed=0)
    reg = EmbeddedRegistry(port=0).start()
    servers = [{**s, "model": str(start)} for s in servers]
    d = DaemonProcess(config(tmp, reg.url, servers, restart={"start_timeout_s": 400, "failed_grace_s": 2,
                                                             "backoff_initial_s": 0.5, "backoff_max_s": 2,
                                                             "max_retries": 3}), tmp)
    t0 = time.monotonic()
    d.start()
    try:
        st = d.wait(lambda s: all(x["state"] == "SERVING" for x in s["servers"]), 600, "every server SERVING")
    except BaseException:
        d.kill_everything()
        reg.stop()
        raise
    print(f"{', '.join(s['name'] for s in servers)} SERVING {time.monotonic() - t0:.1f} s after the daemon's start")
    return Node(tmp, reg, d, {x["name"]: f"http://127.0.0.1:{x['public_port']}" for x in st["servers"]},
                {s["name"]: {} for s in servers})


class Nodes:
    """One node at a time: two would only take each other's cores."""

    def __init__(self, tmp_factory):
        self.tmp_factory, self.open, self.kind = tmp_factory, None, None

    def get(self, kind: str) -> Node:
        if self.kind != kind and self.open is not None:
            self.open.close()
            self.open = None
        if self.open is None:
            tmp = self.tmp_factory.mktemp(kind)
            # Each server lists its cores; the daemon splits them between its workers.
            servers = {"tp": [vllm_server(TP, Path(), "0-1", args=["--tensor-parallel-size", "2"], env={}),
                              vllm_server(ONE, Path(), "1")],  # shares core 1 with the second TP worker
                       "dp": [vllm_server(DP, Path(), "0-1", args=["--data-parallel-size", "2"], env={})]}[kind]
            self.open, self.kind = start_node(tmp, servers), kind
        return self.open


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    require_vllm()
    n = Nodes(tmp_path_factory)
    yield n
    if n.open is not None:
        n.open.close()


def served_exactly(node: Node, version: int, want: list[list[int]], rounds: int = 1) -> None:
    st = node.daemon.wait_versions({name: version for name in node.gateways}, 300)
    for name, url in node.gateways.items():
        for _ in range(rounds):
            got, labels = generate(url, families.PROMPTS)
            assert labels == {str(version)}, (name, labels)
            assert got == want, f"{name} on version {version}: served {got}, transformers {want}"
        node.paused_s[name][version] = node.daemon.server(name, st)["last_update"]["phases_s"]["paused"]


def a_to_c(node: Node, check=lambda version: None, rounds: int = 1) -> None:
    """A, then B and C published: each served exactly by every server of ``node``."""
    a = families.greedy(families.hf_model(FAMILY, 0), families.PROMPTS, NEW_TOKENS)
    for name, url in node.gateways.items():
        assert generate(url, families.PROMPTS)[0] == a, f"{name}: the start model differs from transformers'"
    for version in (1, 2):  # B, C
        model = families.hf_model(FAMILY, SEED[version])
        want = families.greedy(model, families.PROMPTS, NEW_TOKENS)
        assert all(x != y for x, y in zip(a, want, strict=True)), "every output must change"
        node.reg.publish(version, model)
        check(version)
        served_exactly(node, version, want, rounds)
        check(version)
    print("pause window (s) per version:", {k: {v: round(s, 3) for v, s in d.items()} for k, d in
                                              node.paused_s.items()})


def test_a_tensor_parallel_server_is_updated_a_b_c_exactly(nodes):
    """Both workers load every version: a worker left on old weights (or an output head left on
    the old embedding) changes the greedy tokens."""
    node = nodes.get("tp")
    with node.daemon.vllm(TP) as c:
        assert c.get("/get_world_size").json()["world_size"] == 2
    log = node.daemon.log_text()
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in log and "local_rank=1, core ids=[1]" in log, log[-3000:]
    environ = Path(f"/proc/{node.daemon.server(TP)['pid']}/environ").read_text()
    [tmp] = [p for p in node.scratch if f"TMPDIR={p}\0" in environ]  # its own, not /tmp
    assert [f.name for f in tmp.iterdir() if f.name.startswith("vllm_dist_")], "vLLM's rendezvous store"
    a_to_c(node)


def _process(pgid: int, title: str) -> int:
    """The process of group ``pgid`` that vLLM titled ``VLLM::<title>``."""
    for pid in group_pids(pgid):
        try:
            if f"VLLM::{title}" in Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no {title} in group {pgid}")


def killed_mid_update(node: Node, server: str, title: str, rounds: int = 1) -> None:
    """The process ``title`` of ``server`` is stopped before an update (the update's first route
    that needs it then waits), then killed once the daemon is UPDATING: the server is in BACKOFF
    within seconds, then SERVING the new version exactly; nothing of the old group is left:
    processes, /dev/shm segments, its TMPDIR."""
    d = node.daemon
    pid = d.server(server)["pid"]
    segments = {n for n in shm_mapped(group_pids(pid)) if "/" not in n}
    assert segments, "the group holds no /dev/shm segment"
    victim = _process(pid, title)
    old_tmp = {p for p in node.scratch if f"TMPDIR={p}\0" in Path(f"/proc/{pid}/environ").read_text()}
    assert len(old_tmp) == 1 and any(next(iter(old_tmp)).iterdir()), "vLLM wrote nothing in its TMPDIR"
    os.kill(victim, signal.SIGSTOP)
    model = families.hf_model(FAMILY, SEED[3])
    want = families.greedy(model, families.PROMPTS, NEW_TOKENS)
    node.reg.publish(3, model)
    d.wait(lambda s: d.server(server, s)["state"] == "UPDATING", 120, "UPDATING")
    time.sleep(1.0)  # a route of the update is in flight, held by the stopped process
    assert d.server(server)["state"] == "UPDATING"
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    d.wait(lambda s: d.server(server, s)["state"] == "BACKOFF", 30, "BACKOFF")
    to_backoff = time.monotonic() - t0
    wait_until(lambda: not group_pids(pid), 30, "the old group gone")
    def left() -> list[str]:  # removed by the daemon once it found the group gone
        return sorted(n for n in segments if (Path("/dev/shm") / n).exists())
    wait_until(lambda: not left(), 30, f"the dead group's shared memory removed: {left()}")
    served_exactly(node, 3, want, rounds)
    assert not old_tmp & set(node.scratch), "the TMPDIR of the killed group is left"
    print(f"{title} killed: BACKOFF after {to_backoff:.1f} s, SERVING v3 after {time.monotonic() - t0:.1f} s; "
          f"segments of the old group: {sorted(segments)}")
    assert to_backoff < 10, to_backoff
    assert d.server(server)["incarnation"] == 2


def test_a_tp_worker_killed_mid_update_is_in_backoff_within_seconds(nodes):
    killed_mid_update(nodes.get("tp"), TP, "Worker_TP1")


def engine_answers(node: Node) -> dict[str, float]:
    """Requests each engine of the DP server finished, by vLLM's own count: engine -> count."""
    with node.daemon.vllm(DP) as c:
        text = c.get("/metrics").text
    counts: dict[str, float] = {}
    for engine, n in re.findall(r'^vllm:request_success_total\{engine="(\d+)"[^}]*\} ([\d.e+]+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(n)
    return counts


def test_a_data_parallel_server_is_updated_a_b_c_exactly_on_every_engine(nodes):
    """Two engines behind two API server processes on the server's one UNIX socket: every
    version's outputs equal transformers', and each engine answered some of them."""
    node = nodes.get("dp")
    log = node.daemon.log_text()
    assert "Started 2 API server processes" in log, log[-3000:]
    with node.daemon.vllm(DP) as c:
        assert c.get("/get_world_size").json()["world_size"] == 2  # the engines' workers together
    seen: list[dict[str, float]] = [engine_answers(node)]

    def each_engine_answered(version: int) -> None:
        seen.append(engine_answers(node))
    a_to_c(node, each_engine_answered, rounds=ROUNDS)
    for before, after in zip(seen[1::2], seen[2::2], strict=True):  # around each version's outputs
        answered = {e: after.get(e, 0) - before.get(e, 0) for e in ("0", "1")}
        assert all(n >= 2 for n in answered.values()), f"an engine answered too few to show its weights: {answered}"


def test_a_dp_engine_killed_mid_update_is_in_backoff_within_seconds(nodes):
    killed_mid_update(nodes.get("dp"), DP, "EngineCore_DP1", rounds=ROUNDS)
