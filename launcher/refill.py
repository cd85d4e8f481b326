"""Keeping a node's warm spares (``--spare-refill``): a new spare once one took a rank.

Why: ``--spares N`` is a pool that a recovery drains; without a refill the
next failure finds no spare and pays a respawn's setup on its critical path.
The agent therefore owes one new spare for every spare of its own that took a
rank, and starts it once that recovery is over: every rank this node runs
trains again in the generation that took the spare (their heartbeat files say
so), so the new spare's setup (the script's build, on this node's cores) never
competes with the recovery itself.

The decisions are the node machine's (launcher/node_machine.py: which refill
is owed, when the recovery is over, whether a GPU is free, the new spare's
name); :func:`start_spare` carries one out: it reads the new spare's standby
rank, adds its slot, starts it like the node's first spare and offers it on
the agent's lease.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.launcher.node_machine import StartSpare, recovery_over, spares_missing
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.slots import Slot
from ckptless.launcher.workers import WorkerGroup

log = logging.getLogger("ckptless.agent")

__all__ = ["recovery_over", "spare_env", "spares_missing", "start_spare"]  # the rules, named from here too


def spare_env(worker_id: str, heartbeat: str, exit_file: str, standby: int | None,
              device: Mapping[str, str]) -> dict[str, str]:
    """What a new spare's env changes against the node's first spare's (its template); ``device``:
    its LOCAL_RANK (and CUDA_VISIBLE_DEVICES), which put it on a GPU of its own (launcher/devices.py)."""
    return {"CKPTLESS_WORKER_ID": worker_id, "CKPTLESS_ROLE": "spare", **device,
            "CKPTLESS_HEARTBEAT_FILE": heartbeat, "CKPTLESS_EXIT_FILE": exit_file,
            "CKPTLESS_STANDBY_RANK": "" if standby is None else str(standby), "CKPTLESS_GENERATION": "0",
            "RANK": "0" if standby is None else str(standby)}


def start_spare(st: NodeState, group: WorkerGroup, a: StartSpare) -> bool:
    """Start the new spare the node machine decided on; False: etcd did not answer the standby read, nothing
    was started or claimed, and the refill stays owed (the driver tells the machine: SpareDeferred)."""
    try:  # etcd may be away: keep the refill owed and try again on a later turn
        ranks = st.spares.standby_ranks(a.world_size, 1) if st.cfg.spare_prebuild else []
    except CoordinatorError as exc:
        log.info("spare refill waits for etcd: %s", exc)
        return False
    worker_id = a.worker_id
    standby = ranks[0] if ranks else None
    lr = group.size  # add_like appends the next local rank; only this loop adds workers
    hb = st.heartbeat_path(lr)
    slot = Slot(lr, worker_id, None, hb)
    if not st.slots.add_with_device(slot):  # it takes the lowest free good GPU, atomically
        log.warning("spare %s not started: a respawn took the last free GPU meanwhile", worker_id)
        return True
    # The store of the current generation (node 0's may be gone with its node): a pre-built spare
    # connects to it while it builds, long before it is assigned a rank.
    env = dict(spare_env(worker_id, hb, st.exit_path(lr), standby, st.spare_device_env(lr, slot.device)),
               MASTER_ADDR=a.store_host, MASTER_PORT=str(a.store_port))
    try:
        added = group.add_like(st.cfg.nproc_per_node, env)
    except CkptlessError:
        log.exception("starting spare %s failed (not retried: a broken start must not loop)", worker_id)
        st.slots.exited(lr, False)
        return True
    assert added == lr, (added, lr)
    assert st.session is not None
    st.spares.offer_quietly(worker_id, standby, st.session.lease_id)  # on our lease, like the first
    log.warning("spare %s started (standby rank %s, GPU %s) in place of the one that took a rank", worker_id,
                standby, "none" if slot.device is None else slot.device)
    return True
