"""Starting a rank again in one of this node's slots: a respawn a membership asks for, a spare's re-exec.

Why a module of its own: both put a new incarnation in a slot whose process
ended, and both must keep one order: the old incarnation's exit is recorded
first (under its own worker id), then the slot is reset, then its old
heartbeat and exit files are removed (a new incarnation must not be judged by
its predecessor's), then the worker group starts it (warm, from the fork
server, when it can). The membership follower (launcher/follower.py) asks
for respawns; the exit recorder (launcher/exit_records.py) for the re-exec of
a pre-built spare that was given another rank than the one it built for.
Starting a new spare to refill the pool is launcher/refill.py.
"""

from __future__ import annotations

import logging
import os
import time

from ckptless.errors import CkptlessError
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.workers import WorkerGroup
from ckptless.recovery.decision import Assignment
from ckptless.recovery.view import ErrorSummary, ExitRecord
from ckptless.worker import exit_file

log = logging.getLogger("ckptless.agent")


def respawn_all(st: NodeState, group: WorkerGroup, assignments: list[Assignment], generation: int) -> None:
    """Off the watch thread: each respawn waits (bounded) for the process it replaces to be reaped."""
    for a in assignments:
        _respawn(st, group, a, generation)


def _respawn(st: NodeState, group: WorkerGroup, a: Assignment, generation: int) -> None:
    slot = st.slots.for_rank_slot(a.rank, st.result.rank_offset if st.result else 0)
    if slot is None or slot.worker_id == a.worker_id:
        return
    deadline = time.monotonic() + 10.0  # a SIGKILLed process is reaped within milliseconds
    while st.slots.get(slot.local_rank).alive and time.monotonic() < deadline:
        st.stopping.wait(0.01)  # until its exit is recorded under its own worker id
    if st.slots.get(slot.local_rank).alive:
        log.error("rank %d: the worker it replaces (%s) did not exit; not respawning", a.rank, slot.worker_id)
        return
    ok, gpu = st.slots.claim_device(slot.local_rank)  # its GPU, or another if that one failed
    if not ok:
        _no_gpu(st, a)
        return
    log.warning("respawning rank %d as %s (generation %d%s)", a.rank, a.worker_id, generation,
                "" if gpu is None else f", GPU {gpu}")
    st.slots.reset(slot.local_rank, a.worker_id, a.rank)
    try:  # the new incarnation must not be judged by its predecessor's files
        os.unlink(slot.heartbeat_file)
    except FileNotFoundError:
        pass
    exit_file.clear(st.exit_path(slot.local_rank))
    try:
        group.respawn(slot.local_rank, {
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


def reexec_when_assigned(st: NodeState, local_rank: int) -> None:
    """A pre-built spare exited to be started again as the rank it was given: now, or once the
    membership that assigns it reaches us (the follower calls :func:`reexec_if_assigned` again)."""
    with st.membership_lock:
        st.reexec_pending.add(local_rank)
    reexec_if_assigned(st, local_rank)


def reexec_if_assigned(st: NodeState, local_rank: int) -> None:
    group, m = st.group, st.membership
    slot = st.slots.get(local_rank)
    with st.membership_lock:
        if local_rank not in st.reexec_pending or group is None or m is None or slot.rank is None:
            return  # the membership that assigns it has not reached us yet: the follower calls again
        st.reexec_pending.discard(local_rank)
    exit_file.clear(st.exit_path(local_rank))
    log.warning("spare %s restarts as rank %d (generation %d)", slot.worker_id, slot.rank, m.generation)
    st.slots.reset(local_rank, slot.worker_id, slot.rank)
    try:  # its new incarnation must not be judged by the standby's last beat
        os.unlink(slot.heartbeat_file)
    except FileNotFoundError:
        pass
    try:
        group.respawn(local_rank, {"CKPTLESS_ROLE": "spare", "RANK": str(slot.rank),
                                   "CKPTLESS_GENERATION": str(m.generation), "CKPTLESS_STANDBY_RANK": ""})
    except CkptlessError:
        log.exception("restarting spare %s as rank %d failed", slot.worker_id, slot.rank)
