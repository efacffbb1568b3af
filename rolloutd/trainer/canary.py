"""Trainer side: compute a version's canary from the trainer's own model.

A canary (:class:`~rolloutd.wire.manifest.Canary`) is a prompt, a continuation, and the
log-probability the trainer's model gives each continuation token after its prefix. Publish it
with the version (``publish(..., canary=...)``); every server that loads the version scores
the same tokens and must agree within the tolerance before it takes traffic again
(docs/trainer.md, "Attaching a canary"). torch is imported here only, and only when called.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rolloutd.wire.manifest import DEFAULT_CANARY_TOLERANCE, MAX_CANARY_TOLERANCE, Canary


def make_canary(model: Any, prompt_ids: Sequence[int], continuation_ids: Sequence[int] | None = None, *,
                new_tokens: int = 16, tolerance: float = DEFAULT_CANARY_TOLERANCE) -> Canary:
    """The canary of ``model`` (a Hugging Face causal LM, e.g. ``LlamaForCausalLM``) on
    ``prompt_ids``.

    Without ``continuation_ids``, the continuation is the model's own greedy one, ``new_tokens``
    tokens long (greedy tokens are the model's most likely ones, whose logprobs are the least
    sensitive to rounding, so the tolerance can be tight). The expected logprobs come from one
    forward pass over prompt + continuation: ``log_softmax`` in float32 of the logits at each
    position, taken at the next token. The model is put in eval mode for the call (and back in
    training mode after it, if it was) and runs under ``torch.inference_mode``, on its own device.
    """
    import torch

    if not 0 < tolerance <= MAX_CANARY_TOLERANCE:
        raise ValueError(f"tolerance must be above 0 and at most {MAX_CANARY_TOLERANCE:g} nats, not {tolerance:g}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if continuation_ids is None and new_tokens < 1:
        raise ValueError("new_tokens must be at least 1")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if continuation_ids is None:
                continuation = _greedy(model, prompt, new_tokens, device)
            else:
                continuation = [int(t) for t in continuation_ids]
            if not continuation:
                raise ValueError("continuation_ids is empty")
            ids = torch.tensor([prompt + continuation], dtype=torch.long, device=device)
            logits = model(input_ids=ids).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            # the logits at position p predict token p + 1
            at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(continuation), device=device)
            picked = logprobs[at, ids[0, at + 1]]
            values = [float(v) for v in picked.cpu()]
    finally:
        model.train(was_training)
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"the model gives non-finite logprobs on its canary: {values[:8]}")
    values = [min(0.0, v) for v in values]  # float32 rounding can leave +1e-8 on a sure token
    return Canary(prompt_ids=prompt, continuation_ids=continuation, logprobs=values, tolerance=tolerance)


def _greedy(model: Any, prompt: list[int], new_tokens: int, device: Any) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` (argmax of each step's logits, KV cache kept)."""
    import torch

    out = model(input_ids=torch.tensor([prompt], dtype=torch.long, device=device), use_cache=True)
    tokens: list[int] = []
    while True:
        nxt = int(out.logits[0, -1].float().argmax())
        tokens.append(nxt)
        if len(tokens) == new_tokens:
            return tokens
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long, device=device),
                    past_key_values=out.past_key_values, use_cache=True)


def load_canary(path: Path | str) -> Canary:
    """A canary from a JSON file (``Canary.model_dump_json()``), e.g. for ``rolloutd publish --canary``."""
    return Canary.model_validate_json(Path(path).read_bytes())


def save_canary(canary: Canary, path: Path | str) -> None:
    Path(path).write_text(json.dumps(canary.model_dump(mode="json")) + "\n")
