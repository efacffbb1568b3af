"""What the plugin checks in a mirror directory before it touches a single layer.

Standard library only, so it runs in any vLLM environment and is tested without vLLM.
Contract (docs/plugin.md): ``<mirror>/<version>/`` holds ``manifest.json`` and the version's
safetensors files; the daemon passes the directory and the manifest's digest. A directory is
loaded only if its manifest has exactly that digest and lists each file once, every file has
exactly the size the manifest gives, and no tensor name comes twice (in one header or across
files: a loader would silently keep one of them); the puller already checked every chunk's
digest on the way in, and a half-written (hidden ``.partial``) directory is refused by name.

Coverage (exactness, docs/plugin.md): a version must carry every tensor of the checkpoint the
server started from, or say ``"partial": true`` in its manifest. Tied embeddings count as one
tensor under either name: :func:`tie` makes the stream carry both, since vLLM keeps the
output head's own copy and reloads it only when ``lm_head.weight`` itself arrives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .wire import as_dict, manifest_digest, read_header

MANIFEST = "manifest.json"
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
_LAYER_RE = re.compile(r"\.(\d+)\.")


class MirrorError(ValueError):
    """The mirror directory is not the complete version that was asked for."""


# safetensors dtypes and their sizes in bytes
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Tensor:
    """One tensor of a checked file: bytes [start, end) of the file."""

    file: Path
    name: str
    dtype: str = "F32"
    shape: tuple[int, ...] = ()
    start: int = 0
    end: int = 0


@dataclass(frozen=True)
class Version:
    """A checked mirror directory: its files in manifest order, every tensor, and whether the
    manifest declares the version a deliberate subset of the model."""

    files: list[Path]
    tensors: list[Tensor]
    partial: bool


def open_version(path: str | Path, digest: str) -> Version:
    """:func:`check_version`, with the tensors and the manifest's ``partial`` flag."""
    files = check_version(path, digest)
    partial = _read_manifest(Path(path)).get("partial") is True
    return Version(files, [t for p in files for t in tensors(p)], partial)


def check_version(path: str | Path, digest: str) -> list[Path]:
    """The version's files, in manifest order, once the directory is proven to be the complete
    version with manifest ``digest``; otherwise :class:`MirrorError` saying what is wrong."""
    d = Path(path)
    if d.name.startswith("."):
        raise MirrorError(f"{d}: a hidden directory is a pull in progress, never loaded")
    if not d.is_dir():
        raise MirrorError(f"{d}: no such mirror directory")
    manifest = _read_manifest(d)
    actual = manifest_digest(manifest)
    if actual != digest:
        raise MirrorError(f"{d}: manifest digest is {actual}, not the requested {digest}: "
                          "refusing to load a different version")
    files = [_check_file(d, entry) for entry in manifest["files"]]
    if len(set(files)) != len(files):
        twice = sorted({p.name for p in files if files.count(p) > 1})
        raise MirrorError(f"{d / MANIFEST}: lists {', '.join(twice)[:200]} more than once")
    first: dict[str, Path] = {}
    for p in files:  # every header parsed and every tensor proven inside its file, before any is loaded
        for t in tensors(p):
            if t.name in first:
                raise MirrorError(f"{d}: tensor {t.name[:200]!r} is in both {first[t.name].name} and {p.name}: "
                                  "refusing to load one of them over the other")
            first[t.name] = p
    return files


