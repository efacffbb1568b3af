"""One-file versions for the registry's store, published without HTTP."""

from __future__ import annotations

from rolloutd.registry.blobs import MemoryBlob
from rolloutd.wire.manifest import FileEntry, Manifest, digest


def manifest(v: int, payload: bytes = b"x") -> Manifest:
    return Manifest(version=v, chunk_bytes=4096, files=[FileEntry(
        name="model.safetensors", size=len(payload), chunks=[digest("xxh3-128", payload)])]).sealed()


def publish(store, v, payload=b"x"):
    return store.publish(manifest(v, payload), {"model.safetensors": MemoryBlob(payload)})
