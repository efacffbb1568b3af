"""The plugin's checks of a mirror directory and the daemon's plugin directory, without vLLM
(the same checks run inside vLLM in test_vllm_plugin.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distributions

import pytest

from rolloutd.demo import tinymodel
from rolloutd.supervise.plugin_path import child_env, install_plugin
from rolloutd.trainer.publish import save_shards
from rolloutd.wire.manifest import build_manifest
from vllm_plugin import checkpoint
from vllm_plugin.checkpoint import MirrorError, Tensor, check_version, in_layer_order, manifest_digest


@pytest.fixture
def version_dir(tmp_path):
    d = tmp_path / "3"
    files = save_shards(tinymodel.state_dict(tinymodel.TINY, 3), d, shard_bytes=600_000)
    m = build_manifest(3, files, chunk_bytes=1 << 16, metadata={"step": "12", "note": "ünï"})
    (d / "manifest.json").write_text(m.model_dump_json())
    return d, m


@pytest.mark.parametrize("hash_name", ["xxh3-128", "sha256"])
def test_the_plugin_computes_the_registry_digest_with_the_standard_library(tmp_path, hash_name):
    files = save_shards(tinymodel.state_dict(tinymodel.TINY, 1), tmp_path, shard_bytes=600_000)
    m = build_manifest(1, files, chunk_bytes=1 << 16, hash_name=hash_name, metadata={"k": "ü \"q\""})
    assert manifest_digest(json.loads(m.model_dump_json())) == m.digest


def test_a_complete_version_passes(version_dir):
    d, m = version_dir
    assert [p.name for p in check_version(d, m.digest)] == [f.name for f in m.files]


def test_every_defect_is_named(version_dir, tmp_path):
    d, m = version_dir
    with pytest.raises(MirrorError, match="not the requested"):
        check_version(d, "1" * 64)
    with pytest.raises(MirrorError, match="no such mirror directory"):
        check_version(tmp_path / "nowhere", m.digest)
    last = d / m.files[-1].name
    os.truncate(last, last.stat().st_size - 1)
    with pytest.raises(MirrorError, match="truncated"):
        check_version(d, m.digest)
    last.unlink()
    with pytest.raises(MirrorError, match="missing"):
        check_version(d, m.digest)
    (d / "manifest.json").write_text("{")
    with pytest.raises(MirrorError, match="unreadable"):
        check_version(d, m.digest)
    (d / "manifest.json").unlink()
    with pytest.raises(MirrorError, match="no manifest.json"):
        check_version(d, m.digest)


def test_a_hidden_directory_is_never_loaded(version_dir):
    d, m = version_dir
    partial = d.rename(d.with_name(".3.partial"))
    with pytest.raises(MirrorError, match="pull in progress"):
        check_version(partial, m.digest)


def edit_first_tensor(path, change) -> None:
    """Rewrite the header entry of the file's first tensor in place (same header length)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header[next(k for k in header if k != "__metadata__")], len(raw))
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new.ljust(n) + raw[8 + n:])


def test_tensor_outside_the_file_is_caught(version_dir):
    d, m = version_dir

    def past_the_end(meta, size):
        meta["data_offsets"][1] = size * 2

    edit_first_tensor(d / m.files[0].name, past_the_end)
    with pytest.raises(MirrorError, match="outside the file"):
        check_version(d, m.digest)


def test_layer_order():
    names = ["lm_head.weight", "model.layers.10.a", "model.norm.weight", "model.layers.2.b",
             "model.embed_tokens.weight", "model.layers.2.a"]
    got = [t.name for t in in_layer_order([Tensor(None, n) for n in names])]
    assert got == ["model.embed_tokens.weight", "model.layers.2.b", "model.layers.2.a", "model.layers.10.a",
                   "lm_head.weight", "model.norm.weight"]


