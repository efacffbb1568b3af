"""An asynchronous publish: the trainer's step goes on while a version's bytes are written.

``EmbeddedRegistry.publish_async`` returns a :class:`PublishHandle` at once; the version is
written and committed on a thread of its own. The handle says how far it got
(:attr:`PublishHandle.progress`), waits for it (:meth:`~PublishHandle.wait`, which returns the
manifest or raises what the publish raised) and cancels it (:meth:`~PublishHandle.cancel`:
nothing of the version stays staged). Publishes of one registry run one at a time, in the
order they were asked for, so versions commit in order.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rolloutd.wire.manifest import Manifest


class Turns:
    """Publishes of one registry, one at a time, in the order they were asked for (a plain lock
    wakes its waiters in any order): ``with turns.mine():``, or take a ticket now and wait for
    its turn later."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def take(self) -> int:
        with self._cond:
            self._next += 1
            return self._next - 1

    @contextlib.contextmanager
    def wait(self, ticket: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._serving == ticket)
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()

    def mine(self) -> contextlib.AbstractContextManager[None]:
        """A turn of one's own, after those already asked for."""
        return self.wait(self.take())


class PublishState(enum.Enum):
    QUEUED = "queued"          # waiting for an earlier publish of the same registry
    WRITING = "writing"        # shards written into the registry's store, hashed as they land
    COMMITTING = "committing"  # the manifest is being published; it can no longer be cancelled
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_ENDED = (PublishState.DONE, PublishState.FAILED, PublishState.CANCELLED)


@dataclass(frozen=True)
class PublishProgress:
    version: int
    state: PublishState
    bytes_done: int   # tensor bytes written into the store
    bytes_total: int
    seconds: float
    error: str | None


class PublishHandle:
    """Created by the registry with ``run(handle) -> Manifest``, which reports through
    :meth:`set_state` and :meth:`add` and stops at :meth:`cancelled`."""

    def __init__(self, version: int, bytes_total: int, run: Callable[[PublishHandle], Manifest], turns: Turns):
        self.version, self.bytes_total = version, bytes_total
        self._run, self._turns, self._ticket = run, turns, turns.take()
        self._state, self._done_bytes, self._error = PublishState.QUEUED, 0, None
        self._result: Manifest | None = None
        self._exc: BaseException | None = None
        self._cancel = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._ended_at: float | None = None
        self._thread = threading.Thread(target=self._main, name=f"publish-v{version}", daemon=True)
        self._thread.start()

    # -- for the trainer ------------------------------------------------------------------------
    @property
    def progress(self) -> PublishProgress:
        end = self._ended_at if self._ended_at is not None else time.monotonic()
        return PublishProgress(self.version, self._state, self._done_bytes, self.bytes_total,
                               round(end - self._started, 3), self._error)

    def done(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout_s: float | None = None) -> Manifest:
        """The published manifest; raises ``TimeoutError`` if it is not done within ``timeout_s``,
        or what the publish raised (``Cancelled`` after :meth:`cancel`)."""
        if not self._ended.wait(timeout_s):
            raise TimeoutError(f"publish of version {self.version} not done after {timeout_s} s "
                               f"({self._state.value}, {self._done_bytes} of {self.bytes_total} bytes)")
        if self._exc is not None:
            raise self._exc
        return self._result

    def cancel(self, timeout_s: float | None = None) -> bool:
        """Stop the publish; True once it stopped with nothing of the version left staged,
        False if it was already committing or done (the version is, or will be, published).
        Waits up to ``timeout_s`` for it to stop."""
        with self._lock:
            if self._state in (PublishState.COMMITTING, PublishState.DONE):
                return False
            self._cancel.set()
        self._ended.wait(timeout_s)
        return self._state is PublishState.CANCELLED

    # -- for the registry -------------------------------------------------------------------------
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def add(self, n: int) -> None:
        self._done_bytes += n

    def set_state(self, state: PublishState) -> None:
        """Enter WRITING or COMMITTING; COMMITTING is refused (``Cancelled``) once a cancel came."""
        from rolloutd.trainer.shards import Cancelled
        with self._lock:
            if self._cancel.is_set():
                raise Cancelled(f"publish of version {self.version} cancelled")
            self._state = state

    def _main(self) -> None:
        from rolloutd.trainer.shards import Cancelled
        try:
            with self._turns.wait(self._ticket):  # one publish at a time per registry, in order
                self.set_state(PublishState.WRITING)
                self._result = self._run(self)
            end = PublishState.DONE
        except Cancelled as e:
            self._exc, end = e, PublishState.CANCELLED
        except BaseException as e:  # handed to whoever waits
            self._exc, self._error, end = e, f"{type(e).__name__}: {e}", PublishState.FAILED
        self._run = None  # its tensors (a snapshot may be gigabytes) go with it
        with self._lock:
            self._state, self._ended_at = end, time.monotonic()
        self._ended.set()
