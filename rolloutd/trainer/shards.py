"""A state dict as safetensors shards, written where they go in one copy, hashed as they land.

Contract:

- :func:`plan_shards` lays a state dict out (torch tensors of any dtype, strides or device, or
  numpy arrays; tied tensors written once; a model gives its checkpoint layout) as shards of at
  most ``shard_bytes``, tensors in layer order: each shard's safetensors header and where every
  tensor's bytes go. Nothing is copied yet, and a tensor safetensors cannot hold fails here,
  before any work.
- :func:`write_shard` copies each tensor straight into a caller's buffer (a registry's staged
  file, mapped; an anonymous mapping) at its place: one copy per byte (for a tensor on an
  accelerator, the device-to-host copy itself), done by torch or numpy without holding the
  interpreter lock, in blocks, each hashed into its manifest chunk while still in cache.
  Progress goes to ``on_bytes``; ``cancelled`` is checked between blocks.
- :func:`serialize_shards` and :func:`save_shards` give the same bytes as ``bytes`` or files.

The files are safetensors as the library writes them (header padded with spaces to 8 bytes;
``__metadata__`` ``{"format": "pt"}`` for torch tensors), with tensors ordered by item size,
then layer: every tensor starts at a multiple of its item size.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutd.wire.manifest import DEFAULT_HASH, chunk_count, new_hasher

DEFAULT_SHARD_BYTES = 5 << 30  # Hugging Face's usual shard size
BLOCK_BYTES = 8 << 20          # copied, then hashed while in cache; the unit of progress and cancel

_LAYER_RE = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")

# safetensors dtype names, by torch dtype name and by numpy dtype str
_TORCH_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                 "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                 "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32",
                 "uint64": "U64"}
_NUMPY_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                 "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16", "uint32": "U32",
                 "uint64": "U64"}


class Cancelled(Exception):
    """A publish was cancelled while its shards were written."""


# -- which tensors, in which order ------------------------------------------------------------------

def layer_key(name: str) -> tuple[int, int, str]:
    """Sort key that puts embeddings first, then layers by index, then everything else."""
    m = _LAYER_RE.search(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0, 0, name) if "embed" in name else (2, 0, name)


def shard_plan(sizes: Mapping[str, int], shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in layer order, into shards of at most ``shard_bytes`` (a bigger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes, key=layer_key):
        if shards[-1] and used + sizes[name] > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if hasattr(t, "element_size") else t.nbytes


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _alias_key(t: Any) -> tuple | None:
    """What makes two torch tensors one tensor under two names (tied embeddings)."""
    if not _is_torch(t) or t.device.type == "meta":
        return None
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def drop_aliases(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each tensor once: a model with tied embeddings lists one tensor as
    ``model.embed_tokens.weight`` and ``lm_head.weight``; the name first in layer order stays,
    as in Hugging Face's own checkpoints (the plugin loads it under both names)."""
    first: dict[tuple, str] = {}
    out = {}
    for name in sorted(state_dict, key=layer_key):
        key = _alias_key(state_dict[name])
        if key is not None and key in first:
            continue
        if key is not None:
            first[key] = name
        out[name] = state_dict[name]
    return out


def checkpoint_tensors(source: Any) -> Mapping[str, Any]:
    """The tensors to publish, by checkpoint name. A mapping is taken as it is. A model (anything
    with ``state_dict()``) gives its state dict in the layout its checkpoints have: transformers
    >= 5 keeps some weights fused in memory (a mixture-of-experts layer's experts as one
    tensor, ``mlp.experts.gate_up_proj``) that ``save_pretrained`` splits back into the
    per-expert tensors that checkpoints, and vLLM's loaders, know."""
    if isinstance(source, Mapping):
        return source
    state_dict = dict(source.state_dict())
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # not a transformers model, or a transformers without in-memory layouts
        return state_dict
    return revert_weight_conversion(source, state_dict)


# -- layout -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    name: str
    tensor: Any
    start: int  # absolute offsets in the file
    end: int


@dataclass(frozen=True)
class Shard:
    """One safetensors file: its name, its header (length prefix included) and where each
    tensor's bytes go."""

    name: str
    header: bytes
    tensors: tuple[Placed, ...]

    @property
    def size(self) -> int:
        return self.tensors[-1].end if self.tensors else len(self.header)


def _dtype(name: str, t: Any) -> tuple[str, int]:
    """(safetensors dtype, item size); ValueError for what safetensors cannot hold."""
    if _is_torch(t):
        if t.device.type == "meta":
            raise ValueError(f"tensor {name} is on the meta device: it has no values to publish")
        code = _TORCH_DTYPES.get(str(t.dtype).removeprefix("torch."))
        size = t.element_size()
    else:
        code = _NUMPY_DTYPES.get(str(getattr(t, "dtype", type(t).__name__)))
        size = getattr(t, "itemsize", 0)
    if code is None:
        raise ValueError(f"tensor {name} has dtype {getattr(t, 'dtype', type(t).__name__)}, which safetensors "
                         "cannot hold")
    return code, size


