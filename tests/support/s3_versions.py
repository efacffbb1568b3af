"""Versions in a real S3 server's bucket (tests/support/s3_server.py): the settings that reach it,
what the bucket holds, a node's pull from it, and checkpoints to publish there."""

from __future__ import annotations

import numpy as np
import obstore
from safetensors.numpy import save_file

from rolloutd.objstore import ObjectStoreSettings
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.puller import Puller, PullSettings
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.swarm import Swarm, SwarmSettings
from rolloutd.trainer import EmbeddedRegistry

REQUEST_BYTES = 256 << 10  # a node's range requests to the bucket


def settings(s3) -> ObjectStoreSettings:
    return ObjectStoreSettings(endpoint=s3.endpoint, credentials_file=s3.credentials_file)


def served(reg: EmbeddedRegistry) -> int:
    return int(reg.service.metrics.bytes_served._value.get())


async def pull(reg: EmbeddedRegistry, s3, mirror: Mirror, version="latest"):
    async with RegistryClient(reg.url) as client:
        swarm = Swarm(SwarmSettings(), client, mirror, node="n1", object_store=settings(s3))
        puller = Puller(client, mirror, PullSettings(holder="n1", request_bytes=REQUEST_BYTES), swarm=swarm)
        return await puller.pull(version)


def in_bucket(s3, prefix: str) -> list[str]:
    return sorted(m["path"] for batch in obstore.list(s3.store(), prefix) for m in batch)


def version_dirs(s3, prefix: str) -> list[int]:
    names = {p.split("/")[1] for p in in_bucket(s3, prefix) if p.count("/") >= 2}
    return sorted(int(n) for n in names if n.isdigit())


def safetensors_checkpoint(tmp_path, name: str, sd: dict[str, np.ndarray]):
    """``sd`` saved as two safetensors files (by safetensors itself, not rolloutd)."""
    d = tmp_path / name
    d.mkdir()
    names = sorted(sd)
    save_file({n: sd[n] for n in names[:4]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: sd[n] for n in names[4:]}, str(d / "model-00002-of-00002.safetensors"))
    return d


def assert_same_files(mirror: Mirror, version: int, ckpt) -> None:
    """The mirror holds exactly the bytes that were published, file for file."""
    held = sorted(p.name for p in mirror.path(version).iterdir() if p.name not in (".registry.json", "manifest.json"))
    assert held == sorted(p.name for p in ckpt.iterdir())  # no delta file left either
    for p in ckpt.iterdir():
        assert (mirror.path(version) / p.name).read_bytes() == p.read_bytes(), p.name
