"""Publishes under way: one task per manifest, which outlives the request that asked for it.

Verifying a version (reading back and hashing every byte the registry received) takes longer
than any fixed client timeout once the version is large. So ``POST /v1/versions`` runs the
publish as a task of its own:

- the request that starts it waits for it: to the end by default, or at most ``wait=N``
  seconds with ``Prefer: respond-async, wait=N`` (then 202, and the client asks again);
- a POST of the same manifest (same version, same digest, same options) while it runs waits
  for that same task instead of starting another or being refused; a client that gives up stops nothing;
- a publish refused for what the version holds (a registry error: digests, sizes, canary)
  keeps its error for every POST of that manifest for ``KEEP_FAILED_S``, so that a client
  asking again learns why (whether or not it was the one waiting when it ended) instead of
  starting the same failing work over; an upload to the version, or dropping its uploads,
  forgets it (the files changed: the next POST tries afresh). Any other failure is told to
  those waiting and forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rolloutd.wire import errors
from rolloutd.wire.manifest import Manifest, ManifestError

KEEP_FAILED_S = 60.0  # long past any client's next poll (``MAX_WAIT_S`` or less apart)
MAX_WAIT_S = 60.0  # the longest ``wait=`` honoured: a reply well inside any client's timeout

Outcome = tuple[Any, bool]  # (the store's Version, created)
Key = tuple[int, str, tuple]  # (version, manifest digest, the publish's options)


@dataclass(eq=False)
class _Run:
    task: asyncio.Task
    failed_at: float | None = None


class Publishes:
    """The publishes under way (and the recent failures), by (version, manifest digest)."""

    def __init__(self, publish: Callable[..., Awaitable[Outcome]],
                 clock: Callable[[], float] = time.monotonic):
        self._publish, self._clock = publish, clock
        self._runs: dict[Key, _Run] = {}

    async def publish(self, manifest: Manifest, wait_s: float | None, **options: Any) -> Outcome | None:
        """``(version, created)`` once published (``options`` go to the publish); the publish's
        error; or None if it is still under way after ``wait_s`` seconds (None: as long as it
        takes)."""
        try:
            manifest = manifest.sealed()
        except ManifestError as e:
            raise errors.ManifestDigestMismatch(str(e)) from None
        self._expire()
        key = (manifest.version, manifest.digest, tuple(sorted(options.items())))
        run = self._runs.get(key)
        if run is None:
            task = asyncio.create_task(self._publish(manifest, **options), name=f"publish-v{manifest.version}")
            run = self._runs[key] = _Run(task)
            task.add_done_callback(lambda t, key=key, run=run: self._ended(key, run))
        # Waited for, never awaited: a request cancelled (its client gone) leaves the task running.
        done, _ = await asyncio.wait({run.task}, timeout=wait_s)
        return run.task.result() if done else None

    def forget_failed(self, version: int) -> None:
        """The version's files are changing: a failure seen before says nothing about them now."""
        for key in [k for k, r in self._runs.items() if k[0] == version and r.failed_at is not None]:
            del self._runs[key]

    def _ended(self, key: Key, run: _Run) -> None:
        if not run.task.cancelled() and isinstance(run.task.exception(), errors.RegistryError):
            run.failed_at = self._clock()  # kept: refused for what the version holds
        elif self._runs.get(key) is run:  # published (the store answers from now on), or a fault to retry
            del self._runs[key]

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, r in self._runs.items() if r.failed_at is not None
                    and now - r.failed_at > KEEP_FAILED_S]:
            del self._runs[key]


def prefers_async(header: str | None) -> float | None:
    """The seconds to wait before answering 202 under ``Prefer: respond-async, wait=N``
    (RFC 7240; ``wait`` defaults to 0, at most ``MAX_WAIT_S``); None without respond-async."""
    if not header:
        return None
    tokens = [t.strip().lower() for part in header.split(",") for t in part.split(";")]
    if "respond-async" not in tokens:
        return None
    for t in tokens:
        name, _, value = t.partition("=")
        if name.strip() == "wait":
            try:
                return min(MAX_WAIT_S, max(0.0, float(value.strip().strip('"'))))
            except ValueError:
                return 0.0
    return 0.0
