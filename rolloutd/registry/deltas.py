"""Delta versions at publish: whether a new version travels as a delta, and its encoding.

The registry holds the bytes of every version it keeps, so it encodes: at publish, once the
staged files are verified and before the version is visible, against the newest LIVE version
(docs/deltas.md). The encoding runs in threads (zstandard and numpy let go of the interpreter
lock), never on the event loop; the delta files are staged beside the target's and committed
with them, in the same step.

A delta is published unless a full version is better, and the log says why:
- no base: no live version, or its bytes are not here (an object store holds them);
- a version whose bytes are in an object store: its publisher encoded the delta section it
  sent; it is kept when its base is a live version here, as named (number and digest), and the
  rules below allow it (the registry cannot read those delta files: nodes check every chunk
  and the rebuilt target); else dropped, the version published full;
- an anchor: ``delta_anchor_every`` versions since the last full one, or the delta bytes since
  it would pass ``delta_anchor_fraction`` of the full size (a node far behind takes a full
  version from the registry anyway; anchors bound what a chain of deltas costs to follow);
- not worth it: the delta is no smaller than that fraction of its own target.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from rolloutd.registry.blobs import blob_views
from rolloutd.registry.settings import RegistrySettings
from rolloutd.registry.store import Version
from rolloutd.units import percent
from rolloutd.wire.delta import delta_file_name, encode_file, removed_tensors
from rolloutd.wire.manifest import Delta, DeltaFile, Manifest, hash_chunks

log = logging.getLogger("rolloutd.registry")


@dataclass(frozen=True)
class Chain:
    """Where a version stands since the last full version (an anchor)."""

    deltas: int       # delta versions since the last full one, this one included (0: it is full)
    delta_bytes: int  # delta bytes published since then, this version's included


FULL = Chain(0, 0)


def chain_after(base: Chain | None, delta: Delta | None) -> Chain | None:
    """The chain of a version published with ``delta`` (None: full) on a base whose chain is
    ``base`` (None: unknown, as after a restart that lost the versions before it)."""
    if delta is None:
        return FULL
    if base is None:
        return None
    return Chain(base.deltas + 1, base.delta_bytes + delta.total_bytes)


def why_full_before(settings: RegistrySettings, manifest: Manifest, asked: bool, base: Version | None,
                    chain: Chain | None) -> str | None:
    """Why ``manifest`` is published full whatever its delta would be; None: encode one."""
    if not settings.delta:
        return "deltas are off on this registry"
    if not asked:
        return "asked for"
    if manifest.source is not None:
        # Its bytes went to an object store: the registry holds none to encode against, so the
        # trainer's publisher encodes; ``base`` is the live version its delta section names.
        if manifest.delta is None:
            return "its bytes are in an object store"
        d = manifest.delta
        if base is None or base.number != d.base_version or base.manifest.digest != d.base_digest:
            return (f"its delta's base, version {d.base_version} with digest {d.base_digest[:12]}..., is not a "
                    "live version here")
    elif base is None:
        return "no live version to encode against"
    elif base.manifest.source is not None or any(f.name not in base.blobs for f in base.manifest.files):
        return f"version {base.number}'s bytes are not on this registry"
    if chain is None:
        return f"the chain of deltas before version {base.number} is unknown here (a restart)"
    if chain.deltas + 1 >= settings.delta_anchor_every:
        return f"an anchor: every {settings.delta_anchor_every} versions"
    return None


def why_full_after(settings: RegistrySettings, target_bytes: int, delta_bytes: int, chain: Chain) -> str | None:
    """Why a delta of ``delta_bytes`` for a target of ``target_bytes`` is not published."""
    limit = settings.delta_anchor_fraction * target_bytes
    if delta_bytes >= limit:
        return (f"not worth it: the delta would be {delta_bytes} bytes, {_pct(delta_bytes, target_bytes)} "
                f"of the full size, not under {settings.delta_anchor_fraction:.0%}")
    if chain.delta_bytes + delta_bytes > limit:
        return (f"an anchor: the delta bytes since the last full version would be "
                f"{chain.delta_bytes + delta_bytes}, past {settings.delta_anchor_fraction:.0%} of the full size")
    return None


def _pct(part: int, whole: int) -> str:
    return percent(part / max(whole, 1))


def describe(manifest: Manifest, why_full: str | None) -> str:
    """The publish log line's tail: "as a delta on M: ..." or "as a full version (why)"."""
    if manifest.delta is None:
        return f"as a full version ({why_full})"
    d = manifest.delta
    return (f"as a delta on {d.base_version}: {d.total_bytes} bytes, {_pct(d.total_bytes, manifest.total_bytes)} "
            f"of {manifest.total_bytes}")


def encode_delta(blobs, manifest: Manifest, base: Version, *, encoding: str, pool: Executor) -> Delta:
    """Encode every staged file of ``manifest`` against ``base``'s bytes into delta files staged
    beside them; returns the delta section. In a thread: every byte of work is here."""
    version = manifest.version
    with blob_views({f.name: base.blobs[f.name] for f in base.manifest.files}) as bases, \
            contextlib.ExitStack() as stack:
        targets = {f.name: stack.enter_context(blobs.staged_view(version, f.name)) for f in manifest.files}
        taken = set(targets)
        files = []
        for f in manifest.files:
            name = delta_file_name(f.name, taken)
            taken.add(name)
            out = blobs.stage_output(version, name)
            try:
                encode_file(bases, targets[f.name], out.file, encoding=encoding, pool=pool, target_name=f.name)
                out.finish()
            except BaseException:
                out.abort()
                raise
            with blobs.staged_view(version, name) as view:
                files.append(DeltaFile(name=name, size=len(view), target=f.name,
                                       chunks=hash_chunks(view, manifest.chunk_bytes, manifest.hash, pool)))
        removed = removed_tensors(bases, targets)
    return Delta(base_version=base.number, base_digest=base.manifest.digest, encoding=encoding,
                 files=files, removed=removed)
