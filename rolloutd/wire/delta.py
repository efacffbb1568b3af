"""Delta files: a version's changes against a base version, and the target rebuilt from them.

One delta file rebuilds one target file (docs/deltas.md). Standard library, numpy, zstandard
and xxhash only: the pull worker imports this, and starts without pydantic.

Layout of a delta file::

    MAGIC (8 bytes) | header length (8 bytes, little-endian) | header (JSON) | frames

The header is ``{"encoding", "target_size", "segments": [[kind, start, end, base_file,
base_start, itemsize, frame_bytes], ...]}``. The segments cover the target's bytes
``[0, target_size)`` in order, without gaps; each has one zstd frame, in the same order:

- ``raw``: the target's bytes themselves (a safetensors header, a new tensor, a tensor whose
  dtype or shape changed, a file with no counterpart in the base);
- ``xor``: the target's bytes XOR the base file's bytes at ``base_start``; with the encoding
  ``xor-planes-zstd`` the XOR is split into byte planes (byte 0 of every element, then byte 1,
  ...) before compression, which puts the mostly-zero high bytes of a bf16 change together;
- ``iv`` (``index-value-zstd``): the positions of the elements that changed (gaps, uint32) and
  their new values; applying it twice gives the same bytes;
- ``sx`` (``xor-sparse-zstd``): the positions of the elements that changed (gaps, uint32, in
  byte planes) and the XOR of each with its base element (in byte planes). An RL step changes
  about 1 % of a bf16 policy's elements, mostly by one or two bf16 steps: the positions are
  small numbers and the XORs a few low bits, and neither has to carry the unchanged 99 %. A
  segment where more than a quarter of the elements changed is an ``xor`` segment in byte
  planes instead (smaller there).

A tensor longer than ``SEGMENT_BYTES`` is cut into several segments, so that memory stays
bounded on both sides and segments compress and decompress in parallel (zstandard and numpy
release the interpreter lock over the byte work).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import zstandard

from rolloutd.wire.filemap import map_readonly
from rolloutd.wire.hashes import new_hasher

MAGIC = b"RDELTA1\n"
ENCODINGS = ("xor-sparse-zstd", "xor-planes-zstd", "xor-zstd", "index-value-zstd")
DEFAULT_ENCODING = "xor-sparse-zstd"  # the smallest on real optimizer steps (bench/README.md, bench/delta.py)
SEGMENT_BYTES = 8 << 20        # one frame's worth of target bytes at most
MAX_HEADER_BYTES = 64 << 20    # a delta header larger than this is not one rolloutd wrote
_WINDOW = 8                    # segments in flight at once per file (bounds memory)
_PIECE_BYTES = 1 << 20         # hashed then written while in cache (256 KiB or 8 MiB cost more: bench/README.md)
_DENSE_SHARE = 4               # xor-sparse-zstd: a segment with more than 1/4 of its elements changed goes dense
_UINT = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_KINDS = ("raw", "xor", "iv", "sx")
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class DeltaError(ValueError):
    """A delta file that cannot be applied: bytes that do not decode, or a base that lacks what
    the delta points at."""


class TargetMismatch(DeltaError):
    """The rebuilt bytes of a target chunk differ from the manifest's digest."""

    def __init__(self, message: str, chunk: int):
        super().__init__(message)
        self.chunk = chunk


@dataclass
class EncodeStats:
    target_bytes: int = 0
    delta_bytes: int = 0
    tensors_changed: int = 0   # tensors encoded against the base with at least one changed byte
    tensors_whole: int = 0     # tensors (or files) that travel whole
    seconds: float = 0.0


@dataclass(frozen=True)
class _Segment:
    kind: str               # raw | xor | iv | sx
    start: int
    end: int
    base_file: str | None = None
    base_start: int = 0
    itemsize: int = 1
    group: int = -1         # which tensor it is a piece of (encoder's bookkeeping, not written)


# -- safetensors layout -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    start: int   # absolute offsets in the file
    end: int


