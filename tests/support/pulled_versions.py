"""Versions of a small llama-shaped model (about 3 MiB) published to an embedded registry, with
the files the registry holds for each, for the tests of the puller and its workers."""

from __future__ import annotations

from rolloutd.demo.tinymodel import llama_state_dict
from rolloutd.trainer.publish import serialize_shards

CHUNK = 64 << 10
SHARD = 1 << 20


def state_dict(seed: int) -> dict:
    return llama_state_dict(seed, hidden=128, layers=3, vocab=1024, intermediate=344)  # ~3 MiB


def publish(registry, version: int) -> tuple:
    sd = state_dict(version)
    manifest = registry.publish(version, sd, shard_bytes=SHARD, chunk_bytes=CHUNK)
    return manifest, dict(serialize_shards(sd, SHARD))
