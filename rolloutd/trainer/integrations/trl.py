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
map onto :class:`~rolloutd.fleet.Sampling` (:mod:`rolloutd.trainer.integrations.batches`); one that the
fleet cannot honour raises :class:`UnsupportedSetting` when the trainer is built.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trl
from accelerate.utils import broadcast_object_list, is_peft_model
from trl.generation.vllm_generation import VLLMGeneration

from rolloutd.fleet import FleetSync
from rolloutd.trainer.integrations.batches import (
    Batch,
    StaleSample,
    UnsupportedSetting,
    check_batch,
    floor_of,
    logprob_rows,
    raw_logprobs_warning,
    request_seed,
    sampling_of,
)

__all__ = ["FleetConfig", "FleetGeneration", "GRPOTrainer", "RLOOTrainer", "equip", "Batch", "StaleSample",
           "UnsupportedSetting"]

log = logging.getLogger("rolloutd.trainer.integrations.trl")
KEEP_BATCHES = 64  # the last generate calls kept for inspection (FleetGeneration.batches)



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


# -- the generation backend ----------------------------------------------------------------------------

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
        if self.config.canary_prompt_ids and (self._dist.is_zero3 or self._dist.is_fsdp):
            # the canary is a forward pass on the main process alone; sharded, it would wait for the others
            raise UnsupportedSetting("canary_prompt_ids with FSDP or DeepSpeed ZeRO-3: the canary needs the whole "
                                     "model on the main process")
        warning = raw_logprobs_warning(self.sampling)
        if warning and main:
            log.warning("check the servers' logprobs mode: %s", warning)
        newest = [self._newest() if main else None]
        broadcast_object_list(newest, from_process=0)
        self.version = int(newest[0] or 0)  # the trainer's weights: the newest version it published
        self.published: list[int] = []  # the version of each sync (on other processes: the main's)
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
        return floor_of(self.version, self.config.max_staleness)

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

        from rolloutd.trainer.canary import make_canary
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
        batch, metrics = check_batch(gens, self.version, self.config.max_staleness)
        self.batches.append(batch)
        for name, value in metrics.items():
            self.record(name, value)
        logprobs, token_ids = zip(*(logprob_rows(g) for g in gens), strict=True) if gens else ((), ())
        return [list(p) for p in prompts], [g.token_ids for g in gens], list(logprobs), list(token_ids)



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
