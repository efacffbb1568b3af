"""How a version is published: one model for every publish call of the trainer's library
(``publish``, ``publish_async``, ``publish_dir``, over HTTP or in-process), so a setting is
named, typed and described once.

A call takes a :class:`PublishOptions`, or its fields as keywords, or both (the keywords win)::

    reg.publish(7, model.state_dict(), canary=canary, to="s3://bucket/run")
    fast = PublishOptions(hash_name="xxh3-128", delta=False)
    reg.publish(8, model.state_dict(), fast, metadata={"step": "800"})
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rolloutd.objstore import ObjectStoreSettings
from rolloutd.trainer.shards import DEFAULT_SHARD_BYTES
from rolloutd.wire.manifest import DEFAULT_CHUNK_BYTES, DEFAULT_HASH, Canary


class PublishOptions(BaseModel):
    """How a version is published (the version's number and its tensors or files are the call's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_bytes: int = Field(DEFAULT_SHARD_BYTES, description="a state dict's tensors go into safetensors "
                             "shards of about this many bytes (publish_dir publishes the files as they are)")
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, description="bytes per chunk: the unit each digest covers, "
                             "each node checks and peers exchange")
    hash_name: str = Field(DEFAULT_HASH, description="the chunk digest: xxh3-128 (the fastest) guards against "
                           "corruption only, nodes take such a version from its origin, never from their peers; "
                           "blake3 or sha256 are cryptographic: publish with one where nodes have peers on "
                           "(docs/peers.md)")
    metadata: dict[str, str] | None = Field(None, description="free strings kept in the manifest")
    canary: Canary | None = Field(None, description="checked by every server that loads the version before it "
                                  "takes traffic again (rolloutd.trainer.canary.make_canary)")
    partial: bool = Field(False, description="the files carry only some of the model's tensors on purpose; the "
                          "rest keeps its weights (without it, a version that lacks a tensor of the served model "
                          "fails to load, naming it)")
    delta: bool = Field(True, description="publish the version as a delta on the newest live one when that is "
                        "smaller (docs/deltas.md); False: a full version")
    to: str | None = Field(None, description="s3://bucket/prefix: the files go to the object store under "
                           "<prefix>/<version>/ instead of the registry, which keeps the manifest naming that source")
    store: ObjectStoreSettings | None = Field(None, description="where the S3 service of `to` is and which file "
                                              "holds its credentials; null: AWS and the environment's AWS_* variables")
    prune: bool = Field(True, description="with `to`: once the version is published, delete the objects of the "
                        "earlier versions under `to` that the registry no longer holds")

    @classmethod
    def of(cls, options: PublishOptions | None, fields: dict[str, Any]) -> PublishOptions:
        """``options`` (the defaults if None) with ``fields`` set over it, all checked."""
        if not fields:
            return options if options is not None else cls()
        return cls.model_validate({**(dict(options) if options is not None else {}), **fields})
