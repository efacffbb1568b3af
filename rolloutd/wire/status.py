"""The node's status document, ``GET /status`` of the admin API (docs/daemon.md): typed models that
each part of the daemon returns (the supervisor its server's snapshot, the puller its progress,
the updater its view of the registry), and that the API serves as JSON."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rolloutd.wire.states import ServerState


class PullState(enum.Enum):
    LEASING = "leasing"        # taking the lease and reading the manifest
    PULLING = "pulling"        # chunks being fetched into the partial directory
    COMMITTING = "committing"  # fsync and rename into place
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegistryStatus(_Model):
    url: str = Field(description="the registry this node follows")
    reachable: bool = Field(description="the registry answered the last request")
    instance: str | None = Field(description="the registry's instance id (changes when it restarts)")
    latest: int | None = Field(description="newest version the registry announced")
    demand: int | None = Field(description="lowest version the trainer asks every replica for")
    last_error: str | None = Field(description="why the last request failed, if it did")
    last_contact_age_s: float | None = Field(description="seconds since the registry last answered")


class TargetStatus(_Model):
    version: int = Field(description="the version the node is moving every server to")
    digest: str = Field(description="its manifest digest")


class PullStatus(_Model):
    target: int | str = Field(description='what was asked: a version number or "latest"')
    version: int | None = Field(description="the version being pulled (null until \"latest\" is resolved)")
    state: PullState = Field(description="where the pull is")
    bytes_done: int = Field(description="bytes written into the mirror so far")
    bytes_total: int = Field(description="bytes of the whole version (of a delta pull: its delta files' bytes "
                             "plus the version's, fetched then rebuilt)")
    bytes_resumed: int = Field(description="of bytes_done: chunks an earlier try of this version checked "
                               "and left in the mirror, not fetched again")
    rate_bytes_per_s: float = Field(description="recent rate while pulling; the average once ended")
    eta_s: float | None = Field(description="seconds left at the recent rate (null: unknown)")
    retries: int = Field(description="chunk transfers tried again")
    workers: list[int] = Field(description="pids of the pull worker processes moving its bytes (empty when "
                               "none run)")
    worker_restarts: int = Field(description="pull workers that exited mid-pull and were started again")
    seconds: float = Field(description="time spent so far, or in all once ended")
    error: str | None = Field(description="why it failed, if it did")
    kind: Literal["full", "delta"] = Field("full", description="full: the version's files fetched; delta: "
                                           "its delta files fetched and the files rebuilt from a base the "
                                           "mirror holds")
    base: int | None = Field(None, description="a delta pull's base version (null: full)")
    bytes_fetched: int = Field(0, description="bytes fetched over the network so far (of a delta pull: the "
                               "delta files)")
    version_bytes: int = Field(0, description="the version's full size: bytes_fetched / version_bytes is what "
                               "the pull costs on the network against a full one")
    reconstruct_s: float | None = Field(None, description="a delta pull's rebuild from the base so far, or in "
                                        "all once ended (null: none)")
    delta_error: str | None = Field(None, description="why the delta could not be used and the full version "
                                    "was fetched instead (null: it was not)")


class MirrorStatus(_Model):
    dir: str = Field(description="the node mirror's directory")
    max_bytes: int = Field(description="most bytes it may hold")
    usage_bytes: int = Field(description="bytes it holds now")
    spare_bytes: int = Field(description="of those, files of removed versions kept for the next pull to "
                             "overwrite (mirror.recycle)")
    versions: list[int] = Field(description="complete versions it holds")


class ReloadStatus(_Model):
    last_attempt_unix: float | None = Field(description="when the last reload was asked for (Unix time; null: "
                                            "none since start)")
    ok: bool | None = Field(description="the last reload succeeded; false: its file was refused and the "
                            "configuration before it still runs (until a reload succeeds)")
    error: str | None = Field(description="why the last reload was refused, one line per problem")
    where: str | None = Field(description="FILE:LINE of its first problem (the file alone when no line is known)")
    needs_restart: list[str] = Field([], description="sections the file changes that run as they were until "
                                     "rolloutd restarts (node, registry, mirror, ...), as of the last reload "
                                     "that succeeded")


class PullSources(_Model):
    peers: bool = Field(description="the chunk swarm is on (peers.enabled)")
    last_pull: dict[str, int] = Field(description="bytes of the last pull by kind of source: origin (the "
                                      "registry or the object store) and peers")
    url: str | None = Field(None, description="this node's peer listener as other nodes reach it")
    served_bytes: int | None = Field(None, description="bytes this node served its peers since it started")
    served_requests: int | None = Field(None, description="requests its peer listener answered")


class GateStatus(_Model):
    ok: bool = Field(description="the server passed the gate")
    canary: bool = Field(description="the version's canary was scored (false: it has none; only the probe ran)")
    tokens: int = Field(description="positions scored")
    tolerance: float | None = Field(description="the canary's tolerance (nats)")
    max_abs_dlogprob: float | None = Field(description="max |served - expected| logprob over the canary's "
                                           "continuation (null: no canary, or a non-finite value)")


class LastUpdate(_Model):
    version: int = Field(description="the version the update loaded, or tried to")
    ok: bool = Field(description="the server resumed on that version and passed the gate")
    at_unix: float = Field(description="when it began (Unix time)")
    phases_s: dict[str, float] = Field(description="seconds per phase (pause, start, load, finish, check, "
                                       "resume, gate) and in all paused")
    error: str | None = Field(description="why it failed, if it did")
    gate: GateStatus | None = Field(None, description="the last gate of this update (null: none ran)")


class ServerSnapshot(_Model):
    """A server as its supervisor sees it (:meth:`Supervisor.snapshot`)."""

    name: str = Field(description="the server's name in the config")
    state: ServerState = Field(description="lifecycle state")
    pid: int | None = Field(description="pid of its `vllm serve` process while one runs")
    socket: str = Field(description="the UNIX socket its vLLM listens on (it opens no TCP port): only "
                        "rolloutd's user can reach it")
    public_port: int = Field(description="its gateway's port on gateway.host")
    gpus: list[int] = Field(description="GPU indices it uses")
    endpoint: str = Field(description="URL the registry lists for it")
    version: int | None = Field(description="version loaded (null: the base model)")
    target: int | None = Field(description="version it is moving to")
    last_good: int | None = Field(None, description="the last version it served, gate passed, since this "
                                  "daemon started: what it goes back to after a refused version (null: none; "
                                  "it goes back to the node's last_good, else to its start model)")
    incarnation: int = Field(description="processes of this server started since the daemon started (a "
                             "reload that restarts it counts on)")
    restarts: int = Field(description="restarts after a failure")
    state_age_s: float = Field(description="seconds in the current state")
    last_error: str | None = Field(description="the last failure, if any")
    last_update: LastUpdate | None = Field(description="the last weight update, if any")


class ServerStatus(ServerSnapshot):
    """A server as the node's status shows it: its supervisor's snapshot and its heartbeats' age."""

    heartbeat_age_s: float | None = Field(description="seconds since the registry last took its heartbeat")


