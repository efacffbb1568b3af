"""The per-request version contract between a generation client and a server's gateway (written
once, imported by both).

A request may carry ``X-Rolloutd-Min-Version: N`` (a positive decimal integer). The gateway
forwards it only to a server that holds version ``N`` or newer; a server below it is answered
``409`` with the stable error code ``version_behind``, ``Retry-After`` (the server may load a
newer version soon) and ``X-Rolloutd-Version``: the version it holds (``none`` for its start
model). The refusal is retryable: another replica, or this one later, may meet it. A header
that is not a positive integer is ``400`` (``bad_request``). While the server is paused for an
update the request waits at the gateway as any other (``gateway.while_paused``), and is checked
against the version the server holds once it serves again.
"""

from __future__ import annotations

MIN_VERSION_HEADER = "X-Rolloutd-Min-Version"
VERSION_HEADER = "X-Rolloutd-Version"
BEHIND_STATUS = 409
BEHIND_CODE = "version_behind"
MAX_DIGITS = 18  # a version fits in 63 bits


def parse_min_version(value: bytes | str) -> int | None:
    """The header's version, or None when it is not a positive decimal integer."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > MAX_DIGITS:
        return None
    version = int(text)
    return version if version > 0 else None


def held_text(version: int | None) -> str:
    """``X-Rolloutd-Version``'s value for a server holding ``version``."""
    return "none" if version is None else str(version)


def parse_held(value: str | None) -> int | None:
    """The version a refusal says the server holds (None: its start model, or not said)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())
