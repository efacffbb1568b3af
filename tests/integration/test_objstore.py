"""Versions in an object store, against a real S3 server (SeaweedFS on loopback): the trainer
puts the files in the bucket, the registry keeps the manifest, leases and the source and serves
none of the bytes, nodes read ranges from the bucket and check every chunk."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import obstore
import pytest

from rolloutd.objstore import ObjectStoreError, ObjectStoreSettings, read_credentials
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.puller import PullError
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.manifest import verify_file
from tests.support.s3_versions import in_bucket, pull, served, settings, version_dirs

pytestmark = [pytest.mark.slow, pytest.mark.parallel]  # a real SeaweedFS per module: about 2 s to start and 2 s to stop

CHUNK = 256 << 10


def checkpoint(tmp_path, name: str = "ckpt", mib: int = 3):
    d = tmp_path / name
    d.mkdir()
    for i in range(2):
        (d / f"model-{i}.safetensors").write_bytes(os.urandom(mib << 19))
    return d



def test_publish_to_the_bucket_and_pull_from_it(s3, tmp_path):
    ckpt = checkpoint(tmp_path)
    with EmbeddedRegistry(port=0) as reg:
        manifest = reg.publish_dir(7, ckpt, chunk_bytes=CHUNK, to=f"s3://{s3.bucket}/policy", store=settings(s3))
        assert manifest.source == f"s3://{s3.bucket}/policy/7"
        for p in ckpt.iterdir():  # the objects are the files, byte for byte
            assert bytes(obstore.get(s3.store(), f"policy/7/{p.name}").bytes()) == p.read_bytes()
        assert reg.manifest(7).source == manifest.source and reg.manifest(7).digest == manifest.digest
        r = httpx.get(f"{reg.url}/v1/versions/7/files/model-0.safetensors", headers={"range": "bytes=0-9"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "bytes_elsewhere"
        assert manifest.source in r.json()["error"]["message"]
        mirror = Mirror(tmp_path / "mirror", 1 << 30)
        result = asyncio.run(pull(reg, s3, mirror))
        assert result.version == 7 and result.bytes == manifest.total_bytes
        for entry in manifest.files:
            assert verify_file(mirror.path(7) / entry.name, entry, manifest) == []
        assert served(reg) == 0  # the registry sent the manifest only
        assert reg.versions()[0]["leases"] == 0  # the pull's lease was released


def test_publish_a_state_dict_to_the_bucket(s3, tmp_path):
    import numpy as np
    with EmbeddedRegistry(port=0) as reg:
        state = {"model.embed_tokens.weight": np.arange(4096, dtype=np.float32).reshape(64, 64)}
        manifest = reg.publish(1, state, to=f"s3://{s3.bucket}/sd", store=settings(s3), chunk_bytes=4096)
        assert manifest.source == f"s3://{s3.bucket}/sd/1"
        mirror = Mirror(tmp_path / "mirror", 1 << 30)
        asyncio.run(pull(reg, s3, mirror))
        from safetensors.numpy import load_file
        assert (load_file(mirror.path(1) / "model.safetensors")["model.embed_tokens.weight"] == state[
            "model.embed_tokens.weight"]).all()


def test_bytes_changed_in_the_bucket_fail_the_pull_and_leave_no_version(s3, tmp_path):
    ckpt = checkpoint(tmp_path, mib=1)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish_dir(1, ckpt, chunk_bytes=CHUNK, to=f"s3://{s3.bucket}/tampered", store=settings(s3))
        data = bytearray((ckpt / "model-1.safetensors").read_bytes())
        data[CHUNK + 5] ^= 0xFF
        obstore.put(s3.store(), "tampered/1/model-1.safetensors", bytes(data))
        mirror = Mirror(tmp_path / "mirror", 1 << 30)
        with pytest.raises(PullError, match="model-1.safetensors chunk 1.*does not match"):
            asyncio.run(pull(reg, s3, mirror))
        # at most the chunks it checked, hidden, kept for a next try
        assert mirror.versions() == [] and [p.name for p in mirror.dir.iterdir()] in ([], [".1.partial"])


def test_a_missing_object_fails_at_once(s3, tmp_path):
    ckpt = checkpoint(tmp_path, mib=1)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish_dir(1, ckpt, chunk_bytes=CHUNK, to=f"s3://{s3.bucket}/gone", store=settings(s3))
        obstore.delete(s3.store(), "gone/1/model-0.safetensors")
        with pytest.raises(PullError, match="no such object"):
            asyncio.run(pull(reg, s3, Mirror(tmp_path / "mirror", 1 << 30)))


def test_cli_publish_to_the_bucket_and_a_disk_registry_keeps_the_source(s3, tmp_path, standalone):
    ckpt = checkpoint(tmp_path, mib=1)
    obstore.put(s3.store(), "cli/2/model-0.safetensors", b"an upload given up")
    url, proc = standalone("--data-dir", str(tmp_path / "data"))
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "publish", "--registry", url, "--chunk-bytes",
                          str(CHUNK), "--to", f"s3://{s3.bucket}/cli", "--s3-endpoint", s3.endpoint,
                          "--s3-credentials", str(s3.credentials_file), "4", str(ckpt)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"published version 4 at s3://{s3.bucket}/cli/4" in run.stdout
    assert s3.secret_key not in run.stdout + run.stderr
    assert version_dirs(s3, "cli") == [4] and f"delete s3://{s3.bucket}/cli/2 (1 object, 18 B)" in run.stderr
    proc.terminate()
    proc.wait(10)
    url, _ = standalone("--data-dir", str(tmp_path / "data"))  # the same data directory, restarted
    manifest = httpx.get(f"{url}/v1/versions/4").json()
    assert manifest["source"] == f"s3://{s3.bucket}/cli/4"
    assert not any((tmp_path / "data" / "versions" / "4").glob("*.safetensors"))  # the manifest only
    obstore.put(s3.store(), "cli/3/model-0.safetensors", b"an upload given up")
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "publish", "--registry", url, "--chunk-bytes",
                          str(CHUNK), "--to", f"s3://{s3.bucket}/cli", "--s3-endpoint", s3.endpoint,
                          "--s3-credentials", str(s3.credentials_file), "--keep-objects", "5", str(ckpt)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert version_dirs(s3, "cli") == [3, 4, 5]  # --keep-objects: nothing deleted





def test_publish_prunes_the_versions_the_registry_will_never_serve_again_and_nothing_else(s3, tmp_path):
    import numpy as np
    to, store, ckpt = f"s3://{s3.bucket}/pruned", settings(s3), checkpoint(tmp_path, mib=1)
    obstore.put(s3.store(), "pruned/notes/readme.txt", b"not a version: never touched")
    obstore.put(s3.store(), "pruned/0", b"an object named like a version, not a version's prefix")
    obstore.put(s3.store(), "pruned/2/model-0.safetensors", b"an upload given up: never published")
    with EmbeddedRegistry(port=0, keep_versions=2) as reg:
        def publish(v: int) -> None:
            reg.publish_dir(v, ckpt, chunk_bytes=CHUNK, to=to, store=store)

        publish(1)
        publish(3)  # 2 can never be published now (numbers only grow): its objects go
        assert version_dirs(s3, "pruned") == [1, 3]
        lease = httpx.post(f"{reg.url}/v1/leases", json={"holder": "n1", "version": 3}).json()["lease_id"]
        obstore.put(s3.store(), "pruned/9/model-0.safetensors", b"an upload under way, above the newest")
        publish(4)  # retires 1, which no lease holds: reclaimed, so its objects go
        assert version_dirs(s3, "pruned") == [3, 4, 9]
        publish(5)  # retires 3, but a node holds a lease on it: its bytes stay
        assert {v["version"]: v["state"] for v in reg.versions()}[3] == "retired"
        assert version_dirs(s3, "pruned") == [3, 4, 5, 9]
        httpx.delete(f"{reg.url}/v1/leases/{lease}").raise_for_status()
        publish(6)  # 3 (its lease gone) and 4 (retired now) are reclaimed
        assert version_dirs(s3, "pruned") == [5, 6, 9]
        assert "pruned/notes/readme.txt" in in_bucket(s3, "pruned/notes") and "pruned/0" in in_bucket(s3, "pruned")
        # what stays is whole: a node pulls version 5 from the bucket
        mirror = Mirror(tmp_path / "mirror", 1 << 30)
        manifest = reg.manifest(5)
        assert asyncio.run(pull(reg, s3, mirror, 5)).version == 5
        for entry in manifest.files:
            assert verify_file(mirror.path(5) / entry.name, entry, manifest) == []
        # prune=False leaves them, and prune_store alone does the same work later
        reg.publish(7, {"w": np.zeros(4, np.float32)}, to=to, store=store, prune=False)
        assert version_dirs(s3, "pruned") == [5, 6, 7, 9]
        assert reg.prune_store(to, store) == [5]  # below 7, the newest the registry holds
        assert version_dirs(s3, "pruned") == [6, 7, 9] and "pruned/0" in in_bucket(s3, "pruned")


def test_a_prune_that_fails_costs_a_warning_not_the_publish(s3, tmp_path, monkeypatch, caplog):
    import rolloutd.trainer.publish as publish_mod
    from rolloutd.objstore import ObjectStoreError as Err

    def fake_list_outage(to, doomed, settings):  # a fake: a bucket that takes puts but fails to list
        raise Err(f"prune {to}: service unavailable")
    monkeypatch.setattr(publish_mod, "prune_versions", fake_list_outage)
    obstore.put(s3.store(), "outage/1/model-0.safetensors", b"an upload given up")
    with EmbeddedRegistry(port=0) as reg:
        manifest = reg.publish_dir(2, checkpoint(tmp_path, mib=1), chunk_bytes=CHUNK,
                                   to=f"s3://{s3.bucket}/outage", store=settings(s3))
        assert reg.manifest(2).digest == manifest.digest  # published
    assert version_dirs(s3, "outage") == [1, 2]
    assert "service unavailable; version 2 is published" in caplog.text


def test_credentials_files_are_checked_and_never_quoted(tmp_path):
    f = tmp_path / "creds.yaml"
    f.write_text("access_key_id: AKX\nsecret_access_key: s3cr3t-value\n")
    assert read_credentials(f) == {"access_key_id": "AKX", "secret_access_key": "s3cr3t-value"}
    f.write_text(json.dumps({"access_key_id": "AKX"}))
    with pytest.raises(ObjectStoreError, match="secret_access_key is missing"):
        read_credentials(f)
    f.write_text(json.dumps({"access_key_id": "AKX", "secret_access_key": "s3cr3t-value", "extra": 1}))
    with pytest.raises(ObjectStoreError) as e:
        read_credentials(f)
    assert "s3cr3t" not in str(e.value)


def test_wrong_keys_fail_the_publish_before_the_manifest(s3, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"access_key_id": s3.access_key, "secret_access_key": "not-the-secret"}))
    with EmbeddedRegistry(port=0) as reg:
        with pytest.raises(ObjectStoreError, match="upload model-0.safetensors"):
            reg.publish_dir(1, checkpoint(tmp_path, mib=1), chunk_bytes=CHUNK, to=f"s3://{s3.bucket}/x",
                            store=ObjectStoreSettings(endpoint=s3.endpoint, credentials_file=bad))
        assert reg.versions() == []  # nothing visible
