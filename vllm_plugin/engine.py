"""The ``rolloutd`` weight-transfer engine: loads a version from the node mirror into the model.

Built by vLLM in each worker after the model loads. One update is vLLM's cycle
``start_weight_update`` → ``update_weights({"path", "digest"})`` → ``finish_weight_update``:

- start: a server that cannot reload exactly refuses here (``RELOAD_UNSUPPORTED``); the tied
  embeddings are noted while they are still one tensor;
- update: the mirror directory is checked (:mod:`vllm_plugin.checkpoint`) and the version is
  proven to cover the served model (every tensor of the checkpoint the server started from; tied
  embeddings under either name). A version that does not is refused (``VERSION_REFUSED``)
  before the model is touched: the server holds exactly what it held and may be resumed as it
  is. Only then does layerwise reload begin (vLLM clears the layers and buffers each one's new
  weights until it is complete, then processes it), and tensors stream in layer order
  from memory-mapped safetensors files into ``model.load_weights``: the only copy of the bytes
  is the one into the model. The files are mapped with ``MAP_POPULATE`` (page tables filled in
  one call instead of one fault per page): the load takes less time than through
  ``safetensors.safe_open``, whose mapping faults page by page (bench/README.md, "Pause window
  of an update"). Everything the mapping reads was checked against the header first.
  Once streamed, a layer that received nothing fails the update: vLLM would only log
  ``<Layer>: Failed to load weights`` and keep that layer's old tensors (how a tied output head
  stayed stale). A manifest with ``"partial": true`` skips both coverage checks;
- finish: layerwise reload is finalised.

On any error once the reload began, the engine finalises it itself, so every layer that had
not been completely loaded keeps its old weights, then raises: vLLM would otherwise leave the
cleared layers empty, and resuming generation on them kills the engine. Layers that were
completely loaded hold the new weights: such a server must not be resumed (the daemon restarts
it). Works on CPU-only torch.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from .checkpoint import Tensor, Version, checkpoint_names, describe_missing, in_layer_order, missing, open_version, tie
from .wire import RELOAD_UNSUPPORTED, VERSION_REFUSED

# A child of vLLM's logger, so lines appear in the server's log with vLLM's format.
log = logging.getLogger("vllm.rolloutd")


@dataclass
class RolloutdInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the bytes come from the node mirror, not from a trainer connection."""


@dataclass
class RolloutdUpdateInfo(WeightTransferUpdateInfo):
    path: str
    digest: str


class CoverageError(ValueError):
    """The version leaves part of the served model without new values."""


