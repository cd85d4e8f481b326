"""Keeping a node's warm spares (``--spare-refill``): a new spare once one took a rank.

Why: ``--spares N`` is a pool that a recovery drains; without a refill the
next failure finds no spare and pays a respawn's setup on its critical path.
The agent therefore owes one new spare for every spare of its own that took a
rank, and starts it once that recovery is over: every rank this node runs
trains again in the generation that took the spare (their heartbeat files say
so), so the new spare's setup (the script's build, on this node's cores) never
competes with the recovery itself.

The decisions are pure functions over the slot table and heartbeat records;
:func:`maybe_refill`, called on each turn of the agent's main loop, acts on
them: it claims an owed refill, adds the new spare's slot, starts it like the
node's first spare and offers it on the agent's lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.slots import Slot
from ckptless.launcher.workers import WorkerGroup
from ckptless.worker.heartbeat import read_progress

log = logging.getLogger("ckptless.agent")


def recovery_over(slots: Sequence[Slot], generation: int,
                  progress_of: Callable[[str], dict[str, Any] | None]) -> bool:
    """Every live rank of this node trains in ``generation`` or later (and there is one)."""
    ranked = [s for s in slots if s.rank is not None and s.alive]
    if not ranked:
        return False
    for s in ranked:
        p = progress_of(s.heartbeat_file)
        gen = p.get("generation") if p is not None else None
        if p is None or p.get("state") != "training" or not isinstance(gen, int) or gen < generation:
            return False
    return True


def spares_missing(slots: Sequence[Slot], wanted: int) -> int:
    """How many spares this node lacks against ``--spares`` (live, unassigned ones count)."""
    return max(0, wanted - sum(1 for s in slots if s.spare and s.alive))


def spare_env(worker_id: str, heartbeat: str, exit_file: str, standby: int | None,
              device: Mapping[str, str]) -> dict[str, str]:
    """What a new spare's env changes against the node's first spare's (its template); ``device``:
    its LOCAL_RANK (and CUDA_VISIBLE_DEVICES), which put it on a GPU of its own (launcher/devices.py)."""
    return {"CKPTLESS_WORKER_ID": worker_id, "CKPTLESS_ROLE": "spare", **device,
            "CKPTLESS_HEARTBEAT_FILE": heartbeat, "CKPTLESS_EXIT_FILE": exit_file,
            "CKPTLESS_STANDBY_RANK": "" if standby is None else str(standby), "CKPTLESS_GENERATION": "0",
            "RANK": "0" if standby is None else str(standby)}


def maybe_refill(st: NodeState, group: WorkerGroup) -> None:
    """--spare-refill: start a new spare once one of ours took a rank and that recovery is over."""
    m = st.membership
    if (not st.spares.refill_owed or m is None or st.stopping.is_set() or st.status is not None
            or m.generation in st.incident_t  # another failure: wait for its recovery too
            or not recovery_over(st.slots.all(), m.generation, read_progress)):
        return
    if spares_missing(st.slots.all(), st.cfg.spares) == 0:
        st.spares.next_refill(st.cfg.spares)  # the pool is full (e.g. a slot came back): nothing owed
        return
    if not st.slots.gpu_free():  # still owed: a GPU may free up (a rank that moved away)
        if not st.refill_gpu_warned:
            st.refill_gpu_warned = True
            log.warning("spare refill waits: none of this node's %d GPUs is free and good (failed: %s)",
                        st.slots.gpus, sorted(st.slots.bad_gpus()) or "none")
        return
    try:  # etcd may be away: keep the refill owed and try again on a later turn
        ranks = st.spares.standby_ranks(m.world_size, 1) if st.cfg.spare_prebuild else []
    except CoordinatorError as exc:
        log.info("spare refill waits for etcd: %s", exc)
        return
    worker_id = st.spares.next_refill(st.cfg.spares)
    if worker_id is None:
        return
    standby = ranks[0] if ranks else None
    lr = group.size  # add_like appends the next local rank; only this loop adds workers
    hb = st.heartbeat_path(lr)
    slot = Slot(lr, worker_id, None, hb)
    if not st.slots.add_with_device(slot):  # it takes the lowest free good GPU, atomically
        log.warning("spare %s not started: a respawn took the last free GPU meanwhile", worker_id)
        return
    # The store of the current generation (node 0's may be gone with its node): a pre-built spare
    # connects to it while it builds, long before it is assigned a rank.
    env = dict(spare_env(worker_id, hb, st.exit_path(lr), standby, st.spare_device_env(lr, slot.device)),
               MASTER_ADDR=m.store_host, MASTER_PORT=str(m.store_port))
    try:
        added = group.add_like(st.cfg.nproc_per_node, env)
    except CkptlessError:
        log.exception("starting spare %s failed (not retried: a broken start must not loop)", worker_id)
        st.slots.exited(lr, False)
        return
    assert added == lr, (added, lr)
    assert st.session is not None
    st.spares.offer_quietly(worker_id, standby, st.session.lease_id)  # on our lease, like the first
    log.warning("spare %s started (standby rank %s, GPU %s) in place of the one that took a rank", worker_id,
                standby, "none" if slot.device is None else slot.device)
