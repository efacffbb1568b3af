"""Versions written into a node's mirror the way the puller writes them, without a registry."""

from __future__ import annotations

import os

from rolloutd.rollout.mirror import Mirror
from rolloutd.wire.manifest import FileEntry, Manifest, hash_chunks

CHUNK = 4096


def make_manifest(version: int, files: dict[str, bytes]) -> Manifest:
    entries = [FileEntry(name=n, size=len(d), chunks=hash_chunks(d, CHUNK, "xxh3-128")) for n, d in files.items()]
    return Manifest(version=version, chunk_bytes=CHUNK, files=entries).sealed()


def payload(version: int, size: int = 10_000) -> dict[str, bytes]:
    return {"model-00001-of-00002.safetensors": bytes([version]) * size,
            "model-00002-of-00002.safetensors": bytes([version + 1]) * (size // 2)}


def put(mirror: Mirror, version: int, size: int = 10_000) -> Manifest:
    """Write a version the way the puller does: begin, pwrite every file, commit."""
    files = payload(version, size)
    manifest = make_manifest(version, files)
    partial = mirror.begin(manifest)
    for name, data in files.items():
        write(partial, name, data)
    mirror.commit(partial)
    return manifest


def write(partial, name: str, data: bytes) -> None:
    fd = partial.open(name)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
