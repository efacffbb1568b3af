"""What a generation through the fleet can end with, other than an answer.

Every error is a :class:`FleetError`. The client retries, on another replica, what another
replica may answer (a server paused, refusing, restarting, dying mid-request, below the
request's version); the caller only sees these once that is over or cannot help:

- :class:`NoReplica`: no replica meets the request (serving, heard from lately, at the version
  it asks for) within its wait; :class:`VersionRefused`, a kind of it, when too few can ever
  get to the version waited for (their nodes refused the newest one);
- :class:`RetriesExhausted`: replicas were tried ``max_attempts`` times and each failed; it
  lists every attempt and why;
- :class:`GenerationTimeout`: the request's ``timeout_s`` ran out;
- :class:`Rejected`: a server refused the request itself (malformed, too long, unknown route):
  sending it elsewhere would not help; :class:`Unauthorized` and :class:`PromptTooLong` are
  kinds of it.
"""

from __future__ import annotations


class FleetError(Exception):
    """A generation request that did not get an answer."""


class NoReplica(FleetError):
    """No replica meets the request's contract (serving, fresh, at its version) within the wait."""


class VersionRefused(NoReplica):
    """Too few replicas can reach the version waited for: the nodes of the others refused the
    registry's newest version (it failed on their servers, which serve their last good version).
    ``reasons``: the distinct reasons their nodes gave."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message)
        self.reasons = reasons


class RetriesExhausted(FleetError):
    """Every attempt failed; ``attempts`` holds ``(replica_id, why)`` for each, in order."""

    def __init__(self, message: str, attempts: list[tuple[str, str]]):
        super().__init__(message)
        self.attempts = attempts


class Rejected(FleetError):
    """A server refused the request as it is (HTTP 4xx); another server would refuse it too."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 replica: str | None = None):
        super().__init__(message)
        self.status, self.code, self.replica = status, code, replica


class Unauthorized(Rejected):
    """The gateway wants a bearer token (``gateway_token``) that was missing or wrong."""


class PromptTooLong(Rejected):
    """The prompt (with the tokens generated so far) leaves no room under the server's
    ``max_model_len``."""


class GenerationTimeout(FleetError, TimeoutError):
    """The request's ``timeout_s`` ran out before an answer."""
