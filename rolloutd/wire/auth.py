"""The bearer-token check, one for every listener that takes a token (registry, admin API,
gateway, peers): ``Authorization: Bearer <token>``, scheme case-insensitive, the token compared
in constant time. Tokens are never logged."""

from __future__ import annotations

import hmac


def bearer_ok(authorization: bytes | str | None, token: bytes | str) -> bool:
    """Whether an ``Authorization`` header value carries ``token``."""
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    if isinstance(token, str):
        token = token.encode()
    scheme, _, given = (authorization or b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)
