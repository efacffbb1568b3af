"""How the demos and the tests run vLLM's CPU build on a tiny model: small, quick to start,
nothing compiled (docs/plugin.md, "Testing on a machine without a GPU")."""

from __future__ import annotations


def cpu_args(max_model_len: int = 256, max_num_seqs: int = 8) -> list[str]:
    """``vllm serve`` flags for a tiny model on CPU: float32 (what transformers computes the
    references in), a small KV cache, and the model run eagerly rather than compiled."""
    return ["--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]


# TORCHDYNAMO_DISABLE: --enforce-eager leaves a few small functions that vLLM compiles on its own
# with torch.compile, among them the rank of a logprob; a server's first request with logprobs
# (the gate's first score after an update) compiled C++ for 13 s of a core, and still 7 s with the
# compile cache the daemon keeps across starts. Eager, it takes 0.02 s.
#
# VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU platform otherwise turns a one-rank server's "uni"
# executor into "mp", a worker process of its own beside the engine core, which imports torch and
# vLLM again at every start. With it, the worker runs in the engine core, as it does on a GPU with
# one rank (the API server still runs the engine core in a process of its own; a server of several
# ranks still gets a process per rank). bench/README.md has the measurement.
CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TORCHDYNAMO_DISABLE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
