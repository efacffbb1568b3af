"""What generating a trainer's batch on the fleet takes, whatever the trainer library: its vLLM
generation settings as one :class:`~rolloutd.fleet.Sampling` (:func:`sampling_of`; a setting the
fleet cannot honour is :class:`UnsupportedSetting`, never dropped), a seed per request
(:func:`request_seed`), the staleness check of a batch's answers (:func:`check_batch`, which
raises :class:`StaleSample`), and each answer's logprobs as rows, the sampled token first
(:func:`logprob_rows`). Pure: no trainer library imported here."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from rolloutd.fleet import Generation, Sampling
from rolloutd.fleet.sampling import MAX_TOP_LOGPROBS

# generation_kwargs that are vLLM sampling parameters the token-in/token-out route applies as given
PASSED_THROUGH = frozenset({"presence_penalty", "frequency_penalty", "min_tokens", "allowed_token_ids"})
# generation_kwargs that set a field of Sampling (TRL lets them override its own settings)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "max_tokens": "max_tokens", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos"}
WHY_NOT = {
    "n": "each sample is its own request (num_generations sets how many), so that a group spreads over servers",
    "logprobs": "the trainer's logprobs setting decides it (the sampled token's logprob is always returned)",
    "prompt_logprobs": "the fleet returns no prompt logprobs",
    "structured_outputs": "structured outputs are not passed to the fleet",
    "guided_decoding": "structured outputs are not passed to the fleet",
    "stop": "stop strings need detokenising on the server; use stop_token_ids",
    "detokenize": "the fleet generates token ids only",
}


class UnsupportedSetting(ValueError):
    """A trainer's generation setting that generating on the fleet cannot honour."""


class StaleSample(RuntimeError):
    """A sample came from weights older than the staleness bound allows (or from a start model)."""


def sampling_of(*, temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0, min_p: float | None = 0.0,
                repetition_penalty: float = 1.0, max_completion_length: int = 16, logprobs: int | None = 0,
                generation_kwargs: dict | None = None,
                structured_outputs_regex: str | None = None) -> tuple[Sampling, int | None]:
    """A trainer's vLLM generation settings (TRL's ``VLLMGeneration`` arguments) as one :class:`Sampling`, and
    the seed ``generation_kwargs`` names (None: none). UnsupportedSetting for any that the fleet
    cannot honour: nothing is dropped silently."""
    if structured_outputs_regex is not None:
        raise UnsupportedSetting("vllm_structured_outputs_regex: structured outputs are not passed to the fleet")
    top = int(logprobs or 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise UnsupportedSetting(f"logprobs={logprobs}: the fleet returns at most {MAX_TOP_LOGPROBS} top logprobs")
    fields: dict[str, Any] = {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k or 0),
                              "min_p": float(min_p or 0.0), "max_tokens": int(max_completion_length)}
    extra: dict[str, Any] = {}
    if repetition_penalty != 1.0:
        extra["repetition_penalty"] = float(repetition_penalty)
    seed = None
    for key, value in (generation_kwargs or {}).items():
        if key == "seed":
            seed = None if value is None else int(value)
        elif key == "repetition_penalty":
            extra.pop(key, None)
            if value != 1.0:
                extra[key] = float(value)
        elif key in FIELDS:
            fields[FIELDS[key]] = tuple(value) if key == "stop_token_ids" else value
        elif key in PASSED_THROUGH:
            extra[key] = value
        elif key in WHY_NOT:
            raise UnsupportedSetting(f"generation_kwargs[{key!r}]: {WHY_NOT[key]}")
        else:
            raise UnsupportedSetting(
                f"generation_kwargs[{key!r}] is not one the fleet is known to honour; supported: "
                f"{', '.join(sorted({'seed', 'repetition_penalty', *FIELDS, *PASSED_THROUGH}))}")
    try:
        return Sampling(**fields, logprobs=True, top_logprobs=top, extra=extra), seed
    except ValueError as e:
        raise UnsupportedSetting(str(e)) from None


def request_seed(seed: int, process: int, call: int, index: int) -> int:
    """A seed per request, below 2**31, different for every sample of every call on every process."""
    digest = hashlib.blake2b(f"{seed}:{process}:{call}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


def raw_logprobs_warning(sampling: Sampling) -> str | None:
    """vLLM returns logprobs before temperature and truncation unless the server runs with
    ``--logprobs-mode processed_logprobs``; TRL's importance-sampling correction wants them after."""
    shaped = (sampling.temperature != 1.0 or sampling.top_p < 1.0 or sampling.top_k > 0 or sampling.min_p > 0
              or "repetition_penalty" in sampling.extra)
    if not shaped:
        return None
    return ("temperature/top_p/top_k/min_p/repetition_penalty change the sampling distribution: start every "
            "`vllm serve` with `--logprobs-mode processed_logprobs` (vllm.args in rolloutd.yaml) so that the "
            "logprobs TRL's importance-sampling correction uses are the ones sampled from")


@dataclass(frozen=True)
class Batch:
    """What one ``generate`` call got: the trainer's version then, the floor it asked for, and each
    sample's versions (one per span, in order), replicas and tokens."""

    version: int
    floor: int
    versions: list[list[int | None]]
    replicas: list[list[str]]
    completions: list[list[int]]


def check_batch(gens: list[Generation], version: int, k: int) -> tuple[Batch, dict[str, float]]:
    """The batch's record and its metrics; StaleSample when an answer has a token from weights
    older than ``version - k`` (or from a server's start model, which has no version)."""
    floor = floor_of(version, k)
    for g in gens:
        oldest = g.min_version
        if g.token_ids and (oldest is None or oldest < floor):
            raise StaleSample(f"a sample came from version {oldest} (weight_versions {g.weight_versions}), "
                              f"below {floor} = version {version} - k {k}")
    oldest = min((g.min_version for g in gens if g.token_ids), default=version)
    metrics = {"rolloutd/version": float(version), "rolloutd/oldest_version": float(oldest),
               "rolloutd/staleness": float(version - oldest),
               "rolloutd/replicas": float(len({r for g in gens for r in g.replicas}))}
    return Batch(version, floor, [g.versions for g in gens], [g.replicas for g in gens],
                 [g.token_ids for g in gens]), metrics


def floor_of(version: int, k: int) -> int:
    """The oldest version a sample may come from when the trainer trains ``version``."""
    return max(1, version - k)


def logprob_rows(g: Generation) -> tuple[list[list[float]], list[list[int]]]:
    """Per position: the sampled token's logprob and id first, then the top-k others' (when asked for)."""
    lps, ids = [], []
    for i, (tok, lp) in enumerate(zip(g.token_ids, g.logprobs or [], strict=True)):
        row_lp, row_id = [lp], [tok]
        for other, other_lp in (g.top_logprobs[i] if g.top_logprobs else []):
            if other != tok:
                row_lp.append(other_lp)
                row_id.append(other)
        lps.append(row_lp)
        ids.append(row_id)
    return lps, ids