class RolloutdEngine(WeightTransferEngine[RolloutdInitInfo, RolloutdUpdateInfo]):
    init_info_cls = RolloutdInitInfo
    update_info_cls = RolloutdUpdateInfo
    supports_draft_weight_update = False
    _reloading = False  # layerwise reload begun (the layers cleared): from a version's first tensor to finish

    def parse_update_info(self, update_dict: dict) -> RolloutdUpdateInfo:
        if not isinstance(update_dict, dict):
            raise ValueError(f"rolloutd update_info must be an object, got {type(update_dict).__name__}")
        unknown = sorted(set(update_dict) - {"path", "digest"})
        missing = sorted({"path", "digest"} - set(update_dict))
        if unknown or missing:
            raise ValueError(f"rolloutd update_info takes exactly 'path' and 'digest' "
                             f"(unknown: {unknown}, missing: {missing})")
        if not all(isinstance(update_dict[k], str) for k in ("path", "digest")):
            raise ValueError("rolloutd update_info: 'path' and 'digest' must be strings")
        return RolloutdUpdateInfo(path=update_dict["path"], digest=update_dict["digest"])

    def init_transfer_engine(self, init_info: RolloutdInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        refuse_inexact_reload(self.model)
        # While the layers are untouched: tied parameters are still one object.
        self._tied = tied_embeddings(self.model)
        self._reloading = False  # the layers are cleared only once a version is proven to cover them

    def update_weights(self, update_info: dict) -> None:
        t0 = time.perf_counter()
        path = update_info.get("path") if isinstance(update_info, dict) else None
        if self._reloading:  # so that a refusal below always means "untouched"
            self._restore_untouched_layers()
            raise RuntimeError("rolloutd loads one version per update (start, update, finish); the layers "
                               "not completely loaded by the first keep their old weights")
        try:
            loaded, count = self.receive_weights(self.parse_update_info(update_info))
            # The base class synchronises unconditionally, which raises on CPU-only torch.
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except BaseException as e:
            if not self._reloading:
                log.error("rolloutd: update from %s refused; the model is untouched: %s", path, e)
                raise
            self._restore_untouched_layers()
            log.error("rolloutd: update from %s failed; layers not completely loaded keep their "
                      "old weights: %s", path, e)
            raise
        log.info("rolloutd: loaded %d tensors (%.1f MiB) from %s in %.3f s", count, loaded / 2**20,
                 path, time.perf_counter() - t0)

    def receive_weights(self, update_info: RolloutdUpdateInfo) -> tuple[int, int]:
        """Check the mirror directory and its coverage (touching nothing), then begin the reload
        and stream the version into the model; (bytes, tensors) loaded."""
        version, order = self._prepare(update_info)
        initialize_layerwise_reload(self.model)
        self._reloading = True
        return self._stream(version, order, update_info.path), len(order)

    def _prepare(self, update_info: RolloutdUpdateInfo) -> tuple[Version, list[Tensor]]:
        """Check the mirror directory and its coverage, touching nothing; the version and its
        tensors in the order they load."""
        version = open_version(update_info.path, update_info.digest)
        pairs = getattr(self, "_tied", None)
        if pairs is None:
            pairs = self._tied = tied_embeddings(self.model)
        found = tie(version.tensors, pairs)
        if not version.partial:
            self._check_names({t.name for t in found}, pairs, update_info.path)
        return version, in_layer_order(found)

    def _stream(self, version: Version, order: list[Tensor], path: str) -> int:
        """Stream the tensors into the model (the reload begun); the bytes loaded."""
        maps = {p: _map(p) for p in version.files}
        loaded = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            for t in order:
                tensor = _view(maps[t.file], t)
                loaded += tensor.nbytes
                yield t.name, tensor

        self.model.load_weights(stream())
        if not version.partial and (empty := self._layers_without_weights()):
            raise CoverageError(f"{path}: {len(empty)} layer(s) of the served model received no "
                                f"weights: {describe_missing(empty)} (a version that carries a subset on purpose "
                                "says \"partial\": true in its manifest)")
        return loaded

    def _check_names(self, carried: set[str], pairs: dict[str, str], path: str) -> None:
        """Every tensor of the start checkpoint must come with the version; else it is refused,
        tagged for the daemon: nothing was touched, and no attempt can change the answer."""
        lacking = missing(checkpoint_names(self.model_config.model), carried, pairs)
        if lacking:
            raise CoverageError(f"{VERSION_REFUSED} {path}: the version lacks {len(lacking)} tensor(s) of the "
                                f"served model's checkpoint: {describe_missing(lacking)} (a version that carries a "
                                "subset on purpose says \"partial\": true in its manifest)")

    def _layers_without_weights(self) -> list[str]:
        """Layers still waiting for their first weight after the stream: vLLM would put their
        old tensors back at finish. Buffer-only layers (rotary caches) and attention layers
        (processed at finish, no checkpoint weights) are not expected to receive any."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        empty = []
        for name, layer in self.model.named_modules():
            info = LAYERWISE_INFO.get(layer)
            if (info is None or not info.can_load() or info.load_numel > 0 or not info.load_numel_total
                    or not info.restore_metadata[0] or is_deferred_attention_layer(layer)):
                continue
            empty.append(f"{name} ({type(layer).__name__})")
        return empty

    def finish_weight_update(self) -> None:
        if self._reloading:  # else no version was streamed: nothing was cleared
            finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False

    def _restore_untouched_layers(self) -> None:
        """Finalise after a failed update. A layer whose weights all arrived has been processed
        and holds the new weights; a layer that got only part of them is put back to "nothing
        loaded", so finalising returns it, like every untouched layer, to its old tensors."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for info in list(LAYERWISE_INFO.values()):
            if info.can_load() and info.load_numel > 0:
                info.load_numel = 0
                info.loaded_weights = []
        finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False

    def shutdown(self) -> None:
        pass


class ReloadUnsupported(RuntimeError):
    """This vLLM cannot reload the served model exactly: refuse before touching a layer. Its text
    starts with the tag the daemon reads (wire.RELOAD_UNSUPPORTED): the server is untouched, and
    no version will load into it."""


def refuse_inexact_reload(model: torch.nn.Module) -> None:
    """Fail closed where vLLM's layerwise reload is known to serve wrong weights. On vLLM's CPU
    build (0.32) a mixture-of-experts layer's experts are repacked for its CPU kernel, and after
    a reload the outputs differ from the weights loaded, even when the weights reloaded are the
    very ones the server started on (seen on Qwen3-MoE and Mixtral; docs/models.md)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    experts = [name for name, m in model.named_modules()
               if isinstance(getattr(m, "w13_weight", None), torch.nn.Parameter)]
    if experts:
        raise ReloadUnsupported(f"{RELOAD_UNSUPPORTED} vLLM's CPU build does not reload mixture-of-experts "
                                "layers exactly "
                                f"({experts[0]} and {len(experts) - 1} more): refusing to load a version "
                                "into this server; a server started on the version serves it exactly")


def tied_embeddings(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for embedding parameters that are one tensor under two names
    (``lm_head.weight`` tied to ``model.embed_tokens.weight``), canonical first in module order."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    first: dict[int, str] = {}
    pairs: dict[str, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, VocabParallelEmbedding):
            continue
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            qualname = f"{prefix}.{name}" if prefix else name
            if (canonical := first.setdefault(id(param), qualname)) != qualname:
                pairs[qualname] = canonical
    return pairs


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
           "F8_E5M2": getattr(torch, "float8_e5m2", None)}


def _map(path: Path) -> mmap.mmap:
    """The whole file, read-only and shared (the page cache of the tmpfs mirror, no copy). It is
    unmapped when the last tensor viewing it is gone."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)


def _view(mapped: mmap.mmap, t: Tensor) -> torch.Tensor:
    dtype = _DTYPES[t.dtype]
    if dtype is None:
        raise ValueError(f"tensor {t.name!r}: this torch has no {t.dtype}")
    if t.end == t.start:
        return torch.empty(t.shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only on purpose: the model copies out of it
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.frombuffer(mapped, dtype=dtype, count=(t.end - t.start) // dtype.itemsize, offset=t.start)
    return flat.view(t.shape)
