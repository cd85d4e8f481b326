"""How an agent's node joins its job: the rendezvous (with the job-wide settings every agent must agree on,
launcher/admission.py), rank offsets, a restart from disk, the first membership.

Why apart from the agent: these are decisions over the launch config, the
rendezvous result and what etcd or the snapshot directory hold, with no agent
state (what they need is passed in); :func:`join` strings them together and
returns the node's place in the job and generation 0's membership.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TYPE_CHECKING

from ckptless.coordinator import EtcdClient
from ckptless.coordinator import Keyspace
from ckptless import environment
from ckptless.coordinator import NodeInfo, Rendezvous, RendezvousResult, RoundState
from ckptless.coordinator import Session
from ckptless.errors import ConfigError, RendezvousError, RendezvousLate, RendezvousTimeout
from ckptless.launcher.admission import Relaunch, admit, job_config
from ckptless.launcher.args import LaunchConfig
from ckptless.recovery import Assignment, DiskFallback
from ckptless.recovery import Membership, membership_from_json

if TYPE_CHECKING:  # importing ckptless.snapshot imports torch: deferred to the restart itself
    from ckptless.snapshot import WorldMismatch

log = logging.getLogger("ckptless.agent")


def join(client: EtcdClient, keyspace: Keyspace, session: Session, me: NodeInfo, cfg: LaunchConfig, *,
         recovery: bool, timeout_s: float, stopping: threading.Event,
         relaunch: Relaunch | None = None) -> tuple[RendezvousResult, Membership]:
    """Join the job: the rendezvous (a spare-only node only registers and waits for the job to exist),
    then generation 0's membership (written by node rank 0 when it is recovered, else this node's own).

    ``relaunch`` (``admission.admit``): this agent relaunches a failed job; its rendezvous waits only
    the relaunch window, then the agent exits with the job's end (a late agent of the ended run, not a
    relaunch, would otherwise wait ``timeout_s`` for nodes that never come)."""
    if cfg.nproc_per_node == 0:
        return _as_spares(client, keyspace, session, me, cfg, timeout_s, stopping)
    try:
        result = Rendezvous(client, keyspace, session).join(
            me, cfg.min_nodes, cfg.max_nodes, stop=stopping,
            timeout_s=timeout_s if relaunch is None else min(timeout_s, relaunch.window_s),
            last_call_s=float(cfg.rdzv_configs.get("last_call_timeout", 1.0)),
            config=job_config(cfg, environment.environ()))
    except RendezvousTimeout as exc:
        if relaunch is None:
            raise
        raise relaunch.gave_up(cfg.run_id, exc.seen or str(exc)) from exc
    except RendezvousLate as exc:
        admit(client, keyspace, cfg, environment.environ())  # it may have ended since the agent looked (agent.py)
        # The job formed without this node (a scheduler's replacement for a lost node, or one more than
        # --nnodes allows): it serves as spares for whatever rank is or will be lost, never ends the job.
        log.warning("%s: this node serves the job as %d spare(s) (its ranks come from peers when a rank "
                    "is lost, or at once if the job waits for a replacement)", exc, cfg.nproc_per_node + cfg.spares)
        return _as_spares(client, keyspace, session, me, cfg, timeout_s, stopping, late=True)
    log.info("node %s joined round %d as node rank %d of %d (ranks %d..%d of %d)",
             me.node_id, result.round, result.node_rank, result.nnodes, result.rank_offset,
             result.rank_offset + cfg.nproc_per_node - 1, result.world_size)
    ranks = tuple(Assignment(p_off + lr, f"{p.node_id}/w{lr}", p.node_id, "survivor")
                  for p, p_off in rank_offsets(result.participants) for lr in range(p.nproc))
    resume = resume_from_disk(cfg, result.world_size, ranks, result.node_rank)  # every node: may refuse
    initial = Membership(0, result.world_size, result.master.host, result.master.store_port, ranks, resume)
    if recovery and result.world_size > 1:
        from ckptless.recovery import write_initial_membership  # imports torch: only where needed

        initial = write_initial_membership(
            client, keyspace, initial, result.round, writer=result.node_rank == 0,
            deadline=time.monotonic() + timeout_s)
    return result, initial


def _as_spares(client: EtcdClient, keyspace: Keyspace, session: Session, me: NodeInfo, cfg: LaunchConfig,
               timeout_s: float, stopping: threading.Event, late: bool = False) -> tuple[RendezvousResult, Membership]:
    """A spare-only node (or a late one): not a rendezvous participant; it waits for the job to exist."""
    Rendezvous(client, keyspace, session).register(me)
    m = _await_membership(client, keyspace, cfg.run_id, timeout_s, stopping)
    check_spare_settings(client, keyspace, cfg)
    log.info("spare node %s joined job %s (world %d)", me.node_id, cfg.run_id, m.world_size)
    # Its spares' placeholder groups (unbound until a rank is assigned) use this node's own store: the
    # membership's may be a lost node's (a late node arrives while the job waits because that node is
    # gone). An assigned spare connects to its generation's store, named by the membership.
    return RendezvousResult(0, 0, 1, (), 0, m.world_size, NodeInfo("", me.host, 1, me.store_port), late=late), m


def _await_membership(client: EtcdClient, keyspace: Keyspace, run_id: str, timeout_s: float,
                      stopping: threading.Event) -> Membership:
    changed = threading.Event()
    watch = client.watch_prefix(keyspace.membership, lambda _e: changed.set())
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if stopping.is_set():
                raise RendezvousError(f"spare node: waiting for job {run_id!r} interrupted")
            kv = client.get(keyspace.membership)
            if kv is not None and _membership_is_current(client, keyspace):
                return membership_from_json(kv.value)
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(f"spare node: job {run_id!r} did not start within "
                                        f"{timeout_s}s")
            changed.wait(min(0.25, deadline - time.monotonic()))
            changed.clear()
    finally:
        watch.cancel()


def _membership_is_current(client: EtcdClient, keyspace: Keyspace) -> bool:
    """The membership belongs to the current rendezvous round (not a previous run of this job id)."""
    state, rnd = client.get(keyspace.rdzv_state), client.get(keyspace.round)
    if state is None or rnd is None:
        return False
    st = RoundState.from_bytes(state.value)
    return st.state == "closed" and int(rnd.value) == st.round


def check_spare_settings(client: EtcdClient, keyspace: Keyspace, cfg: LaunchConfig) -> None:
    """A spare node must be started as the job's agents were: the job-wide settings recorded in the round
    (its script and arguments, --replicas, ...) are compared with its own, and it is refused in one line
    naming each setting that differs (a spare running another script once took a rank and lost the job).
    ``admission.admit`` checked them already when the round existed as the agent started; this is for the
    spare node that came before its job formed."""
    kv = client.get(keyspace.rdzv_state)
    if kv is not None:
        RoundState.from_bytes(kv.value).check(job_config(cfg, environment.environ()))


def rank_offsets(participants: tuple[NodeInfo, ...]) -> list[tuple[NodeInfo, int]]:
    """Each node with the first global rank of its workers, in rendezvous order."""
    out, off = [], 0
    for p in participants:
        out.append((p, off))
        off += p.nproc
    return out


def resume_from_disk(cfg: LaunchConfig, world_size: int, ranks: tuple[Assignment, ...],
                     node_rank: int = 0) -> DiskFallback | None:
    """A whole job started again: generation 0 resumes from the newest verified snapshot, if any.

    Called on every node after the rendezvous, before any worker is spawned.
    Every node refuses (one :class:`ConfigError`) a start whose world size
    does not match the job's complete snapshots: resuming is impossible and
    training from step 0 beside them is what lost a user's last good
    snapshot (issue 17); every node checks because each would otherwise wait
    for a membership that never comes. With ``--fresh-start`` node 0 sets
    the old snapshots aside, unchanged, and the job starts from step 0. Only
    node 0 chooses the snapshot (it writes the membership).
    """
    if not cfg.snapshot_dir:
        return None
    from ckptless.snapshot import check_world, choose_snapshot, set_aside

    if cfg.fresh_start:
        moved = set_aside(cfg.snapshot_dir, cfg.run_id) if node_rank == 0 else None
        if moved is not None:
            print(f"ckptless-run: --fresh-start: job {cfg.run_id} starts from step 0; its previous snapshots "
                  f"were set aside, unchanged, in {moved}", file=sys.stderr, flush=True)
        return None
    mismatch = check_world(cfg.snapshot_dir, cfg.run_id, world_size)
    if mismatch is not None:
        raise world_mismatch_error(cfg.run_id, mismatch)
    if node_rank != 0:
        return None
    info, rejected = choose_snapshot(cfg.snapshot_dir, cfg.run_id, world_size)
    for step, why in rejected:
        log.warning("not resuming from snapshot step %d: %s", step, why)
    if info is None:
        return None
    print(f"ckptless-run: job {cfg.run_id} resumes from its disk snapshot of step {info.step}",
          file=sys.stderr, flush=True)
    return DiskFallback(cfg.run_id, 0, ranks, (), info.step,
                        f"whole-job restart: resuming from the newest verified snapshot (step {info.step})", (), 0)


def world_mismatch_error(run_id: str, m: WorldMismatch) -> ConfigError:
    """One line: what does not match, where, and the two ways on (neither loses a snapshot)."""
    from ckptless.snapshot import SET_ASIDE

    steps = ", ".join(str(s) for s in m.steps[:8]) + (", ..." if len(m.steps) > 8 else "")
    return ConfigError(
        "world_size", m.job_world,
        f"job {run_id!r} has complete disk snapshots in {m.job_dir} written by a world of {m.world_size} ranks "
        f"(steps {steps}), and a start of {m.job_world} ranks cannot resume from them. To resume, relaunch with "
        f"{m.world_size} ranks (--nnodes x --nproc-per-node); to start from step 0 instead, add --fresh-start, "
        f"which sets those snapshots aside unchanged (in {m.job_dir}{SET_ASIDE}<time>; nothing is deleted)")
