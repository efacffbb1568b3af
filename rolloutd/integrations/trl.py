"""TRL's GRPO and RLOO trainers generating on a rolloutd fleet (``pip install 'rolloutd[trl]'``).

Every TRL trainer that uses vLLM goes through one object, ``trl.generation.VLLMGeneration``:
``sync_weights()`` when the training step changed, then ``generate(prompts, images,
num_generations, profiler)``. :class:`FleetGeneration` is that object on a fleet:

- ``sync_weights()`` publishes the policy to the registry as the next version, under the names
  vLLM loads (TRL's own ``_iter_named_params``: FSDP and DeepSpeed shards gathered, PEFT adapters
  merged; a tied head is the embedding, as ``named_parameters`` gives it), optionally with a
  canary the servers score before they serve it. Only the main process publishes; every process
  takes part in the gathers and counts the version.
- ``generate(...)`` sends each prompt's token ids through :class:`rolloutd.fleet.FleetSync`, one
  request per sample, each with its own seed (a GRPO group spread over servers is not copies),
  with ``min_version = version - k``: no sample comes from weights more than ``k`` versions
  behind the ones being trained. Every answer's versions are checked again here
  (:class:`StaleSample`). It returns TRL's tuple; the logprobs' first entry at each position is
  the **sampled** token's, which TRL's vLLM importance-sampling correction compares with the
  trainer's.
- TRL's logs get ``rolloutd/version`` (what the trainer trains), ``rolloutd/oldest_version``
  (the oldest weights any token of the batch came from) and ``rolloutd/staleness`` (the
  difference, at most ``k``).

:class:`GRPOTrainer` and :class:`RLOOTrainer` are TRL's, built with ``fleet=FleetConfig(...)``;
:func:`equip` does the same to a trainer built with ``use_vllm=False``. TRL's generation settings
map onto :class:`~rolloutd.fleet.Sampling` in :func:`sampling_of`; one that the fleet cannot
honour raises :class:`UnsupportedSetting` when the trainer is built.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trl
from accelerate.utils import broadcast_object_list, is_peft_model
from trl.generation.vllm_generation import VLLMGeneration

from rolloutd.fleet import FleetSync, Generation, Sampling
from rolloutd.fleet.sampling import MAX_TOP_LOGPROBS

log = logging.getLogger("rolloutd.integrations.trl")

KEEP_BATCHES = 64  # the last generate calls kept for inspection (FleetGeneration.batches)
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
    """A TRL generation setting that generating on the fleet cannot honour."""


class StaleSample(RuntimeError):
    """A sample came from weights older than the staleness bound allows (or from a start model)."""


@dataclass
class FleetConfig:
    """Where the trainer publishes and generates.

    ``registry``: the publisher (an ``EmbeddedRegistry`` or ``RegistryHTTP``); needed on the
    main process only. ``registry_url``: the registry the fleet client reads (default:
    ``registry.url``); ``registry_token``/``gateway_token``: the bearer tokens of the registry
    and of the servers' gateways. ``max_staleness`` (k): a sample's weights are at most k
    versions behind the weights it trains (0: on-policy, each batch waits for the version just
    published). ``canary_prompt_ids``: attach a canary computed from the trainer's model on
    these ids to every version (every server scores it before it serves the version).
    ``seed``: of the per-request seeds (default: the trainer's ``args.seed``). ``fleet_options``:
    :class:`rolloutd.fleet.Fleet`'s keyword arguments (``wait_s``, ``refresh_s``, ...).
    ``publish=False`` holds the fleet on the version it serves (an ablation: the trainer trains,
    nothing reaches the servers).
    """

    registry: Any = None
    registry_url: str | None = None
    registry_token: str | None = None
    gateway_token: str | None = None
    max_staleness: int = 0
    canary_prompt_ids: Sequence[int] | None = None
    canary_tolerance: float = 0.05
    canary_new_tokens: int = 8
    seed: int | None = None
    fleet_options: dict[str, Any] = field(default_factory=lambda: {"wait_s": 600.0})
    publish: bool = True

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def url(self) -> str:
        url = self.registry_url or getattr(self.registry, "url", None)
        if not url:
            raise ValueError("FleetConfig needs registry_url (or a registry that has a url)")
        return url


# -- settings ----------------------------------------------------------------------------------------

def sampling_of(*, temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0, min_p: float | None = 0.0,
                repetition_penalty: float = 1.0, max_completion_length: int = 16, logprobs: int | None = 0,
                generation_kwargs: dict | None = None,
                structured_outputs_regex: str | None = None) -> tuple[Sampling, int | None]:
    """TRL's generation settings (``VLLMGeneration``'s arguments) as one :class:`Sampling`, and
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


