"""The messages a node, a trainer and the registry exchange (contract: docs/registry-api.md), written once:
the registry parses requests with these models, its clients send them; clients parse replies
with the reply models, which ignore keys they do not know, so a newer registry may add some."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from rolloutd.wire.chunkmap import HEX_RE, MAX_HEX_CHARS
from rolloutd.wire.manifest import Count, ManifestDigest, VersionNumber
from rolloutd.wire.states import ServerState

MAX_ERROR_CHARS = 512
# Heartbeat fields added after the first registries: left out of the body when unset, and left
# out by a node whose registry refuses them (node/heartbeat.py).
OPTIONAL_HEARTBEAT_FIELDS = ("gate", "last_error", "refused", "last_pull")
MAX_REFUSED = 16  # versions a node keeps refused (the oldest refusal goes first)

# A replica id is ``<node>.<server>``: node configs refuse a name this would not take.
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


# -- requests ------------------------------------------------------------------------------------

class GateReport(BaseModel):
    """The last gate of a server: the check, after a load, that it serves the version's logprobs."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    ok: bool = Field(description="the server passed")
    canary: bool = Field(description="the version's canary was scored (false: only the finite-logprob probe)")
    max_abs_dlogprob: float | None = Field(None, ge=0, description="max |served - expected| logprob over the "
                                           "canary's continuation (null: no canary, or a non-finite value)")
    tolerance: float | None = Field(None, gt=0, description="the canary's tolerance")
    tokens: Count = Field(0, description="positions scored")


class RefusedVersion(BaseModel):
    """A version the node refused: no server of it loads it, each serves its last good version."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    version: VersionNumber
    digest: ManifestDigest = Field(description="the manifest digest refused (the same number with other "
                                   "bytes is another version)")
    reason: str = Field(max_length=MAX_ERROR_CHARS, description="why, as the node logged it")


class PullReport(BaseModel):
    """The node's last pull that ended with the version in its mirror: how it came (whole, or as a
    delta on a base the node held) and what it cost on the network against the version's size."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    version: VersionNumber
    kind: Literal["full", "delta"] = Field(description="full: the version's files fetched; delta: its "
                                           "delta files fetched and the files rebuilt from the base")
    base: VersionNumber | None = Field(None, description="the delta's base version (null for full)")
    bytes_fetched: Count = Field(description="bytes fetched over the network by this pull (0: the mirror "
                                 "held the version already)")
    version_bytes: Count = Field(description="the version's full size")
    seconds: float = Field(ge=0, description="the whole pull")
    reconstruct_s: float | None = Field(None, ge=0, description="rebuilding the files from the base and "
                                        "the delta, their digests checked (null: not a delta)")
    delta_error: str | None = Field(None, max_length=MAX_ERROR_CHARS, description="why a delta could not be "
                                    "used and the full version was fetched instead (null: none)")


