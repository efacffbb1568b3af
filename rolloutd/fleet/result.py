"""What a generation gives back: tokens, logprobs, and the weight versions that produced them.

One request may be answered in several **parts**: a server paused in ``abort`` mode for an
update ends a request early, with its tokens so far (``finish_reason: "abort"``), and the
client continues it (prompt + those tokens) on the new weights. :class:`Generation` is the
parts joined: the tokens in order, their logprobs, and ``weight_versions``: half-open spans of
token indices, each with the version whose weights produced them (``None``: the server's start
model, which carries no version). A generation across an update has two spans or more.

:func:`parse_part` reads one answer of ``/inference/v1/generate``; an answer that is not the
expected shape raises :class:`BadAnswer`, which the client treats as that server's failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class BadAnswer(ValueError):
    """A server's answer is not what the generate route returns."""


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of the output were produced by weights of ``version``."""

    version: int | None
    start: int
    end: int


@dataclass(frozen=True)
class Part:
    """One server's answer to one attempt."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str
    spans: list[Span]


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # of each sampled token (None: not asked for)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position: (token id, logprob), likeliest first
    finish_reason: str | None = None  # "stop", "length" (budget or max_model_len), "abort" (ended by a server)
    weight_versions: list[Span] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)  # the replica of each part, in order
    attempts: int = 0  # HTTP requests sent for it, failed ones included
    continuations: int = 0  # parts after the first (resumed after a server aborted it)

    @property
    def replica(self) -> str | None:
        """The replica that produced the last tokens."""
        return self.replicas[-1] if self.replicas else None

    @property
    def versions(self) -> list[int | None]:
        """The versions of the spans, in order."""
        return [s.version for s in self.weight_versions]

    @property
    def min_version(self) -> int | None:
        """The oldest version any token came from (None: a token came from a start model)."""
        vs = self.versions
        return None if not vs or None in vs else min(vs)

    def add(self, part: Part, replica: str) -> None:
        """Append one part: its tokens continue the ones before."""
        offset = len(self.token_ids)
        if self.replicas:
            self.continuations += 1
        self.token_ids.extend(part.token_ids)
        if part.logprobs is not None:
            self.logprobs = (self.logprobs or []) + part.logprobs
        if part.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + part.top_logprobs
        for span in part.spans:
            last = self.weight_versions[-1] if self.weight_versions else None
            if last is not None and last.version == span.version and last.end == offset + span.start:
                self.weight_versions[-1] = Span(last.version, last.start, offset + span.end)
            elif span.end > span.start:
                self.weight_versions.append(Span(span.version, offset + span.start, offset + span.end))
        self.finish_reason = part.finish_reason
        self.replicas.append(replica)


def version_of(label: Any) -> int | None:
    """The version a server's weight label names: rolloutd labels each load with the version's
    number; a server still on its start model says ``"default"``."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and label.isdigit():
        return int(label)
    return None


def parse_part(body: Any, top_k: int) -> Part:
    """The first choice of a generate answer; BadAnswer when it is not that."""
    try:
        choice = body["choices"][0]
        tokens = [int(t) for t in choice["token_ids"] or []]
        reason = str(choice.get("finish_reason") or "stop")
        spans = [Span(version_of(s["version"]), int(s["start"]), int(s["end"]))
                 for s in choice.get("weight_versions") or []]
        logprobs = top = None
        content = (choice.get("logprobs") or {}).get("content")
        if content is not None:
            logprobs = [float(c["logprob"]) for c in content]
            if top_k:
                top = [_top(c.get("top_logprobs") or [], top_k) for c in content]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BadAnswer(f"not a generate answer ({type(e).__name__}: {e})") from None
    if logprobs is not None and len(logprobs) != len(tokens):
        raise BadAnswer(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
    if spans and (spans[0].start != 0 or spans[-1].end != len(tokens)):
        raise BadAnswer(f"weight_versions {spans} do not cover the {len(tokens)} tokens")
    if not spans and tokens:
        spans = [Span(None, 0, len(tokens))]  # a server that does not label its weights
    return Part(tokens, logprobs, top, reason, spans)


def _top(entries: list[dict], k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest tokens at one position, likeliest first. vLLM lists the sampled token
    first whatever its rank, then the likeliest ones (k + 1 asked for, see Sampling.params); a
    sampled token outside the top k is left out."""
    seen: dict[int, tuple[int, float]] = {}
    for e in entries:
        rank = e.get("rank")
        if rank is not None and rank <= k:
            seen.setdefault(int(rank), (int(e["token_id"]), float(e["logprob"])))
    return [seen[r] for r in sorted(seen)][:k]