def _layout(data: memoryview) -> tuple[int, dict[str, _Tensor]] | None:
    """(end of the header, tensors by name) of a safetensors file; None for any other bytes."""
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    if not 2 <= n <= min(MAX_HEADER_BYTES, len(data) - 8):
        return None
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    base, tensors = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            tensor = _Tensor(str(info["dtype"]), tuple(int(x) for x in info["shape"]), base + begin, base + end)
        except (KeyError, TypeError, ValueError):
            return None
        if not base <= tensor.start <= tensor.end <= len(data):
            return None
        tensors[name] = tensor
    return base, tensors


def _plan(bases: Mapping[str, memoryview], target_name_hint: str | None, target: memoryview,
          encoding: str, stats: EncodeStats) -> list[_Segment]:
    """The segments of one target file: each tensor against the base tensor of the same name,
    dtype and shape wherever it is; the rest whole."""
    kind = {"index-value-zstd": "iv", "xor-sparse-zstd": "sx"}.get(encoding, "xor")
    layout = _layout(target)
    if layout is None:  # not safetensors: against the base file of the same name and size
        base = bases.get(target_name_hint) if target_name_hint else None
        if base is not None and len(base) == len(target):
            return list(_cut(_Segment(kind, 0, len(target), target_name_hint, 0, 1, group=0)))
        stats.tensors_whole += 1
        return list(_cut(_Segment("raw", 0, len(target))))
    header_end, tensors = layout
    in_base: dict[str, tuple[str, _Tensor]] = {}
    for fname, data in bases.items():
        if (base_layout := _layout(data)) is not None:
            for name, t in base_layout[1].items():
                in_base.setdefault(name, (fname, t))
    segments: list[_Segment] = []
    pos = 0

    def raw_to(end: int) -> None:
        nonlocal pos
        if end > pos:
            segments.extend(_cut(_Segment("raw", pos, end)))
            pos = end

    raw_to(header_end)
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].start):
        if t.start < pos:
            return list(_cut(_Segment("raw", 0, len(target))))  # overlapping tensors: send it whole
        raw_to(t.start)
        found = in_base.get(name)
        if found is not None and found[1].dtype == t.dtype and found[1].shape == t.shape:
            fname, bt = found
            segments.extend(_cut(_Segment(kind, t.start, t.end, fname, bt.start, _DTYPE_BYTES.get(t.dtype, 1),
                                          group=len(segments))))
        else:
            stats.tensors_whole += 1
            segments.extend(_cut(_Segment("raw", t.start, t.end)))
        pos = t.end
    raw_to(len(target))
    return segments


def _cut(seg: _Segment) -> Iterator[_Segment]:
    """``seg`` in pieces of at most SEGMENT_BYTES, each a whole number of elements."""
    step = max(seg.itemsize, SEGMENT_BYTES - SEGMENT_BYTES % seg.itemsize)
    for s in range(seg.start, seg.end, step):
        e = min(seg.end, s + step)
        yield _Segment(seg.kind, s, e, seg.base_file, seg.base_start + (s - seg.start), seg.itemsize, seg.group)


# -- encoding -----------------------------------------------------------------------------------

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    key = f"c{level}"
    c = getattr(_local, key, None)
    if c is None:  # one per thread: a compressor is not safe to share between threads
        c = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
        setattr(_local, key, c)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _u8(data) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _planes(x: np.ndarray, itemsize: int) -> np.ndarray:
    return x if itemsize == 1 else np.ascontiguousarray(x.reshape(-1, itemsize).T)


