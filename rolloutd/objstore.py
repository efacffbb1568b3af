"""Object storage (S3 API) for version bytes, the part both ends share: where the S3 service is,
its credentials, sources and keys, and a bucket opened on them. The trainer uploads a version's
files to a bucket (:mod:`rolloutd.trainer.bucket`), the registry keeps the manifest, leases and
the source, and nodes read byte ranges from the bucket. One client for both sides: obstore
(Rust's ``object_store``: async range reads that never block the loop, no dependency beyond
itself, multipart uploads).

Contract:

- A source is ``s3://bucket/prefix``; file ``name`` of the version is the object
  ``<prefix>/<name>``.
- :class:`ObjectStoreSettings` says where the S3 service is (``endpoint``: any S3-compatible
  service; unset: AWS) and which file holds the credentials; the file is JSON or YAML with
  ``access_key_id``, ``secret_access_key`` and optionally ``session_token``. Keys are never
  logged nor shown in an error.
- Bytes read from a bucket are untrusted like every source's: the reader checks each chunk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from rolloutd.wire.manifest import SOURCE_RE

log = logging.getLogger("rolloutd.objstore")


class ObjectStoreError(Exception):
    """A source URL, credentials file or bucket that cannot be used; the message says which."""


class ObjectStoreSettings(BaseModel):
    """Where the S3 service is and the file with its credentials (node config ``object_store``,
    the trainer's ``publish(..., store=...)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    endpoint: str | None = Field(None, description="the S3 service's URL, e.g. http://minio:9000 (any "
                                 "S3-compatible service); null: AWS S3 of region")
    region: str = Field("us-east-1", min_length=1, description="the bucket's region")
    credentials_file: Annotated[Path, Field(strict=False)] | None = Field(
        None, description="JSON or YAML file with access_key_id, secret_access_key and optionally "
        "session_token; null: the environment's AWS_* variables")


def parse_source(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without surrounding slashes)."""
    if not SOURCE_RE.fullmatch(url):
        raise ObjectStoreError(f"{url[:100]!r} is not s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def object_key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def read_credentials(path: Path) -> dict[str, str]:
    """The keys in a credentials file; errors name the file and the key, never a value."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ObjectStoreError(f"credentials file {path}: {e.strerror or type(e).__name__}") from None
    except yaml.YAMLError:
        raise ObjectStoreError(f"credentials file {path}: not JSON or YAML") from None
    if not isinstance(data, dict):
        raise ObjectStoreError(f"credentials file {path}: expected a mapping with access_key_id and "
                               "secret_access_key")
    out = {}
    for key in ("access_key_id", "secret_access_key", "session_token"):
        value = data.get(key)
        if value is None and key != "session_token":
            raise ObjectStoreError(f"credentials file {path}: {key} is missing")
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ObjectStoreError(f"credentials file {path}: {key} is not a non-empty string")
            out[key] = value
    unknown = sorted(set(data) - {"access_key_id", "secret_access_key", "session_token"})
    if unknown:
        raise ObjectStoreError(f"credentials file {path}: unknown keys {unknown}")
    return out


def open_bucket(bucket: str, settings: ObjectStoreSettings, *, max_retries: int = 3,
                timeout_s: float | None = None) -> Any:
    """An obstore ``S3Store`` on ``bucket`` (path-style requests, as S3-compatible services want)."""
    from obstore.store import S3Store

    creds = read_credentials(settings.credentials_file) if settings.credentials_file else {}
    options: dict[str, Any] = {}
    if settings.endpoint and settings.endpoint.startswith("http://"):
        options["allow_http"] = True
    if timeout_s is not None:
        options["timeout"] = f"{timeout_s}s"
    kw: dict[str, Any] = {"region": settings.region, "virtual_hosted_style_request": False,
                          "client_options": options, "retry_config": {"max_retries": max_retries}}
    if settings.endpoint:
        kw["endpoint"] = settings.endpoint
    if creds:
        kw.update(access_key_id=creds["access_key_id"], secret_access_key=creds["secret_access_key"])
        if "session_token" in creds:
            kw["token"] = creds["session_token"]
    return S3Store(bucket, **kw)


def short_error(e: BaseException) -> str:
    """An obstore error's first line: its full text carries a debug dump of the request."""
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


