"""The tests of test_s3_delta.py that run one at a time in the slow tier (slow by this folder): a
delta version through a real S3 bucket, pulled and rebuilt; the rest is in
tests/integration/test_s3_delta.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile

import obstore
from safetensors.numpy import load_file

from rolloutd.rollout.mirror import Mirror
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.trainer.publish import RegistryHTTP
from rolloutd.wire.manifest import hash_chunks
from tests.support.np_weights import step, weights
from tests.support.s3_versions import (
    assert_same_files,
    in_bucket,
    pull,
    safetensors_checkpoint,
    served,
    settings,
    version_dirs,
)

CHUNK = 64 << 10


def test_the_next_version_in_the_bucket_is_a_delta_a_node_with_the_base_rebuilds_exactly(s3, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    to, store = f"s3://{s3.bucket}/delta", settings(s3)
    w1 = weights()
    w2 = step(w1, seed=1)
    ckpt = safetensors_checkpoint(tmp_path, "ckpt", w1)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish_dir(1, ckpt, chunk_bytes=CHUNK, to=to, store=store)
        with_base = Mirror(tmp_path / "with-base", 1 << 30)
        assert asyncio.run(pull(reg, s3, with_base, 1)).kind == "full"
        c2 = safetensors_checkpoint(tmp_path, "c2", w2)
        for p in c2.iterdir():  # the trainer saves the next version over the last, in place
            with open(ckpt / p.name, "r+b") as f:
                f.write(p.read_bytes())
        m2 = reg.publish_dir(2, ckpt, chunk_bytes=CHUNK, to=to, store=store)
        section = reg.manifest(2).delta
        assert section is not None and (section.base_version, section.base_digest) == (1, reg.manifest(1).digest)
        assert reg.manifest(2).digest == m2.digest and m2.delta is None  # the target's digest either way
        # the delta files are objects beside the target's files, under the version's prefix
        assert in_bucket(s3, "delta/2/") == sorted(
            f"delta/2/{n}" for n in [*(f.name for f in m2.files), *(d.name for d in section.files)])
        for d in section.files:  # each as its entry says
            data = bytes(obstore.get(s3.store(), f"delta/2/{d.name}").bytes())
            assert len(data) == d.size and hash_chunks(data, m2.chunk_bytes, m2.hash) == d.chunks
        assert section.total_bytes < m2.total_bytes / 5  # 1 % of the elements changed

        result = asyncio.run(pull(reg, s3, with_base, 2))
        assert (result.kind, result.base, result.digest) == ("delta", 1, m2.digest)
        assert result.bytes_fetched == section.total_bytes and result.version_bytes == m2.total_bytes
        assert_same_files(with_base, 2, c2)
        assert with_base.manifest(2).delta is None

        fresh = Mirror(tmp_path / "fresh", 1 << 30)  # no base: the whole version, from the bucket
        result = asyncio.run(pull(reg, s3, fresh, 2))
        assert (result.kind, result.bytes_fetched) == ("full", m2.total_bytes)
        assert_same_files(fresh, 2, c2)
        assert served(reg) == 0  # the registry sent manifests only

        # a state dict published there next is a delta on version 2 (kept from publish_dir)
        w3 = step(w2, seed=2)
        m3 = reg.publish(3, w3, chunk_bytes=CHUNK, to=to, store=store)
        assert reg.manifest(3).delta.base_version == 2
        result = asyncio.run(pull(reg, s3, with_base, 3))
        assert (result.kind, result.bytes_fetched) == ("delta", reg.manifest(3).delta.total_bytes)
        got = {}
        for f in m3.files:
            got.update(load_file(with_base.path(3) / f.name))
        assert sorted(got) == sorted(w3) and all((got[n] == w3[n]).all() for n in w3)
    assert "publish version 2 as a delta on 1" in caplog.text


def test_delta_false_a_new_publisher_and_a_newer_registry_version_publish_full(s3, tmp_path):
    to, store = f"s3://{s3.bucket}/full", settings(s3)
    w = weights(seed=3)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, w, chunk_bytes=CHUNK, to=to, store=store)
        w = step(w, seed=4)
        reg.publish(2, w, chunk_bytes=CHUNK, to=to, store=store, delta=False)
        assert reg.manifest(2).delta is None
        assert not [k for k in in_bucket(s3, "full/2/") if k.endswith(".delta")]
        w = step(w, seed=5)
        reg.publish(3, w, chunk_bytes=CHUNK, to=to, store=store)  # on 2, kept though published full
        assert reg.manifest(3).delta.base_version == 2
        other = RegistryHTTP(reg.url)  # a publisher that kept nothing: full
        try:
            w = step(w, seed=6)
            other.publish(4, w, chunk_bytes=CHUNK, to=to, store=store)
            assert reg.manifest(4).delta is None
        finally:
            other.close()
        w = step(w, seed=7)
        reg.publish(5, w, chunk_bytes=CHUNK, to=to, store=store)  # it kept 3; the registry's newest is 4: full
        assert reg.manifest(5).delta is None
        assert not [k for k in in_bucket(s3, "full/") if k.endswith(".delta") and not k.startswith("full/3/")]


def test_a_delta_the_registry_would_not_take_is_not_uploaded(s3, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    to, store = f"s3://{s3.bucket}/big", settings(s3)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, weights(seed=10), chunk_bytes=CHUNK, to=to, store=store)
        reg.publish(2, weights(seed=11), chunk_bytes=CHUNK, to=to, store=store)  # every element changed
        assert reg.manifest(2).delta is None
    assert "publish version 2 full: not worth it: the delta would be" in caplog.text
    assert ".delta to s3://" not in caplog.text  # never uploaded


def test_anchors_apply_a_refused_delta_leaves_no_objects_and_one_version_is_kept(s3, tmp_path, monkeypatch,
                                                                                  caplog):
    """The registry's own rules decide (here an anchor every 3rd version): over HTTP once the
    publisher sent the delta section, which then deletes the delta objects of a version the
    registry took full. The publisher keeps one version's files on disk, the last."""
    caplog.set_level(logging.INFO)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    to, store = f"s3://{s3.bucket}/anchor", settings(s3)
    w = weights(seed=8)
    with EmbeddedRegistry(port=0, delta_anchor_every=3) as reg, contextlib.closing(RegistryHTTP(reg.url)) as pub:
        kinds = []
        for v in range(1, 6):
            pub.publish(v, w, chunk_bytes=CHUNK, to=to, store=store, prune=False)
            kinds.append(reg.manifest(v).delta and reg.manifest(v).delta.base_version)
            kept = list(work.iterdir())
            assert [p.name.split("-")[1] for p in kept] == [f"v{v}"]  # this version's files, no other
            assert sorted(p.name for p in kept[0].iterdir()) == sorted(f.name for f in reg.manifest(v).files)
            w = step(w, seed=v)
        assert kinds == [None, 1, 2, None, 4]
        deltas = sorted({k.split("/")[1] for k in in_bucket(s3, "anchor/") if k.endswith(".delta")})
        assert deltas == ["2", "3", "5"]
    assert list(work.iterdir()) == []  # gone with the publisher
    assert "drop the delta section sent with version 4: an anchor: every 3 versions" in caplog.text
    assert "upload model.safetensors.delta to s3://rolloutd-test/anchor/4/" in caplog.text


