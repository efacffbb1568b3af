"""What a generation asks a server for: the sampling settings, passed through as they are.

A :class:`Sampling` becomes the ``sampling_params`` of vLLM's token-in/token-out route
(``POST /inference/v1/generate``). Every setting a trainer relies on is forwarded, none
dropped on the way: the token budget (``max_tokens``, which the client clamps to the server's
``max_model_len``), ``seed``, ``ignore_eos``, ``temperature``/``top_p``/``top_k``/``min_p``,
``stop_token_ids``, the sampled token's logprob (``logprobs``) and the ``top_logprobs`` most
likely tokens at each position. ``extra`` carries any other vLLM sampling parameter verbatim
(``repetition_penalty``, ``min_tokens``, ...), for settings this class does not name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 19  # vLLM's default --max-logprobs (20), less the one asked for on top (see params)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 16  # new tokens at most: the budget, over every continuation of one request
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    seed: int | None = None  # the same seed, prompt and weights give the same tokens
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True  # the logprob of each sampled token
    top_logprobs: int = 0  # also the k most likely tokens at each position, with their logprobs
    extra: dict[str, Any] = field(default_factory=dict)  # other vLLM sampling parameters, verbatim

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        owned = {"max_tokens", "logprobs"} & set(self.extra)
        if owned:
            raise ValueError(f"extra must not set {sorted(owned)}: use the fields of Sampling")

    def params(self, max_tokens: int) -> dict[str, Any]:
        """vLLM's ``sampling_params`` for one attempt, with the budget left for it."""
        out: dict[str, Any] = {
            "max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logprobs:
            # vLLM lists the sampled token first, then the likeliest, and cuts the list at the
            # number asked for: when the sampled token is not among the top k, the k-th would be
            # cut. One more is asked for, and the result keeps the top k (result.parse_part).
            out["logprobs"] = self.top_logprobs + 1 if self.top_logprobs else 0
        out.update(self.extra)
        return out
