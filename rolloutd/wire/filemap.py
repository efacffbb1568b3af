"""A file mapped read-only, for hashing and rebuilding without copying it into memory.
Standard library only: the pull worker and the manifest both use it."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path


def map_readonly(path: Path) -> tuple[memoryview, Callable[[], None]]:
    """A view of the file's bytes and the function that unmaps it (an empty file maps to an
    empty view). Unmapping is skipped while a slice of the view is still held (an error's
    traceback can hold one): the map then goes when the last slice does."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(b""), lambda: None
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(m)

    def close() -> None:
        try:
            view.release()
            m.close()
        except BufferError:
            pass
    return view, close