def _read_manifest(d: Path) -> dict:
    try:
        manifest = json.loads((d / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise MirrorError(f"{d}: no {MANIFEST}: not a complete mirror of a version") from None
    except (OSError, ValueError, RecursionError) as e:
        raise MirrorError(f"{d / MANIFEST}: unreadable: {str(e)[:200]}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list) or not manifest["files"]:
        raise MirrorError(f"{d / MANIFEST}: not a manifest (no list of files)")
    return manifest


def _check_file(d: Path, entry: object) -> Path:
    name = entry.get("name") if isinstance(entry, dict) else None
    size = entry.get("size") if isinstance(entry, dict) else None
    if (not isinstance(name, str) or not _FILE_NAME_RE.fullmatch(name) or name == MANIFEST
            or not isinstance(size, int) or isinstance(size, bool)):
        raise MirrorError(f"{d / MANIFEST}: bad file entry {str(entry)[:200]}")
    p = d / name
    try:
        actual = p.stat().st_size
    except FileNotFoundError:
        raise MirrorError(f"{p}: missing (the manifest lists it with {size} bytes)") from None
    if actual != size:
        raise MirrorError(f"{p}: {actual} bytes, the manifest says {size}: "
                          f"{'truncated' if actual < size else 'longer than published'}")
    return p


def tensors(p: Path) -> list[Tensor]:
    """The tensors of a safetensors file in file order, each proven to lie inside the file with
    as many bytes as its dtype and shape need: cheap, and it catches a file that is not
    safetensors before the first layer is cleared."""
    size = p.stat().st_size
    with open(p, "rb") as f:
        def read(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)
        header = read_header(read, size)
    if isinstance(header, str):
        raise MirrorError(f"{p}: {header}")
    pairs, base = header
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        twice = next(name for i, name in enumerate(names) if name in names[:i])
        raise MirrorError(f"{p}: tensor {twice[:200]!r} is twice in the safetensors header")
    out = [_tensor(p, name, as_dict(meta), base, size) for name, meta in pairs if name != "__metadata__"]
    return sorted(out, key=lambda t: t.start)


def _tensor(p: Path, name: str, meta: object, base: int, size: int) -> Tensor:
    meta = meta if isinstance(meta, dict) else {}
    offsets, dtype, shape = meta.get("data_offsets"), meta.get("dtype"), meta.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= size - base):
        raise MirrorError(f"{p}: tensor {name!r} lies outside the file ({offsets})")
    if dtype not in ITEMSIZE or not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise MirrorError(f"{p}: tensor {name!r} has dtype {dtype!r} and shape {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    if numel * ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise MirrorError(f"{p}: tensor {name!r} ({dtype} {shape}) needs {numel * ITEMSIZE[dtype]} bytes, "
                          f"its offsets span {offsets[1] - offsets[0]}")
    return Tensor(p, name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def layer_rank(name: str) -> tuple[int, int]:
    """Embeddings first, then decoder layers by index, then the rest (final norm, head):
    the order layerwise reload wants, so each layer is completed and processed in turn."""
    m = _LAYER_RE.search(name)
    if m:
        return (1, int(m.group(1)))
    return (0, 0) if "embed" in name else (2, 0)


def in_layer_order(tensors: list[Tensor]) -> list[Tensor]:
    """Stable: tensors keep their file order within a layer."""
    return sorted(tensors, key=lambda t: layer_rank(t.name))


# -- coverage and tied embeddings ---------------------------------------------------------------

# Checkpoint tensors no model loads (old exports carry rotary caches): never required.
_NOT_WEIGHTS_RE = re.compile(r"(^|\.)rotary_(pos_)?emb\.(inv_freq|cos_cached|sin_cached)$")


def checkpoint_names(model_dir: str | Path) -> set[str] | None:
    """The tensor names of the safetensors checkpoint in ``model_dir`` (what the server started
    from); None when it is not a local directory of safetensors files (nothing to compare with)."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        return None
    return {t.name for p in files for t in tensors(p) if not _NOT_WEIGHTS_RE.search(t.name)}


def tie(found: list[Tensor], pairs: dict[str, str]) -> list[Tensor]:
    """``found`` plus, for each tied pair ``{alias: canonical}`` of which the version carries one
    name only, the same bytes under the other name: both layers then reload from them."""
    names = {t.name for t in found}
    by_name = {t.name: t for t in found}
    extra = []
    for alias, canonical in pairs.items():
        for have, want in ((canonical, alias), (alias, canonical)):
            if have in names and want not in names:
                extra.append(replace(by_name[have], name=want))
                names.add(want)
    return found + extra


def missing(expected: set[str] | None, carried: set[str], pairs: dict[str, str]) -> list[str]:
    """The tensors of ``expected`` that ``carried`` (after :func:`tie`) lacks, sorted."""
    if expected is None:
        return []
    tied = set(pairs) | set(pairs.values())
    return sorted(n for n in expected - carried if not (n in tied and carried & _pair_of(n, pairs)))


def _pair_of(name: str, pairs: dict[str, str]) -> set[str]:
    return {a for a, c in pairs.items() if name in (a, c)} | {c for a, c in pairs.items() if name in (a, c)}


def describe_missing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown
