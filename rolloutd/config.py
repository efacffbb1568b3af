"""The daemon's configuration (``/etc/rolloutd.yaml``): typed, strict, immutable; units in the names.

Contract:

- :class:`Config` is a frozen pydantic model; every section and every field forbids unknown keys
  and carries a description (the example file and ``docs/config.md`` are generated from them by
  `scripts/configdoc.py`). Types are strict where YAML has them natively: ``"80"`` or ``true``
  for an integer is refused; an integer for a float is fine. Paths take strings, byte sizes take
  integers or strings such as ``"32GiB"``; command words, arguments and environment values take
  numbers too (``--max-model-len 8192`` need not be quoted).
- Cross-field rules (unique server names and ports, a GPU used by one server only, flags and
  variables that rolloutd sets itself) are part of validation, so a ``Config`` built in code is
  checked exactly like one read from a file.
- :func:`load_config` / :func:`parse_config` raise :class:`ConfigError` only, whose text is one
  line per problem: ``FILE:LINE: key.path: message``. Lines come from the composed YAML nodes,
  which also reveal duplicate keys (a plain YAML load keeps the last one silently).
- :func:`read_token` reads a token file; its errors name the file, never its content.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import shlex
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rolloutd.wire.messages import REPLICA_ID_RE

DEFAULT_CONFIG_PATH = Path("/etc/rolloutd.yaml")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Flags rolloutd passes to every `vllm serve` itself (a second value would fight it), and flags that
# would open vLLM to every local user: its pause and weight routes have no authentication.
_PRIVATE = "vLLM listens only on a UNIX socket that rolloutd's user alone can reach (--uds)"
OWNED_FLAGS = {
    "--host": f"is set by rolloutd: {_PRIVATE}; the server's gateway listens on gateway.host",
    "--port": f"is set by rolloutd: {_PRIVATE}; the server's gateway listens on its public_port",
    "--uds": "is set by rolloutd: every server's socket is <state_dir>/sockets/<name>.sock",
    "--grpc-port": "is refused: it opens a TCP port on loopback, which every local user can reach",
    "--weight-transfer-config": "is set by rolloutd: rolloutd selects its own weight-transfer plugin",
    "--enable-scale-out": "is set by rolloutd: rolloutd enables it itself",
}
# state_dir/<SCRATCH>/<random>/: one running server's TMPDIR, with the /dev/shm names its processes were
# seen holding, removed once it stopped, or at the next start after a crash.
SCRATCH = "scratch"
# state_dir/<COMPILE_CACHE>/: torch's compile cache, shared by the servers and kept across their starts.
# Its default lives in TMPDIR, which is each server's own scratch directory: every start would
# compile again what the one before compiled.
COMPILE_CACHE = "compile-cache"
# vLLM's flags of a data-parallel server spread over several nodes (or of a node serving some of its
# engines): the pause and the update would reach only this node's part of it.
SPANNING_FLAGS = {"--nnodes", "-n", "--node-rank", "-r", "--headless", "--data-parallel-size-local", "-dpl",
                  "--data-parallel-address", "-dpa", "--data-parallel-start-rank", "-dpr", "--data-parallel-rank",
                  "--data-parallel-rpc-port", "-dpp", "--data-parallel-external-lb", "--data-parallel-hybrid-lb",
                  "--data-parallel-multi-port-external-lb"}
# The longest path a UNIX socket can have (sun_path is 108 bytes with its terminating NUL).
SOCKET_PATH_MAX = 107
OWNED_ENV = {
    "CUDA_VISIBLE_DEVICES": "use the server's `gpus` instead",
    "TMPDIR": "each server gets its own under state_dir/scratch, removed once the server stopped (vLLM leaves "
              "files there)",
    "VLLM_SERVER_DEV_MODE": "rolloutd sets it to reach the pause and weight routes",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")

Loc = tuple[int | str, ...]


class ConfigError(ValueError):
    """A configuration that cannot be used; ``str()`` is one line per problem."""

    def __init__(self, lines: list[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))

    @property
    def where(self) -> str | None:
        """``FILE:LINE`` of the first problem, or None when it names no line (a missing file)."""
        m = re.match(r"(.+?):(\d+)(?::\d+)?: ", self.lines[0]) if self.lines else None
        return f"{m[1]}:{m[2]}" if m else None


# -- field types ---------------------------------------------------------------------------------

def _number_to_str(value: Any) -> Any:
    # YAML reads `8192` as an int; a command word or env value is text all the same. A bool stays
    # refused: `true` would become "True", which is rarely what was meant.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _split_command(value: Any) -> Any:
    return shlex.split(value) if isinstance(value, str) else value


Word = Annotated[str, BeforeValidator(_number_to_str)]
def _absolute(path: Path) -> Path:
    # The daemon runs from / under systemd: a relative path would silently mean something else there.
    if not path.is_absolute():
        raise PydanticCustomError("relative_path", "must be an absolute path, got '{path}'", {"path": str(path)})
    return path


LaxPath = Annotated[Path, Field(strict=False), AfterValidator(_absolute)]
Seconds = Annotated[float, Field(gt=0)]


def _problems(problems: list[tuple[Loc, str]]) -> PydanticCustomError:
    """An error that names key paths below the failing value; :func:`_error_lines` expands them."""
    text = "; ".join(f"{format_path(loc)}: {msg}" if loc else msg for loc, msg in problems)
    return PydanticCustomError("rolloutd_config", "{text}", {"text": text, "problems": problems})


def _args_problems(args: list[str]) -> list[tuple[Loc, str]]:
    out = []
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        # vLLM's argument parser takes `--weight_transfer_config` for `--weight-transfer-config`.
        owned = flag.replace("_", "-") if flag.startswith("--") else flag
        if owned in OWNED_FLAGS:
            out.append(((i,), f"{flag} {OWNED_FLAGS[owned]}"))
        elif owned in SPANNING_FLAGS:
            out.append(((i,), f"{flag} is refused: a server whose engines span several nodes is not supported "
                              "(rolloutd supervises, pauses and updates each server of its node whole)"))
    return out


def _env_problems(env: dict[str, str]) -> list[tuple[Loc, str]]:
    out = []
    for name in env:
        if not _ENV_NAME.fullmatch(name):
            out.append(((name,), "not a valid environment variable name"))
        elif name in OWNED_ENV:
            out.append(((name,), f"{name} is set by rolloutd: {OWNED_ENV[name]}"))
    return out


def _listed_twice(what: str) -> Any:
    def problems(items: list[int]) -> list[tuple[Loc, str]]:
        return [((i,), f"{what} {item} is listed twice") for i, item in enumerate(items) if item in items[:i]]
    return problems


def _checked(problems_of: Any) -> AfterValidator:
    """A validator raising every problem ``problems_of(value)`` finds, each at its own place."""
    def check(value: Any) -> Any:
        if problems := problems_of(value):
            raise _problems(problems)
        return value
    return AfterValidator(check)


# Extra vLLM arguments and environment, for every server (``vllm``) or one (``servers[i]``).
Args = Annotated[list[Word], _checked(_args_problems)]
Env = Annotated[dict[str, Word], _checked(_env_problems)]
Gpus = Annotated[list[Annotated[int, Field(ge=0)]], _checked(_listed_twice("GPU"))]
Cpus = Annotated[list[Annotated[int, Field(ge=0)]], _checked(_listed_twice("CPU"))]


# -- a server's parallel shape ---------------------------------------------------------------------

# vLLM's flags of a server's parallel shape and their short forms; its parser takes `_` for `-` in
# long flags, `--flag=value`, and the last of several.
_SHAPE_FLAGS = {"--tensor-parallel-size": "tensor", "-tp": "tensor", "--pipeline-parallel-size": "pipeline",
                "-pp": "pipeline", "--data-parallel-size": "data", "-dp": "data"}
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # the CPU build's core lists, one per worker: "0,1|2,3"
_OMP_BIND_WORDS = ("auto", "nobind")    # its values that are no core lists


@dataclass(frozen=True)
class ParallelShape:
    """How many processes a server's model runs in: one worker per tensor x pipeline rank, per
    data-parallel engine."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def workers(self) -> int:
        return self.tensor * self.pipeline * self.data

    def __str__(self) -> str:
        sizes = [f"{k}={n}" for k, n in (("tensor", self.tensor), ("pipeline", self.pipeline), ("data", self.data))
                 if n > 1]
        return f"{' x '.join(sizes)} parallel, {self.workers} workers" if sizes else "one worker"


