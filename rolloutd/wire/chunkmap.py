"""Which chunks of a version a node holds: one bit per chunk, over the version's chunks in
manifest order (file by file), as a Python int on either side and as lowercase hex on the wire
(bit ``i`` is chunk ``i``; ``"0"`` is none). Written once, read by the registry's tracker, the
daemon's announcer and its puller."""

from __future__ import annotations

import re

from rolloutd.wire.manifest import FileEntry, Manifest

# The most chunks a map on the wire holds (1 TiB of 64 MiB chunks): announcements and replies stay
# small. A version with more is pulled from its origin only (rollout/swarm.py, peers_refused).
MAX_CHUNKS = 16_384
MAX_HEX_CHARS = MAX_CHUNKS // 4
HEX_RE = re.compile(rf"^[0-9a-f]{{1,{MAX_HEX_CHARS}}}$")


def chunk_index(manifest: Manifest) -> list[tuple[FileEntry, int]]:
    """(file, index in the file) for every chunk of the version, in bit order."""
    return [(entry, i) for entry in manifest.files for i in range(len(entry.chunks))]


def full(count: int) -> int:
    return (1 << count) - 1


def to_hex(bits: int) -> str:
    return format(bits, "x")


def from_hex(text: str, count: int) -> int:
    """The bits of ``text``, bits at or past ``count`` dropped; ValueError if it is not hex."""
    if not HEX_RE.fullmatch(text):
        raise ValueError("a chunk map is lowercase hex")
    return int(text, 16) & full(count)


def ones(bits: int) -> list[int]:
    """Indices of the set bits, lowest first."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out
