"""No update setting lets a request read KV computed with older weights, unless
``update.keep_kv_cache`` says so (partial-rollout semantics, chosen explicitly).

The daemon's own update sequence (:class:`rolloutd.rollout.apply.Applier`) runs against a real ``vllm
serve`` (CPU build); the reference is transformers' greedy decoding of each version. The prompts
are longer than one KV-cache block (128 tokens on CPU), where vLLM's prefix cache reuses blocks.

- Every ``pause_mode``: a long prompt answered before the update is answered after it exactly as
  the new weights answer it (no prefix-cache block of the old weights is reused).
- ``keep``: a request frozen mid-generation by the pause resumes on the new weights; its tokens
  after the update equal the new weights' greedy continuation of everything before them, because
  its KV is recomputed. With ``keep_kv_cache: true`` they attend to the old KV and differ: that is
  the partial-rollout setting, and nothing else gives it.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from rolloutd.config import Update
from rolloutd.demo import tinymodel
from rolloutd.metrics import Metrics
from rolloutd.rollout.apply import Applier, UpdateRecord
from rolloutd.rollout.updater import Target
from rolloutd.rollout.vllm_http import VllmClient
from rolloutd.supervise.plugin_path import install_plugin
from rolloutd.wire.manifest import build_manifest
from tests.support.vllm_server import VllmServer

# alone: a request must still be generating when the pause reaches it, a race with the machine's speed
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread"), pytest.mark.alone]

LONG = [1] + [(i * 37) % 500 + 3 for i in range(150)]  # 151 tokens: more than one 128-token block
SEEDS = range(10)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv")
    dirs = {s: tinymodel.build(d / str(s), seed=s) for s in SEEDS}
    targets = {}
    for s in SEEDS[1:]:
        m = build_manifest(s, [dirs[s] / "model.safetensors"])
        (dirs[s] / "manifest.json").write_text(m.model_dump_json())
        targets[s] = Target(s, m.digest, dirs[s], "test")
    server = VllmServer(dirs[0], d / "vllm.sock", d / "vllm.log", pythonpath=[install_plugin(d / "plugin")], cpus="0-1")
    try:
        server.wait_healthy()
        yield server, dirs, targets
    finally:
        server.stop()


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def generate(server: VllmServer, prompt: list[int], n: int) -> dict:
    with server.client(timeout=120) as http:
        r = http.post("/inference/v1/generate", json={
            "token_ids": prompt, "sampling_params": {"max_tokens": n, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["choices"][0]


def apply(server: VllmServer, target: Target, gateway_calls: list | None = None, **policy) -> UpdateRecord:
    """One update; ``gateway_calls`` gets (what, whether vLLM was paused then) for each call the
    update made to its gateway's hooks (quiet, recall)."""
    async def run():
        vllm = VllmClient(server.socket)  # as the daemon reaches its servers: on their UNIX socket
        hooks = {}
        if gateway_calls is not None:
            def ask() -> bool:
                with server.client(timeout=30) as http:
                    return http.get("/is_paused").raise_for_status().json()["is_paused"]

            async def paused() -> bool:
                return await asyncio.to_thread(ask)

            async def quiet(timeout_s: float) -> bool:
                gateway_calls.append(("quiet", await paused()))
                return True

            async def recall(grace_s: float) -> int:
                gateway_calls.append(("recall", await paused()))
                return 0
            hooks = {"quiet": quiet, "recall": recall}
        try:
            record = UpdateRecord(target.version)
            await Applier("s0", vllm, Update(**policy), Metrics(), verify=_no_verify, **hooks).apply(target, record)
            return record
        finally:
            await vllm.close()
    return asyncio.run(run())


async def _no_verify(target: Target) -> Target:
    raise AssertionError("the load was not expected to fail")


@pytest.mark.parametrize("mode,version", [("abort", 1), ("wait", 2), ("keep", 3)])
def test_a_long_prompt_after_an_update_is_answered_by_the_new_weights(node, mode, version):
    server, dirs, targets = node
    generate(server, LONG, 8)  # its blocks are now in the prefix cache, computed with the weights before
    calls: list = []
    assert apply(server, targets[version], gateway_calls=calls, pause_mode=mode).ok
    # wait: the gateway's requests all answered before vLLM pauses; abort: what vLLM queued
    # instead of aborting taken back once it has paused; keep: requests go on, nothing asked
    assert calls == {"wait": [("quiet", False)], "abort": [("recall", True)], "keep": []}[mode]
    assert generate(server, LONG, 8)["token_ids"] == hf_greedy(dirs[version], LONG, 8)


@pytest.mark.parametrize("keep_kv_cache,versions", [(False, (4, 5, 6)), (True, (7, 8, 9))])
def test_a_request_frozen_by_keep_resumes_on_recomputed_kv_unless_told_to_keep_it(node, keep_kv_cache, versions):
    server, dirs, targets = node
    prompt, n = LONG[:30], 220
    for version in versions:  # the tiny model is fast: a request may end before the pause reaches it
        stream = Stream(server, prompt, n)
        try:
            assert stream.started.wait(60), "the request did not start generating"
            assert apply(server, targets[version], pause_mode="keep", keep_kv_cache=keep_kv_cache).ok
        finally:
            stream.join(120)
        assert len(stream.tokens) == n and stream.finish_reason == "length"
        if len(stream.spans) == 2:
            break
    else:
        pytest.fail(f"no request was frozen mid-generation in {len(versions)} tries")
    tokens, spans = stream.tokens, stream.spans
    assert spans[-1]["version"] == str(version), spans
    split = spans[-1]["start"]
    assert 0 < split < n - 20, spans
    # The first tokens after the update: where KV of the old weights would weigh most (further on,
    # two float32 implementations of 200-token sequences may part at a near tie)
    after = tokens[split:split + 16]
    recomputed = hf_greedy(dirs[version], prompt + tokens[:split], len(after))
    if keep_kv_cache:
        assert after != recomputed, "keep_kv_cache: the tokens after the update read the old KV"
    else:
        assert after == recomputed


class Stream(threading.Thread):
    """One streamed generation, read in a thread; ``started`` is set once a few tokens arrived."""

    def __init__(self, server: VllmServer, prompt: list[int], n: int):
        super().__init__(daemon=True)
        self.server, self.prompt, self.n = server, prompt, n
        self.tokens: list[int] = []
        self.spans: list[dict] = []
        self.finish_reason: str | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"token_ids": self.prompt, "stream": True,
                "sampling_params": {"max_tokens": self.n, "temperature": 0, "ignore_eos": True}}
        with self.server.client(timeout=120) as http, http.stream("POST", "/inference/v1/generate", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.tokens += choice.get("token_ids") or []
                self.spans = choice.get("weight_versions") or self.spans
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
                if len(self.tokens) >= 8:
                    self.started.set()

