"""The ``rolloutd`` weight-transfer engine: loads a version from the node mirror into the model.

Built by vLLM in each worker after the model loads. One update is vLLM's cycle
``start_weight_update`` → ``update_weights({"path", "digest"})`` → ``finish_weight_update``:

- start: layerwise reload begins (vLLM clears the layers and buffers each one's new weights
  until it is complete, then processes it);
- update: the mirror directory is checked (:mod:`vllm_plugin.checkpoint`) before any layer is
  touched, then tensors stream in layer order from memory-mapped safetensors files into
  ``model.load_weights``: the only copy of the bytes is the one into the model;
- finish: layerwise reload is finalised.

On any error during update the engine finalises the reload itself, so every layer that had
not been completely loaded keeps its old weights, then raises: vLLM would otherwise leave the
cleared layers empty, and resuming generation on them kills the engine. Works on CPU-only torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from .checkpoint import Tensor, check_version, in_layer_order

# A child of vLLM's logger, so lines appear in the server's log with vLLM's format.
log = logging.getLogger("vllm.rolloutd")


@dataclass
class RolloutdInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the bytes come from the node mirror, not from a trainer connection."""


@dataclass
class RolloutdUpdateInfo(WeightTransferUpdateInfo):
    path: str
    digest: str


class RolloutdEngine(WeightTransferEngine[RolloutdInitInfo, RolloutdUpdateInfo]):
    init_info_cls = RolloutdInitInfo
    update_info_cls = RolloutdUpdateInfo
    supports_draft_weight_update = False

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
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        t0 = time.perf_counter()
        path = update_info.get("path") if isinstance(update_info, dict) else None
        try:
            info = self.parse_update_info(update_info)
            loaded, count = self.receive_weights(info)
            # The base class synchronises unconditionally, which raises on CPU-only torch.
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except BaseException as e:
            self._restore_untouched_layers()
            log.error("rolloutd: update from %s failed; layers not completely loaded keep their "
                      "old weights: %s", path, e)
            raise
        log.info("rolloutd: loaded %d tensors (%.1f MiB) from %s in %.3f s", count, loaded / 2**20,
                 path, time.perf_counter() - t0)

    def receive_weights(self, update_info: RolloutdUpdateInfo) -> tuple[int, int]:
        """Check the mirror directory, then stream it into the model; (bytes, tensors) loaded."""
        files = check_version(update_info.path, update_info.digest)
        with ExitStack() as stack:
            handles = {p: stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in files}
            tensors = in_layer_order([Tensor(p, name) for p, h in handles.items() for name in h.offset_keys()])
            return self._load(handles, tensors), len(tensors)

    def _load(self, handles: dict, tensors: list[Tensor]) -> int:
        total = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal total
            for t in tensors:
                tensor = handles[t.file].get_tensor(t.name)  # a view of the mapped file, no copy
                total += tensor.nbytes
                yield t.name, tensor

        self.model.load_weights(stream())
        return total

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

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

    def shutdown(self) -> None:
        pass
