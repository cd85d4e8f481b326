"""Mirroring configuration, validated once at start-up.

Why pydantic plus our own ConfigError: the launcher turns flags into this
model; a bad value must fail fast with one line naming the field and value,
and the rest of ckptless catches only :class:`ckptless.errors.ConfigError`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptless.errors import ConfigError
from ckptless.state import DEFAULT_CHUNK_BYTES


class MirrorConfig(BaseModel):
    """How each rank's image is mirrored to its peers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(default=1, ge=1, description="K: peers holding a copy of each rank's image")
    mirror_every: int = Field(default=1, ge=1, description="mirror (and commit) every N steps")
    placement: Literal["ring", "group", "mixed"] = "ring"
    chunk_bytes: int = Field(default=DEFAULT_CHUNK_BYTES, ge=4096, description="checksum chunk size")
    wire_bytes: int = Field(default=64 << 20, ge=4096, description="bytes per p2p message (multiple of chunk_bytes)")
    shm_dir: str | None = Field(default=None, description="back the peer store with files here (e.g. /dev/shm)")
    node_local: bool = Field(default=True, description="with shm_dir: keep this rank's own capture buffers there "
                             "too, so a respawn on this node restores its committed image without the network")
    timeout_s: float = Field(default=60.0, gt=0, description="deadline of one mirror round")
    pool_buffers: int = Field(default=2, ge=1, description="owner capture buffers: 2 = committed + in flight; "
                              "1 = capture reuses the committed buffer (memory budget, see mirror.py)")
    on_replica_mismatch: Literal["stop", "replace"] = Field(
        default="stop", description="replicas that differ at a round (silent data corruption): stop the job, "
                                    "or replace the odd rank of a majority (ckptless.mirror.replica_check)")
    max_send_bytes_s: float = Field(default=0.0, ge=0, description="cap on one rank's payload send rate, "
                                    "bytes/s (0: none); spreads a round's CPU work over more steps")

    @classmethod
    def build(cls, **values: Any) -> MirrorConfig:
        """Construct, translating pydantic errors into :class:`ConfigError`."""
        try:
            cfg = cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err.get("loc", ())) or "mirror"
            raise ConfigError(field, err.get("input"), err.get("msg", "invalid")) from exc
        if cfg.wire_bytes % cfg.chunk_bytes:
            raise ConfigError("wire_bytes", cfg.wire_bytes, f"must be a multiple of chunk_bytes={cfg.chunk_bytes}")
        return cfg

    def validate_for_world(self, world_size: int) -> MirrorConfig:
        """Check the parts that depend on the job's size; returns self for chaining."""
        if world_size < 2:
            raise ConfigError("world_size", world_size, "mirroring needs at least 2 ranks")
        if self.replicas >= world_size:
            raise ConfigError("replicas", self.replicas, f"must be < world_size ({world_size})")
        return self
