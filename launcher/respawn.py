"""Starting a rank again in one of this node's slots: a respawn a membership asks for, a spare's re-exec.

Why a module of its own: both put a new incarnation in a slot whose process
ended, and both must keep one order: the old incarnation's exit is recorded
first (under its own worker id), then the slot is reset, then its old
heartbeat and exit files are removed (a new incarnation must not be judged by
its predecessor's), then the worker group starts it (warm, from the fork
server, when it can). The node machine (launcher/node_machine.py) asks for
both: a respawn when a membership places a rank here, the re-exec of a
pre-built spare that was given another rank than the one it built for once
the membership that assigns it reached us.
Starting a new spare to refill the pool is launcher/refill.py.
"""

from __future__ import annotations

import logging
import os
import time

from ckptless.errors import CkptlessError
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.workers import WorkerGroup
from ckptless.recovery import Assignment
from ckptless.recovery import ErrorSummary, ExitRecord
from ckptless.worker import exit_file

log = logging.getLogger("ckptless.agent")


def start(st: NodeState, group: WorkerGroup, local_rank: int, a: Assignment, generation: int) -> None:
    """Start ``a``'s rank in ``local_rank``, whose previous worker exited (the node machine waited for it,
    bounded, and chose the slot: launcher/node_machine.py)."""
    ok, gpu = st.slots.claim_device(local_rank)  # its GPU, or another if that one failed
    if not ok:
        _no_gpu(st, a)
        return
    log.warning("respawning rank %d as %s (generation %d%s)", a.rank, a.worker_id, generation,
                "" if gpu is None else f", GPU {gpu}")
    slot = st.slots.get(local_rank)
    st.slots.reset(local_rank, a.worker_id, a.rank)
    try:  # the new incarnation must not be judged by its predecessor's files
        os.unlink(slot.heartbeat_file)
    except FileNotFoundError:
        pass
    exit_file.clear(st.exit_path(local_rank))
    try:
        group.respawn(local_rank, {
            "CKPTLESS_WORKER_ID": a.worker_id, "CKPTLESS_ROLE": "replacement",
            "CKPTLESS_GENERATION": str(generation), "RANK": str(a.rank), **st.respawn_device_env(gpu),
        })
    except CkptlessError:
        log.exception("respawn of rank %d failed", a.rank)


def _no_gpu(st: NodeState, a: Assignment) -> None:
    """The plan respawns a rank here, but no good GPU is free (the exit record said there was one;
    another start took it since). Not started; its exit is recorded at once as a failed start that
    this node cannot retry, so the leader re-plans (a spare, or a wait) instead of waiting out the
    formation deadline for a worker that never comes."""
    bad = sorted(st.slots.bad_gpus())
    why = f"no free good GPU on this node for rank {a.rank} ({st.slots.gpus} GPUs, failed: {bad or 'none'})"
    log.error("not respawning rank %d: %s", a.rank, why)
    rec = ExitRecord(rank=a.rank, worker_id=a.worker_id, node_id=st.node_id, pid=-1, exitcode=None, signal=None,
                     time=time.time(), kind="device", error=ErrorSummary("NoFreeGPU", why), respawnable=False)
    st.outbox.put(st.keyspace.worker_exit(a.rank), rec.to_json(), f"the failed start of rank {a.rank}")


def reexec(st: NodeState, local_rank: int, worker_id: str, rank: int, generation: int) -> None:
    """Start the pre-built spare in ``local_rank`` again as ``rank``, under the same worker id (the node
    machine decided it once the membership that assigns the rank reached us: launcher/node_machine.py)."""
    group = st.group
    if group is None:
        return
    slot = st.slots.get(local_rank)
    exit_file.clear(st.exit_path(local_rank))
    log.warning("spare %s restarts as rank %d (generation %d)", worker_id, rank, generation)
    st.slots.reset(local_rank, worker_id, rank)
    try:  # its new incarnation must not be judged by the standby's last beat
        os.unlink(slot.heartbeat_file)
    except FileNotFoundError:
        pass
    try:
        group.respawn(local_rank, {"CKPTLESS_ROLE": "spare", "RANK": str(rank),
                                   "CKPTLESS_GENERATION": str(generation), "CKPTLESS_STANDBY_RANK": ""})
    except CkptlessError:
        log.exception("restarting spare %s as rank %d failed", worker_id, rank)