def test_a_failed_encode_publishes_full_and_leaves_no_delta_file(s3, tmp_path, monkeypatch, caplog):
    import rolloutd.wire.delta as codec

    def fake_encoder_crash(bases, target, out, **kw):  # a fault the codec does not show on demand
        out.write(b"half a delta")
        raise MemoryError("fake: out of memory mid-encode")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    to, store = f"s3://{s3.bucket}/crash", settings(s3)
    w = weights(seed=13)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, w, chunk_bytes=CHUNK, to=to, store=store)
        monkeypatch.setattr(codec, "encode_file", fake_encoder_crash)
        reg.publish(2, step(w, seed=1), chunk_bytes=CHUNK, to=to, store=store)
        assert reg.manifest(2).delta is None
        assert [p.name for p in next(work.iterdir()).iterdir()] == ["model.safetensors"]  # kept: the target only
        assert not [k for k in in_bucket(s3, "crash/") if k.endswith(".delta")]
    assert "encode version 2 against version 1 failed: fake: out of memory mid-encode; publish it full" in caplog.text


def test_an_embedded_registrys_rules_are_asked_before_the_upload(s3, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    to, store = f"s3://{s3.bucket}/embedded", settings(s3)
    w = weights(seed=12)
    with EmbeddedRegistry(port=0, delta_anchor_every=2) as reg:
        for v in (1, 2, 3):
            reg.publish(v, w, chunk_bytes=CHUNK, to=to, store=store)
            w = step(w, seed=v)
        assert [reg.manifest(v).delta and reg.manifest(v).delta.base_version for v in (1, 2, 3)] == [None, 1, None]
    assert "publish version 3 full: an anchor: every 2 versions" in caplog.text
    assert ".delta to s3://rolloutd-test/embedded/3/" not in caplog.text


def test_prune_removes_a_delta_versions_objects_with_it(s3, tmp_path):
    to, store = f"s3://{s3.bucket}/prune", settings(s3)
    w = weights(seed=9)
    with EmbeddedRegistry(port=0, keep_versions=2) as reg:
        for v in (1, 2, 3):
            reg.publish(v, w, chunk_bytes=CHUNK, to=to, store=store)
            w = step(w, seed=v)
        assert reg.manifest(2).delta is not None and version_dirs(s3, "prune") == [2, 3]
        assert [k for k in in_bucket(s3, "prune/2/") if k.endswith(".delta")]
        reg.publish(4, w, chunk_bytes=CHUNK, to=to, store=store)  # retires and reclaims 2 (no lease): pruned
        assert reg.manifest(4).delta is not None and version_dirs(s3, "prune") == [3, 4]
        assert in_bucket(s3, "prune/2/") == []
