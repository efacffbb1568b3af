"""Delta versions whose bytes go straight to object storage: the trainer's publisher keeps the last
version it put under a ``to`` and encodes the next one against it, its delta files are objects
beside the target's, the registry keeps the section it is sent only on a live base it names, and
a node pulls the delta from the bucket (real SeaweedFS S3 on loopback, real pull workers)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx

from rolloutd.registry.store import VersionState
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.manifest import Delta, DeltaFile, Manifest

# -- the registry and a delta section it is sent with a source ----------------------------------------

def fake_section(base: Manifest, target: Manifest, *, base_digest: str | None = None) -> Delta:
    """A delta section naming ``base``: the registry cannot read the files (they are in the bucket)."""
    files = [DeltaFile(name=f"{f.name}.delta", size=10, target=f.name, chunks=["0" * 32]) for f in target.files]
    return Delta(base_version=base.version, base_digest=base_digest or base.digest, encoding="xor-sparse-zstd",
                 files=files)


def source_manifest(version: int, prefix: str = "s3://bucket/run") -> Manifest:
    return Manifest.model_validate({
        "version": version, "hash": "xxh3-128", "chunk_bytes": 4096, "source": f"{prefix}/{version}",
        "files": [{"name": "model.safetensors", "size": 1 << 20, "chunks": [f"{version:032x}"] * 256}]}).sealed()


def post(http: httpx.Client, manifest: Manifest, **params) -> dict:
    r = http.post("/v1/versions", content=manifest.model_dump_json(), params=params)
    assert r.status_code == 201, r.text
    return r.json()


def test_the_registry_keeps_a_sent_section_only_on_a_live_base_it_names(caplog):
    caplog.set_level(logging.INFO, "rolloutd.registry")
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url) as http:
        m1 = source_manifest(1)
        assert post(http, m1)["delta"] is None
        m2 = source_manifest(2)
        assert post(http, m2.with_delta(fake_section(m1, m2)))["delta"] == {"base_version": 1, "bytes": 10}
        assert reg.manifest(2).delta.base_digest == m1.digest
        m3 = source_manifest(3)
        wrong = fake_section(m2, m3, base_digest="0" * 64)
        assert post(http, m3.with_delta(wrong))["delta"] is None
        assert reg.manifest(3).delta is None and reg.manifest(3).digest == m3.digest
        m4 = source_manifest(4)
        assert post(http, m4.with_delta(fake_section(m3, m4)), delta="false")["delta"] is None
        http.post("/v1/leases", json={"holder": "n1", "version": 4}).raise_for_status()
        reg.retire(4)  # held by the lease: retired, not reclaimed
        assert reg.service.store.get(4).state is VersionState.RETIRED
        m5 = source_manifest(5)
        assert post(http, m5.with_delta(fake_section(m4, m5)))["delta"] is None  # its base is retired
        m6 = source_manifest(6)
        assert post(http, m6.with_delta(fake_section(m1, m6)))["delta"] is None  # its base is reclaimed
    assert "drop the delta section sent with version 3: its delta's base, version 2 with digest 000000000000..." \
        in caplog.text
    assert "publish version 4 as a full version (asked for)" in caplog.text
    assert "drop the delta section sent with version 5: its delta's base, version 4" in caplog.text
    assert "drop the delta section sent with version 6: its delta's base, version 1" in caplog.text
    assert "publish version 1 as a full version (its bytes are in an object store)" in caplog.text


def test_a_sent_section_no_smaller_than_the_fraction_is_dropped(caplog):
    caplog.set_level(logging.INFO, "rolloutd.registry")
    with EmbeddedRegistry(port=0, delta_anchor_fraction=0.1) as reg, httpx.Client(base_url=reg.url) as http:
        m1, m2 = source_manifest(1), source_manifest(2)
        post(http, m1)
        section = fake_section(m1, m2)
        big = section.model_copy(update={"files": [f.model_copy(update={"size": 200_000, "chunks": ["0" * 32] * 49})
                                                   for f in section.files], "digest": None})
        assert post(http, m2.with_delta(big))["delta"] is None
    assert "drop the delta section sent with version 2: not worth it" in caplog.text


def test_the_kept_version_goes_with_the_process_without_close(tmp_path):
    """A trainer that never closes its publisher leaves no version behind in TMPDIR."""
    script = (
        "from rolloutd.trainer.bucket import KeptVersions\n"
        "from rolloutd.wire.manifest import build_manifest\n"
        "kept = KeptVersions()\n"
        "d = kept.workdir(1)\n"
        "(d / 'model.safetensors').write_bytes(bytes(1000))\n"
        "m = build_manifest(1, [d / 'model.safetensors'])\n"
        "kept.keep('s3://b/p', m, d)\n"
        "assert kept.base('s3://b/p/', 1, m.digest).directory == d and kept.base('s3://b/p', 1, '0' * 64) is None\n"
        "print(d)\n")
    work = tmp_path / "tmp"
    work.mkdir()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TMPDIR": str(work)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith(str(work / "rolloutd-v1-"))
    assert list(work.iterdir()) == []