class RefusedStatus(_Model):
    version: int = Field(description="the version refused")
    digest: str = Field(description="its manifest digest (the same number with other bytes is another version)")
    reason: str = Field(description="why: the failure that refused it")
    server: str = Field(description="the server whose failures refused it")
    at_unix: float = Field(description="when (Unix time)")


class NodeStatus(_Model):
    node: str = Field(description="this node's name in the registry")
    rolloutd_version: str = Field(description="version of rolloutd running")
    pid: int = Field(description="the daemon's pid")
    uptime_s: float = Field(description="seconds since the daemon started")
    ready: bool = Field(description="every server came up (SERVING, or gave up as FATAL) since start")
    registry: RegistryStatus
    target: TargetStatus | None = Field(description="the version every server is moving to (null: none yet)")
    pull: PullStatus | None = Field(description="the current or last pull (null: none yet)")
    pull_workers_kept: list[int] = Field([], description="pids of the pull workers kept idle for the next "
                                         "pull (pull.keep_workers_s); while a pull runs they are its "
                                         "`pull.workers`")
    pull_sources: PullSources | None = Field(None, description="where the last pull's bytes came from; what "
                                              "peers took")
    reload: ReloadStatus | None = Field(None, description="the last reload (SIGHUP or POST /reload)")
    mirror: MirrorStatus
    servers: list[ServerStatus]
    last_good: int | None = Field(None, description="the node's last good version: the last version any of its "
                                  "servers served, gate passed; a server with no good version of its own goes "
                                  "back to it after a refused version (null: none since the daemon started)")
    refused: list[RefusedStatus] = Field([], description="versions this node refused, oldest first: no server "
                                         "loads them, each serves its last good version (docs/daemon.md, "
                                         "\"A node keeps its last good version\")")
