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

A data-parallel server has one engine per rank, each with its own copy of the weights: the gate
scores every engine, each request pinned to its engine by vLLM's header ``X-data-parallel-rank``
(through vLLM's load balancer, whichever engine answered would stand for all of them). Any
engine failing fails the gate, and the error names it; without a canary, every engine's probe
values must also agree with engine 0's.

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
from rolloutd.wire.manifest import DEFAULT_CANARY_TOLERANCE, MAX_CANARY_TOLERANCE, Canary, Manifest
from rolloutd.wire.status import GateStatus

# Small ids: in the vocabulary of every real tokenizer (the daemon does not know the vocabulary).
PROBE_IDS = (1, 2, 3, 4, 5)
MANIFEST_NAME = "manifest.json"
# What vLLM answers for a request it will not run as it is (a validation error): the same canary
# gets the same answer from any process of this server.
REFUSED_REQUEST = frozenset({400, 422})
# How far (nats) the probe's values of two data-parallel engines may part: engines with the same
# weights give the same values, up to the rounding of other batch shapes.
PROBE_ENGINE_TOLERANCE = DEFAULT_CANARY_TOLERANCE


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

    def status(self) -> GateStatus:
        """For status and heartbeats: JSON-safe (a non-finite figure is null, with ok false)."""
        figure = self.max_abs_dlogprob
        return GateStatus(ok=self.ok, canary=self.canary, tokens=self.tokens, tolerance=self.tolerance,
                          max_abs_dlogprob=round(figure, 6) if figure is not None and math.isfinite(figure) else None)


def read_canary(version_dir: Path, digest: str) -> Canary | None:
    """The canary of the version in ``version_dir`` (None: it has none). The manifest must be
    the one with ``digest``, the version the server was told to load."""
    manifest = Manifest.model_validate_json((Path(version_dir) / MANIFEST_NAME).read_bytes())
    actual = manifest.compute_digest()
    if actual != digest:
        raise ValueError(f"{version_dir}/{MANIFEST_NAME} has digest {actual}, not {digest}")
    return manifest.canary


async def run_gate(vllm: VllmClient, canary: Canary | None, timeout_s: float, *, engines: int = 1) -> GateResult:
    """Score the canary (or the probe) on the server; GateFailed unless it passes.

    ``engines``: the server's data-parallel engines. Each has its own weights, so each is scored,
    its request pinned to it (``X-data-parallel-rank``): scored through vLLM's load balancer, an
    engine left on other weights would pass whenever another one answered. The probe's values of
    every engine must also agree with engine 0's (:data:`PROBE_ENGINE_TOLERANCE`)."""
    result = GateResult(canary=canary is not None, tolerance=canary.tolerance if canary else None)
    if canary is not None and canary.tolerance > MAX_CANARY_TOLERANCE:
        result.error = (f"gate: the canary's tolerance {canary.tolerance:g} is above {MAX_CANARY_TOLERANCE:g} "
                        "nats: it would pass any weights")
        raise GateFailed(result.error, result, version_fault=True)
    ids = [*canary.prompt_ids, *canary.continuation_ids] if canary else list(PROBE_IDS)
    ranks: list[int | None] = list(range(engines)) if engines > 1 else [None]  # None: no engine named
    scored: list[list[float]] = []
    try:
        async with asyncio.timeout(timeout_s):
            model = await vllm.served_model(timeout_s)
            for rank in ranks:
                pinned = {"engine": rank} if rank is not None else {}
                scored.append(await vllm.prompt_logprobs(ids, timeout_s, model=model, **pinned))
    except (VllmError, TimeoutError) as e:
        what = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else str(e)
        where = _engine(ranks[len(scored)], engines) if len(scored) < len(ranks) else ""
        # Refused as a request by the first engine asked: the canary's doing. By a later one, which
        # got the same request, it cannot be.
        unscorable = (canary is not None and len(scored) == 0 and isinstance(e, VllmError)
                      and e.status in REFUSED_REQUEST)
        result.error = (f"gate: {where}the server cannot score the canary of {len(ids)} tokens: {what}"
                        if unscorable else f"gate: {where}scoring failed: {what}")
        raise GateFailed(result.error, result, version_fault=unscorable,
                         no_answer=not isinstance(e, VllmError) or e.status is None) from None
    for rank, served in zip(ranks, scored, strict=True):
        _check(served, canary, result, _engine(rank, engines))
    if canary is None and len(scored) > 1:
        _agree(scored, result)
    result.ok = True
    return result


def _engine(rank: int | None, engines: int) -> str:
    """How an error names the engine that gave it ("" for a server of one engine)."""
    return "" if rank is None else f"data-parallel engine {rank} of {engines}: "


def _check(served: list[float], canary: Canary | None, result: GateResult, where: str) -> None:
    """One engine's answer: every value finite, the canary's continuation within its tolerance.
    ``result`` keeps the worst figure of the engines scored so far."""
    result.tokens = len(served)
    bad = [i + 1 for i, v in enumerate(served) if not math.isfinite(v)]
    if canary is not None:
        first = len(canary.prompt_ids) - 1  # served[k] is position k + 1
        figure = canary.max_abs_delta(served[first:])
        result.max_abs_dlogprob = max(figure, result.max_abs_dlogprob or 0.0)
    if bad:
        result.error = (f"gate: {where}non-finite logprobs at {len(bad)} of {len(served)} positions "
                        f"(first at {bad[0]}: {served[bad[0] - 1]})")
        raise GateFailed(result.error, result)
    if canary is not None and figure > canary.tolerance:
        worst = max(range(len(canary.logprobs)),
                    key=lambda i: abs(served[first + i] - canary.logprobs[i]))
        result.error = (f"gate: {where}canary mismatch: max |dlogprob| {figure:.4g} > tolerance "
                        f"{canary.tolerance:g} (continuation token {worst}: served "
                        f"{served[first + worst]:.4f}, expected {canary.logprobs[worst]:.4f})")
        raise GateFailed(result.error, result)


def _agree(scored: list[list[float]], result: GateResult) -> None:
    """Without a canary: every engine's probe values within PROBE_ENGINE_TOLERANCE of engine 0's
    (an engine holding other weights scores the probe otherwise)."""
    for rank, served in enumerate(scored[1:], start=1):
        delta = max(abs(a - b) for a, b in zip(scored[0], served, strict=True))
        if delta > PROBE_ENGINE_TOLERANCE:
            result.error = (f"gate: {_engine(rank, len(scored))}the probe differs from engine 0's by max "
                            f"|dlogprob| {delta:.4g} > {PROBE_ENGINE_TOLERANCE:g}: the engines hold different "
                            "weights")
            raise GateFailed(result.error, result)
