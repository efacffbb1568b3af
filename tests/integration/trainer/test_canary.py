"""The canary: its wire model, the manifest digest with and without it (registry and plugin
agree), publishing it, and make_canary against a computation by hand on a tiny HF model."""

from __future__ import annotations

import json
import math
import os

import pytest
from pydantic import ValidationError

from rolloutd.demo import tinymodel
from rolloutd.rollout.mirror import Mirror
from rolloutd.trainer import RegistryHTTP
from rolloutd.trainer.canary import load_canary, make_canary, save_canary
from rolloutd.trainer.publish import save_shards
from rolloutd.wire import errors
from rolloutd.wire.manifest import Canary, FileEntry, Manifest, build_manifest
from rolloutd.wire.messages import GateReport, Heartbeat
from vllm_plugin.checkpoint import check_version, manifest_digest

CANARY = Canary(prompt_ids=[1, 17, 42], continuation_ids=[5, 6], logprobs=[-0.25, -1e-05], tolerance=0.01)


def old_manifest() -> Manifest:
    return Manifest(version=7, chunk_bytes=4096, metadata={"step": "7"},
                    files=[FileEntry(name="model.safetensors", size=5000, chunks=["0" * 32, "f" * 32])]).sealed()


# -- the model -----------------------------------------------------------------------------------
@pytest.mark.parametrize("change", [
    {"prompt_ids": []}, {"prompt_ids": [-1]}, {"prompt_ids": [True]}, {"prompt_ids": list(range(2049))},
    {"continuation_ids": []}, {"continuation_ids": [1, 2, 3]},  # 3 ids for 2 logprobs
    {"logprobs": [-0.1, 0.5]}, {"logprobs": [-0.1, math.nan]}, {"logprobs": [-0.1, -math.inf]},
    {"tolerance": 0}, {"tolerance": math.inf}, {"tolerance": "0.1"}, {"extra": 1},
])
def test_a_bad_canary_is_refused(change):
    with pytest.raises(ValidationError):
        Canary.model_validate(CANARY.model_dump() | change)


def test_canary_defaults_and_json_round_trip(tmp_path):
    c = Canary.model_validate_json('{"prompt_ids": [1, 2.0], "continuation_ids": [3], "logprobs": [-1]}')
    assert c.prompt_ids == [1, 2] and c.logprobs == [-1.0] and c.tolerance == 0.05
    save_canary(CANARY, tmp_path / "c.json")
    assert load_canary(tmp_path / "c.json") == CANARY
    assert CANARY.max_abs_delta([-0.2, -0.001]) == pytest.approx(0.05)
    assert CANARY.max_abs_delta([-0.2, math.nan]) == math.inf
    assert list(CANARY.positions()) == [3, 4]


# -- the digest: unchanged without the new keys, covering them with ---------------------------------
def test_a_manifest_without_canary_or_partial_keeps_its_bytes_and_digest():
    m = old_manifest()
    # computed with the code before canary/partial existed (git 298939a)
    assert m.digest == "0b37f5688d6c55dad193acc8039d45b8ee7e7bd40a6fa3f84690b293002b2a57"
    for dumped in (m.model_dump(), m.model_dump(mode="json"), json.loads(m.model_dump_json()),
                   json.loads(m.canonical_bytes())):
        assert "canary" not in dumped and "partial" not in dumped
    assert manifest_digest(json.loads(m.model_dump_json())) == m.digest
    # an explicit null is the same manifest
    again = Manifest.model_validate_json(m.model_dump_json()[:-1] + ',"canary":null,"partial":null}')
    assert again.sealed().digest == m.digest


def test_canary_and_partial_are_sealed_by_the_digest():
    base = old_manifest().model_dump() | {"digest": None}
    with_canary = Manifest.model_validate(base | {"canary": CANARY.model_dump()}).sealed()
    partial = Manifest.model_validate(base | {"partial": True}).sealed()
    other = Manifest.model_validate(base | {"canary": CANARY.model_dump() | {"tolerance": 0.02}}).sealed()
    assert len({old_manifest().digest, with_canary.digest, partial.digest, other.digest}) == 4
    for m in (with_canary, partial):
        assert manifest_digest(json.loads(m.model_dump_json())) == m.digest
    assert json.loads(partial.model_dump_json())["partial"] is True
    assert Manifest.model_validate_json(with_canary.model_dump_json()) == with_canary


def test_the_plugin_accepts_a_version_with_a_canary_as_the_mirror_writes_it(tmp_path):
    files = save_shards(tinymodel.state_dict(tinymodel.TINY, 3), tmp_path / "src", shard_bytes=600_000)
    manifest = build_manifest(3, files, chunk_bytes=1 << 16, canary=CANARY)
    mirror = Mirror(tmp_path / "mirror", max_bytes=1 << 30)
    partial = mirror.begin(manifest)
    for p in files:
        fd = partial.open(p.name)
        try:
            os.pwrite(fd, p.read_bytes(), 0)
        finally:
            os.close(fd)
    path = mirror.commit(partial)
    assert json.loads((path / "manifest.json").read_bytes())["canary"]["logprobs"] == [-0.25, -1e-05]
    assert [p.name for p in check_version(path, manifest.digest)] == [f.name for f in manifest.files]
    assert mirror.manifest(3).canary == CANARY