def parallel_shape(args: list[str]) -> ParallelShape:
    """The shape vLLM reads from ``args``; ValueError naming the flag for a size that is no
    positive integer (vLLM would fail at start)."""
    sizes: dict[str, int] = {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        if flag not in _SHAPE_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{flag} takes a positive integer, got {value!r}")
        sizes[_SHAPE_FLAGS[flag]] = int(value)
    return ParallelShape(**sizes)


def omp_threads_bind(cpus: list[int], workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each worker its own cores of ``cpus``: ``workers``
    contiguous groups in ascending order, the first ones one core larger when they do not divide
    evenly (``[0, 1, 2], 2 -> "0,1|2"``). Without it the CPU build binds every worker by NUMA
    node, all of them to the same cores on a one-node machine."""
    cores, groups, start = sorted(cpus), [], 0
    for rank in range(workers):
        size = len(cores) // workers + (rank < len(cores) % workers)
        groups.append(",".join(map(str, cores[start:start + size])))
        start += size
    return "|".join(groups)


def omp_bind_lists(value: str) -> int | None:
    """How many worker core lists a ``VLLM_CPU_OMP_THREADS_BIND`` value gives; None for vLLM's words."""
    return None if value in _OMP_BIND_WORDS else len(value.split("|"))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# -- sections ------------------------------------------------------------------------------------

class Node(_Section):
    name: str | None = Field(None, min_length=1, description="this node's name in the registry's replica "
                             "directory (replica ids are <name>.<server>): letters, digits and . _ : @ -, a "
                             "letter or digit first, the replica id at most 128 characters; null: the "
                             "machine's host name")
    advertise_host: str | None = Field(None, min_length=1, description="host the registry lists in this "
                                       "node's server endpoints (trainers send generate requests there); "
                                       "null: the machine's host name")


class Registry(_Section):
    url: str = Field(description="the trainer's registry, an http:// or https:// URL (a trailing / is dropped)")
    token_file: LaxPath | None = Field(None, description="file holding the registry's bearer token, read at "
                                       "start; null: no token")
    connect_timeout_s: Seconds = Field(5.0, description="longest wait to connect to the registry")
    request_timeout_s: Seconds = Field(15.0, description="longest wait for a registry reply (a long-poll "
                                       "gets its wait on top)")
    long_poll_s: float = Field(30.0, gt=0, le=300, description="how long one \"is there a newer version\" "
                               "request waits at the registry")
    retry_initial_s: Seconds = Field(1.0, description="first delay before retrying an unreachable registry")
    retry_max_s: Seconds = Field(30.0, description="longest delay between retries (the delay doubles up "
                                 "to it); at least retry_initial_s")

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host, e.g. http://trainer:8700")
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in range
        if parts.username is not None or parts.password is not None:
            raise ValueError("no user or password in the URL (it would show in logs and /status): "
                             "put the registry's token in registry.token_file")
        if parts.query or parts.fragment:
            raise ValueError("the registry URL takes no query or fragment")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _check_retry(self) -> Registry:
        if self.retry_max_s < self.retry_initial_s:
            raise _problems([(("retry_max_s",), f"must be at least retry_initial_s ({self.retry_initial_s})")])
        return self


ADMIN_TOKEN_NAME = "admin.token"  # the actions' token the daemon writes under state_dir without admin.token_file


class Admin(_Section):
    host: str = Field("127.0.0.1", min_length=1, description="address of the admin API (status, metrics, "
                      "actions); a host other than loopback needs token_file or allow_unauthenticated")
    port: int = Field(9100, ge=1, le=65535, description="TCP port of the admin API")
    token_file: LaxPath | None = Field(None, description="file holding the admin token: the actions (restart, "
                                       "update, reload) need `Authorization: Bearer <token>`; reads (status, "
                                       "metrics, healthz) need none; null: the daemon writes a new random token "
                                       "at every start to <state_dir>/admin.token (mode 0600: only rolloutd's "
                                       "user and root can read it; the rolloutd CLI reads it there)")
    allow_unauthenticated: bool = Field(False, description="without token_file: actions need no token, from "
                                        "anyone who can reach the admin API (every local user on loopback), "
                                        "and a host other than loopback is allowed")

    @model_validator(mode="after")
    def _check_open(self) -> Admin:
        # Fail closed, as the gateway: a generated token reaches local users only, so another host
        # needs a token the operator chose, or an explicit choice to let anyone act.
        if self.token_file is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise _problems([(("token_file",), f"required when admin.host ({self.host}) is not loopback: "
                              "set a token file, or admin.allow_unauthenticated: true to let anyone who can "
                              "reach it restart, update and reload")])
        return self


class Gateway(_Section):
    host: str = Field("127.0.0.1", min_length=1, description="address every server's gateway listens on: "
                      "the node's public address (e.g. 0.0.0.0) for trainers on other hosts, which then needs "
                      "token_file or allow_unauthenticated; vLLM itself listens on no TCP port at all")
    token_file: LaxPath | None = Field(None, description="file holding the gateway's token; when set, every "
                                       "request needs `Authorization: Bearer <token>`; null: no token, which "
                                       "a host other than loopback refuses unless allow_unauthenticated")
    allow_unauthenticated: bool = Field(False, description="serve a host other than loopback without "
                                        "token_file: generation open to anyone who can reach the node")
    while_paused: Literal["hold", "reject"] = Field("hold", description="a request that arrives while its "
                                                    "server is paused for an update: held until the server "
                                                    "resumes (at most hold_max_s), or answered 503 with "
                                                    "Retry-After at once")
    hold_max_s: Seconds = Field(60.0, description="hold: longest a request waits for its server to resume; "
                                "then 503 with Retry-After")
    retry_after_s: int = Field(2, ge=0, le=3600, description="Retry-After of a 503 (server paused, starting "
                               "or restarting)")
    max_body_bytes: ByteSize = Field(ByteSize(16 * MiB), ge=1 * KiB, description="largest request body "
                                     "accepted (413 above it)")
    head_timeout_s: Seconds = Field(10.0, description="longest time to receive a request's line and headers, "
                                    "from its first byte (from the connection's start for the first "
                                    "request); then 408 and the connection is closed")
    body_timeout_s: Seconds = Field(60.0, description="longest silence while a request body comes; then 408 "
                                    "and the connection is closed")
    idle_timeout_s: Seconds = Field(60.0, description="a kept-alive client connection with no request for "
                                    "this long is closed (a request being answered is never timed out)")
    max_connections: int = Field(4096, ge=1, description="most client connections of one server's gateway; "
                                 "one more ends the oldest connection that has not sent the token, or, "
                                 "when every one has, is answered 503 and closed at once")

    @model_validator(mode="after")
    def _check_open(self) -> Gateway:
        # Fail closed: the gateway is the way to a server from other hosts; open on a public address
        # only when the config says so in as many words.
        if self.token_file is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise _problems([(("token_file",), f"required when gateway.host ({self.host}) is not loopback: "
                              "set a token file, or gateway.allow_unauthenticated: true to serve anyone "
                              "who can reach the node")])
        return self


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); a name is not looked up."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Mirror(_Section):
    dir: LaxPath = Field(Path("/dev/shm/rolloutd"), description="the node's host mirror: one directory per "
                         "pulled version, shared by every server (memory-backed tmpfs is fastest)")
    max_bytes: ByteSize = Field(ByteSize(32 * GiB), gt=0, description="most bytes the mirror may hold; old "
                                "versions no server uses are removed to stay within it")
    recycle: bool = Field(True, description="keep a removed version's files (at most one version's bytes, "
                          "within max_bytes) for the next pull to overwrite, instead of deleting them: fresh "
                          "tmpfs pages cost the pull their allocation and zeroing, about a third of its CPU; "
                          "false gives the memory back between pulls")


class Pull(_Section):
    workers: int | None = Field(None, ge=1, le=256, description="processes that move a pull's bytes (network "
                                "reads, digests, writes into the mirror), beside the daemon so that pull work "
                                "never delays the gateway, heartbeats or the admin API; null: one per core, "
                                "at most 16")
    streams: int | None = Field(None, ge=1, le=1024, description="concurrent transfers of one pull, spread over "
                                "the workers (at least one each); null: two per worker")
    cpu_priority: Literal["idle", "low", "normal"] = Field("low", description="CPU priority of the pull "
                                                            "workers: low (nice 10: generation and the gateway "
                                                            "come first when the CPU is contended; a node whose "
                                                            "CPUs are all busy, such as vLLM's CPU build under "
                                                            "load, may slow a pull many times over, and its "
                                                            "progress lines then say how long the workers "
                                                            "waited for a CPU), idle (SCHED_IDLE: only CPU time "
                                                            "no other process wants; on a node whose CPUs are "
                                                            "all busy a pull may not finish), normal (the "
                                                            "daemon's)")
    request_bytes: ByteSize = Field(ByteSize(16 * MiB), ge=64 * KiB, description="largest byte range asked "
                                    "for in one request")
    max_chunk_retries: int = Field(3, ge=0, le=100, description="times one chunk is fetched again after a "
                                   "failed transfer or a bad digest before the pull fails")
    lease_ttl_s: float = Field(60.0, ge=5, description="lifetime of the lease that keeps the version's "
                               "bytes on the registry while pulling (renewed well before it ends)")
    read_timeout_s: Seconds = Field(30.0, description="longest silence while receiving bytes")
    worker_silence_s: float = Field(10.0, gt=1, description="a pull worker writes a line every second, busy "
                                    "or not; one silent this long with no thread waiting for a CPU (stopped, "
                                    "or stuck in the kernel) is killed and replaced, and its chunks fetched "
                                    "again")
    timeout_s: Seconds = Field(3600.0, description="longest time for a whole pull")
    keep_workers_s: float = Field(600.0, ge=0, description="how long the pull workers are kept after a pull "
                                  "for the next one: a node that pulls every RL step starts them once, not "
                                  "at every pull (a start is a noticeable share of a pull); an idle worker takes "
                                  "no CPU and some memory (bench/README.md: \"Workers kept between steps\", "
                                  "\"The daemon's own footprint\"); 0 stops them after each pull")

    def worker_count(self) -> int:
        return self.workers or max(1, min(os.cpu_count() or 1, 16))

    def stream_count(self) -> int:
        return max(self.streams or 2 * self.worker_count(), 1)


class Peers(_Section):
    enabled: bool = Field(False, description="take chunks from other nodes and serve this node's chunks to "
                          "them (the chunk swarm: the trainer then sends about one copy of a version however "
                          "many nodes pull it); off by default because it opens a listener to other nodes")
    host: str = Field("0.0.0.0", min_length=1, description="address of the peer listener, reachable from the "
                      "other nodes; it serves only checked chunks of versions, read-only, with a token")
    port: int = Field(9300, ge=1, le=65535, description="TCP port of the peer listener")
    advertise_url: str | None = Field(None, description="the listener's URL as other nodes reach it, e.g. "
                                      "http://10.0.0.7:9300; null: http://<node.advertise_host>:<port>")
    token_file: LaxPath | None = Field(None, description="file holding the token every node of the fleet "
                                       "presents to its peers; null: one derived from the registry's token "
                                       "(HMAC-SHA256), never the registry's own (a listener off loopback "
                                       "refuses to start without either)")
    announce_every_s: Seconds = Field(0.5, description="while pulling: how often the registry's tracker "
                                      "hears which chunks this node holds (and says where to take the rest)")
    announce_idle_s: Seconds = Field(10.0, description="at rest: how often it hears which complete versions "
                                     "this node serves (keep it under the registry's --holder-ttl-s)")
    peer_timeout_s: Seconds = Field(10.0, description="longest silence from a peer before it is dropped "
                                    "for the pull")
    peer_chunk_timeout_s: Seconds = Field(60.0, description="longest time for one chunk from a peer before "
                                          "it is dropped for the pull and the chunk fetched elsewhere")
    origin_wait_s: Seconds = Field(5.0, description="with nothing to fetch and no word from the tracker "
                                   "for this long, take the rest from the origin (registry or object store)")
    head_timeout_s: Seconds = Field(10.0, description="the peer listener closes a connection that has not sent "
                                    "a whole request head this long after connecting or after its last response "
                                    "(nothing is authenticated before the head)")
    max_connections: int = Field(256, ge=1, description="most connections the peer listener keeps open; more are "
                                 "closed as they come")

    @field_validator("advertise_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None and not re.fullmatch(r"https?://[^\s/]+", url.rstrip("/")):
            raise ValueError("expected http://HOST:PORT (no path)")
        return url.rstrip("/") if url else url


class ObjectStore(_Section):
    endpoint: str | None = Field(None, description="the S3-compatible service versions published with "
                                 "`to: s3://...` are read from, e.g. http://minio:9000; null: AWS S3")
    region: str = Field("us-east-1", min_length=1, description="the bucket's region")
    credentials_file: LaxPath | None = Field(None, description="JSON or YAML file with access_key_id, "
                                             "secret_access_key and optionally session_token; null: the "
                                             "environment's AWS_* variables")


class Update(_Section):
    pause_mode: Literal["abort", "wait", "keep"] = Field("keep", description="how a server pauses for an "
                                                         "update: abort running requests, wait for them to "
                                                         "finish, or keep them (resumed on the new weights)")
    min_version_lag: int = Field(1, ge=1, description="update once the newest version is this many versions "
                                 "ahead of the loaded one")
    max_update_delay_s: float = Field(300.0, ge=0, description="... or once a newer version has waited this "
                                      "long")
    strategy: Literal["all_at_once", "rolling"] = Field("all_at_once", description="update every server of "
                                                        "the node together, or a few at a time")
    max_unavailable: int = Field(1, ge=1, description="rolling: most servers paused at once")
    pause_timeout_s: Seconds = Field(60.0, description="longest wait for POST /pause")
    start_timeout_s: Seconds = Field(30.0, description="longest wait for POST /start_weight_update")
    load_timeout_s: Seconds = Field(600.0, description="longest wait for POST /update_weights (loading the "
                                    "mirror into the server)")
    finish_timeout_s: Seconds = Field(60.0, description="longest wait for POST /finish_weight_update")
    resume_timeout_s: Seconds = Field(30.0, description="longest wait for POST /resume")
    max_reapply: int = Field(1, ge=0, description="a failed load is applied again this many times before "
                            "the server is restarted")
    serve_mirror_when_registry_down: bool = Field(False, description="rolloutd (re)started while the registry "
                                                  "cannot be reached: sync every server to the newest complete "
                                                  "version in the mirror and serve it, instead of waiting in "
                                                  "SYNCING until the registry answers. Off: a server is never "
                                                  "SERVING on weights the registry has not named since rolloutd "
                                                  "started")
    keep_kv_cache: bool = Field(False, description="partial-rollout semantics: keep every KV cache across an "
                                "update, so requests frozen by pause_mode keep go on attending to KV computed "
                                "with the old weights, and new requests reuse prefix-cache blocks of the old "
                                "weights. Off: the prefix cache is dropped and frozen requests are recomputed "
                                "on the new weights, so no request reads KV of older weights")


class Heartbeat(_Section):
    interval_s: Seconds = Field(5.0, description="time between two heartbeats of a server to the registry")
    timeout_s: Seconds = Field(5.0, description="longest wait for the registry to take one heartbeat")


class Health(_Section):
    interval_s: Seconds = Field(5.0, description="time between two probes of a server's /health")
    timeout_s: Seconds = Field(5.0, description="longest wait for one probe")
    failures: int = Field(3, ge=1, description="consecutive failed probes before the server is restarted")


class Restart(_Section):
    start_timeout_s: Seconds = Field(900.0, description="longest time from spawning a server to its /health "
                                     "passing (large models load slowly)")
    backoff_initial_s: Seconds = Field(1.0, description="delay before restarting a server that failed")
    backoff_max_s: Seconds = Field(60.0, description="longest delay between restarts; at least "
                                   "backoff_initial_s")
    backoff_factor: float = Field(2.0, ge=1, description="each consecutive failure multiplies the delay by this")
    max_retries: int = Field(5, ge=0, description="consecutive failed starts before the server is given up "
                             "(FATAL)")
    stable_after_s: Seconds = Field(300.0, description="serving this long resets the count of failed starts")
    failed_grace_s: Seconds = Field(5.0, description="after a failure, how long a server's process group gets "
                                    "between SIGTERM and SIGKILL (shutdown.server_grace_s is for stops asked for: "
                                    "a failed server has nothing worth draining, and vLLM's API process whose "
                                    "engine died may never exit on SIGTERM)")

    @model_validator(mode="after")
    def _check_backoff(self) -> Restart:
        if self.backoff_max_s < self.backoff_initial_s:
            raise _problems([(("backoff_max_s",), f"must be at least backoff_initial_s "
                                                  f"({self.backoff_initial_s})")])
        return self


class Shutdown(_Section):
    server_grace_s: Seconds = Field(20.0, description="after SIGTERM, wait this long for a server's process "
                                    "group before SIGKILL")
    kill_wait_s: Seconds = Field(10.0, description="after SIGKILL, wait this long for the group to disappear")
    deregister_timeout_s: Seconds = Field(5.0, description="longest wait to remove the node's servers from "
                                          "the registry's directory")
    admin_grace_s: Seconds = Field(2.0, description="longest wait for admin API requests in flight")

    @property
    def longest_s(self) -> float:
        """The longest an ordered stop can take (the unit's TimeoutStopSec must be above it)."""
        return self.server_grace_s + self.kill_wait_s + self.deregister_timeout_s + self.admin_grace_s


class Vllm(_Section):
    command: Annotated[list[Word], BeforeValidator(_split_command)] = Field(
        ["vllm", "serve"], min_length=1, description="the command that starts one server, as a list or one "
        "string split like a shell does; rolloutd appends the model, the port and its own flags")
    args: Args = Field([], description="extra arguments for every server (not --host, --port, "
                             "--weight-transfer-config, --enable-scale-out: rolloutd sets those)")
    env: Env = Field({}, description="extra environment variables for every server (not "
                                 "CUDA_VISIBLE_DEVICES, VLLM_SERVER_DEV_MODE, TMPDIR)")
    log_every_request: bool = Field(False, description="vLLM's access-log line for every request it answers "
                                    "(generation, health probes, metrics); false: only the other routes, such "
                                    "as the pause and weight routes rolloutd calls, are logged. At a fleet's "
                                    "request rates a line per request would flood the journal, whose limit per "
                                    "service (10,000 lines in 30 s by default) then drops the daemon's own "
                                    "lines too; the gateway counts requests in rolloutd_gateway_requests_total. "
                                    "Access-log flags in vllm.args or a server's args (--disable-uvicorn-"
                                    "access-log, --disable-access-log-for-endpoints, --log-config-file) win")


class Server(_Section):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="the server's name: lower-case "
                      "letters, digits, - and _; unique on the node")
    model: str = Field(min_length=1, description="the model `vllm serve` starts with (a path or a model "
                       "name); the registry's versions then replace its weights")
    public_port: int = Field(ge=1, le=65535, description="port of this server's gateway on gateway.host: "
                             "where trainers send generation requests, and the endpoint the registry lists; "
                             "unique on the node and not the admin port. vLLM itself listens on no port: "
                             "on the UNIX socket <state_dir>/sockets/<name>.sock, which only rolloutd's user "
                             "can reach")
    gpus: Gpus = Field([], description="GPU indices the server uses (its "
                                                   "CUDA_VISIBLE_DEVICES), at least one per worker of its parallel "
                                                   "shape (--tensor-parallel-size x --pipeline-parallel-size "
                                                   "x --data-parallel-size in its vLLM args); no GPU in two "
                                                   "servers; []: the variable is left as rolloutd found it")
    cpus: Cpus = Field([], description="CPU cores all of the server's processes run on (its API server, engine "
                       "core and workers): a busy server then leaves the other cores to the daemon, its gateway "
                       "and other servers; at least one per worker of its parallel shape; [] (default): wherever "
                       "rolloutd runs. rolloutd splits them between the workers in VLLM_CPU_OMP_THREADS_BIND "
                       "(vLLM's CPU build binds each worker's threads to its own cores), unless env sets it")
    args: Args = Field([], description="extra arguments for this server, after vllm.args")
    env: Env = Field({}, description="extra environment variables for this server, over "
                                 "vllm.env")

    @model_validator(mode="before")
    @classmethod
    def _removed_port(cls, data: Any) -> Any:
        # `port` was vLLM's loopback TCP port, which every local user could reach (and pause, or
        # load weights into): say so rather than "unknown key" to whoever upgrades.
        if isinstance(data, dict) and "port" in data:
            raise _problems([(("port",), "no longer taken: vLLM listens on a UNIX socket that only rolloutd's "
                              "user can reach (<state_dir>/sockets/<name>.sock), never on a TCP port; the "
                              "server's gateway port is public_port (it was port + 1000)")])
        return data

    @property
    def cuda_visible_devices(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` for this server, e.g. ``"0,1"``; None leaves the variable as it is."""
        return ",".join(str(g) for g in self.gpus) if self.gpus else None


# -- the whole file ------------------------------------------------------------------------------

SECTIONS = ("node", "registry", "admin", "gateway", "mirror", "pull", "peers", "object_store", "update", "heartbeat",
            "health", "restart", "shutdown", "vllm")


class Config(_Section):
    node: Node = Field(default_factory=Node, description="who this node is")
    registry: Registry = Field(description="the trainer's weight registry (required)")
    admin: Admin = Field(default_factory=Admin, description="the local admin API")
    gateway: Gateway = Field(default_factory=Gateway, description="the servers' gateways: the only way to a "
                             "server from other hosts, an allow-list of generation routes")
    state_dir: LaxPath = Field(Path("/var/lib/rolloutd"), description="the daemon's own state: records of "
                               "running servers and of /dev/shm at its start (to clean after a crash), the "
                               "plugin copy servers import, sockets/ (mode 0700), where each server's "
                               "vLLM listens, scratch/: a directory per running server (its TMPDIR, with "
                               "the names of the /dev/shm segments it holds), removed once it stopped, and "
                               "compile-cache/: torch's compile cache (TORCHINDUCTOR_CACHE_DIR unless env "
                               "sets it), kept across the servers' starts")
    mirror: Mirror = Field(default_factory=Mirror, description="the node's host mirror of pulled versions")
    pull: Pull = Field(default_factory=Pull, description="how a version is pulled into the mirror")
    peers: Peers = Field(default_factory=Peers, description="the chunk swarm: chunks from and to other nodes")
    object_store: ObjectStore = Field(default_factory=ObjectStore, description="where versions published to "
                                      "an object store are read from")
    update: Update = Field(default_factory=Update, description="when and how servers load a new version")
    heartbeat: Heartbeat = Field(default_factory=Heartbeat, description="each server's state reported to the "
                                 "registry")
    health: Health = Field(default_factory=Health, description="liveness probes of running servers")
    restart: Restart = Field(default_factory=Restart, description="starting and restarting servers")
    shutdown: Shutdown = Field(default_factory=Shutdown, description="deadlines of an ordered stop")
    vllm: Vllm = Field(default_factory=Vllm, description="what every server runs")
    servers: list[Server] = Field(min_length=1, description="the `vllm serve` processes of this node, at "
                                  "least one")

    @field_validator(*SECTIONS, mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        # A section whose keys are all commented out reads as null: take it as all defaults.
        return {} if value is None else value

    @model_validator(mode="after")
    def _check_servers(self) -> Config:
        if problems := (list(self._server_conflicts()) + self._replica_id_problems() + self._peers_port_problems()
                        + list(self._parallel_problems())):
            raise _problems(problems)
        return self

    def _parallel_problems(self) -> Iterator[tuple[Loc, str]]:
        for i, s in enumerate(self.servers):
            try:
                shape = self.shape(s)
            except ValueError as e:
                yield ("servers", i, "args"), str(e)
                continue
            if s.gpus and len(s.gpus) < shape.workers:  # vLLM would fail at start, after loading for a while
                yield ("servers", i, "gpus"), (f"lists {len(s.gpus)} GPU(s) for a server of {shape}: "
                                               f"list at least {shape.workers}, one per worker")
            if s.cpus and len(s.cpus) < shape.workers:
                yield ("servers", i, "cpus"), (f"lists {len(s.cpus)} core(s) for a server of {shape}: list at "
                                               "least one per worker, whose threads are bound to their own cores")
            where = ("servers", i, "env", OMP_BIND) if OMP_BIND in s.env else ("vllm", "env", OMP_BIND)
            given = {**self.vllm.env, **s.env}.get(OMP_BIND)
            if given is not None and (lists := omp_bind_lists(given)) not in (None, shape.workers):
                yield where, (f"gives {lists} core list(s) ('|' between them) for servers[{i}] ({s.name}), a "
                              f"server of {shape}: give one per worker, or leave it out and list the cores in "
                              "cpus (rolloutd then splits them between the workers)")

    def shape(self, server: Server) -> ParallelShape:
        """The parallel shape of ``server``, from vllm.args and its own args."""
        return parallel_shape([*self.vllm.args, *server.args])

    def omp_threads_bind(self, server: Server) -> str | None:
        """``VLLM_CPU_OMP_THREADS_BIND`` rolloutd gives ``server``: its cores split between its
        workers; None when it has no cpus or the config sets the variable itself."""
        if not server.cpus or OMP_BIND in {**self.vllm.env, **server.env}:
            return None
        return omp_threads_bind(list(server.cpus), self.shape(server).workers)

    def _peers_port_problems(self) -> list[tuple[Loc, str]]:
        if not self.peers.enabled:
            return []
        taken = {self.admin.port: "the admin API's port (admin.port)"}
        for i, s in enumerate(self.servers):
            taken.setdefault(s.public_port, f"the public_port of servers[{i}]")
        if self.peers.port in taken:
            return [(("peers", "port"), f"{self.peers.port} is also {taken[self.peers.port]}")]
        return []

    def _replica_id_problems(self) -> list[tuple[Loc, str]]:
        # Heartbeats go to /v1/replicas/<node>.<server>: a name the registry refuses would fail every
        # heartbeat for as long as the daemon runs, so refuse it here, where a person reads the error.
        node = self.node_name
        whose = "" if self.node.name is not None else f"null, and the host name {node!r} "
        if not REPLICA_ID_RE.fullmatch(node):
            return [(("node", "name"), f"{whose}is not valid in a registry replica id (<node>.<server>, "
                     f"{REPLICA_ID_RE.pattern}): letters, digits and . _ : @ -, a letter or digit first, "
                     "at most 128 characters")]
        longest = max(self.servers, key=lambda s: len(s.name))
        replica_id = f"{node}.{longest.name}"
        if not REPLICA_ID_RE.fullmatch(replica_id):
            return [(("node", "name"), f"{whose}makes the registry replica id of server {longest.name!r} "
                     f"{len(replica_id)} characters long; the registry takes at most 128: shorten node.name")]
        return []

    def _server_conflicts(self) -> Iterator[tuple[Loc, str]]:
        names: dict[str, int] = {}
        ports: dict[int, str] = {}
        gpus: dict[int, int] = {}
        for i, s in enumerate(self.servers):
            if s.name in names:
                yield ("servers", i, "name"), f"{s.name!r} is also the name of servers[{names[s.name]}]"
            names.setdefault(s.name, i)
            where, port = ("servers", i, "public_port"), s.public_port
            if port == self.admin.port:
                yield where, f"{port} is the admin API's port (admin.port)"
            elif port in ports:
                yield where, f"{port} is also {ports[port]}"
            ports.setdefault(port, f"the public_port of servers[{i}]")
            for k, gpu in enumerate(s.gpus):
                if gpu in gpus:
                    yield ("servers", i, "gpus", k), f"GPU {gpu} is also used by servers[{gpus[gpu]}]"
                gpus.setdefault(gpu, i)
        longest = self.socket_path(max((s.name for s in self.servers), key=len))
        if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
            yield ("state_dir",), (f"makes a server's socket path ({longest}) longer than a UNIX socket's may be "
                                   f"({SOCKET_PATH_MAX} bytes): shorten state_dir")


    @property
    def scratch_dir(self) -> Path:
        """Where each running server gets a directory of its own (:data:`SCRATCH`)."""
        return self.state_dir / SCRATCH

    @property
    def compile_cache_dir(self) -> Path:
        """``TORCHINDUCTOR_CACHE_DIR`` of every server unless its env sets it (:data:`COMPILE_CACHE`)."""
        return self.state_dir / COMPILE_CACHE

    @property
    def socket_dir(self) -> Path:
        """Where every server's vLLM listens: a directory only rolloutd's user may enter."""
        return self.state_dir / "sockets"

    def socket_path(self, name: str) -> Path:
        """The UNIX socket of server ``name``'s vLLM (it listens on no TCP port)."""
        return self.socket_dir / f"{name}.sock"

    @property
    def admin_token_path(self) -> Path | None:
        """The file holding the admin actions' token: admin.token_file, else the one the daemon
        writes at start under state_dir; None with admin.allow_unauthenticated and no token file."""
        if self.admin.token_file is not None:
            return self.admin.token_file
        return None if self.admin.allow_unauthenticated else self.state_dir / ADMIN_TOKEN_NAME

    @property
    def node_name(self) -> str:
        """This node's name: ``node.name``, else the machine's host name."""
        return self.node.name or socket.gethostname()

    @property
    def peers_url(self) -> str:
        """Where other nodes reach this node's peer listener."""
        return self.peers.advertise_url or f"http://{self.advertise_host}:{self.peers.port}"

    @property
    def advertise_host(self) -> str:
        """The host in this node's server endpoints: ``node.advertise_host``, else the host name."""
        return self.node.advertise_host or socket.gethostname()

    def server(self, name: str) -> Server:
        """The server named ``name``; KeyError when there is none."""
        for s in self.servers:
            if s.name == name:
                return s
        raise KeyError(f"no server named {name!r}")


def read_token(path: Path | None) -> str | None:
    """The token in ``path`` with surrounding whitespace stripped; None for no path. Never logged."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"token file {path}: not found") from None
    except IsADirectoryError:
        raise ConfigError(f"token file {path}: is a directory") from None
    except PermissionError:
        raise ConfigError(f"token file {path}: permission denied") from None
    except (OSError, UnicodeDecodeError) as e:  # the reason only: a decode error would quote the bytes
        raise ConfigError(f"token file {path}: cannot read it ({type(e).__name__})") from None
    if not token:
        raise ConfigError(f"token file {path}: is empty")
    return token


# -- loading -------------------------------------------------------------------------------------

def load_config(path: str | Path, *, check_files: bool = False) -> Config:
    """Read and validate a config file; ConfigError (one line per problem) for anything wrong.

    ``check_files`` also reads the token files, as the daemon does when it starts.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    return parse_config(text, str(path), check_files=check_files)


def parse_config(text: str, source: str = "<string>", *, check_files: bool = False) -> Config:
    """Validate config text; ``source`` names it in error messages."""
    root, data = _compose(text, source)
    problems = [(line, f"{format_path(loc)}: {msg}") for loc, line, msg in _duplicate_keys(root)]
    cfg = None
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        problems += [(_line_of(root, loc), f"{format_path(loc)}: {msg}") for loc, msg in _error_lines(e)]
    if cfg is not None and check_files:
        problems += [(_line_of(root, loc), f"{format_path(loc)}: {msg}") for loc, msg in _file_problems(cfg)]
    if problems:
        problems.sort(key=lambda p: p[0])  # stable: pydantic's order within a line
        raise ConfigError([f"{source}:{line}: {_printable(msg)}" for line, msg in problems])
    return cfg


def _printable(msg: str) -> str:
    """One line per problem, whatever a value held: a newline in it shows as ``\\n``."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)


def _unreadable(source: str, e: yaml.reader.ReaderError) -> ConfigError:
    char = chr(e.character) if isinstance(e.character, int) else e.character
    return ConfigError(f"{source}: cannot read the YAML: character {char!r} at position {e.position} is not "
                       "allowed in YAML")


def _compose(text: str, source: str) -> tuple[yaml.Node, dict]:
    """The document's node tree and the plain data built from that same tree."""
    try:
        loader = yaml.SafeLoader(text)  # reads the whole text: a control character fails here
    except yaml.reader.ReaderError as e:
        raise _unreadable(source, e) from None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{mark.line + 1}:{mark.column + 1}" if mark else "1"
        raise ConfigError(f"{source}:{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.reader.ReaderError as e:
        raise _unreadable(source, e) from None
    except RecursionError:
        raise ConfigError(f"{source}: cannot read the YAML: nested too deeply") from None
    except (yaml.YAMLError, ValueError) as e:  # a bad date such as 2024-02-30 is a ValueError
        raise ConfigError(f"{source}: cannot read the YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{source}: is empty: a config needs at least `registry` and `servers`")
    if not isinstance(data, dict):
        kind = {list: "list", str: "string", bool: "boolean"}.get(type(data), "number")
        raise ConfigError(f"{source}:{root.start_mark.line + 1}: the top level must be a mapping of sections "
                          f"(registry, servers, ...), not a {kind}")
    return root, data


# Pydantic's wording names Python classes where a YAML user thinks of mappings and text.
_MESSAGES = {
    "model_type": "Input should be a mapping of keys",
    "model_attributes_type": "Input should be a mapping of keys",
    "path_type": "Input should be a path (text)",
}


def _error_lines(e: ValidationError) -> Iterator[tuple[Loc, str]]:
    for err in e.errors():
        loc = tuple(part for part in err["loc"] if part != "[key]")
        if err["type"] == "invalid_key" or "[key]" in err["loc"]:
            loc = loc[:-1] + (str(loc[-1]),)  # a mapping key that is not text, not a list index
        ctx = err.get("ctx") or {}
        if err["type"] == "rolloutd_config":
            for rel, msg in ctx["problems"]:
                yield loc + tuple(rel), msg
        elif err["type"] == "extra_forbidden":
            yield loc, _unknown_key(loc)
        elif "[key]" in err["loc"]:
            yield loc, f"{err['msg']} (the key)"
        elif err["type"] == "byte_size" and str(err["input"]).lstrip().startswith("-"):
            # pydantic cannot parse a sign and says so as if the unit were unknown
            yield loc, f"a size must be positive, got {err['input']!r}"
        else:
            yield loc, _MESSAGES.get(err["type"]) or err["msg"].removeprefix("Value error, ")


def _unknown_key(loc: Loc) -> str:
    known = _keys_at(loc[:-1])
    if not known:
        return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return f"unknown key (did you mean {close[0]!r}?)" if close else f"unknown key; expected one of: {', '.join(known)}"


def _keys_at(loc: Loc) -> list[str]:
    """The keys the model takes at ``loc`` (a section, or a server), or [] when not a model."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue  # an item of servers
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = field.annotation
        if get_origin(model) is list:
            model = get_args(model)[0]
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return list(model.model_fields)


def _file_problems(cfg: Config) -> Iterator[tuple[Loc, str]]:
    for section in ("registry", "admin", "gateway", "peers"):
        try:
            read_token(getattr(cfg, section).token_file)
        except ConfigError as e:
            yield (section, "token_file"), str(e)


def format_path(loc: Loc) -> str:
    """``("servers", 1, "port")`` -> ``servers[1].port``; odd keys are quoted: ``env["A B"]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out or "(top level)"


def _line_of(root: yaml.Node, loc: Loc) -> int:
    """1-based line of the value at ``loc``, or of the deepest key on the way that exists.

    A scalar value's own line; a mapping or a list reached through a key: the key's line (the
    value itself starts a line lower in block style). A missing key: its parent's line.
    """
    node, key_line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # The last of duplicate keys, as the loader keeps the last.
            match = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)]
            if not match:
                break
            key, node = match[-1]
            key_line = key.start_mark.line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node, key_line = node.value[part], None
        else:
            break
    if key_line is None or isinstance(node, yaml.ScalarNode):
        return node.start_mark.line + 1
    return key_line + 1


def _duplicate_keys(root: yaml.Node) -> Iterator[tuple[Loc, int, str]]:
    """Keys given twice in one mapping: (path, line of the repeat, message)."""
    seen_nodes: set[int] = set()  # aliases share nodes; a recursive alias would loop

    def walk(node: yaml.Node, loc: Loc) -> Iterator[tuple[Loc, int, str]]:
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    continue
                line = key.start_mark.line + 1
                if (key.tag, key.value) in first:
                    yield loc + (key.value,), line, f"duplicate key (first on line {first[key.tag, key.value]})"
                first.setdefault((key.tag, key.value), line)
                yield from walk(value, loc + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                yield from walk(item, loc + (i,))

    yield from walk(root, ())
