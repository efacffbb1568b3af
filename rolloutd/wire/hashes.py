"""The chunk digests a manifest may name, as incremental hashers. Standard library and xxhash
only, so that a pull worker hashes without importing pydantic; rolloutd/wire/manifest.py uses it too."""

from __future__ import annotations

import hashlib

import xxhash


def new_hasher(hash_name: str):
    """An incremental hasher (``update``, ``hexdigest``) of the chunk digest ``hash_name``."""
    if hash_name == "xxh3-128":
        return xxhash.xxh3_128()
    if hash_name == "sha256":
        return hashlib.sha256()
    if hash_name == "blake3":
        import blake3  # only where a version uses it: a pull worker starts without it

        return blake3.blake3()
    raise ValueError(f"unknown chunk hash {hash_name!r}")
