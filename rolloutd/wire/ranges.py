"""HTTP byte ranges as the registry serves them, and every node's peer listener too: one
``Range: bytes=a-b``, ``a-`` or ``-n`` inside the file; anything else is 416 with
``Content-Range: bytes */SIZE``."""

from __future__ import annotations

from rolloutd.wire import errors

OWS = " \t"


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single ``bytes=`` range as [start, end); None for no header; 416 for anything else."""
    if header is None:
        return None
    unsatisfiable = errors.RangeNotSatisfiable(
        f"Range {header[:100]!r} is not one byte range within {size} bytes")
    unsatisfiable.headers = {"content-range": f"bytes */{size}"}
    unit, _, spec = header.partition("=")
    # HTTP's optional whitespace is spaces and tabs; str.strip() would also take '\x85' and
    # other Unicode spaces, turning 'bytes=\x85-1' into the range 'bytes=-1'.
    first, dash, last = spec.strip(OWS).partition("-")
    if unit.strip(OWS).lower() != "bytes" or not dash or "," in spec:
        raise unsatisfiable
    if not (_digits(first) or first == "") or not (_digits(last) or last == ""):
        raise unsatisfiable
    if first == "":
        if not last or int(last) == 0:
            raise unsatisfiable
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise unsatisfiable
    return start, end


def _digits(s: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²', which int() refuses."""
    return s.isascii() and s.isdigit()
