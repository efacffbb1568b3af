"""The gate end to end: ``rolloutd run`` with one real ``vllm serve`` (CPU build), an embedded
registry, and canaries computed by make_canary on Hugging Face copies of the weights.

Version 1 carries the canary of its own weights: the server serves it, and /status, the metrics
and the heartbeat show a figure far below the tolerance. Version 2 carries the canary of other
weights: the server never serves it (gate failures counted, re-applied, restarted, gated again
during the sync, then FATAL), and no request through the gateway is answered by its weights.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from rolloutd.demo import tinymodel
from rolloutd.registry import EmbeddedRegistry
from rolloutd.registry.canary import make_canary

from .conftest import free_port
from .daemon_harness import DaemonProcess, config, vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [1, 17, 42, 99, 250, 7, 300, 12]


def hf(directory):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(directory)


def metric(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^rolloutd_{name}{{{re.escape(want)}}} (\S+)$", text, re.M)
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


def test_a_version_whose_canary_fails_is_never_served(tmp_path):
    start = tinymodel.build(tmp_path / "m0", seed=0)
    m1, m2, m3 = (hf(tinymodel.build(tmp_path / f"m{s}", seed=s)) for s in (1, 2, 3))
    good = make_canary(m1, PROMPT)           # v1's own canary
    wrong = make_canary(m3, PROMPT)          # attached to v2, whose weights are seed 2
    v1_tokens = good.continuation_ids
    v2_tokens = make_canary(m2, PROMPT).continuation_ids
    assert v1_tokens != v2_tokens, "the two versions must answer differently for the check to mean anything"

    with EmbeddedRegistry(port=free_port()) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), chunk_bytes=1 << 16, canary=good)
        cfg = config(tmp_path, reg.url, [vllm_server("gpu0", start, "1")],
                     restart={"max_retries": 1}, gateway={"hold_max_s": 2},
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
            assert metric(daemon.url, "update_failures_total", kind="gate") == 0
            beat = next(r for r in reg.replicas() if r["server"] == "gpu0")
            deadline = time.monotonic() + 10
            while not beat.get("gate") and time.monotonic() < deadline:
                time.sleep(0.2)
                beat = next(r for r in reg.replicas() if r["server"] == "gpu0")
            assert beat["gate"]["ok"] and beat["gate"]["max_abs_dlogprob"] == gate["max_abs_dlogprob"]
            # what the server answers is what the trainer's model says
            r = httpx.post(gateway + "/inference/v1/generate", timeout=30, json={
                "token_ids": PROMPT, "stream": False,
                "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == v1_tokens

            hammer = Hammer(gateway)
            hammer.start()
            deadline = time.monotonic() + 30
            while not any(status == 200 for status, _ in hammer.results) and time.monotonic() < deadline:
                time.sleep(0.05)
            reg.publish(2, tinymodel.state_dict(tinymodel.TINY, 2), chunk_bytes=1 << 16, canary=wrong)
            seen: set[tuple[str, int | None]] = set()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                s = daemon.server("gpu0")
                seen.add((s["state"], s["version"]))
                if s["state"] == "FATAL" or (s["state"], s["version"]) == ("SERVING", 2):
                    break
                time.sleep(0.2)
            hammer.stopped.set()
            hammer.join(40)
            st = daemon.server("gpu0")
            assert st["state"] == "FATAL", (st, daemon.tail())
            assert ("SERVING", 2) not in seen and ("UPDATING", 2) not in seen, seen
            assert "gate" in st["last_error"] and "canary mismatch" in st["last_error"], st["last_error"]
            last = st["last_update"]
            assert last["version"] == 2 and not last["ok"] and not last["gate"]["ok"]
            assert last["gate"]["max_abs_dlogprob"] > wrong.tolerance
            # the update, its re-apply, then the sync after the restart and its re-apply
            assert metric(daemon.url, "update_failures_total", kind="gate") == 4
            assert metric(daemon.url, "gate_max_abs_dlogprob", server="gpu0") == pytest.approx(
                last["gate"]["max_abs_dlogprob"], abs=1e-5)
            answered = [tokens for status, tokens in hammer.results if status == 200]
            assert answered, hammer.results[:5]
            assert all(t == v1_tokens for t in answered), [t for t in answered if t != v1_tokens][:3]
            assert all(status in (200, 503) for status, _ in hammer.results), hammer.results
            assert "gate gpu0: version 2 failed: gate: canary mismatch" in daemon.log_text()
            print(f"gate figures: v1 {gate['max_abs_dlogprob']:.3g}, v2 {last['gate']['max_abs_dlogprob']:.3g}; "
                  f"gateway answers: {len(answered)} x 200, {len(hammer.results) - len(answered)} refused")
        finally:
            try:
                daemon.stop()
            finally:
                daemon.kill_everything()
