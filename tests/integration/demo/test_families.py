"""The architecture matrix of tiny test models (rolloutd.demo.families), without vLLM: deterministic
bytes per seed, every tensor seed-dependent, the checkpoint layouts vLLM's loaders see, and
greedy outputs that are distinct between seeds, not degenerate, and have clear margins.

Building the models takes torch and transformers (seconds of imports, then 33 models): those
tests are slow, and torch is imported only when one runs, so the fast tier never loads it."""

import hashlib
import json

import pytest
from safetensors import safe_open

from rolloutd.demo import families
from rolloutd.demo.tinymodel import BOS_ID

FAMILIES = sorted(families.FAMILIES)
SEEDS = (0, 1, 2)


def builds_models(test):
    """A test that builds torch models: slow, on one torch thread, beside other such tests."""
    return pytest.mark.slow(pytest.mark.parallel(pytest.mark.usefixtures("one_torch_thread")(test)))


@pytest.fixture(scope="module")
def torch():
    import torch
    return torch


@pytest.fixture(scope="module")
def models():
    return {(f, s): families.hf_model(f, s) for f in FAMILIES for s in SEEDS}


@pytest.fixture(scope="module")
def outputs(models):
    return {k: families.greedy_and_margins(m, families.PROMPTS, 16) for k, m in models.items()}


def digest_of(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def checkpoint_keys(d):
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())


@builds_models
@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_deterministic_and_has_the_family_layout(tmp_path, family):
    a1 = families.build(tmp_path / "a1", family, seed=0)
    a2 = families.build(tmp_path / "a2", family, seed=0)
    assert digest_of(a1) == digest_of(a2)
    assert {f.stat().st_mode & 0o777 for f in a1.iterdir()} == {0o644}
    config = json.loads((a1 / "config.json").read_text())
    fam = families.FAMILIES[family]
    assert config["architectures"] == [fam.architecture]
    assert config["head_dim"] >= 64 and config["vocab_size"] == families.VOCAB
    assert config["max_position_embeddings"] >= 512
    assert config["tie_word_embeddings"] is fam.tied
    keys = checkpoint_keys(a1)
    assert "model.embed_tokens.weight" in keys
    assert ("lm_head.weight" in keys) is not fam.tied
    if family == "phi3":
        assert any(k.endswith("self_attn.qkv_proj.weight") for k in keys)
        assert any(k.endswith("mlp.gate_up_proj.weight") for k in keys)
        assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in keys)
    if family == "qwen2":
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias"} <= keys
    if family in ("qwen3", "qwen3-moe", "gemma3", "olmo2"):
        assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= keys
    if family in ("qwen3-moe", "mixtral"):
        assert sum(".experts." in k for k in keys) > 0


@builds_models
@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_differs_between_seeds(models, family, torch):
    a = dict(models[family, 0].state_dict())
    b = dict(models[family, 1].state_dict())
    assert a.keys() == b.keys()
    params = {n for n, _ in models[family, 0].named_parameters(remove_duplicate=False)}
    for name in params:
        assert a[name].shape == b[name].shape
        assert not torch.equal(a[name], b[name]), name
    if families.FAMILIES[family].tied:
        m = models[family, 0]
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


@builds_models
def test_same_seed_same_tensors(torch):
    a, b = families.hf_model("qwen2", 3).state_dict(), families.hf_model("qwen2", 3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    raw = families.hf_model("qwen2", 3, min_margin=0).state_dict()  # draw 0, margins unchecked
    assert all(torch.equal(raw[k], families.hf_model("qwen2", 3, min_margin=0).state_dict()[k]) for k in raw)


@builds_models
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_outputs_differ_between_seeds_and_are_not_degenerate(outputs, family):
    per_seed = [outputs[family, s][0] for s in SEEDS]
    for outs in per_seed:
        assert len(outs) == len(families.PROMPTS) and all(len(o) == 16 for o in outs)
        assert all(0 <= t < families.VOCAB for o in outs for t in o)
        assert all(len(set(o)) >= 3 for o in outs), outs  # not one token repeated
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert all(a != b for a, b in zip(per_seed[i], per_seed[j], strict=True)), (family, i, j)


@builds_models
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_margins_are_clear(outputs, family):
    # logits have a std of ~6; float32 differences between implementations are ~1e-5
    for s in SEEDS:
        assert min(outputs[family, s][1]) >= families.MIN_MARGIN, (family, s)


@builds_models
def test_greedy_is_argmax_without_eos_stop(models, torch):
    m = models["llama", 0]
    prompt = families.PROMPTS[0]
    out = families.greedy(m, [prompt], 4)[0]
    with torch.no_grad():
        logits = m(torch.tensor([prompt + out[:2]])).logits[0, -1]
    assert int(torch.argmax(logits)) == out[2]
    assert families.greedy_margin(m, [prompt], 4) == min(families.greedy_and_margins(m, [prompt], 4)[1])


def test_prompts_fit_the_test_servers():
    assert len(families.PROMPTS) >= 4
    assert all(p[0] == BOS_ID and all(0 <= t < families.VOCAB for t in p) for p in families.PROMPTS)
    assert any(len(p) > 128 for p in families.PROMPTS)  # longer than one vLLM CPU KV block
    assert all(len(p) + 16 <= 256 for p in families.PROMPTS)  # --max-model-len 256


def test_unsupported_names_known_families():
    assert set(families.UNSUPPORTED) <= set(families.FAMILIES)


@builds_models
def test_sparse_step_moves_a_few_elements_and_every_output(torch):
    """An RL-like step: about 2 % of each tensor's elements move, the rest keep their bytes; every
    greedy output changes with clear margins; the same arguments give the same bytes."""
    before = families.hf_model("qwen2", 1)
    after = families.sparse_step(before, 7, families.PROMPTS, 16, rounded=True)
    again = families.sparse_step(before, 7, families.PROMPTS, 16, rounded=True)
    a, b = before.state_dict(), after.state_dict()
    moved = sum(int((a[k] != b[k]).sum()) for k in a)
    total = sum(a[k].numel() for k in a)
    assert 0.01 < moved / total < 0.03, moved / total
    assert all(torch.equal(b[k], again.state_dict()[k]) for k in b)
    rounded = families.bf16_rounded(after)
    assert all(p.dtype == torch.float32 and torch.equal(p, p.to(torch.bfloat16).float()) for p in rounded.parameters())
    outs, margins = families.greedy_and_margins(rounded, families.PROMPTS, 16)
    old = families.greedy(families.bf16_rounded(before), families.PROMPTS, 16)
    assert all(x != y for x, y in zip(outs, old, strict=True)) and min(margins) >= families.MIN_MARGIN
