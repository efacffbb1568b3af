"""Manifests: what one weight version holds and how every byte of it is checked.

Contract (docs/registry-api.md): a version is one or more safetensors files; the manifest lists each
file with its size and one digest per fixed-size chunk (``hash``: xxh3-128 by default, for
speed; sha256 or blake3, cryptographic, for a version that peers may carry: docs/peers.md), plus
a digest of the manifest itself: always sha256 over its canonical JSON (sorted
keys, no spaces, ASCII, without the ``digest`` field). sha256 because any reader can check it
with its standard library: the vLLM plugin does, in an environment without xxhash.
A reader checks the manifest digest first, then every chunk it receives.

A **delta version** (docs/deltas.md) carries a ``delta`` section beside the target's description:
the base it applies to (version and manifest digest), the encoding, and the delta files with
their own chunk digests, one per target file. The section is sealed by its own ``digest`` and
left out of the manifest's: the manifest digest of a delta version is the digest a full publish
of the same tensors has, so the node's mirror, the plugin and the gate see an ordinary version
once the target is rebuilt and checked against it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

import xxhash
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from rolloutd.wire.filemap import map_readonly
from rolloutd.wire.hashes import new_hasher
from vllm_plugin.wire import canonical_json, read_header

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 64 * MiB
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 30
MAX_VERSION = (1 << 53) - 1  # survives a round trip through any JSON parser
MAX_FILES = 10_000
MAX_CANARY_PROMPT = 2048       # token ids of a canary's prompt
MAX_CANARY_CONTINUATION = 512  # token ids (and expected logprobs) of its continuation
MAX_TOKEN_ID = (1 << 31) - 1
DEFAULT_CANARY_TOLERANCE = 0.05
# Above this (nats: a factor e in probability) a canary's check would pass wrong weights.
MAX_CANARY_TOLERANCE = 1.0

HashName = Literal["xxh3-128", "sha256", "blake3"]
# Fast enough that hashing never bounds a pull from the origin: a small share of a pull worker's
# CPU (docs/data-path.md, "What was measured of the alternatives").
DEFAULT_HASH: HashName = "xxh3-128"
# Chunk digests nobody can collide on purpose: the only ones a node accepts peers' bytes against
# (xxh3-128 guards against corruption, not against a hostile peer; docs/peers.md, threat model).
CRYPTO_HASHES = frozenset({"sha256", "blake3"})
_HEX_LEN = {"xxh3-128": 32, "sha256": 64, "blake3": 64}


def _one_shot(hash_name: str) -> Callable[[bytes | memoryview], str]:
    def fn(data: bytes | memoryview) -> str:
        h = new_hasher(hash_name)
        h.update(data)
        return h.hexdigest()
    return fn


_HASHERS: dict[str, Callable[[bytes | memoryview], str]] = {
    "xxh3-128": xxhash.xxh3_128_hexdigest,
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    "blake3": _one_shot("blake3"),
}

# One path component, no leading dot: ".." and "a/b" can never be a file name.
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
# The name a version directory keeps its own manifest under (registry and node mirror alike).
RESERVED_NAMES = frozenset({"manifest.json"})


def valid_file_name(name: str) -> bool:
    return bool(FILE_NAME_RE.fullmatch(name)) and name not in RESERVED_NAMES


def digest(hash_name: str, data: bytes | memoryview) -> str:
    return _HASHERS[hash_name](data)


def _json_int(value: object) -> object:
    """JSON integers: 3 and 3.0 (JSON Schema's "integer"), never true/false or "3"."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_int(**constraints: int) -> object:
    """An integer field of a strict model that also takes 3.0; constraints go before the
    validator so that the JSON schema states them (minimum/maximum)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_json_int)]


VersionNumber = json_int(ge=1, le=MAX_VERSION)
Count = json_int(ge=0)
ChunkBytes = json_int(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)
HexDigest = Annotated[str, Field(pattern=r"^[0-9a-f]{32}([0-9a-f]{32})?$", description="lowercase hex")]
ManifestDigest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256, lowercase hex")]
TokenId = json_int(ge=0, le=MAX_TOKEN_ID)


class FileEntry(BaseModel):
    """One file of a version: its name, size and per-chunk digests."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(description="file name inside the version directory (one path component)",
                      json_schema_extra={"pattern": FILE_NAME_RE.pattern})
    size: Count = Field(description="size in bytes")
    chunks: list[HexDigest] = Field(description="hex digest of each chunk, in order")

    @field_validator("name")
    @classmethod
    def _name_is_safe(cls, name: str) -> str:
        if not valid_file_name(name):
            raise ValueError(f"invalid file name {name[:210]!r}: one path component of "
                             "letters, digits, '.', '_', '-', not starting with '.', and not "
                             f"{' or '.join(sorted(RESERVED_NAMES))}")
        return name


