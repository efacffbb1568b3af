"""rolloutd's vLLM plugin: the weight-transfer engine that loads a version from the node mirror.

It runs inside ``vllm serve`` (API server, engine core and workers); the daemon never imports
it. vLLM calls :func:`register` once per process through the ``vllm.general_plugins`` entry
point, whether rolloutd is installed in vLLM's environment or the daemon put this package on
the child's import path. Select it with ``--weight-transfer-config '{"backend": "rolloutd"}'``.

This package imports only the standard library at module level, so it loads in any vLLM
environment; torch, vLLM and safetensors are imported by the engine when vLLM builds it.
"""

BACKEND = "rolloutd"


def register() -> None:
    """Register the engine lazily, once: vLLM may run plugins more than once per process, and a
    second registration under the same name raises."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "vllm_plugin.engine", "RolloutdEngine")
