"""The tests of test_gate.py that run one at a time in the slow tier (slow by this folder): the
gate end to end on a real vLLM; its tests against the fake vLLM are in
tests/integration/rollout/test_gate.py."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry, VersionRefused
from rolloutd.trainer.canary import make_canary
from rolloutd.wire.manifest import Canary
from tests.conftest import free_port
from tests.support.daemon_harness import DaemonProcess, config, vllm_server

PROMPT = [1, 17, 42, 99, 250, 7, 300, 12]


def hf(directory):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(directory)


def metric(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^rolloutd_{name}{f'{{{re.escape(want)}}}' if want else ''} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


class Hammer(threading.Thread):
    """Greedy requests through the gateway, one after another, until stopped: (status, token ids)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.results, self.stopped = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            while not self.stopped.is_set():
                try:
                    r = c.post(self.url + "/inference/v1/generate", json={
                        "token_ids": PROMPT, "stream": False,
                        "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}})
                    self.results.append((r.status_code, r.json()["choices"][0]["token_ids"]
                                         if r.status_code == 200 else None))
                except httpx.HTTPError as e:
                    self.results.append((None, repr(e)))
                time.sleep(0.05)


def generate(gateway: str) -> list[int]:
    r = httpx.post(gateway + "/inference/v1/generate", timeout=30, json={
        "token_ids": PROMPT, "stream": False,
        "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def until(fetch, timeout_s: float):
    """``fetch()`` once it gives something true, polled; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (got := fetch()):
        assert time.monotonic() < deadline, f"nothing after {timeout_s} s"
        time.sleep(0.1)
    return got


@pytest.mark.timeout(600)
def test_a_bad_version_is_refused_and_the_server_serves_its_last_good_version_then_the_next(tmp_path):
    start = tinymodel.build(tmp_path / "m0", seed=0)
    m1, m2, m3 = (hf(tinymodel.build(tmp_path / f"m{s}", seed=s)) for s in (1, 2, 3))
    good, good3 = make_canary(m1, PROMPT), make_canary(m3, PROMPT)  # each version's own canary
    v1_tokens, v3_tokens = good.continuation_ids, good3.continuation_ids  # greedy, by transformers
    v2_tokens = make_canary(m2, PROMPT).continuation_ids
    assert len({tuple(v1_tokens), tuple(v2_tokens), tuple(v3_tokens)}) == 3, "the versions must answer differently"
    # version 2's canary is longer than the server's max_model_len (256, FAST_CPU_FLAGS): vLLM refuses to score it
    unscorable = Canary(prompt_ids=(PROMPT * 80)[:600], continuation_ids=[5], logprobs=[-1.0])

    with EmbeddedRegistry(port=free_port()) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), chunk_bytes=1 << 16, canary=good)
        cfg = config(tmp_path, reg.url, [vllm_server("gpu0", start, "1")],
                     restart={"max_retries": 0}, gateway={"hold_max_s": 2},  # FATAL at the first counted failure
                     # "wait": requests in flight end on version 1 before the pause; with "keep" they would
                     # go on after /resume on version 2's weights while the gate runs (docs/daemon.md)
                     update={"pause_mode": "wait"})
        daemon = DaemonProcess(cfg, tmp_path).start()
        gateway = f"http://127.0.0.1:{cfg['servers'][0]['public_port']}"
        try:
            st = daemon.wait_versions({"gpu0": 1}, timeout_s=240)
            gate = daemon.server("gpu0", st)["last_update"]["gate"]
            assert gate["ok"] and gate["canary"] and gate["tokens"] == len(PROMPT) + 16 - 1
            assert gate["max_abs_dlogprob"] < 1e-3 < good.tolerance, gate
            assert metric(daemon.url, "gate_max_abs_dlogprob", server="gpu0") == pytest.approx(
                gate["max_abs_dlogprob"], abs=1e-6)
            assert generate(gateway) == v1_tokens, "what the server answers is what the trainer's model says"

            hammer = Hammer(gateway)
            hammer.start()
            until(lambda: any(status == 200 for status, _ in hammer.results), 30)
            reg.publish(2, tinymodel.state_dict(tinymodel.TINY, 2), chunk_bytes=1 << 16, canary=unscorable)
            st = daemon.wait(lambda st: st["refused"] and daemon.server("gpu0", st)["state"] == "SERVING", 120,
                             "version 2 refused and the server serving")
            hammer.stopped.set()
            hammer.join(40)
            server, refused = daemon.server("gpu0", st), st["refused"]
            assert (server["version"], server["last_good"], server["incarnation"]) == (1, 1, 1), server
            assert [r["version"] for r in refused] == [2] and "cannot score the canary of 601 tokens" in \
                refused[0]["reason"] and "HTTP 400" in refused[0]["reason"], refused
            assert metric(daemon.url, "update_failures_total", kind="gate") == 1, "never loaded again"
            assert metric(daemon.url, "versions_refused_total") == 1
            assert generate(gateway) == v1_tokens, "back on version 1, exactly"
            daemon.wait(lambda st: st["mirror"]["versions"] == [1], 15, "the refused version gone from the mirror")
            answered = [tokens for status, tokens in hammer.results if status == 200]
            assert answered and all(t == v1_tokens for t in answered), [t for t in answered if t != v1_tokens][:3]
            assert all(status in (200, 503) for status, _ in hammer.results), hammer.results

            # the registry knows: its directory, and a trainer waiting for version 2 hears why at once
            listed = until(lambda: next(r for r in reg.replicas() if r["server"] == "gpu0").get("refused"), 15)
            assert listed[0]["version"] == 2 and listed[0]["reason"] == refused[0]["reason"]
            t0 = time.monotonic()
            with pytest.raises(VersionRefused, match="refused version 2"):
                reg.wait_for_replicas(1, min_version=2, timeout_s=120, poll_s=0.1)
            assert time.monotonic() - t0 < 5

            reg.publish(3, tinymodel.state_dict(tinymodel.TINY, 3), chunk_bytes=1 << 16, canary=good3)
            daemon.wait_versions({"gpu0": 3}, timeout_s=120)
            assert generate(gateway) == v3_tokens, "the next good version is taken and served exactly"
            assert reg.wait_for_replicas(1, min_version=3, timeout_s=30)
            assert daemon.server("gpu0")["state"] == "SERVING"
            print(f"gate figures: v1 {gate['max_abs_dlogprob']:.3g}; gateway answers while refusing v2: "
                  f"{len(answered)} x 200, {len(hammer.results) - len(answered)} refused")
        finally:
            try:
                daemon.stop()
            finally:
                daemon.kill_everything()
