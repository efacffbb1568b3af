"""Registry settings: typed, strict, immutable; units in the names."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutd.config import is_loopback
from rolloutd.wire.delta import DEFAULT_ENCODING
from rolloutd.wire.manifest import DeltaEncoding

MiB = 1 << 20


class RegistrySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on; 0.0.0.0 for every interface")
    port: int = Field(8700, ge=0, le=65535, description="TCP port (0 picks a free one)")
    data_dir: Path | None = Field(None, description="keep version bytes here (they survive a "
                                  "restart); unset keeps them in memory")
    keep_versions: int = Field(3, ge=2, description="newest versions kept live; older ones are "
                               "retired (bytes kept until their last lease ends)")
    token_file: Path | None = Field(None, description="file holding the bearer token every "
                                    "route but /healthz and the fleet page's files requires; unset: no auth, "
                                    "which a host other than loopback refuses unless allow_unauthenticated")
    allow_unauthenticated: bool = Field(False, description="serve a host other than loopback without "
                                        "token_file: anyone who can reach it may publish, retire and read "
                                        "versions")
    max_lease_ttl_s: float = Field(3600.0, gt=0, description="longest lease a client may ask for")
    max_wait_s: float = Field(60.0, gt=0, description="longest long-poll on /v1/versions/latest")
    max_json_bytes: int = Field(16 * MiB, ge=4096, description="largest JSON request body "
                                "(manifests are the largest)")
    max_file_bytes: int = Field(1 << 40, ge=1, description="largest uploaded file")
    replica_forget_after_s: float = Field(3600.0, gt=0, description="drop a replica from the "
                                          "directory after this long without a heartbeat")
    keep_alive_s: float = Field(75.0, gt=0, description="idle keep-alive of client connections")
    holder_ttl_s: float = Field(30.0, gt=0, description="peers: forget a node's chunks after this long "
                                "without an announcement")
    assign_ttl_s: float = Field(30.0, gt=0, description="peers: a chunk handed to a puller to take from the "
                                "origin is handed to another if not announced within this long")
    max_peers: int = Field(8, ge=1, le=64, description="peers: most holders named to a puller in one reply")
    delta: bool = Field(True, description="publish a version as a delta on the newest live version when that "
                        "is smaller (docs/deltas.md); off: every version is full")
    delta_anchor_every: int = Field(10, ge=1, description="deltas: every this many versions since the last full "
                                    "one, a full version (an anchor)")
    delta_anchor_fraction: float = Field(0.5, gt=0, le=1, description="deltas: a full version when the delta "
                                         "bytes since the last full one would pass this fraction of the full "
                                         "size, or when one delta is not under it")
    delta_encoding: DeltaEncoding = Field(DEFAULT_ENCODING, description="deltas: how changed tensors are "
                                          "encoded (docs/deltas.md)")

    @model_validator(mode="after")
    def _check_open(self) -> RegistrySettings:
        # Fail closed, as the node's gateway and admin API: open to other hosts only when asked for.
        if self.token_file is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(f"a registry on {self.host} (not loopback) needs a token file (--token-file, "
                             "token_file=), or allow_unauthenticated (--allow-unauthenticated) to let anyone who "
                             "can reach it publish and read versions")
        return self

    def read_token(self) -> str | None:
        """The token from ``token_file`` (surrounding whitespace stripped); never logged."""
        if self.token_file is None:
            return None
        token = Path(self.token_file).read_text().strip()
        if not token:
            raise ValueError(f"token file {self.token_file} is empty")
        return token
