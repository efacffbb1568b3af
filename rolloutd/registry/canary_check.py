"""The registry's check of a canary at publish: one whose token ids fall outside the version's
vocabulary, or whose tolerance would pass any weights, can never pass, and would have every node
load the version and refuse it. The trainer computes canaries (:mod:`rolloutd.trainer.canary`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from rolloutd.wire.manifest import MAX_CANARY_TOLERANCE, Canary, FileEntry
from vllm_plugin.wire import as_dict, read_header

# Tensors whose rows are the vocabulary: the input embedding and the output head of the usual
# Hugging Face checkpoints. A canary's token id must be a row of every one the version holds.
VOCABULARY_TENSORS = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "word_embeddings.weight",
                      "embed_in.weight", "embed_out.weight", "tok_embeddings.weight")



def canary_problems(canary: Canary, tensors: Iterable[tuple[str, object]]) -> list[str]:
    """Why ``canary`` can never pass on a server of the version whose safetensors headers give
    ``tensors`` (name, header entry); none: it may. Checked by the registry at publish: a canary
    that cannot pass would have every node refuse the version, after loading it."""
    problems = []
    if canary.tolerance > MAX_CANARY_TOLERANCE:
        problems.append(f"tolerance {canary.tolerance:g} is above {MAX_CANARY_TOLERANCE:g} nats: the check would "
                        "pass any weights")
    rows = [(shape[0], name) for name, entry in tensors
            if name.endswith(VOCABULARY_TENSORS) and isinstance(entry, Mapping)
            and isinstance(shape := entry.get("shape"), list) and len(shape) == 2 and isinstance(shape[0], int)]
    if rows:
        vocab, name = min(rows)
        outside = sorted({t for t in (*canary.prompt_ids, *canary.continuation_ids) if t >= vocab})
        if outside:
            problems.append(f"token id(s) {outside[:5]} outside the vocabulary of {vocab} ({name} has {vocab} rows)")
    return problems


def version_tensors(files: Iterable[FileEntry], read: Callable[[str, int, int], bytes]) -> Iterator[tuple[str, object]]:
    """(name, header entry) of every tensor in the safetensors headers of a version's ``files``;
    ``read(file name, offset, length)`` reads them. Files that are not safetensors give none."""
    for f in files:
        header = read_header(lambda offset, n, name=f.name: read(name, offset, n), f.size)
        if not isinstance(header, str):
            yield from ((k, as_dict(v)) for k, v in header[0] if k != "__metadata__")
