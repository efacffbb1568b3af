"""``rolloutd.fleet`` on real servers: two nodes (two ``rolloutd run`` daemons), each with one
real ``vllm serve`` (CPU build) behind its gateway, and an embedded registry; the client finds
them in the registry's directory and reaches them only through their gateways.

node-a pauses in ``abort`` mode; node-b updates only when asked (its lag policy never moves
it), so the two can hold different versions. The tests run in file order on one pair of nodes:
load spread, seeds, top-k logprobs (both on version 1), the version contract (a at 2, b at 1),
an abort-mode update across a request (a moves to 3), and last a server killed mid-request.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.fleet import FleetSync, Sampling, Span
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire import version_contract as contract
from tests.support.daemon_harness import DaemonProcess, config, uds_client, vllm_server, wait_until
from tests.support.vllm_server import require_vllm

pytestmark = [pytest.mark.timeout(1800)]

SHAPE = tinymodel.Shape(max_positions=2048)
MAX_MODEL_LEN = 2048
PROMPT = [1, 17, 42, 99, 250, 311]


@dataclass
class Nodes:
    reg: EmbeddedRegistry
    a: DaemonProcess
    b: DaemonProcess

    def node(self, replica_id: str) -> DaemonProcess:
        return self.a if replica_id.startswith("node-a.") else self.b


def _daemon(d, registry_url: str, model, name: str, cpus: str, **update) -> DaemonProcess:
    d.mkdir()
    server = vllm_server("s0", model, cpus, args=["--max-model-len", str(MAX_MODEL_LEN)])
    cfg = config(d, registry_url, [server], node={"name": name, "advertise_host": "127.0.0.1"}, update=update,
                 restart={"start_timeout_s": 900})  # two servers starting at once on a busy 2-core machine
    return DaemonProcess(cfg, d)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    require_vllm()
    d = tmp_path_factory.mktemp("fleet")
    model = tinymodel.build(d / "model", SHAPE, seed=0)
    reg = EmbeddedRegistry(port=0).start()
    reg.publish(1, tinymodel.state_dict(SHAPE, 1))
    a = _daemon(d / "a", reg.url, model, "node-a", "0", pause_mode="abort")
    b = _daemon(d / "b", reg.url, model, "node-b", "1", min_version_lag=1000, max_update_delay_s=86400)
    try:
        for n in (a, b):
            n.start()
        for n in (a, b):
            n.wait_versions({"s0": 1}, timeout_s=960)
        yield Nodes(reg, a, b)
    finally:
        for n in (a, b):
            try:
                n.stop()
            finally:
                n.kill_everything()
        reg.stop()


@pytest.fixture(scope="module")
def fleet(nodes):
    with FleetSync(nodes.reg.url, refresh_s=0.2) as f:
        f.wait_for(1, n=2, timeout_s=30)
        yield f


def vllm_metric(node: DaemonProcess, name: str) -> float:
    """Sum of a metric's samples on the node's vLLM (its private socket: the test's own view)."""
    with uds_client(node.socket("s0"), timeout=10) as c:
        text = c.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def answered(node: DaemonProcess) -> float:
    return vllm_metric(node, "vllm:request_success_total")


# -- both nodes on version 1 ----------------------------------------------------------------------

def test_routing_spreads_concurrent_requests_over_both_servers(nodes, fleet):
    before = {n: answered(n) for n in (nodes.a, nodes.b)}
    outs = fleet.generate_many([PROMPT] * 8, Sampling(max_tokens=24, ignore_eos=True))
    by_replica = {r: sum(o.replica == r for o in outs) for r in ("node-a.s0", "node-b.s0")}
    assert by_replica == {"node-a.s0": 4, "node-b.s0": 4}
    assert {n: answered(n) - before[n] for n in (nodes.a, nodes.b)} == {nodes.a: 4, nodes.b: 4}  # the servers' count
    assert all(len(o.token_ids) == 24 and o.weight_versions == [Span(1, 0, 24)] for o in outs)


def test_a_seed_gives_the_same_sample_on_every_replica_at_a_version(fleet):
    def sample(seed: int | None, n: int = 4) -> list[list[int]]:
        outs = fleet.generate_many([PROMPT] * n, Sampling(max_tokens=32, temperature=2.0, seed=seed, ignore_eos=True))
        assert {o.replica for o in outs} == {"node-a.s0", "node-b.s0"}
        return [o.token_ids for o in outs]
    seven = sample(7)
    assert all(t == seven[0] for t in seven)  # two requests on each server, one sample
    assert sample(7, 2) == seven[:2]
    assert sample(8, 2)[0] != seven[0]
    # No seed: each request draws on from its server's generator (every server starts its generator
    # alike, so compare two requests on one server, kept there by a session).
    free = Sampling(max_tokens=32, temperature=2.0, ignore_eos=True)
    unseeded = [fleet.generate(PROMPT, free, session="one-server").token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_top_k_logprobs_arrive_ranked_with_the_sampled_token(fleet):
    out = fleet.generate(PROMPT, Sampling(max_tokens=16, temperature=0, top_logprobs=5, ignore_eos=True))
    assert len(out.logprobs) == len(out.top_logprobs) == 16
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 5 and len({t for t, _ in top}) == 5
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == token and abs(top[0][1] - logprob) < 1e-4  # greedy: the sampled token is the top one
        assert all(lp <= 0 for _, lp in top)
    sampled = fleet.generate(PROMPT, Sampling(max_tokens=16, temperature=2.0, seed=1, top_logprobs=3))
    assert all(len(top) == 3 for top in sampled.top_logprobs)


# -- node-a on version 2, node-b on 1 -----------------------------------------------------------------

def test_a_min_version_request_is_never_answered_by_an_older_server(nodes, fleet):
    nodes.reg.publish(2, tinymodel.state_dict(SHAPE, 2))
    nodes.a.wait_versions({"s0": 2})
    fleet.wait_for(2, timeout_s=30)
    assert nodes.b.server("s0")["version"] == 1
    before_b = answered(nodes.b)
    outs = fleet.generate_many([PROMPT] * 12, Sampling(max_tokens=8), min_version=2)
    assert {o.replica for o in outs} == {"node-a.s0"} and all(o.versions == [2] for o in outs)
    assert answered(nodes.b) == before_b
    assert {o.replica for o in fleet.generate_many([PROMPT] * 6, Sampling(max_tokens=4))} == \
        {"node-a.s0", "node-b.s0"}  # without the contract, node-b still serves
    # Any client, any language: the gateway itself refuses what its server cannot meet.
    gateway_b = nodes.b.server("s0")["endpoint"]
    r = httpx.post(gateway_b + "/inference/v1/generate", headers={contract.MIN_VERSION_HEADER: "2"}, timeout=30,
                   json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}})
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_behind"
    assert r.headers[contract.VERSION_HEADER] == "1" and "Retry-After" in r.headers


