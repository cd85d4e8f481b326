"""The worker's view of its job, read once from the environment the agent set.

Why from the environment: ``ckptless-run`` gives workers exactly torchrun's
variables plus ``CKPTLESS_*`` ones, so a script runs unchanged under either
launcher and ckptless needs no side channel to start. They are parsed here,
once, from :func:`ckptless.environment.environ`; a worker's process-wide knobs
are :class:`ckptless.environment.ProcessEnv`. :meth:`WorkerContext.describe`
and ``ProcessEnv.describe`` together are its effective configuration (its
ledger's ``job_start`` event carries them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ckptless import environment
from ckptless.errors import ConfigError


def _int(env: Mapping[str, str], name: str, default: int | None = None, low: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(name, None, "not set: is this process running under ckptless-run (or torchrun)?")
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(name, raw, "must be an integer") from exc
    if value < low:
        raise ConfigError(name, raw, f"must be >= {low}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(name, raw, "must be a number") from exc
    if value <= 0:
        raise ConfigError(name, raw, "must be positive")
    return value


def _standby(env: Mapping[str, str], role: str, world: int) -> int | None:
    if role != "spare" or not env.get("CKPTLESS_STANDBY_RANK"):
        return None
    r = _int(env, "CKPTLESS_STANDBY_RANK")
    if r >= world:
        raise ConfigError("CKPTLESS_STANDBY_RANK", r, f"must be < WORLD_SIZE ({world})")
    return r


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job_id: str
    node_id: str
    generation: int
    etcd_endpoint: str | None
    replicas: int
    mirror_every: int
    placement: str
    collective_timeout_s: float
    goodput_dir: str | None
    shm_dir: str | None
    worker_id: str
    role: str  # member (started with the job), replacement (respawned), spare (waits for a rank)
    recovery_timeout_s: float
    replacement_timeout_s: float = 600.0  # the leader's wait for a replacement (--replacement-timeout)
    lost_node: str = "wait"  # --lost-node: the job may go on with fewer ranks (shrink); said at start if it cannot
    snapshot_dir: str | None = None
    snapshot_every: int = 0
    standby_rank: int | None = None  # a spare that builds the script's objects as this rank while it waits
    on_replica_mismatch: str = "stop"  # MirrorConfig.on_replica_mismatch: "stop" or "replace"
    mirror_replicated: bool = False  # holders keep replicated prefixes too (--mirror-replicated)
    mirror_buffers: int = 2  # owner capture buffers (MirrorConfig.pool_buffers); 1 = the (2 + 2K) x S memory budget
    control_relay: str | None = None  # the node's control relay (coordinator/relay_server.py); None: watch etcd

    def describe(self) -> dict[str, object]:
        """Printable: every field (none is secret)."""
        return dict(self.__dict__)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerContext:
        e = environment.environ() if env is None else env
        world = _int(e, "WORLD_SIZE", low=1)
        role = e.get("CKPTLESS_ROLE", "member")
        if role not in ("member", "replacement", "spare"):
            raise ConfigError("CKPTLESS_ROLE", role, "must be member, replacement or spare")
        rank = _int(e, "RANK", 0 if role == "spare" else None)
        node_id = e.get("CKPTLESS_NODE_ID", "local")
        local_rank = _int(e, "LOCAL_RANK", 0)
        if rank >= world:
            raise ConfigError("RANK", rank, f"must be < WORLD_SIZE ({world})")
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=_int(e, "LOCAL_WORLD_SIZE", 1, low=1),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(e, "MASTER_PORT", low=1),
            job_id=e.get("CKPTLESS_JOB_ID") or e.get("TORCHELASTIC_RUN_ID") or "default",
            node_id=node_id,
            # Under plain torchrun (no ckptless-run) each elastic restart is a new generation: the store keys of
            # a restarted round never meet the previous round's while the restart count rises (torchrun does not
            # raise it for a membership change), and the ledgers show the restart as an incident.
            generation=_int(e, "CKPTLESS_GENERATION", _int(e, "TORCHELASTIC_RESTART_COUNT", 0)),
            etcd_endpoint=e.get("CKPTLESS_ETCD_ENDPOINT") or None,
            replicas=_int(e, "CKPTLESS_REPLICAS", 1, low=0),
            mirror_every=_int(e, "CKPTLESS_MIRROR_EVERY", 1, low=1),
            placement=e.get("CKPTLESS_PLACEMENT", "ring"),
            collective_timeout_s=_float(e, "CKPTLESS_COLLECTIVE_TIMEOUT", 60.0),
            goodput_dir=e.get("CKPTLESS_GOODPUT_DIR") or None,
            shm_dir=e.get("CKPTLESS_SHM_DIR") or None,
            worker_id=e.get("CKPTLESS_WORKER_ID") or f"{node_id}/w{local_rank}",
            role=role,
            recovery_timeout_s=_float(e, "CKPTLESS_RECOVERY_TIMEOUT", 120.0),
            replacement_timeout_s=_float(e, "CKPTLESS_REPLACEMENT_TIMEOUT", 600.0),
            lost_node=e.get("CKPTLESS_LOST_NODE") or "wait",
            snapshot_dir=e.get("CKPTLESS_SNAPSHOT_DIR") or None,
            snapshot_every=_int(e, "CKPTLESS_SNAPSHOT_EVERY", 0),
            standby_rank=_standby(e, role, world),
            mirror_buffers=_int(e, "CKPTLESS_MIRROR_BUFFERS", 2, low=1),
            on_replica_mismatch=e.get("CKPTLESS_ON_REPLICA_MISMATCH") or "stop",
            mirror_replicated=e.get("CKPTLESS_MIRROR_REPLICATED", "0") == "1",
            control_relay=e.get("CKPTLESS_CONTROL_RELAY") or None,
        )
