"""Small Llama checkpoints built on the spot: the demo, the tests and the benchmarks need real
models that vLLM serves, with no model hub.

A model directory holds ``config.json`` (``LlamaForCausalLM``), a tokenizer trained here with
the ``tokenizers`` library on a fixed text, and ``model.safetensors``. Everything is
deterministic: the same shape and seed give the same bytes; another seed gives the same shapes
with other weights, whose greedy outputs differ (weights are drawn with a large standard
deviation so that the top token is never a near tie). vLLM on CPU needs ``head_dim >= 64``.
Needs the ``models`` extra (numpy, tokenizers); never imported by the daemon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True)
class Shape:
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 512
    init_std: float = 0.5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Shape()  # ~1.5 MB: the tests' servers start in seconds
BENCH = Shape(hidden=1024, layers=6, heads=16, intermediate=2816, vocab=4096)  # ~320 MB: bench/pause


def llama_state_dict(seed: int, hidden: int = 256, layers: int = 4, vocab: int = 4096,
                     intermediate: int = 688, init_std: float = 0.05) -> dict:
    """A Llama-shaped checkpoint (numpy float32, HF tensor names); same shapes for every seed."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def w(*shape: int):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(init_std)

    sd = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{proj}.weight"] = w(hidden, hidden)
        sd[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        sd[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        sd[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
    sd["model.norm.weight"] = np.ones(hidden, np.float32)
    sd["lm_head.weight"] = w(vocab, hidden)
    return sd


def state_dict(shape: Shape, seed: int) -> dict:
    return llama_state_dict(seed, hidden=shape.hidden, layers=shape.layers, vocab=shape.vocab,
                            intermediate=shape.intermediate, init_std=shape.init_std)


def config(shape: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": shape.init_std,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    }


def _corpus() -> list[str]:
    """A fixed text to train the tokenizer on: every run trains on the same lines."""
    words = ("policy weights version trainer registry node mirror server update pause resume "
             "rollout reward token layer tensor chunk digest lease heartbeat stream model "
             "the a of to and in is it for on with as at by from this that").split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer trained here, padded with unused tokens to exactly ``vocab``
    ids, so that every id the model can produce decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() < vocab:
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab - tok.get_vocab_size())])
    assert tok.get_vocab_size() == vocab, (tok.get_vocab_size(), vocab)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 512}, indent=1))


def build(directory: Path, shape: Shape = TINY, seed: int = 0) -> Path:
    """Write a servable model directory; returns it."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(shape), indent=1))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}))
    write_tokenizer(directory, shape.vocab)
    weights = directory / "model.safetensors"
    # One metadata key: the header's map order is not stable.
    save_file(state_dict(shape, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; a model is read by servers running as another user
    return directory
