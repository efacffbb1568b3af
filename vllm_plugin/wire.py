"""The part of rolloutd's wire contract both sides read, written once: the manifest digest and
the safetensors header. The daemon's and the registry's manifests (``rolloutd.wire.manifest``)
and the plugin inside vLLM import it from here; standard library only, since the plugin runs in
vLLM's environment, where rolloutd may not be installed.

- A manifest's digest is sha256 over its canonical JSON: keys sorted, no spaces, ASCII, without
  the ``digest`` field itself (docs/registry-api.md).
- A safetensors file is an 8-byte little-endian header length, a JSON object header of
  ``name -> {dtype, shape, data_offsets}`` (plus ``__metadata__``), then the data.
- A refusal that left the server untouched starts its error with a tag: vLLM hands a worker's
  error to the HTTP caller as text only, so the tag is the one typed thing that crosses; the
  daemon's client reads it into a field, once. :data:`RELOAD_UNSUPPORTED`: this server cannot
  load versions in place (any version will be refused). :data:`VERSION_REFUSED`: this version
  cannot be loaded (it lacks tensors of the served model), and nothing of it was loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

MAX_HEADER_BYTES = 100 << 20  # the largest safetensors header read (safetensors' own limit)
RELOAD_UNSUPPORTED = "[rolloutd: reload unsupported]"
VERSION_REFUSED = "[rolloutd: version refused]"


def canonical_json(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its ``digest``."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "digest"})).hexdigest()


class Pairs(list):
    """A JSON object read as its (key, value) pairs, in order, repeated keys kept: a loader
    given a repeated tensor name would silently keep one of them."""


def read_header(read: Callable[[int, int], bytes], size: int) -> tuple[Pairs, int] | str:
    """The header of a safetensors file of ``size`` bytes as (pairs, offset of the data), or a
    string saying why the bytes are not a safetensors file. ``read(offset, length)`` reads it."""
    raw = read(0, 8) if size >= 8 else b""
    n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
        return f"not a safetensors file (header length {n})"
    try:
        pairs = json.loads(bytes(read(8, n)), object_pairs_hook=Pairs)
    except (ValueError, RecursionError) as e:
        return f"safetensors header is not JSON: {str(e)[:200]}"
    if not isinstance(pairs, Pairs):
        return "safetensors header is not an object"
    return pairs, 8 + n


def as_dict(value: object) -> object:
    """A header value read as pairs, back as a dict (anything else as it is)."""
    return dict(value) if isinstance(value, Pairs) else value