def test_publish_carries_the_canary(registry, tmp_path):
    sd = tinymodel.state_dict(tinymodel.TINY, 1)
    http = RegistryHTTP(registry.url, registry.service.token)

    def check(m: Manifest, canary: Canary | None) -> None:
        got = http.manifest(m.version)
        assert got.canary == m.canary == canary and got.digest == m.digest

    try:
        check(registry.publish(1, sd, chunk_bytes=1 << 16, canary=CANARY), CANARY)
        save_shards(tinymodel.state_dict(tinymodel.TINY, 2), tmp_path / "v2")
        check(registry.publish_dir(2, tmp_path / "v2", chunk_bytes=1 << 16, canary=CANARY), CANARY)
        save_shards(tinymodel.state_dict(tinymodel.TINY, 3), tmp_path / "v3")
        check(http.publish_dir(3, tmp_path / "v3", chunk_bytes=1 << 16, canary=CANARY), CANARY)
        check(http.publish(4, sd, chunk_bytes=1 << 16, canary=CANARY), CANARY)
        check(http.publish(5, sd, chunk_bytes=1 << 16), None)
    finally:
        http.close()


@pytest.mark.parametrize("change, why", [
    ({"continuation_ids": [5, 512]},
     r"token id\(s\) \[512\] outside the vocabulary of 512 \(lm_head.weight has 512 rows\)"),
    ({"prompt_ids": [1, 99999, 42]}, r"token id\(s\) \[99999\] outside the vocabulary of 512"),
    ({"tolerance": 1.5}, "tolerance 1.5 is above 1 nats: the check would pass any weights"),
])
def test_a_canary_that_can_never_pass_is_refused_at_publish(registry, change, why):
    """Checked against the version's own tensors (the rows of its embedding and head): every node
    would otherwise load the version to find out, and refuse it."""
    sd = tinymodel.state_dict(tinymodel.TINY, 1)
    bad = CANARY.model_copy(update=change)
    http = RegistryHTTP(registry.url, registry.service.token)
    try:
        with pytest.raises(errors.BadCanary, match=why):
            http.publish(1, sd, chunk_bytes=1 << 16, canary=bad)
        with pytest.raises(errors.BadCanary, match=why):
            registry.publish(1, sd, chunk_bytes=1 << 16, canary=bad)
        assert http.versions() == []
        assert http.publish(1, sd, chunk_bytes=1 << 16, canary=CANARY).canary == CANARY, "fixed, it is taken"
    finally:
        http.close()


def test_make_canary_refuses_a_tolerance_that_would_pass_anything():
    with pytest.raises(ValueError, match="at most 1 nats"):
        make_canary(object(), [1, 2], tolerance=2.0)


def test_heartbeat_gate_is_optional_and_left_out_when_absent():
    hb = Heartbeat(node="n", server="s", state="SERVING")
    assert "gate" not in json.loads(hb.model_dump_json())
    gate = GateReport(ok=True, canary=True, max_abs_dlogprob=1e-5, tolerance=0.05, tokens=23)
    again = Heartbeat.model_validate_json(hb.model_copy(update={"gate": gate}).model_dump_json())
    assert again.gate == gate
    with pytest.raises(ValidationError):
        GateReport(ok=False, canary=True, max_abs_dlogprob=math.inf)


# -- make_canary ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    import transformers
    d = tinymodel.build(tmp_path_factory.mktemp("hf") / "m", seed=1)
    return transformers.AutoModelForCausalLM.from_pretrained(d)


def by_hand(model, ids: list[int]) -> float:
    """log p(ids[-1] | ids[:-1]), one position at a time, in float64."""
    import torch
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0, -1].double()
    return float(logits[ids[-1]] - torch.logsumexp(logits, 0))


@pytest.mark.slow  # torch and transformers: seconds of imports, then a model
@pytest.mark.parallel
def test_make_canary_matches_a_computation_by_hand(hf_model):
    import torch
    prompt = [1, 17, 42, 99, 250, 7]
    hf_model.train()
    c = make_canary(hf_model, prompt, new_tokens=6, tolerance=0.02)
    assert hf_model.training  # put back as it was
    assert c.prompt_ids == prompt and len(c.continuation_ids) == len(c.logprobs) == 6 and c.tolerance == 0.02
    seq = list(prompt)
    for tok, lp in zip(c.continuation_ids, c.logprobs, strict=True):
        with torch.no_grad():
            greedy = int(hf_model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        assert tok == greedy
        seq.append(tok)
        assert lp == pytest.approx(by_hand(hf_model, seq), abs=1e-4)
    given = make_canary(hf_model, prompt, [3, 4, 5])
    assert given.continuation_ids == [3, 4, 5]
    assert given.logprobs == pytest.approx([by_hand(hf_model, prompt + [3, 4, 5][:i + 1]) for i in range(3)],
                                           abs=1e-4)
