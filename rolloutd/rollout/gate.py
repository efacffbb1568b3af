"""The gate: a server that loaded a version proves it before it takes traffic again (docs/daemon.md, "The gate").

After a load and ``/resume``, while the supervisor still holds the server out of traffic
(UPDATING or SYNCING: its gateway forwards nothing), the daemon asks the server itself, on its
private socket, for the prompt logprobs of a fixed token sequence:

- the version's **canary** (``manifest.json`` in the mirror: prompt, continuation, the logprobs
  the trainer's model gives, a tolerance): the gate passes when every served logprob of the
  continuation is finite and ``max |served - expected| <= tolerance``;
- without a canary, the **probe** :data:`PROBE_IDS`: every logprob must be finite. That only
  catches a broken model (NaN or inf weights, a dead head), not wrong weights.

Every prompt position is also checked for finite values. The daemon never imports torch: the
server computes the logprobs, this module only compares numbers.

A failure says whose it is (:attr:`GateFailed.version_fault`): a canary the server refuses to
score as a request (HTTP 400 or 422: a token id outside its vocabulary, a canary longer than its
``max_model_len``), or one whose tolerance is above :data:`MAX_CANARY_TOLERANCE` (such a gate
would pass anything), is the version's fault for certain: loading it again or restarting the
server cannot change the answer. A mismatch, a non-finite value or a server that does not answer
may be the server's; a server that gives no answer at all (:attr:`GateFailed.no_answer`) is at
fault itself.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path

from rolloutd.rollout.vllm_http import VllmClient, VllmError
from rolloutd.wire.manifest import MAX_CANARY_TOLERANCE, Canary, Manifest

# Small ids: in the vocabulary of every real tokenizer (the daemon does not know the vocabulary).
PROBE_IDS = (1, 2, 3, 4, 5)
MANIFEST_NAME = "manifest.json"
# What vLLM answers for a request it will not run as it is (a validation error): the same canary
# gets the same answer from any process of this server.
REFUSED_REQUEST = frozenset({400, 422})


class GateFailed(Exception):
    """The server did not pass; ``result`` holds what was measured."""

    def __init__(self, message: str, result: GateResult, *, version_fault: bool = False, no_answer: bool = False):
        super().__init__(message)
        self.result = result
        self.version_fault = version_fault  # the version's canary is at fault for certain (module docstring)
        self.no_answer = no_answer  # the server gave no answer to score: its failure, not the version's


@dataclass
class GateResult:
    canary: bool                        # the version's canary ran (False: only the probe)
    ok: bool = False
    max_abs_dlogprob: float | None = None  # canary only; inf when a served value was not finite
    tolerance: float | None = None
    tokens: int = 0                     # positions scored
    error: str | None = None

    def as_dict(self) -> dict:
        """For status and heartbeats: JSON-safe (a non-finite figure is null, with ok false)."""
        figure = self.max_abs_dlogprob
        return {"ok": self.ok, "canary": self.canary, "tokens": self.tokens, "tolerance": self.tolerance,
                "max_abs_dlogprob": round(figure, 6) if figure is not None and math.isfinite(figure) else None}


def read_canary(version_dir: Path, digest: str) -> Canary | None:
    """The canary of the version in ``version_dir`` (None: it has none). The manifest must be
    the one with ``digest``, the version the server was told to load."""
    manifest = Manifest.model_validate_json((Path(version_dir) / MANIFEST_NAME).read_bytes())
    actual = manifest.compute_digest()
    if actual != digest:
        raise ValueError(f"{version_dir}/{MANIFEST_NAME} has digest {actual}, not {digest}")
    return manifest.canary


async def run_gate(vllm: VllmClient, canary: Canary | None, timeout_s: float) -> GateResult:
    """Score the canary (or the probe) on the server; GateFailed unless it passes."""
    result = GateResult(canary=canary is not None, tolerance=canary.tolerance if canary else None)
    if canary is not None and canary.tolerance > MAX_CANARY_TOLERANCE:
        result.error = (f"gate: the canary's tolerance {canary.tolerance:g} is above {MAX_CANARY_TOLERANCE:g} "
                        "nats: it would pass any weights")
        raise GateFailed(result.error, result, version_fault=True)
    ids = [*canary.prompt_ids, *canary.continuation_ids] if canary else list(PROBE_IDS)
    scoring = False  # the scoring request itself was sent (not only the model's name asked)
    try:
        async with asyncio.timeout(timeout_s):
            model = await vllm.served_model(timeout_s)
            scoring = True
            served = await vllm.prompt_logprobs(ids, timeout_s, model=model)
    except (VllmError, TimeoutError) as e:
        what = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else str(e)
        unscorable = (canary is not None and scoring and isinstance(e, VllmError)
                      and e.status in REFUSED_REQUEST)
        result.error = (f"gate: the server cannot score the canary of {len(ids)} tokens: {what}" if unscorable
                        else f"gate: scoring failed: {what}")
        raise GateFailed(result.error, result, version_fault=unscorable,
                         no_answer=not isinstance(e, VllmError) or e.status is None) from None
    result.tokens = len(served)
    bad = [i + 1 for i, v in enumerate(served) if not math.isfinite(v)]
    if canary is not None:
        first = len(canary.prompt_ids) - 1  # served[k] is position k + 1
        result.max_abs_dlogprob = canary.max_abs_delta(served[first:])
    if bad:
        result.error = (f"gate: non-finite logprobs at {len(bad)} of {len(served)} positions "
                        f"(first at {bad[0]}: {served[bad[0] - 1]})")
        raise GateFailed(result.error, result)
    if canary is not None and result.max_abs_dlogprob > canary.tolerance:
        worst = max(range(len(canary.logprobs)),
                    key=lambda i: abs(served[first + i] - canary.logprobs[i]))
        result.error = (f"gate: canary mismatch: max |dlogprob| {result.max_abs_dlogprob:.4g} > tolerance "
                        f"{canary.tolerance:g} (continuation token {worst}: served "
                        f"{served[first + worst]:.4f}, expected {canary.logprobs[worst]:.4f})")
        raise GateFailed(result.error, result)
    result.ok = True
    return result
