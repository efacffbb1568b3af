"""Registry errors: one class per stable ``code``, shared by the server and its clients.

On the wire an error is ``{"error": {"code": "<code>", "message": "<words>"}}`` with the
class's HTTP status (an ``invalid_request`` adds ``"fields"``). Clients turn the code back into
the same class, so callers catch ``LeaseExpired`` rather than compare strings. Codes are a
contract: never rename one.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ValidationError


class RegistryError(Exception):
    code = "registry_error"
    status = 500
    headers: dict[str, str] | None = None  # extra response headers (e.g. Content-Range on 416)

    def __init__(self, message: str = "", *, status: int | None = None):
        super().__init__(message or self.code)
        self.message = message or self.code
        if status is not None:
            self.status = status

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


class InvalidRequest(RegistryError):
    """The request's body, path or query is malformed. ``fields``: the top-level fields of the
    body at fault, in order (empty: none named, e.g. a body that is not JSON); on the wire as
    ``error.fields``, so a client tells which field was refused without reading the words."""
    code = "invalid_request"
    status = 422

    def __init__(self, message: str = "", *, status: int | None = None, fields: Iterable[str] = ()):
        super().__init__(message, status=status)
        self.fields = tuple(fields)

    @classmethod
    def of(cls, problems, *, request_parts: bool = False) -> InvalidRequest:
        """From pydantic's ``errors()``: the message :func:`describe` writes, and the fields.
        ``request_parts``: each location starts with the part of the request (FastAPI's
        ``body``, ``query``, ``path``, ...); only the body's name fields."""
        return cls(describe(problems), fields=_fields(problems, request_parts))

    def to_json(self) -> dict:
        body = super().to_json()
        if self.fields:
            body["error"]["fields"] = list(self.fields)
        return body


class Unauthorized(RegistryError):
    """A bearer token is required and was missing or wrong."""
    code = "unauthorized"
    status = 401


class RouteNotFound(RegistryError):
    """No such route."""
    code = "not_found"
    status = 404


class MethodNotAllowed(RegistryError):
    """The route exists but not with this method."""
    code = "method_not_allowed"
    status = 405


class BodyTooLarge(RegistryError):
    """The request body is over the configured limit."""
    code = "body_too_large"
    status = 413


class NoVersions(RegistryError):
    """Nothing has been published yet."""
    code = "no_versions"
    status = 404


class VersionUnknown(RegistryError):
    """That version was never published here."""
    code = "version_unknown"
    status = 404


class VersionRetired(RegistryError):
    """That version was retired: no new leases, and its bytes may be gone."""
    code = "version_retired"
    status = 410


class VersionNotNewer(RegistryError):
    """A version must be newer than every version published before."""
    code = "version_not_newer"
    status = 409


class VersionConflict(RegistryError):
    """That version exists with different contents."""
    code = "version_conflict"
    status = 409


class FileUnknown(RegistryError):
    """The version has no file of that name."""
    code = "file_unknown"
    status = 404


class RangeNotSatisfiable(RegistryError):
    """The Range header is outside the file or not a single byte range."""
    code = "range_not_satisfiable"
    status = 416


class BytesElsewhere(RegistryError):
    """The version's bytes are not on the registry: its manifest's ``source`` (an object store)
    holds them; the registry keeps only the manifest, leases and the source."""

    code = "bytes_elsewhere"
    status = 409


class UploadIncomplete(RegistryError):
    """Files the manifest lists were not uploaded, or have the wrong size."""
    code = "upload_incomplete"
    status = 409


class DigestMismatch(RegistryError):
    """Uploaded bytes do not match the manifest's chunk digests."""
    code = "digest_mismatch"
    status = 422


class ManifestDigestMismatch(RegistryError):
    """The manifest's digest does not match its contents."""
    code = "manifest_digest_mismatch"
    status = 422


class DuplicateTensor(RegistryError):
    """The version's safetensors files give one tensor name more than once."""
    code = "duplicate_tensor"
    status = 422


class BadCanary(RegistryError):
    """The version's canary can never pass on a server of its model (a token id outside the
    vocabulary its tensors give, or a tolerance so wide it would pass any weights)."""
    code = "bad_canary"
    status = 422


class LeaseUnknown(RegistryError):
    """No such lease (never granted, or released)."""
    code = "lease_unknown"
    status = 404


class LeaseExpired(RegistryError):
    """The lease's TTL ran out before it was renewed."""
    code = "lease_expired"
    status = 410


class DemandAhead(RegistryError):
    """Demand names a version newer than the newest published one."""
    code = "demand_ahead"
    status = 409


class Internal(RegistryError):
    """A bug in the registry; the message says where to look."""
    code = "internal"
    status = 500


class RegistryUnavailable(RegistryError):
    """Client side only: the registry could not be reached or did not answer in time."""
    code = "unavailable"
    status = 503


BY_CODE: dict[str, type[RegistryError]] = {
    cls.code: cls for cls in (
        InvalidRequest, Unauthorized, RouteNotFound, MethodNotAllowed, BodyTooLarge, NoVersions,
        VersionUnknown, VersionRetired, VersionNotNewer, VersionConflict, FileUnknown, BytesElsewhere,
        RangeNotSatisfiable, UploadIncomplete, DigestMismatch, ManifestDigestMismatch,
        DuplicateTensor, BadCanary, LeaseUnknown, LeaseExpired, DemandAhead, Internal, RegistryUnavailable)
}


def from_json(status: int, body: object) -> RegistryError:
    """Rebuild the typed error from a response body (an unknown code stays a RegistryError)."""
    code, message = "registry_error", f"HTTP {status}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code", code))
        message = str(body["error"].get("message", message))
    cls = BY_CODE.get(code, RegistryError)
    if cls is InvalidRequest:
        fields = body["error"].get("fields")
        if not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
            fields = described_fields(message)  # a registry from before ``error.fields``
        return InvalidRequest(message, status=status, fields=fields)
    return cls(message, status=status)


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body against ``model``; any problem is an ``InvalidRequest`` naming the fields."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise InvalidRequest.of(e.errors()) from None


def describe(problems) -> str:
    parts = []
    for p in problems[:10]:
        loc = ".".join(str(x) for x in p.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {p.get('msg')}")
    return "; ".join(parts)


def _fields(problems, request_parts: bool) -> list[str]:
    """The top-level body fields named by pydantic's ``errors()``, each once, in order."""
    locs = [tuple(p.get("loc", ())) for p in problems]
    if request_parts:
        locs = [loc[1:] for loc in locs if loc[:1] == ("body",)]
    return list(dict.fromkeys(str(loc[0]) for loc in locs if loc))


def described_fields(message: str) -> list[str]:
    """The top-level fields in a message :func:`describe` wrote (``loc: msg; loc: msg``): what a
    registry from before ``error.fields`` says of them. Only each part's ``loc`` is read, so a
    field name inside a message's words names nothing."""
    names = (part.partition(": ")[0].split(".")[0] for part in message.split("; ") if ": " in part)
    return list(dict.fromkeys(n for n in names if n and n != "body" and " " not in n))
