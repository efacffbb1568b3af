"""The soak's trainer and checker (bench/soak.py).

:class:`Trainer` makes each version of a tied model (Qwen2-shaped, ``rolloutd.demo.families``),
computes its reference with transformers when it publishes it (greedy outputs on a few prompts,
every one with a clear top-1/top-2 margin, so that float noise cannot flip a token), and
publishes it over HTTP, as a trainer does; a version that lacks a tensor (the plugin refuses
it) has no reference.

:class:`Checker` asks, again and again, every server the daemon claims SERVING (in its
``/status`` and in the registry's directory) for a greedy generation through its gateway, and
judges the answer against the reference of the version vLLM labels it with:

- ``ok``: equal to that version's reference (an answer whose tokens span two versions, an
  update having happened while it ran, is judged span by span: the first against the reference,
  each later one against transformers continuing the tokens so far on that span's version; an
  answer cut short, aborted by a server stopping under it, as a prefix);
- ``stale``: not, but equal to an older version's reference (weights not, or not all, replaced);
- ``torn``: equal to no version's reference (a load mixed two versions, or broke the model);
- ``bad_version``: labelled with a version that must never be served, or an unknown one;
- a claim mismatch: vLLM's label is not the version ``/status`` claims, while ``/status``
  claimed the same version of the same process before and after the answer.

Wrong outputs are stale + torn + bad versions; the soak's goal is none.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import httpx

from rolloutd.demo import families
from rolloutd.trainer.canary import make_canary
from rolloutd.trainer.publish import RegistryHTTP, checkpoint_tensors, drop_aliases

FAMILY = "qwen2"  # tied embeddings, q/k/v biases: the shape of the small models RL post-trains
PROMPTS = [p for p in families.PROMPTS if len(p) < 32][:3]  # short: a check costs ~0.1 s of a core
NEW_TOKENS = 8
CANARY_PROMPT = [1, 5, 9, 13, 40]
MISSING = "model.layers.1.self_attn.k_proj.weight"  # what a version the plugin refuses lacks
SHARD_BYTES, CHUNK_BYTES = 600_000, 1 << 16  # three files, ~23 chunks: a Range request per chunk
KEEP_MODELS = 16  # models kept for republishing and for judging answers that span an update
START = 0  # the servers' start model, as a version number of its own


@dataclass
class Made:
    version: int
    seed: int
    model: object
    refs: list[list[int]]


class Trainer:
    """Versions, their references and their publication; every method blocks (call in a thread)."""

    def __init__(self, registry_url: str, *, canary: bool = True):
        self.registry_url, self.canary = registry_url, canary
        self.refs: dict[int, list[list[int]]] = {}
        self.seeds: dict[int, int] = {}
        self.bad: set[int] = set()
        self.good: list[int] = []       # published good versions, in order
        self.models: OrderedDict[int, object] = OrderedDict()
        self.next_version = 1
        self.republished = 0
        self.lock = threading.RLock()   # one publication at a time (publisher, faults)

    # -- making versions ------------------------------------------------------------------------
    def start_model(self):
        """The start model (``families.build(dir, FAMILY, 0)`` writes the same), with its reference."""
        model = families.hf_model(FAMILY, 0)
        self._keep(START, 0, model, families.greedy(model, PROMPTS, NEW_TOKENS))
        return model

    def make(self, version: int) -> Made:
        """The version's model: the first seed whose greedy outputs have clear margins."""
        for attempt in range(64):
            seed = 1000 * attempt + version
            model = families.hf_model(FAMILY, seed, min_margin=0)
            outs, margins = families.greedy_and_margins(model, PROMPTS, NEW_TOKENS)
            if min(margins) >= families.MIN_MARGIN:
                return Made(version, seed, model, outs)
        raise RuntimeError(f"no seed for version {version} has greedy margins >= {families.MIN_MARGIN}")

    def _keep(self, version: int, seed: int, model, refs: list[list[int]]) -> None:
        self.refs[version], self.seeds[version] = refs, seed
        self.models[version] = model
        while len(self.models) > KEEP_MODELS:
            self.models.popitem(last=False)

    # -- publishing -----------------------------------------------------------------------------
    def publish_next(self) -> int:
        with self.lock:
            made = self.make(self.next_version)
            canary = make_canary(made.model, CANARY_PROMPT) if self.canary else None
            self._publish(made.version, made.model, canary=canary)
            self._keep(made.version, made.seed, made.model, made.refs)
            self.good.append(made.version)
            self.next_version += 1
            return made.version

    def publish_bad(self) -> int:
        """A version lacking one tensor, without ``partial``: every server must refuse it."""
        with self.lock:
            version = self.next_version
            model = families.hf_model(FAMILY, 500_000 + version, min_margin=0)
            tensors = {k: v for k, v in drop_aliases(checkpoint_tensors(model)).items() if k != MISSING}
            self.bad.add(version)
            self._publish(version, tensors)
            self.next_version += 1
            return version

    def republish(self, count: int = 2) -> list[int]:
        """After the registry lost its state: the newest ``count`` good versions again, same
        numbers, same weights (the trainer still has them)."""
        with self.lock:
            again = [v for v in self.good[-count:] if v in self.models]
            for v in again:
                self._publish(v, self.models[v], canary=make_canary(self.models[v], CANARY_PROMPT)
                              if self.canary else None)
            self.republished += len(again)
            return again

    def _publish(self, version: int, state, canary=None) -> None:
        reg = RegistryHTTP(self.registry_url, timeout_s=60)
        try:
            reg.publish(version, state, shard_bytes=SHARD_BYTES, chunk_bytes=CHUNK_BYTES, canary=canary)
        finally:
            reg.close()

    @property
    def newest_good(self) -> int | None:
        return self.good[-1] if self.good else None

    # -- judging --------------------------------------------------------------------------------
    def continuation(self, version: int, tokens: list[int], count: int) -> list[int] | None:
        """Greedy ``count`` tokens after ``tokens`` on ``version`` (None: model not kept, or a
        near tie on the way, where another implementation may rightly pick the other token)."""
        model = self.models.get(version)
        if model is None:
            return None
        outs, margins = families.greedy_and_margins(model, [tokens], count)
        return outs[0] if margins[0] >= families.MIN_MARGIN else None