def _xor_planes(base: np.ndarray, planes: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    """``out`` = ``base`` XOR the XOR whose byte planes are ``planes``: one strided pass per
    plane, no interleaved copy of the planes first."""
    n = len(base) // itemsize
    for k in range(itemsize):
        np.bitwise_xor(base[k::itemsize], planes[k * n:(k + 1) * n], out=out[k::itemsize])


def _elements(x: np.ndarray, size: int) -> np.ndarray:
    """The bytes ``x`` as one unsigned integer per element where numpy has one of that size (one
    comparison per element instead of one per byte), else one row of bytes per element."""
    dt = _UINT.get(size)
    return x.view(dt) if dt is not None else x.reshape(-1, size)


def _nonzero(elements: np.ndarray) -> np.ndarray:
    """Indices of the elements with any byte set."""
    # a boolean array first: numpy's nonzero over uint16 is far slower than over bools (bench/README.md,
    # "Delta versions")
    return np.flatnonzero(elements != 0 if elements.ndim == 1 else elements.any(axis=1))


def _encode_segment(seg: _Segment, bases: Mapping[str, memoryview], target: memoryview, encoding: str,
                    level: int) -> tuple[str, bytes, bool]:
    """(the segment's kind as written, its frame, whether any byte differs from the base)."""
    tgt = _u8(target[seg.start:seg.end])
    if seg.kind == "raw":
        return "raw", _compressor(level).compress(tgt.data), True
    base = _u8(bases[seg.base_file][seg.base_start:seg.base_start + (seg.end - seg.start)])
    size = seg.itemsize
    if seg.kind == "iv":  # the elements whose bytes differ, as gaps between their indices, and their values
        differ = _nonzero(_elements(base, size) != _elements(tgt, size))
        gaps = np.diff(differ, prepend=-1).astype("<u4")
        values = tgt.reshape(-1, size)[differ]
        payload = len(differ).to_bytes(8, "little") + gaps.tobytes() + values.tobytes()
        return "iv", _compressor(level).compress(payload), len(differ) > 0
    x = np.bitwise_xor(base, tgt, out=_scratch(len(tgt)))  # only used within this call
    if seg.kind == "sx":
        xe = _elements(x, size)
        differ = _nonzero(xe)
        if len(differ) * _DENSE_SHARE <= len(xe):
            gaps = np.diff(differ, prepend=-1).astype("<u4")
            payload = b"".join((len(differ).to_bytes(8, "little"), _planes(_u8(gaps), 4).tobytes(),
                                _planes(_u8(np.ascontiguousarray(xe[differ])), size).tobytes()))
            return "sx", _compressor(level).compress(payload), len(differ) > 0
        changed = True
    else:
        changed = bool(x.any())
    if encoding == "xor-zstd" or size == 1:
        payload = x
    else:  # in byte planes, into this thread's other buffer
        payload = _scratch(len(x), "b")
        np.copyto(payload.reshape(size, -1), x.reshape(-1, size).T)
    return "xor", _compressor(level).compress(payload.data), changed


def encode_file(bases: Mapping[str, object], target: object, out: BinaryIO, *,
                encoding: str = DEFAULT_ENCODING, level: int = 1, pool: Executor | None = None,
                target_name: str | None = None) -> EncodeStats:
    """Write the delta file that rebuilds ``target`` from ``bases`` (the base version's files
    by name) to ``out``. ``target_name``: the target file's name, for a file that is not
    safetensors (then encoded against the base file of that name, if it has the same size)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}; one of {', '.join(ENCODINGS)}")
    began = time.perf_counter()
    views = {name: memoryview(data).cast("B") for name, data in bases.items()}
    tview = memoryview(target).cast("B")
    stats = EncodeStats(target_bytes=len(tview))
    segments = _plan(views, target_name, tview, encoding, stats)

    def work(seg: _Segment) -> tuple[str, bytes, bool]:
        return _encode_segment(seg, views, tview, encoding, level)

    results = list(pool.map(work, segments) if pool is not None else map(work, segments))
    stats.tensors_changed = len({seg.group for seg, (_, _, changed) in zip(segments, results, strict=True)
                                 if seg.kind != "raw" and changed})
    header = json.dumps({"encoding": encoding, "target_size": len(tview),
                         "segments": [[k, s.start, s.end, s.base_file, s.base_start, s.itemsize, len(f)]
                                      for s, (k, f, _) in zip(segments, results, strict=True)]},
                        separators=(",", ":")).encode()
    frames = [frame for _, frame, _ in results]
    out.write(b"".join((MAGIC, len(header).to_bytes(8, "little"), header, *frames)))  # one write: small
    stats.delta_bytes = len(MAGIC) + 8 + len(header) + sum(map(len, frames))
    stats.seconds = time.perf_counter() - began
    return stats


def removed_tensors(bases: Mapping[str, object], targets: Mapping[str, object]) -> list[str]:
    """Tensor names of the base's safetensors files that no target file has, sorted."""
    def names(files: Mapping[str, object]) -> set[str]:
        out: set[str] = set()
        for data in files.values():
            if (layout := _layout(memoryview(data).cast("B"))) is not None:
                out.update(layout[1])
        return out
    return sorted(names(bases) - names(targets))


def delta_file_name(target_name: str, taken: set[str]) -> str:
    """A name for the delta file of ``target_name`` that is a valid file name not in ``taken``."""
    name = f"{target_name}.delta"
    if len(name) <= 200 and name not in taken:
        return name
    i = 0
    while (name := f"delta-{i:05d}.delta") in taken:
        i += 1
    return name


# -- applying ------------------------------------------------------------------------------------

def _header(delta: memoryview, what: str) -> tuple[str, int, list[_Segment], list[int], int]:
    """(encoding, target size, segments, frame lengths, offset of the first frame)."""
    if len(delta) < 16 or bytes(delta[:8]) != MAGIC:
        raise DeltaError(f"{what}: not a rolloutd delta file")
    n = int.from_bytes(delta[8:16], "little")
    if not 2 <= n <= min(MAX_HEADER_BYTES, len(delta) - 16):
        raise DeltaError(f"{what}: header length {n} is out of bounds")
    try:
        h = json.loads(bytes(delta[16:16 + n]))
        encoding, size = h["encoding"], int(h["target_size"])
        segments, frames = [], []
        for kind, start, end, base_file, base_start, itemsize, frame in h["segments"]:
            segments.append(_Segment(str(kind), int(start), int(end), base_file, int(base_start), int(itemsize)))
            frames.append(int(frame))
    except (ValueError, KeyError, TypeError) as e:
        raise DeltaError(f"{what}: header is not valid ({e})") from None
    if encoding not in ENCODINGS:
        raise DeltaError(f"{what}: unknown encoding {encoding!r}")
    pos = 0
    for i, s in enumerate(segments):
        if (s.start != pos or s.end < s.start or s.end - s.start > SEGMENT_BYTES or s.kind not in _KINDS
                or s.itemsize < 1 or (s.end - s.start) % s.itemsize or frames[i] < 0):
            raise DeltaError(f"{what}: segment {i} is not valid")
        pos = s.end
    if pos != size:
        raise DeltaError(f"{what}: segments cover {pos} bytes of {size}")
    if 16 + n + sum(frames) != len(delta):
        raise DeltaError(f"{what}: {len(delta)} bytes, the header accounts for {16 + n + sum(frames)}")
    return encoding, size, segments, frames, 16 + n


def _scratch(length: int, which: str = "a") -> np.ndarray:
    """A buffer of this thread's (two: ``which`` is "a" or "b"), reused from segment to segment:
    fresh memory costs a page fault per page, more than the copy into it."""
    buf = getattr(_local, which, None)
    if buf is None or len(buf) < length:
        buf = np.empty(max(length, SEGMENT_BYTES), dtype=np.uint8)
        setattr(_local, which, buf)
    return buf[:length]


def _decompress_into(frame: memoryview, out: np.ndarray, what: str, index: int) -> None:
    """Decompress ``frame`` straight into ``out``, which it must fill exactly (its checksum is
    checked at its end)."""
    try:
        reader = _decompressor().stream_reader(frame)
        view, n = memoryview(out), 0
        while n < len(out) and (got := reader.readinto(view[n:])):
            n += got
        extra = reader.readinto(bytearray(1)) if n == len(out) else 0
    except zstandard.ZstdError as e:
        raise DeltaError(f"{what}: segment {index} does not decompress ({e})") from None
    if n != len(out) or extra:
        raise DeltaError(f"{what}: segment {index} has {'more than ' if extra else ''}{n} bytes, not {len(out)}")


def _decode_into(seg: _Segment, frame: memoryview, bases: Mapping[str, memoryview], encoding: str,
                 what: str, index: int, out: np.ndarray) -> None:
    """The segment's target bytes, into ``out``."""
    length = seg.end - seg.start
    if seg.kind == "raw":
        _decompress_into(frame, out, what, index)
        return
    base_data = bases.get(seg.base_file) if isinstance(seg.base_file, str) else None
    if base_data is None or not 0 <= seg.base_start <= seg.base_start + length <= len(base_data):
        raise DeltaError(f"{what}: segment {index} refers to bytes the base lacks "
                         f"({seg.base_file!r} at {seg.base_start})")
    base = _u8(base_data[seg.base_start:seg.base_start + length])
    if seg.kind == "xor":
        if encoding == "xor-zstd" or seg.itemsize == 1:
            _decompress_into(frame, out, what, index)
            np.bitwise_xor(base, out, out=out)
        else:
            planes = _scratch(length)
            _decompress_into(frame, planes, what, index)
            _xor_planes(base, planes, seg.itemsize, out)
        return
    try:  # an index list: small, at most 8 + (4 + itemsize) bytes per element
        payload = _decompressor().decompress(frame, max_output_size=max(length, 1) + 8 + 4 * length)
    except zstandard.ZstdError as e:
        raise DeltaError(f"{what}: segment {index} does not decompress ({e})") from None
    where, at = _positions(payload, length // seg.itemsize, seg.itemsize, seg.kind == "sx", what, index)
    np.copyto(out, base)
    changed = _elements(out, seg.itemsize)
    values = _elements(_unplanes(_u8(payload)[at:], seg.itemsize) if seg.kind == "sx" else _u8(payload)[at:],
                       seg.itemsize)
    if seg.kind == "sx":
        changed[where] ^= values
    else:
        changed[where] = values


def _positions(payload: bytes, elements: int, size: int, gap_planes: bool, what: str,
               index: int) -> tuple[np.ndarray, int]:
    """(indices of the changed elements, offset of their values) of an index list: a count, then
    the gaps between consecutive indices (the first from -1), checked to stay inside the tensor."""
    count = int.from_bytes(payload[:8], "little") if len(payload) >= 8 else -1
    if not 0 <= count <= elements or len(payload) != 8 + count * (4 + size):
        raise DeltaError(f"{what}: segment {index} is not a valid index list")
    raw = _u8(payload)[8:8 + 4 * count]
    gaps = (_unplanes(raw, 4) if gap_planes else raw).view("<u4").astype(np.int64)
    where = np.cumsum(gaps) - 1
    if count and (gaps[0] < 1 or where[-1] >= elements or (gaps[1:] < 1).any()):
        raise DeltaError(f"{what}: segment {index} points outside its tensor")
    return where, 8 + 4 * count


def _unplanes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes whose byte planes are ``planes``, interleaved back."""
    if itemsize == 1:
        return planes
    rows = planes.reshape(itemsize, -1)
    dt = _UINT.get(itemsize)
    if dt is None:
        return np.ascontiguousarray(rows.T).reshape(-1)
    # as integers, plane k shifted into byte k: numpy's byte-wise transpose costs 2-3x more
    # (bench/README.md, "A delta version")
    out = rows[0].astype(dt)
    for k in range(1, itemsize):
        plane = rows[k].astype(dt)
        plane <<= 8 * k
        out |= plane
    return out.view(np.uint8)




class _ChunkHasher:
    """Digests of consecutive ``chunk_bytes`` pieces of a stream, checked as they complete."""

    def __init__(self, hash_name: str, chunk_bytes: int, digests: list[str], what: str):
        self.hash_name, self.chunk_bytes, self.digests, self.what = hash_name, chunk_bytes, digests, what
        self.index, self.filled, self.h = 0, 0, new_hasher(hash_name)

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_bytes - self.filled)
            self.h.update(data[:take])
            self.filled += take
            data = data[take:]
            if self.filled == self.chunk_bytes:
                self._check()

    def _check(self) -> None:
        got = self.h.hexdigest()
        want = self.digests[self.index] if self.index < len(self.digests) else None
        if got != want:
            raise TargetMismatch(f"{self.what}: rebuilt chunk {self.index} has digest {got[:16]}..., the "
                                 f"manifest says {str(want)[:16]}...", self.index)
        self.index, self.filled, self.h = self.index + 1, 0, new_hasher(self.hash_name)

    def finish(self) -> None:
        if self.filled:
            self._check()
        if self.index != len(self.digests):
            raise TargetMismatch(f"{self.what}: rebuilt {self.index} chunks, the manifest lists "
                                 f"{len(self.digests)}", self.index)


def apply_and_verify(base_files: Mapping[str, Path], delta_path: Path, target_path: Path, *,
                     hash_name: str, chunk_bytes: int, digests: list[str],
                     progress: Callable[[int], None] | None = None, pool: Executor | None = None) -> None:
    """Write the target rebuilt from ``base_files`` (read only) and the delta file into
    ``target_path`` (an existing file, truncated or extended to the target's size), checking
    each chunk against ``digests`` as it is written: :class:`TargetMismatch` names the first
    that differs, :class:`DeltaError` a delta that cannot be applied."""
    what = f"{Path(target_path).name} from {Path(delta_path).name}"
    closers: list[Callable[[], None]] = []
    try:
        delta, close = map_readonly(Path(delta_path))
        closers.append(close)
        encoding, size, segments, frames, offset = _header(delta, what)
        bases: dict[str, memoryview] = {}
        for name in {s.base_file for s in segments if s.kind != "raw"}:
            if not isinstance(name, str) or name not in base_files:
                raise DeltaError(f"{what}: the base has no file {name!r}")
            bases[name], close = map_readonly(Path(base_files[name]))
            closers.append(close)
        starts = np.cumsum([offset, *frames]).tolist()
        hasher = _ChunkHasher(hash_name, chunk_bytes, digests, what)
        free: list[np.ndarray] = []  # segment buffers the hasher is done with, reused
        lock = threading.Lock()

        def rebuild(i: int) -> np.ndarray:
            """Segment i decoded (in a pool thread); the buffer goes to the hasher and writer,
            which hands it back."""
            seg = segments[i]
            with lock:
                buf = free.pop() if free else None
            if buf is None or len(buf) < seg.end - seg.start:
                buf = np.empty(max(SEGMENT_BYTES, seg.end - seg.start), dtype=np.uint8)
            out = buf[:seg.end - seg.start]
            _decode_into(seg, delta[starts[i]:starts[i + 1]], bases, encoding, what, i, out)
            return out

        if -(-size // chunk_bytes) != len(digests):  # before the file takes the header's word for its size
            raise TargetMismatch(f"{what}: the delta rebuilds {size} bytes, {-(-size // chunk_bytes)} chunks; "
                                 f"the manifest lists {len(digests)}", 0)
        fd = os.open(target_path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            with contextlib.closing(_ordered(rebuild, len(segments), pool)) as rebuilt:
                for i, out in enumerate(rebuilt):  # in order: the chunk digests are of the file's bytes in order
                    _hash_and_write(hasher, fd, memoryview(out), segments[i].start)
                    with lock:
                        free.append(out.base if out.base is not None else out)
                    if progress is not None:
                        progress(len(out))
        finally:
            os.close(fd)
        hasher.finish()
    finally:
        for close in reversed(closers):
            close()


def _hash_and_write(hasher: _ChunkHasher, fd: int, data: memoryview, offset: int) -> None:
    """``data`` hashed and written at ``offset``, a piece at a time: the write copies each piece
    while the hash has just brought it into cache. From this one thread: pool threads writing
    the same file at once spin on its inode lock in the kernel, and cost 0.4-1 s of CPU more
    per 2 GiB (bench/README.md, "A delta version")."""
    for p in range(0, len(data), _PIECE_BYTES):
        piece = data[p:p + _PIECE_BYTES]
        hasher.update(piece)
        done = 0
        while done < len(piece):  # a regular file takes it all at once, unless it is full
            done += os.pwrite(fd, piece[done:], offset + p + done)


def _ordered(fn: Callable[[int], np.ndarray], n: int, pool: Executor | None) -> Iterator[np.ndarray]:
    """``fn(0) .. fn(n-1)`` in order, at most ``_WINDOW`` computed ahead on ``pool``."""
    if pool is None:
        yield from (fn(i) for i in range(n))
        return
    pending = [pool.submit(fn, i) for i in range(min(n, _WINDOW))]
    nxt = len(pending)
    try:
        while pending:
            result = pending.pop(0).result()
            if nxt < n:
                pending.append(pool.submit(fn, nxt))
                nxt += 1
            yield result
    finally:  # on an error: nothing of this rebuild may still run once the caller closes its files
        for f in pending:
            f.cancel()
        wait(pending)