def test_plugin_directory_declares_the_entry_point(tmp_path):
    d = install_plugin(tmp_path / "plugin")
    install_plugin(tmp_path / "plugin")  # replaced in place, no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plugin"]
    (dist,) = distributions(path=[str(d)])
    (ep,) = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert (ep.name, ep.value) == ("rolloutd", "vllm_plugin:register")
    # importable from there alone, with the standard library only
    code = "import sys, vllm_plugin.checkpoint, vllm_plugin; print(vllm_plugin.__file__, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(d)}, capture_output=True,
                         text=True, check=True, cwd=tmp_path).stdout.split()
    assert out == [str(d / "vllm_plugin" / "__init__.py"), "False"]


def test_child_env_puts_the_plugin_first_and_keeps_an_allow_list_working(tmp_path):
    env = child_env({"PYTHONPATH": "/x", "VLLM_PLUGINS": "lora"}, tmp_path)
    assert env["PYTHONPATH"] == f"{tmp_path}:/x" and env["VLLM_PLUGINS"] == "lora,rolloutd"
    assert "VLLM_PLUGINS" not in child_env({}, tmp_path)  # unset means every plugin loads


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_caught(version_dir):
    d, m = version_dir

    def one_row_more(meta, _size):
        meta["shape"][0] += 1

    edit_first_tensor(d / m.files[0].name, one_row_more)
    with pytest.raises(MirrorError, match="needs .* bytes, its offsets span"):
        check_version(d, m.digest)


# -- coverage and tied embeddings (the engine's checks, without vLLM) ----------------------------
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _t(name: str) -> Tensor:
    return Tensor(file=None, name=name, start=len(name), end=len(name))


@pytest.mark.parametrize("carried", ["model.embed_tokens.weight", "lm_head.weight"])
def test_a_tied_pair_is_streamed_under_both_names_whichever_the_version_carries(carried):
    out = checkpoint.tie([_t("model.norm.weight"), _t(carried)], TIED)
    assert sorted(t.name for t in out) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert {(t.start, t.end) for t in out if "norm" not in t.name} == {(len(carried), len(carried))}  # same bytes


def test_an_untied_model_streams_what_the_version_carries():
    found = [_t("model.embed_tokens.weight"), _t("lm_head.weight")]
    assert checkpoint.tie(found, {}) == found
    assert [t.name for t in checkpoint.tie(found[:1], {})] == ["model.embed_tokens.weight"]


def test_missing_names_the_tensors_of_the_start_checkpoint_a_version_lacks():
    expected = {"model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"}
    assert checkpoint.missing(expected, {"model.embed_tokens.weight", "model.norm.weight"}, TIED) == [
        "model.layers.0.self_attn.k_proj.weight"]
    # a tied pair is covered by either of its names; nothing to compare with: nothing missing
    assert checkpoint.missing(expected | {"lm_head.weight"}, expected - {"model.embed_tokens.weight"}
                              | {"lm_head.weight"}, TIED) == []
    assert checkpoint.missing(None, set(), TIED) == []
    # untied: the head is a tensor of its own
    assert checkpoint.missing({"lm_head.weight", "model.norm.weight"}, {"model.norm.weight"}, {}) == ["lm_head.weight"]


def test_checkpoint_names_reads_the_start_model_and_ignores_rotary_caches(tmp_path):
    d = tinymodel.build(tmp_path / "m", seed=0)
    names = checkpoint.checkpoint_names(d)
    assert names == set(tinymodel.state_dict(tinymodel.TINY, 0))
    assert checkpoint.checkpoint_names(tmp_path / "nowhere") is None
    assert checkpoint.checkpoint_names("org/model-on-a-hub") is None


def test_open_version_reads_the_partial_flag(version_dir, tmp_path):
    d, m = version_dir
    assert checkpoint.open_version(d, m.digest).partial is False
    body = json.loads((d / "manifest.json").read_text())
    body["partial"] = True
    body["digest"] = manifest_digest(body)
    (d / "manifest.json").write_text(json.dumps(body))
    v = checkpoint.open_version(d, body["digest"])
    assert v.partial is True and {t.name for t in v.tensors} == set(tinymodel.state_dict(tinymodel.TINY, 3))