class Heartbeat(BaseModel):
    """What a node reports for one server (contract with the daemon)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    node: str = Field(min_length=1, max_length=253)
    server: str = Field(min_length=1, max_length=128)
    endpoint: str | None = Field(None, max_length=512, description="where generation requests go")
    state: ServerState = Field(strict=False, description="the server's state (lax: its name on the wire)")
    version: VersionNumber | None = Field(None, description="version loaded now")
    target: VersionNumber | None = Field(None, description="version it is moving to")
    incarnation: Count = Field(0, description="how many times the server was (re)started")
    registry_instance: str | None = Field(None, max_length=64, description="instance it synced with")
    timings: dict[str, float] = Field(default_factory=dict, max_length=32,
                                      description="last update's phase durations, seconds")
    gate: GateReport | None = Field(None, description="last update's gate (absent: none ran yet)")
    last_error: str | None = Field(None, max_length=MAX_ERROR_CHARS, description="the server's last failure, "
                                   "if any (it stays after the server recovered)")
    refused: list[RefusedVersion] | None = Field(None, max_length=MAX_REFUSED, description="versions the "
                                                 "node refused (absent: none)")
    last_pull: PullReport | None = Field(None, description="the node's last pull that brought a version "
                                         "(absent: none since the daemon started)")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        data = handler(self)  # without them, the body is what registries before these fields accept
        if isinstance(data, dict):
            for name in OPTIONAL_HEARTBEAT_FIELDS:
                if data.get(name, 0) is None:
                    del data[name]
        return data


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    holder: str = Field(min_length=1, max_length=256, description="who holds it, e.g. node name")
    version: VersionNumber | Literal["latest"] = Field(description='a version number, or "latest" (atomic)')
    ttl_s: float = Field(60.0, gt=0, description="seconds until it expires unless renewed "
                         "(capped at the registry's max_lease_ttl_s; the reply has the TTL granted)")


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    ttl_s: float | None = Field(None, gt=0, description="new TTL; unset keeps the lease's TTL")


class DemandRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    min_version: VersionNumber | None = Field(description="every replica should "
                                    "load at least this version; null clears the demand")


class HeldVersion(BaseModel):
    """What a node holds of one version: all of it, or the chunks of a pull in progress."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    digest: ManifestDigest = Field(description="the manifest digest it holds, or the delta section's digest for "
                                   "the delta files of a pull from the delta (another is ignored)")
    chunks: str | None = Field(None, pattern=HEX_RE.pattern, description="chunks held and checked, "
                               "bit i = chunk i of the version in manifest order, lowercase hex; null: all")
    pulling: bool = Field(False, description="a pull of it is in progress: the reply says where from")
    delta: ManifestDigest | None = Field(None, description="the version held complete and also its delta files, "
                                         "all of them: the delta section's digest (kept after the node rebuilt "
                                         "the version from them, until it commits another version)")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        data = handler(self)  # without it, the body is what registries before this field accept
        if isinstance(data, dict) and data.get("delta", 0) is None:
            del data["delta"]
        return data


class Announce(BaseModel):
    """``PUT /v1/holders/{node}``: where a node serves chunks to its peers, and what it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    url: str = Field(min_length=8, max_length=512, pattern=r"^https?://[^\s/]+$",
                     description="the node's peer listener, e.g. http://10.0.0.7:9300")
    versions: dict[Annotated[str, Field(pattern=r"^[1-9][0-9]{0,15}$")], HeldVersion] = Field(
        max_length=16, description="version number -> what the node holds of it",
        # pydantic writes the key pattern as patternProperties, which alone lets other keys
        # through: the schema must refuse them as the model does
        json_schema_extra={"additionalProperties": False})
    failed: list[Annotated[str, Field(pattern=REPLICA_ID_RE.pattern)]] = Field(
        default_factory=list, max_length=64, description="peers that failed this node since its last "
        "announcement (gone, too slow, or bad bytes): not handed out for a while")


# -- replies -------------------------------------------------------------------------------------

class Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class LatestInfo(Reply):
    instance: str
    version: int | None
    digest: str | None
    total_bytes: int | None


class LeaseInfo(Reply):
    lease_id: str
    holder: str
    version: int
    ttl_s: float
    expires_in_s: float
    digest: str | None = None


class Demand(Reply):
    min_version: int | None


class HeartbeatReply(Reply):
    instance: str
    latest: int | None
    demand: Demand


class Replicas(Reply):
    replicas: list[dict]


# Replies are bounded like requests: a node parses them on its event loop.
class PeerInfo(Reply):
    node: str = Field(max_length=253)
    url: str = Field(max_length=512)
    chunks: str = Field(max_length=MAX_HEX_CHARS)  # hex chunk map, as in HeldVersion (every bit set: complete)


class SwarmView(Reply):
    """For one version being pulled: peers that hold chunks the puller lacks (a sample, spread
    over pullers) and the chunks it should take from the origin (registry or object store) now."""

    peers: list[PeerInfo] = Field(max_length=64)  # the registry's --max-peers is at most 64
    origin: str = Field(max_length=MAX_HEX_CHARS)  # hex chunk map
    pullers: int = 0  # nodes pulling the version now


class AnnounceReply(Reply):
    instance: str
    versions: dict[str, SwarmView] = Field(max_length=16)  # at most one per version announced
