"""Manifests: sealing, validation, chunk digests of files."""

import json
import os

import pytest
from pydantic import ValidationError

from rolloutd.wire.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    bad_chunks,
    build_manifest,
    digest,
    duplicate_tensors,
    safetensors_names,
    valid_file_name,
    verify_file,
)

CHUNK = 4096


def write(path, size, seed=0):
    data = os.urandom(size) if seed == 0 else bytes((i * seed) % 251 for i in range(size))
    path.write_bytes(data)
    return path


def test_build_manifest_digests_every_chunk_and_seals(tmp_path):
    a = write(tmp_path / "a.safetensors", 3 * CHUNK + 17)
    b = write(tmp_path / "b.safetensors", CHUNK)
    m = build_manifest(7, [a, b], chunk_bytes=CHUNK)
    assert [f.name for f in m.files] == ["a.safetensors", "b.safetensors"]
    assert [len(f.chunks) for f in m.files] == [4, 1]
    data = a.read_bytes()
    assert m.files[0].chunks[3] == digest("xxh3-128", data[3 * CHUNK:])
    assert m.digest == m.compute_digest() and len(m.digest) == 64  # sha256 whatever the chunk hash
    assert m.total_bytes == 4 * CHUNK + 17


def test_digest_covers_everything_but_itself(tmp_path):
    m = build_manifest(1, [write(tmp_path / "a.safetensors", 100)], chunk_bytes=CHUNK)
    changed = m.model_copy(update={"metadata": {"step": "5"}, "digest": None}).sealed()
    assert changed.digest != m.digest
    body = json.loads(m.model_dump_json())
    body["files"][0]["size"] = 99
    with pytest.raises(ManifestError, match="does not match"):
        Manifest.model_validate(body).sealed()


def test_sha256_is_allowed(tmp_path):
    m = build_manifest(1, [write(tmp_path / "a.safetensors", 10)], chunk_bytes=CHUNK, hash_name="sha256")
    assert len(m.digest) == 64 and len(m.files[0].chunks[0]) == 64


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "..", "", "a b", "x" * 201, "é.bin", "manifest.json"])
def test_unsafe_file_names_are_refused(name):
    assert not valid_file_name(name)
    with pytest.raises(ValidationError, match="invalid file name"):
        FileEntry(name=name, size=0, chunks=[])


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b["files"].append(dict(b["files"][0])), "duplicate file names"),
    (lambda b: b["files"][0]["chunks"].pop(), "chunk digests"),
    (lambda b: b["files"][0]["chunks"].__setitem__(0, "zz" * 16), "should match pattern"),
    (lambda b: b["files"][0]["chunks"].__setitem__(0, "ab" * 32), "not a xxh3-128 hex digest"),
    (lambda b: b.update(version=True), "expected an integer, got a boolean"),
    (lambda b: b.update(version="3"), "Input should be a valid integer"),
    (lambda b: b.update(version=0), "greater than or equal to 1"),
    (lambda b: b.update(chunk_bytes=10), "greater than or equal to 4096"),
    (lambda b: b.update(files=[]), "at least 1 item"),
    (lambda b: b.update(extra=1), "Extra inputs are not permitted"),
    (lambda b: b.update(hash="md5"), "Input should be"),
])
def test_inconsistent_manifests_are_refused(tmp_path, mutate, message):
    body = json.loads(build_manifest(1, [write(tmp_path / "a.safetensors", 2 * CHUNK)],
                                     chunk_bytes=CHUNK).model_dump_json())
    mutate(body)
    with pytest.raises(ValidationError, match=message):
        Manifest.model_validate(body)


def test_verify_file_names_the_bad_chunks(tmp_path):
    p = write(tmp_path / "a.safetensors", 3 * CHUNK)
    m = build_manifest(1, [p], chunk_bytes=CHUNK)
    assert verify_file(p, m.files[0], m) == []
    data = bytearray(p.read_bytes())
    data[CHUNK + 5] ^= 0xFF
    p.write_bytes(data)
    assert verify_file(p, m.files[0], m) == [1]
    assert bad_chunks(bytes(data[:-1]), m.files[0], m) == [0, 1, 2]  # truncated: all suspect
    assert verify_file(tmp_path / "missing", m.files[0], m) == [0, 1, 2]


def header_file(header: bytes, payload: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + payload


DEEP = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("data", [b"", b"short", os.urandom(4096), header_file(b"[1, 2]"), header_file(b"{x"),
                                  header_file(DEEP), (1 << 40).to_bytes(8, "little") + b"{}"])
def test_bytes_that_are_not_safetensors_have_no_tensor_names(data):
    assert safetensors_names(lambda o, n: data[o:o + n], len(data)) is None


def test_tensor_names_keep_repeats_and_duplicates_are_named():
    data = header_file(b'{"__metadata__": {"a": "b"}, "w": {}, "v": {}, "w": {}}', b"\0" * 8)
    assert safetensors_names(lambda o, n: data[o:o + n], len(data)) == ["w", "v", "w"]
    assert duplicate_tensors([("a.safetensors", ["w", "v", "w"]), ("b.safetensors", None),
                              ("c.safetensors", ["v", "u"])]) == [
        "tensor 'w' is twice in a.safetensors", "tensor 'v' is in a.safetensors and c.safetensors"]
    assert duplicate_tensors([("a.safetensors", ["w"]), ("b.safetensors", ["v"])]) == []