@dataclass
class Claim:
    name: str
    endpoint: str
    version: int | None
    incarnation: int | None  # None: claimed by the registry's directory only


@dataclass
class Verdict:
    kind: str  # ok, ok_spanning, stale, torn, bad_version, unjudged
    detail: str = ""


@dataclass
class Checker:
    admin_url: str
    registry_url: str
    trainer: Trainer
    every_s: float = 1.0
    counts: Counter = field(default_factory=Counter)
    problems: list[dict] = field(default_factory=list)
    _turn: int = 0

    WRONG = ("stale", "torn", "bad_version")

    @property
    def wrong(self) -> int:
        return sum(self.counts[k] for k in self.WRONG)

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=90) as http:
            while not stop.is_set():
                claims = await self.claims(http)
                await asyncio.gather(*(self.check(http, c) for c in claims))
                await _wait(stop, self.every_s)

    async def claims(self, http: httpx.AsyncClient) -> list[Claim]:
        """Every server claimed SERVING, by the daemon's status or by the registry's directory."""
        found: dict[str, Claim] = {}
        try:
            for s in (await http.get(self.admin_url + "/status", timeout=10)).json()["servers"]:
                if s["state"] == "SERVING":
                    found[s["endpoint"]] = Claim(s["name"], s["endpoint"], s["version"], s["incarnation"])
        except (httpx.HTTPError, ValueError, KeyError):
            self.counts["status_unavailable"] += 1
        try:
            replicas = (await http.get(self.registry_url + "/v1/replicas", timeout=10)).json()["replicas"]
            for r in replicas:
                if r["state"] == "SERVING" and r["endpoint"] not in found:
                    found[r["endpoint"]] = Claim(r["server"], r["endpoint"], r["version"], None)
                    self.counts["directory_only_claims"] += 1
        except (httpx.HTTPError, ValueError, KeyError):
            self.counts["directory_unavailable"] += 1
        return list(found.values())

    async def check(self, http: httpx.AsyncClient, claim: Claim, prompt: int | None = None) -> Verdict | None:
        if prompt is None:
            self._turn += 1
            prompt = self._turn % len(PROMPTS)
        t0 = time.monotonic()
        try:
            r = await http.post(claim.endpoint + "/inference/v1/generate", json={
                "token_ids": PROMPTS[prompt], "stream": False,
                "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
            choice = r.json()["choices"][0] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            choice = None
        if choice is None:  # restarting, paused past the hold, or the engine just died: not an answer
            self.counts["unavailable"] += 1
            return None
        spans = choice.get("weight_versions") or []
        verdict = await asyncio.to_thread(self.judge, prompt, choice["token_ids"], spans)
        self.counts["checks"] += 1
        self.counts[verdict.kind] += 1
        if len(choice["token_ids"]) < NEW_TOKENS:
            self.counts["partial"] += 1  # cut short (the server stopped under it): judged as a prefix
        if verdict.kind not in ("ok", "ok_spanning", "unjudged"):
            self._problem(claim, verdict, spans, choice["token_ids"], prompt, choice.get("finish_reason"))
        if spans and claim.incarnation is not None and spans[-1]["version"] != str(claim.version):
            await self._check_claim(http, claim, spans, time.monotonic() - t0)
        return verdict

    def judge(self, prompt: int, tokens: list[int], spans: list[dict]) -> Verdict:
        """An answer cut short (a server stopped or restarted under it aborts it, with the
        tokens it had) is judged as a prefix of what it would have been."""
        if not spans:
            return Verdict("bad_version", "the answer carries no weight version")
        versions = [_number(s["version"]) for s in spans]
        for v in versions:
            if v is None or v in self.trainer.bad or v not in self.trainer.refs:
                return Verdict("bad_version", f"served by version {v} (bad: {v in self.trainer.bad})")
        if not tokens:
            return Verdict("unjudged", "no token")
        first, refs = versions[0], self.trainer.refs
        if len(spans) == 1:
            if tokens == refs[first][prompt][:len(tokens)]:
                return Verdict("ok")
            return self._wrong(prompt, tokens, first)
        if tokens[:spans[0]["end"]] != refs[first][prompt][:spans[0]["end"]]:
            return self._wrong(prompt, tokens, first)
        for span, v in zip(spans[1:], versions[1:], strict=True):
            want = self.trainer.continuation(v, PROMPTS[prompt] + tokens[:span["start"]], span["end"] - span["start"])
            if want is None:
                return Verdict("unjudged", f"span on version {v}: model not kept, or a near tie")
            if tokens[span["start"]:span["end"]] != want:
                return Verdict("torn", f"span {span} differs from version {v} continuing the tokens so far")
        return Verdict("ok_spanning")

    def _wrong(self, prompt: int, tokens: list[int], version: int) -> Verdict:
        older = [u for u, ref in self.trainer.refs.items() if u != version and ref[prompt][:len(tokens)] == tokens]
        if older:
            return Verdict("stale", f"labelled {version}, equal to version {older[-1]}'s reference")
        return Verdict("torn", f"labelled {version}, equal to no version's reference")

    async def _check_claim(self, http: httpx.AsyncClient, claim: Claim, spans: list[dict], took_s: float) -> None:
        """vLLM labelled another version than /status claimed: a race, unless /status still claims
        the same version of the same process, unchanged since before the request."""
        try:
            after = next(s for s in (await http.get(self.admin_url + "/status", timeout=10)).json()["servers"]
                         if s["name"] == claim.name)
        except (httpx.HTTPError, ValueError, KeyError, StopIteration):
            return
        if (after["state"], after["version"], after["incarnation"]) == ("SERVING", claim.version, claim.incarnation) \
                and after["state_age_s"] > took_s + 1:
            self.counts["claim_mismatch"] += 1
            self._problem(claim, Verdict("claim_mismatch", f"/status says {claim.version}"), spans, [])

    def _problem(self, claim: Claim, verdict: Verdict, spans: list[dict], tokens: list[int], prompt: int | None = None,
                 finish_reason: str | None = None) -> None:
        line = {"kind": verdict.kind, "server": claim.name, "claimed": claim.version, "spans": spans,
                "prompt": prompt, "tokens": tokens, "finish_reason": finish_reason, "detail": verdict.detail,
                "at_unix": round(time.time(), 1)}
        print(f"soak: WRONG {line}", flush=True)
        if len(self.problems) < 50:
            self.problems.append(line)


def _number(label: str) -> int | None:
    return int(label) if label.isdigit() else None


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass
