"""The gate end to end: ``rolloutd run`` with one real ``vllm serve`` (CPU build), an embedded
registry, and canaries computed by make_canary on Hugging Face copies of the weights.

Version 1 carries the canary of its own weights: the server serves it, /status and the metrics
show a figure far below the tolerance, and its greedy answers are transformers'. Version 2 carries
a canary the server cannot score (longer than its max_model_len): it is loaded once, refused on
the node, and the server serves version 1 again (no restart, never FATAL); no request through the
gateway is answered by version 2's weights; /status, the registry's directory and
wait_for_replicas say why at once. Version 3 is then taken as usual and served exactly.

The fast tests run the gate against the fake vLLM (tests/support/fake_vllm.py) in this process, on a
UNIX socket: a data-parallel server has each engine scored, and one engine on other weights
fails the gate, named.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from rolloutd.rollout.gate import GateFailed, run_gate
from rolloutd.rollout.vllm_http import VllmClient
from rolloutd.wire.manifest import Canary
from tests.support.fake_vllm import FakeVllm, parse_faults

# -- each data-parallel engine, against the fake ----------------------------------------------------------
CANARY = Canary(prompt_ids=[1, 2, 3], continuation_ids=[4, 5], logprobs=[-1.0, -1.0])  # what the fake serves


@contextlib.asynccontextmanager
async def fake_vllm(tmp: Path, faults: str = "", engines: int = 1) -> AsyncIterator[tuple[VllmClient, list[str]]]:
    """The fake vLLM standing for ``engines`` engines, served in this process on a UNIX socket:
    a client of it, and the ``X-data-parallel-rank`` header of each request it scored."""
    fake, pinned = FakeVllm("m", parse_faults(faults), engines), []

    @web.middleware
    async def seen(request: web.Request, handler):
        if request.path == "/v1/completions":
            pinned.append(request.headers.get("X-data-parallel-rank"))
        return await handler(request)
    app = fake.app()
    app.middlewares.insert(0, seen)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(tmp / "fake.sock")).start()
    vllm = VllmClient(tmp / "fake.sock")
    try:
        yield vllm, pinned
    finally:
        await vllm.close()
        await runner.cleanup()


@pytest.mark.parametrize("canary", [CANARY, None], ids=["canary", "probe"])
async def test_each_data_parallel_engine_is_scored_by_the_gate(tmp_path, canary):
    async with fake_vllm(tmp_path, engines=3) as (vllm, pinned):
        result = await run_gate(vllm, canary, 5, engines=3)
    assert result.ok and result.tokens == 4
    assert pinned == ["0", "1", "2"], "each engine named in its own request"


@pytest.mark.parametrize("canary,fault,error", [
    (CANARY, "1:-3.0", "gate: data-parallel engine 1 of 2: canary mismatch: max |dlogprob| 2 > tolerance 0.05"),
    (None, "1:-3.0", "gate: data-parallel engine 1 of 2: the probe differs from engine 0's by max |dlogprob| 2 > "
                     "0.05: the engines hold different weights"),
    (None, "1:nan", "gate: data-parallel engine 1 of 2: non-finite logprobs at 4 of 4 positions"),
], ids=["canary", "probe", "non-finite"])
async def test_one_data_parallel_engine_on_other_weights_fails_the_gate_named(tmp_path, canary, fault, error):
    """Engine 0 (the one vLLM's balancer picks for an idle server) is right: a gate that scored
    whichever engine answered would pass."""
    async with fake_vllm(tmp_path, f"rank_logprob={fault}", engines=2) as (vllm, _):
        assert (await run_gate(vllm, canary, 5)).ok, "through the balancer engine 0 answers, and passes"
        with pytest.raises(GateFailed) as failed:
            await run_gate(vllm, canary, 5, engines=2)
    assert str(failed.value).startswith(error), failed.value
    assert not failed.value.version_fault and not failed.value.no_answer
    assert failed.value.result.ok is False


async def test_a_request_refused_by_a_later_engine_only_is_not_the_versions_fault(tmp_path):
    """The canary the first engine scored is a request every engine can run: a refusal by another
    one (here: an engine the server does not have) is the server's, never a reason to refuse the
    version on the node at once."""
    async with fake_vllm(tmp_path, engines=1) as (vllm, _):
        with pytest.raises(GateFailed) as failed:
            await run_gate(vllm, CANARY, 5, engines=2)
    assert "gate: data-parallel engine 1 of 2: scoring failed: /v1/completions: HTTP 400: data_parallel_rank 1 is " \
           "out of range [0, 1)" in str(failed.value), failed.value
    assert not failed.value.version_fault