def test_a_request_across_an_abort_mode_update_completes_on_the_new_weights_within_the_budget(nodes, fleet):
    tokens_before = vllm_metric(nodes.a, "vllm:generation_tokens_total")
    future = fleet.submit(PROMPT, Sampling(max_tokens=100_000, ignore_eos=True), min_version=2)
    wait_until(lambda: vllm_metric(nodes.a, "vllm:generation_tokens_total") > tokens_before + 50, 120,
               "the request generating on node-a")
    nodes.reg.publish(3, tinymodel.state_dict(SHAPE, 3))  # node-a pauses in abort mode to load it
    out = future.result(timeout=600)
    assert not future.cancelled()
    assert out.versions == [2, 3], out.weight_versions  # two spans: the tokens before and after the update
    first, second = out.weight_versions
    assert first.start == 0 and first.end == second.start > 0 and second.end == len(out.token_ids)
    assert len(PROMPT) + len(out.token_ids) == MAX_MODEL_LEN  # the budget re-clamped against max_model_len
    assert out.finish_reason == "length" and out.continuations >= 1 and set(out.replicas) == {"node-a.s0"}
    assert len(out.logprobs) == len(out.token_ids)
    assert nodes.a.server("s0")["last_update"]["version"] == 3 and nodes.b.server("s0")["version"] == 1


# -- both on version 3; then a server dies --------------------------------------------------------------

def test_a_server_killed_mid_request_is_retried_elsewhere_and_the_caller_gets_one_answer(nodes, fleet):
    assert nodes.b.action("/update").status_code == 200  # "update now": node-b moves to 3 as well
    nodes.b.wait_versions({"s0": 3})
    fleet.wait_for(3, n=2, timeout_s=30)
    future = fleet.submit(PROMPT, Sampling(max_tokens=1500, ignore_eos=True), min_version=3)
    deadline = time.monotonic() + 60
    while not (busy := [r for r in fleet.replicas() if r["in_flight"]]) and time.monotonic() < deadline:
        time.sleep(0.02)
    victim, survivor = (nodes.a, nodes.b) if busy[0]["replica_id"] == "node-a.s0" else (nodes.b, nodes.a)
    wait_until(lambda: vllm_metric(victim, "vllm:num_requests_running") >= 1, 60, "the request running")
    os.killpg(victim.server("s0")["pid"], signal.SIGKILL)  # the whole vllm serve, mid-request
    out = future.result(timeout=600)
    survivor_id = f"{survivor.cfg['node']['name']}.s0"
    assert out.replicas == [survivor_id] and out.attempts == 2  # one answer, from the other server
    assert len(out.token_ids) == 1500 and out.versions == [3]
    # One retry, of whichever kind the gateway's answer took: the connection lost or a 502 while
    # the daemon still counts the server as serving, a 503 once it has seen the group die (its
    # watch of vLLM's processes may see that before the gateway sees the connection end).
    retries = {k: n for k, n in fleet.stats.items() if k.startswith("retry_") and n}
    assert sum(retries.values()) == 1 and set(retries) <= {"retry_lost", "retry_server_error",
                                                          "retry_unavailable"}, retries
    victim.wait(lambda st: st["servers"][0]["incarnation"] == 2, 60, "the killed server restarted by its daemon")
