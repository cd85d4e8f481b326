"""How an agent's node joins its job: the script's fingerprint, rank offsets, a restart from disk.

Why apart from the agent: these are decisions over the launch config, the
rendezvous result and what etcd or the snapshot directory hold, with no agent
state; the agent's ``_join`` strings them together.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import NodeInfo, RoundState
from ckptless.errors import ConfigError
from ckptless.launcher.args import LaunchConfig
from ckptless.recovery.plan import Assignment, DiskFallback

log = logging.getLogger("ckptless.agent")


def script_fingerprint(cfg: LaunchConfig) -> str:
    """What identifies the job's program: the script's bytes (or module name) and its arguments."""
    h = hashlib.sha256()
    h.update(f"module={cfg.module} no_python={cfg.no_python}\0{cfg.training_script}\0".encode())
    if not cfg.module and os.path.isfile(cfg.training_script):
        with open(cfg.training_script, "rb") as f:
            h.update(f.read())
    h.update("\0".join(cfg.training_script_args).encode())
    return h.hexdigest()


def check_fingerprint(client: EtcdClient, keyspace: Keyspace, cfg: LaunchConfig) -> None:
    """A spare must run the job's script: one started with another script is refused at join."""
    kv = client.get(keyspace.rdzv_state)
    if kv is None:
        return
    round_ = RoundState.from_bytes(kv.value).round
    fp = client.get(keyspace.fingerprint(round_))
    mine = script_fingerprint(cfg)
    if fp is not None and fp.value.decode() != mine:
        raise ConfigError("training_script", cfg.training_script,
                          f"job {cfg.run_id!r} runs a different script or arguments (fingerprint "
                          f"{fp.value.decode()[:12]}, this node {mine[:12]}): a spare must run the job's script")


def rank_offsets(participants: tuple[NodeInfo, ...]) -> list[tuple[NodeInfo, int]]:
    """Each node with the first global rank of its workers, in rendezvous order."""
    out, off = [], 0
    for p in participants:
        out.append((p, off))
        off += p.nproc
    return out


def resume_from_disk(cfg: LaunchConfig, world_size: int, ranks: tuple[Assignment, ...]) -> DiskFallback | None:
    """A whole job started again: generation 0 resumes from the newest verified snapshot, if any."""
    if not cfg.snapshot_dir:
        return None
    from ckptless.snapshot import choose_snapshot

    info, rejected = choose_snapshot(cfg.snapshot_dir, cfg.run_id, world_size)
    for step, why in rejected:
        log.warning("not resuming from snapshot step %d: %s", step, why)
    if info is None:
        return None
    print(f"ckptless-run: job {cfg.run_id} resumes from its disk snapshot of step {info.step}",
          file=sys.stderr, flush=True)
    return DiskFallback(cfg.run_id, 0, ranks, (), info.step,
                        f"whole-job restart: resuming from the newest verified snapshot (step {info.step})", (), 0)