# -- the generation backend ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    """What one ``generate`` call got: the trainer's version then, the floor it asked for, and each
    sample's versions (oldest first per span) and replicas."""

    version: int
    floor: int
    versions: list[list[int | None]]
    replicas: list[list[str]]


class FleetGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` on a rolloutd fleet: publish to the registry, generate on the
    fleet. Built with ``VLLMGeneration``'s arguments (its vLLM-only ones are unused) plus
    ``fleet`` (a :class:`FleetConfig`) and ``record(name, value)``, where the metrics go."""

    def __init__(self, model, accelerator, processing_class, *, fleet: FleetConfig,
                 record: Callable[[str, float], None] | None = None, seed: int = 0, **settings: Any):
        self.config = fleet
        self.record = record or (lambda name, value: None)
        self.sampling, kw_seed = sampling_of(
            **{k: settings[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                        "max_completion_length", "logprobs", "generation_kwargs",
                                        "structured_outputs_regex") if k in settings})
        self.seed = fleet.seed if fleet.seed is not None else kw_seed if kw_seed is not None else seed
        self.client: FleetSync | None = None
        super().__init__(model, accelerator, processing_class, mode="server", **settings)

    def _init_vllm(self) -> None:
        """Instead of starting or reaching vLLM: the fleet client, and the version to count from."""
        main = self.accelerator.is_main_process
        if main and self.config.registry is None:
            raise ValueError("FleetConfig.registry is needed on the main process: it publishes the versions")
        warning = raw_logprobs_warning(self.sampling)
        if warning and main:
            log.warning("check the servers' logprobs mode: %s", warning)
        newest = [self._newest() if main else None]
        broadcast_object_list(newest, from_process=0)
        self.version = int(newest[0] or 0)  # the trainer's weights: the newest version it published
        self.published: list[int] = []
        self.batches: deque[Batch] = deque(maxlen=KEEP_BATCHES)  # the last generate calls, in order
        self.calls = 0
        self.client = FleetSync(self.config.url(), registry_token=self.config.registry_token,
                                gateway_token=self.config.gateway_token, **self.config.fleet_options)

    def _newest(self) -> int | None:
        return self.config.registry.latest().get("version")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def floor(self) -> int:
        """The oldest version a sample may come from now."""
        return max(1, self.version - self.config.max_staleness)

    # -- weights --------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Publish the policy as the next version (the main process; every process gathers)."""
        if not self.config.publish:
            return
        keep = bool(self._dist.is_zero3 or self._dist.is_fsdp or is_peft_model(self.model))
        main = self.accelerator.is_main_process
        tensors = {}
        for name, tensor in self._iter_named_params():
            if main:
                # a gathered shard or a merged adapter is only valid while iterating: copy it
                tensors[name] = tensor.detach().to("cpu", copy=keep)
        version = self.version + 1
        if main:
            canary = self._canary() if self.config.canary_prompt_ids else None
            self.config.registry.publish(version, tensors, canary=canary)
            log.info("published version %d (%d tensors)", version, len(tensors))
        self.version = version
        self.published.append(version)

    def _canary(self):
        import torch

        from rolloutd.registry.canary import make_canary
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                return make_canary(model, list(self.config.canary_prompt_ids),
                                   new_tokens=self.config.canary_new_tokens, tolerance=self.config.canary_tolerance)
        finally:
            model.train(was_training)

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], images: list | None, num_generations: int,
                 profiler: Any = None) -> tuple:
        """One request per prompt entry (TRL repeats each prompt ``num_generations`` times), each
        seeded, all at ``min_version`` = version - k; TRL's (prompt_ids, completion_ids, logprobs,
        logprob_token_ids)."""
        if images is not None and any(i is not None for i in images):
            raise UnsupportedSetting("images: the fleet generates from token ids only")
        floor = self.floor()
        self.calls += 1
        process = self.accelerator.process_index
        futures = [self.client.submit(list(p), replace(self.sampling, seed=request_seed(self.seed, process,
                                                                                            self.calls, i)),
                                      min_version=floor)
                   for i, p in enumerate(prompts)]
        try:
            if profiler is not None:
                with profiler:
                    gens = [f.result() for f in futures]
            else:
                gens = [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
        self._check_and_record(gens, floor)
        logprobs, token_ids = zip(*(self._logprobs_of(g) for g in gens), strict=True) if gens else ((), ())
        return [list(p) for p in prompts], [g.token_ids for g in gens], list(logprobs), list(token_ids)

    def _check_and_record(self, gens: list[Generation], floor: int) -> None:
        for g in gens:
            oldest = g.min_version
            if g.token_ids and (oldest is None or oldest < floor):
                raise StaleSample(f"a sample came from version {oldest} (weight_versions {g.weight_versions}), "
                                  f"below {floor} = version {self.version} - k {self.config.max_staleness}")
        oldest = min((g.min_version for g in gens if g.token_ids), default=self.version)
        self.record("rolloutd/version", float(self.version))
        self.record("rolloutd/oldest_version", float(oldest))
        self.record("rolloutd/staleness", float(self.version - oldest))
        replicas = Counter(r for g in gens for r in g.replicas)
        self.record("rolloutd/replicas", float(len(replicas)))
        self.batches.append(Batch(self.version, floor, [g.versions for g in gens], [g.replicas for g in gens]))

    def _logprobs_of(self, g: Generation) -> tuple[list[list[float]], list[list[int]]]:
        """Per position: the sampled token first, then the top-k others (when TRL asked for them)."""
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


# -- the trainers ----------------------------------------------------------------------------------------

def _without_vllm(args):
    """A copy of the trainer's arguments with ``use_vllm`` off, so that TRL builds no vLLM of its own."""
    if args is None:
        raise TypeError("pass args (a GRPOConfig or RLOOConfig) explicitly")
    inner = copy.copy(args)
    inner.use_vllm = False
    return inner


def equip(trainer, fleet: FleetConfig) -> FleetGeneration:
    """Make a TRL GRPO or RLOO trainer (built with ``use_vllm=False``) generate on the fleet:
    the vLLM path of the trainer (weight sync per step, the importance-sampling correction and its
    ``sampling/*`` metrics) runs with :class:`FleetGeneration` as its generation object."""
    args = trainer.args
    if getattr(trainer, "use_transformers_continuous_batching", False):
        raise UnsupportedSetting("use_transformers_continuous_batching: generation goes to the fleet instead")
    # TRL checks this only when it builds its own vLLM
    is_on = getattr(trainer, "vllm_importance_sampling_correction", False)
    if getattr(trainer, "loss_type", None) == "vespo" and is_on \
            and trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        raise UnsupportedSetting("VESPO needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask'")

    def record(name: str, value: float) -> None:
        trainer._metrics["train" if trainer.model.training else "eval"][name].append(value)

    trainer.vllm_generation = FleetGeneration(
        trainer.model, trainer.accelerator, trainer.processing_class, fleet=fleet, record=record, seed=args.seed,
        structured_outputs_regex=args.vllm_structured_outputs_regex, repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k, min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length, logprobs=0, generation_kwargs=args.generation_kwargs)
    trainer.use_vllm = True
    trainer.vllm_mode = "rolloutd"  # neither of TRL's: its colocate-only and server-only paths stay off
    trainer._last_loaded_step = -1  # publish at the first generation
    args.use_vllm = True
    return trainer.vllm_generation


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer generating on a rolloutd fleet: ``GRPOTrainer(model, reward_funcs,
    args=GRPOConfig(...), train_dataset=..., fleet=FleetConfig(registry=reg, max_staleness=1))``.
    ``args.use_vllm`` and the ``vllm_*`` server and colocate settings are not used."""

    def __init__(self, *a: Any, fleet: FleetConfig, args=None, **kw: Any):
        super().__init__(*a, args=_without_vllm(args), **kw)
        equip(self, fleet)


class RLOOTrainer(trl.RLOOTrainer):
    """TRL's RLOOTrainer generating on a rolloutd fleet (as :class:`GRPOTrainer`)."""

    def __init__(self, *a: Any, fleet: FleetConfig, args=None, **kw: Any):
        super().__init__(*a, args=_without_vllm(args), **kw)
        equip(self, fleet)
