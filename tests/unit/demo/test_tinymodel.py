"""The locally built test models: deterministic, same shapes for every seed, servable shapes."""

import hashlib
import json

from rolloutd.demo import tinymodel


def digest_of(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a1 = digest_of(tinymodel.build(tmp_path / "a1", seed=1))
    a2 = digest_of(tinymodel.build(tmp_path / "a2", seed=1))
    b = digest_of(tinymodel.build(tmp_path / "b", seed=2))
    assert a1 == a2
    assert a1["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a1.items() if k != "model.safetensors"} == \
           {k: v for k, v in b.items() if k != "model.safetensors"}  # config and tokenizer shared


def test_shapes_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    d = tinymodel.build(tmp_path / "m", seed=0)
    config = json.loads((d / "config.json").read_text())
    assert config["head_dim"] >= 64  # vLLM on CPU needs it
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    ids = tok.encode("the policy weights version").ids
    assert ids and tok.decode(ids) == "the policy weights version"
    a, b = tinymodel.state_dict(tinymodel.TINY, 0), tinymodel.state_dict(tinymodel.TINY, 1)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
