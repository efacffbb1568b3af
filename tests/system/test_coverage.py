"""A version that leaves part of the served model on old values is a failed update, unless its
manifest says it is partial on purpose: a real daemon, a real ``vllm serve`` (a tied Qwen2
model, q/k/v biases), transformers as the reference.

1. Version 1 lacks one tensor, ``k_proj`` of layer 1. vLLM fuses q/k/v into one layer, so the
   layer would still be "loaded" (q and v arrived) with garbage where k belongs: the plugin
   refuses it by name before touching the model, the daemon counts a failed load, names the
   tensor, refuses the version and resumes the server as it was: never SERVING version 1, not
   restarted, and still answering exactly as transformers does on the start weights (A). Version
   2 (complete) is then served exactly.
2. Version 3 carries only layer 0, of other weights, and says ``partial``: it is served, and the
   outputs equal transformers' on version 2 with layer 0 replaced.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from rolloutd.demo import families
from rolloutd.trainer import EmbeddedRegistry
from tests.support.daemon_harness import DaemonProcess, config, vllm_server
from tests.support.served import generate, reference

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

FAMILY = "qwen2"
MISSING = "model.layers.1.self_attn.k_proj.weight"


def load_failures(daemon: DaemonProcess) -> float:
    text = httpx.get(daemon.url + "/metrics", timeout=10).text
    m = re.search(r'^rolloutd_update_failures_total\{kind="load"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_missing_tensor_fails_the_update_and_a_declared_partial_version_is_served(tmp_path):
    import torch

    start = families.build(tmp_path / "A", FAMILY, seed=0)
    b, c, d = (families.hf_model(FAMILY, s) for s in (1, 2, 3))
    with EmbeddedRegistry(port=0) as reg:
        daemon = DaemonProcess(config(tmp_path, reg.url, [vllm_server("s0", start, "0")],
                                      restart={"backoff_initial_s": 0.2, "max_retries": 5}), tmp_path)
        try:
            daemon.start()
            st = daemon.wait(lambda s: daemon.server("s0", s)["state"] == "SERVING", 300, "serving A")
            gateway = f"http://127.0.0.1:{daemon.server('s0', st)['public_port']}"

            incomplete = {k: v for k, v in b.state_dict().items() if k != MISSING}
            reg.publish(1, incomplete)
            deadline = time.monotonic() + 120
            while load_failures(daemon) < 1:
                s0 = daemon.server("s0")
                assert (s0["state"], s0["version"]) != ("SERVING", 1), "served a version that lacks a tensor"
                assert time.monotonic() < deadline, f"no failed load after 120 s: {s0}"
                time.sleep(0.1)
            st = daemon.wait(lambda s: [r["version"] for r in s["refused"]] == [1]
                             and daemon.server("s0", s)["state"] == "SERVING", 60, "version 1 refused, serving")
            s0 = daemon.server("s0", st)
            assert MISSING in (s0["last_update"] or {}).get("error", ""), s0
            assert MISSING in daemon.log_text()
            assert (s0["version"], s0["incarnation"], s0["restarts"]) == (None, 1, 0), s0  # the start model, as it was
            assert load_failures(daemon) == 1  # refused at once: the answer cannot change
            assert generate(gateway, families.PROMPTS)[0] == reference(families.hf_model(FAMILY, 0))

            reg.publish(2, c.state_dict())
            st = daemon.wait_versions({"s0": 2}, timeout_s=120)
            assert daemon.server("s0", st)["incarnation"] == 1
            assert generate(gateway, families.PROMPTS)[0] == reference(c)

            layer0 = {k: v for k, v in d.state_dict().items() if ".layers.0." in k}
            reg.publish(3, layer0, partial=True)
            daemon.wait_versions({"s0": 3}, timeout_s=120)
            mixed = families.hf_model(FAMILY, 2)
            with torch.no_grad():
                for k, v in mixed.named_parameters():
                    if k in layer0:
                        v.copy_(layer0[k])
            assert generate(gateway, families.PROMPTS)[0] == reference(mixed) != reference(c)
        finally:
            daemon.stop()
            daemon.kill_everything()