def _layout(name: str, tensors: dict[str, Any]) -> Shard:
    torch_format = any(_is_torch(t) for t in tensors.values())
    kinds = {n: _dtype(n, t) for n, t in tensors.items()}
    # Larger items first: every tensor then starts at a multiple of its item size.
    order = sorted(tensors, key=lambda n: (-kinds[n][1], layer_key(n)))
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}} if torch_format else {}
    offset = 0
    for n in order:
        size = nbytes(tensors[n])
        entries[n] = {"dtype": kinds[n][0], "shape": list(tensors[n].shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = struct.pack("<Q", len(text)) + text
    placed, at = [], len(header)
    for n in order:
        size = nbytes(tensors[n])
        placed.append(Placed(n, tensors[n], at, at + size))
        at += size
    return Shard(name, header, tuple(placed))


def plan_shards(state_dict: Mapping[str, Any] | Any, shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Shard]:
    """The shards of a state dict (or a model: :func:`checkpoint_tensors`), tied tensors once."""
    state_dict = drop_aliases(checkpoint_tensors(state_dict))
    if not state_dict:
        raise ValueError("state_dict is empty")
    plan = shard_plan({k: nbytes(v) for k, v in state_dict.items()}, shard_bytes)
    return [_layout(fname, {n: state_dict[n] for n in names})
            for fname, names in zip(shard_names(len(plan)), plan, strict=True)]


# -- writing --------------------------------------------------------------------------------------------

class ChunkHasher:
    """The manifest's per-chunk digests of bytes fed in file order."""

    def __init__(self, chunk_bytes: int, hash_name: str, total: int):
        self._new = lambda: new_hasher(hash_name)
        self.chunk_bytes, self.expected = chunk_bytes, chunk_count(total, chunk_bytes)
        self.digests: list[str] = []
        self._h, self._in_chunk = self._new(), 0

    def feed(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), self.chunk_bytes - self._in_chunk)
            self._h.update(view[:take])  # releases the interpreter lock for large pieces
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self.chunk_bytes:
                self.digests.append(self._h.hexdigest())
                self._h, self._in_chunk = self._new(), 0

    def finish(self) -> list[str]:
        if self._in_chunk:
            self.digests.append(self._h.hexdigest())
            self._h, self._in_chunk = self._new(), 0
        if len(self.digests) != self.expected:
            raise AssertionError(f"{len(self.digests)} chunk digests for {self.expected} chunks")
        return self.digests


def write_shard(shard: Shard, dest: memoryview, chunk_bytes: int, hash_name: str = DEFAULT_HASH, *,
                on_bytes: Callable[[int], None] | None = None,
                cancelled: Callable[[], bool] | None = None) -> list[str]:
    """Write ``shard`` into ``dest`` (exactly ``shard.size`` bytes, writable) and return its
    chunk digests. Raises :class:`Cancelled` when ``cancelled()`` turns true."""
    if len(dest) != shard.size:
        raise ValueError(f"{shard.name}: {len(dest)} bytes to write {shard.size} into")
    hasher = ChunkHasher(chunk_bytes, hash_name, shard.size)
    dest[:len(shard.header)] = shard.header
    hasher.feed(dest[:len(shard.header)])
    for p in shard.tensors:
        for start, end in _copy_blocks(p.tensor, dest[p.start:p.end]):
            if cancelled is not None and cancelled():
                raise Cancelled(f"cancelled while writing {shard.name}")
            hasher.feed(dest[p.start + start:p.start + end])
            if on_bytes is not None:
                on_bytes(end - start)
    return hasher.finish()


def _copy_blocks(t: Any, dest: memoryview) -> Iterator[tuple[int, int]]:
    """Copy tensor ``t`` into ``dest`` in blocks; yields each block's [start, end) once copied."""
    if not len(dest):
        return
    if _is_torch(t):
        yield from _copy_torch(t, dest)
    else:
        yield from _copy_numpy(t, dest)


def _copy_torch(t: Any, dest: memoryview) -> Iterator[tuple[int, int]]:
    import torch
    t = t.detach()
    out = torch.frombuffer(dest, dtype=torch.uint8)
    if t.is_contiguous():  # blockwise: each block hashed while it is still in cache
        src = t.reshape(-1).view(torch.uint8)
        for start in range(0, len(dest), BLOCK_BYTES):
            end = min(len(dest), start + BLOCK_BYTES)
            out[start:end].copy_(src[start:end])  # from any device: the device-to-host copy is this one
            yield start, end
    else:  # strided: one copy that gathers it into place
        out.view(t.dtype).view(t.shape).copy_(t)
        yield 0, len(dest)


def _copy_numpy(a: Any, dest: memoryview) -> Iterator[tuple[int, int]]:
    import numpy as np
    out = np.frombuffer(dest, dtype=np.uint8)
    if a.flags.c_contiguous:
        src = a.reshape(-1).view(np.uint8)
        for start in range(0, len(dest), BLOCK_BYTES):
            end = min(len(dest), start + BLOCK_BYTES)
            out[start:end] = src[start:end]
            yield start, end
    else:
        out.view(a.dtype).reshape(a.shape)[...] = a
        yield 0, len(dest)


def read_shard(shard: Shard) -> Iterator[memoryview]:
    """The bytes of ``shard`` in file order, as views each valid until the next is asked for.
    A tensor in host memory, contiguous, is given as its own memory (no copy: the socket's is
    the one copy); any other (on an accelerator, strided) is copied through one block of
    ``BLOCK_BYTES`` (for a tensor on an accelerator, the device-to-host copy)."""
    yield memoryview(shard.header)
    scratch: memoryview | None = None
    for p in shard.tensors:
        if (own := _host_bytes(p.tensor)) is not None:
            for start in range(0, len(own), BLOCK_BYTES):
                yield own[start:start + BLOCK_BYTES]
            continue
        if scratch is None:
            scratch = memoryview(bytearray(BLOCK_BYTES))
        src = _contiguous(p.tensor)
        for start in range(0, p.end - p.start, BLOCK_BYTES):
            n = min(BLOCK_BYTES, p.end - p.start - start)
            for _ in _copy_blocks(src[start:start + n], scratch[:n]):
                pass
            yield scratch[:n]


def hash_shard(shard: Shard, chunk_bytes: int, hash_name: str = DEFAULT_HASH) -> list[str]:
    """The chunk digests of ``shard`` as :func:`write_shard` gives them, without writing it."""
    hasher = ChunkHasher(chunk_bytes, hash_name, shard.size)
    for piece in read_shard(shard):
        hasher.feed(piece)
    return hasher.finish()


def _host_bytes(t: Any) -> memoryview | None:
    """A contiguous host tensor's own bytes, or None when it has to be copied to be read."""
    if _is_torch(t):
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        import torch
        return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    if getattr(t, "flags", None) is not None and t.flags.c_contiguous:
        return memoryview(t.reshape(-1).view("uint8"))
    return None


def _contiguous(t: Any) -> Any:
    """``t`` flattened to bytes, contiguous where it is (on its own device: no host copy yet)."""
    if _is_torch(t):
        import torch
        return t.detach().contiguous().reshape(-1).view(torch.uint8)
    import numpy as np
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


# -- as bytes or files -----------------------------------------------------------------------------------

def serialize_shards(state_dict: Mapping[str, Any] | Any, shard_bytes: int = DEFAULT_SHARD_BYTES
                     ) -> Iterator[tuple[str, bytes]]:
    """(file name, safetensors bytes) per shard."""
    for shard in plan_shards(state_dict, shard_bytes):
        buf = bytearray(shard.size)
        write_shard(shard, memoryview(buf), max(shard.size, 1))
        yield shard.name, bytes(buf)


def save_shards(state_dict: Mapping[str, Any], directory: Path,
                shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write the shards as files of ``directory``, each tensor copied once, into the mapped file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in plan_shards(state_dict, shard_bytes):
        path = directory / shard.name
        with MappedFile(path, shard.size) as dest:
            write_shard(shard, dest, max(shard.size, 1))
        paths.append(path)
    return paths


class MappedFile:
    """A new file of ``size`` bytes mapped for writing: ``with MappedFile(p, n) as view``. The
    view is released and the mapping closed on the way out (``sync``: fsync the file first)."""

    def __init__(self, path: Path, size: int, *, sync: bool = False):
        self.path, self.size, self.sync = Path(path), size, sync

    def __enter__(self) -> memoryview:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(self._fd, self.size)
            self._map = mmap.mmap(self._fd, self.size) if self.size else None
        except BaseException:
            os.close(self._fd)
            raise
        self._view = memoryview(self._map) if self._map is not None else memoryview(bytearray())
        return self._view

    def __exit__(self, *exc) -> None:
        self._view.release()
        try:
            if self._map is not None:
                self._map.close()
            if self.sync and exc[0] is None:
                os.fsync(self._fd)  # the mapped pages are the page cache's: fsync writes them
        finally:
            os.close(self._fd)