class Canary(BaseModel):
    """A correctness check the trainer attaches to a version: a prompt, a continuation, and the
    log-probability the trainer's own model gives each continuation token after its prefix.
    A server that loaded the version must reproduce every one within ``tolerance`` (nats)
    before it takes traffic (docs/daemon.md, "The gate"). Made by
    :func:`rolloutd.trainer.canary.make_canary`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    prompt_ids: list[TokenId] = Field(min_length=1, max_length=MAX_CANARY_PROMPT,
                                      description="token ids of the prompt")
    continuation_ids: list[TokenId] = Field(min_length=1, max_length=MAX_CANARY_CONTINUATION,
                                            description="token ids that follow the prompt")
    logprobs: list[Annotated[float, Field(le=0)]] = Field(
        min_length=1, max_length=MAX_CANARY_CONTINUATION,
        description="expected log-probability (natural log, <= 0) of each continuation token given "
                    "everything before it")
    tolerance: float = Field(DEFAULT_CANARY_TOLERANCE, gt=0,
                             description="largest |served - expected| logprob accepted, in nats")

    @model_validator(mode="after")
    def _lengths(self) -> Canary:
        if len(self.logprobs) != len(self.continuation_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.continuation_ids)} continuation "
                             "tokens: one each")
        return self

    def positions(self) -> range:
        """Indices, in ``prompt_ids + continuation_ids``, of the continuation tokens."""
        return range(len(self.prompt_ids), len(self.prompt_ids) + len(self.continuation_ids))

    def max_abs_delta(self, served: list[float]) -> float:
        """max |served - expected| over the continuation (inf if a served value is not finite)."""
        if len(served) != len(self.logprobs):
            raise ValueError(f"{len(served)} served logprobs for {len(self.logprobs)} expected")
        worst = 0.0
        for got, want in zip(served, self.logprobs, strict=True):
            if not math.isfinite(got):
                return math.inf
            worst = max(worst, abs(got - want))
        return worst


# Optional keys left out of every dump while unset, so that a manifest without them keeps the
# canonical bytes, and so the digest, it had before they existed (the plugin hashes the raw JSON).
_OMITTED_WHEN_NONE = ("canary", "partial", "source", "delta")

DeltaEncoding = Literal["xor-sparse-zstd", "xor-planes-zstd", "xor-zstd", "index-value-zstd"]
MAX_REMOVED = 100_000
MAX_TENSOR_NAME = 1000


class DeltaFile(FileEntry):
    """One delta file: the encoded changes that rebuild target file ``target`` from the base."""

    target: str = Field(description="the target file this delta file rebuilds")


class Delta(BaseModel):
    """How to rebuild a version from an earlier one: sealed by its own ``digest`` (sha256 of its
    canonical JSON without that field), which the manifest's digest does not cover."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    base_version: VersionNumber = Field(description="the version the delta applies to")
    base_digest: ManifestDigest = Field(description="that version's manifest digest")
    encoding: DeltaEncoding = Field(description="how changed tensors are encoded (docs/deltas.md)")
    files: list[DeltaFile] = Field(min_length=1, max_length=MAX_FILES,
                                   description="the delta files, one per target file, chunked and hashed "
                                               "as the target's files are")
    removed: list[Annotated[str, Field(max_length=MAX_TENSOR_NAME)]] = Field(
        default_factory=list, max_length=MAX_REMOVED, description="tensors of the base that the target lacks")
    digest: ManifestDigest | None = Field(None, description="sha256 of this section's canonical JSON without "
                                          "this field")

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json", exclude={"digest"}))

    def compute_digest(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def sealed(self) -> Delta:
        actual = self.compute_digest()
        if self.digest is not None and self.digest != actual:
            raise ManifestError(f"delta section digest {self.digest} does not match its contents ({actual})")
        return self.model_copy(update={"digest": actual})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def for_target(self, name: str) -> DeltaFile | None:
        return next((f for f in self.files if f.target == name), None)

# Where a version's bytes are when not on the registry: an S3 bucket and key prefix; file
# ``name`` is the object ``<prefix>/<name>``. Bucket names as S3 allows them.
SOURCE_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*'()/=+-]{0,900})?$")


class Manifest(BaseModel):
    """A version's table of contents; ``digest`` seals everything else."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    version: VersionNumber
    hash: HashName = DEFAULT_HASH
    chunk_bytes: ChunkBytes = DEFAULT_CHUNK_BYTES
    files: list[FileEntry] = Field(min_length=1, max_length=MAX_FILES)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64,
                                     description="free-form labels, e.g. the training step")
    digest: ManifestDigest | None = Field(None, description="sha256 of the canonical JSON without this field")
    canary: Canary | None = Field(None, description="correctness check a server must pass after loading this "
                                  "version, before it takes traffic (absent: none)")
    partial: bool | None = Field(None, description="true: this version deliberately carries only some of the "
                                 "model's tensors; the others keep their values (absent: a full checkpoint)")
    source: str | None = Field(None, description="where the bytes are when not on the registry: "
                               "s3://bucket/prefix, file <name> being the object <prefix>/<name> (absent: "
                               "on the registry)", json_schema_extra={"pattern": SOURCE_RE.pattern})
    delta: Delta | None = Field(None, description="how to rebuild this version from an earlier one the node "
                                "holds (absent: a full version only); not covered by ``digest``, sealed by "
                                "its own")

    @field_validator("source")
    @classmethod
    def _source_is_s3(cls, source: str | None) -> str | None:
        if source is not None and not SOURCE_RE.fullmatch(source):
            raise ValueError(f"source {source[:100]!r} is not s3://bucket/prefix (bucket: 3 to 63 lowercase "
                             "letters, digits, '.', '-'; prefix: letters, digits and !_.*'()/=+-)")
        return source

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        data = handler(self)
        if isinstance(data, dict):
            for key in _OMITTED_WHEN_NONE:
                if key in data and data[key] is None:
                    del data[key]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("duplicate file names")
        want_len = _HEX_LEN[self.hash]
        for f in self.files:
            expected = chunk_count(f.size, self.chunk_bytes)
            if len(f.chunks) != expected:
                raise ValueError(f"file {f.name!r}: {len(f.chunks)} chunk digests for "
                                 f"{f.size} bytes, expected {expected}")
            for d in f.chunks:
                if len(d) != want_len or not _is_lower_hex(d):
                    raise ValueError(f"file {f.name!r}: chunk digest {d[:80]!r} is not a "
                                     f"{self.hash} hex digest")
        if self.delta is not None:
            self._consistent_delta(set(names), want_len)
        return self

    def _consistent_delta(self, targets: set[str], want_len: int) -> None:
        delta = self.delta
        if delta.base_version >= self.version:
            raise ValueError(f"delta base version {delta.base_version} is not older than version {self.version}")
        names = [f.name for f in delta.files]
        if len(set(names)) != len(names):
            raise ValueError("duplicate delta file names")
        if clash := targets & set(names):
            raise ValueError(f"delta file names {sorted(clash)[:3]} are also target file names")
        rebuilt = [f.target for f in delta.files]
        if sorted(rebuilt) != sorted(targets):
            raise ValueError("the delta files must rebuild every target file, each once")
        for f in delta.files:
            if len(f.chunks) != chunk_count(f.size, self.chunk_bytes):
                raise ValueError(f"delta file {f.name!r}: {len(f.chunks)} chunk digests for {f.size} bytes")
            if any(len(d) != want_len or not _is_lower_hex(d) for d in f.chunks):
                raise ValueError(f"delta file {f.name!r}: a chunk digest is not a {self.hash} hex digest")

    # -- sealing ---------------------------------------------------------------------------
    def canonical_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json", exclude={"digest", "delta"}))

    def compute_digest(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def sealed(self) -> Manifest:
        """This manifest with its digest filled in (and checked if it was given), and its delta
        section's likewise."""
        actual = self.compute_digest()
        if self.digest is not None and self.digest != actual:
            raise ManifestError(f"manifest digest {self.digest} does not match its "
                                f"contents ({actual})")
        update: dict = {"digest": actual}
        if self.delta is not None:
            update["delta"] = self.delta.sealed()
        return self.model_copy(update=update)

    def target(self) -> Manifest:
        """The full version this manifest describes, without its delta section: same digest."""
        return self if self.delta is None else self.model_copy(update={"delta": None})

    def with_delta(self, delta: Delta | None) -> Manifest:
        """This manifest with ``delta`` as its delta section (sealed; checked against the files)."""
        data = self.model_dump(mode="json")
        data["delta"] = None if delta is None else delta.sealed().model_dump(mode="json")
        return Manifest.model_validate(data).sealed()

    # -- queries -----------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, FileEntry]:  # a peer listener looks a file up at every request
        return {f.name: f for f in self.files}

    def chunk_span(self, entry: FileEntry, index: int) -> tuple[int, int]:
        """Byte range [start, end) of chunk ``index`` of ``entry``."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, entry.size)


class ManifestError(ValueError):
    """A manifest or the bytes it describes do not agree."""


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def _is_lower_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


# -- hashing files -------------------------------------------------------------------------

def hash_chunks(data: memoryview | bytes, chunk_bytes: int, hash_name: str,
                pool: ThreadPoolExecutor | None = None) -> list[str]:
    """Digest of every ``chunk_bytes`` slice of ``data``."""
    view = memoryview(data)
    spans = [view[i:i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
    fn = _HASHERS[hash_name]
    if pool is None or len(spans) < 2:
        return [fn(s) for s in spans]
    return list(pool.map(fn, spans))


def hash_file(path: Path, chunk_bytes: int, hash_name: str,
              pool: ThreadPoolExecutor | None = None) -> FileEntry:
    view, close = map_readonly(path)
    try:
        return FileEntry(name=path.name, size=len(view),
                         chunks=hash_chunks(view, chunk_bytes, hash_name, pool))
    finally:
        close()


def build_manifest(version: int, paths: Iterable[Path], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   hash_name: str = DEFAULT_HASH, metadata: dict[str, str] | None = None,
                   canary: Canary | None = None, partial: bool = False, source: str | None = None) -> Manifest:
    """Hash ``paths`` (in the given order) into a sealed manifest for ``version``."""
    with ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2))) as pool:
        files = [hash_file(Path(p), chunk_bytes, hash_name, pool) for p in paths]
    return Manifest(version=version, hash=hash_name, chunk_bytes=chunk_bytes, files=files,
                    metadata=metadata or {}, canary=canary, partial=partial or None, source=source).sealed()


def bad_chunks(data: memoryview | bytes, entry: FileEntry, manifest: Manifest) -> list[int]:
    """Indices of the chunks of ``data`` whose digest differs from ``entry`` (all, if the size differs)."""
    if len(data) != entry.size:
        return list(range(len(entry.chunks))) or [0]
    got = hash_chunks(data, manifest.chunk_bytes, manifest.hash)
    return [i for i, (a, b) in enumerate(zip(got, entry.chunks, strict=True)) if a != b]


def verify_file(path: Path, entry: FileEntry, manifest: Manifest) -> list[int]:
    """Like :func:`bad_chunks`, for a file on disk."""
    if not path.is_file():
        return list(range(len(entry.chunks))) or [0]
    view, close = map_readonly(path)
    try:
        return bad_chunks(view, entry, manifest)
    finally:
        close()


def safetensors_files(directory: Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory, in name order (shard order)."""
    files = sorted(p for p in Path(directory).iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        raise ManifestError(f"no .safetensors files in {directory}")
    return files


# -- safetensors headers ---------------------------------------------------------------------------

def safetensors_names(read: Callable[[int, int], bytes], size: int) -> list[str] | None:
    """The tensor names in the header of a safetensors file of ``size`` bytes, in header order
    (a name the header gives twice comes twice); None when the bytes are not a safetensors file.
    ``read(offset, length)`` reads the file."""
    header = read_header(read, size)
    if isinstance(header, str):
        return None
    return [k for k, _ in header[0] if k != "__metadata__"]


def duplicate_tensors(headers: Iterable[tuple[str, list[str] | None]]) -> list[str]:
    """One line per tensor name given more than once across the (file name, tensor names) of one
    version, in order: a loader would take one and silently drop the other."""
    first: dict[str, str] = {}
    problems = []
    for file, names in headers:
        for name in names or ():
            if name in first:
                where = f"twice in {file}" if first[name] == file else f"in {first[name]} and {file}"
                problems.append(f"tensor {name[:200]!r} is {where}")
            else:
                first[name] = file
    return problems
