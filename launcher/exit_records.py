"""A worker's exit, recorded: the reaper's callback that puts its ExitRecord in etcd, then decides.

Why a module of its own: the exit record is the fact a recovery starts from
(the leader plans on it within milliseconds of the reap), so it is written
first, from the reaper thread, through the outbox (it must never block on an
etcd that is away). What the record says comes from the worker's own exit
file: a fault is recovered, a user error ends the job; a pre-built spare that
exits to restart as another rank is no failure and is started again
(launcher/respawn.py, once the node machine says so); a spare that died
leaves the pool. With the node-local
tier (``--shm-dir``) the record also names the newest version of the rank's
own image found intact on this node. A worker whose GPU failed (kind
``device``) has that GPU marked bad for good (one warning naming it), and its
record says whether this node can start the rank again on another good GPU
(``respawnable``; launcher/devices.py). A worker the agent killed stuck in
its teardown, after its program ended, is recorded with the code its program
ended with (launcher/watchdog.py). Without recovery, the first failure
ends the job, as with torchrun (the node machine decides: launcher/node_machine.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ckptless import environment
from ckptless.launcher.node_machine import ExitRecorded, ReexecAsked
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.worker_process import WorkerExit
from ckptless.recovery import NodeLocalCopy, NodeLocalImage
from ckptless.recovery import ErrorSummary, ExitRecord
from ckptless.worker import exit_file

log = logging.getLogger("ckptless.agent")


def record_exit(st: NodeState, ex: WorkerExit) -> None:
    """Called by the reaper the moment a worker is reaped: into etcd first, then decide."""
    slot = st.slots.get(ex.local_rank)
    if ex.pid in st.killed_in_teardown:
        # Killed by us in its teardown, after its program ended: it ended as its program said.
        end = exit_file.read_end(st.exit_path(ex.local_rank), ex.pid)
        if end is not None:
            ex = replace(ex, exitcode=end[0], signal=None)
    kind, error = exit_file.read(st.exit_path(ex.local_rank), pid=ex.pid)
    if kind == "reexec" and not ex.requested:
        # A pre-built spare assigned another rank than the one it built for: start it again
        # (warm) as that rank, under the same worker id. Not a failure: nothing is recorded.
        lr = ex.local_rank
        st.feed(lambda slots: ReexecAsked(lr, slots))  # now, or once the membership that assigns it reaches us
        return
    respawnable = True
    if kind == "device":
        respawnable = _gpu_failed(st, ex.local_rank, slot.worker_id, slot.rank is None, error)
    rec = ExitRecord(rank=-1 if slot.rank is None else slot.rank, worker_id=slot.worker_id, node_id=st.node_id,
                     pid=ex.pid, exitcode=ex.exitcode, signal=ex.signal, time=ex.wall,
                     requested=ex.requested, kind=kind, error=error, respawnable=respawnable)
    st.slots.exited(ex.local_rank, ex.succeeded)
    # The node-local tier: checksum the own image the worker left in --shm-dir off the reaper
    # thread (~25 ms per 256 MiB), and record the version found intact with its exit.
    shm = st.cfg.shm_dir
    if slot.rank is not None and shm and st.recovery and rec.outcome == "fault":
        rank = slot.rank

        def with_local_image() -> bytes:
            from ckptless.mirror import newest_verified

            try:
                m = newest_verified(shm, st.cfg.run_id, st.node_id, rank)
            except Exception:  # never lose an exit record to a failed look at shm: peers have it
                log.exception("rank %d: checking its node-local image failed", rank)
                m = None
            img = None if m is None else NodeLocalImage(rank, st.node_id, m.version, len(m.chunk_checksums),
                                                        m.generation)
            return replace(rec, local_image=img, local_replicas=_local_replicas(shm, st, rank)).to_json()

        st.outbox.put(st.keyspace.worker_exit(rank), with_local_image, f"the exit of rank {rank}")
    elif slot.rank is not None:
        st.outbox.put(st.keyspace.worker_exit(slot.rank), rec.to_json(), f"the exit of rank {slot.rank}")
    else:  # a spare that died is never assigned: it leaves the pool at once, and says it died (the
        # leader may have assigned it a rank just before: it must see that worker dead at once)
        st.outbox.delete(st.spares.key(slot.worker_id), f"spare {slot.worker_id}")
        if not ex.succeeded:
            st.outbox.put(st.keyspace.spare_exit(slot.worker_id), rec.to_json(), f"the exit of {slot.worker_id}")
    if not ex.succeeded and not ex.requested:
        log.error("%s", rec.describe())
    # The machine keeps our ranks' failures, and without recovery ends the job on the first (as torchrun).
    st.feed(ExitRecorded(ex.local_rank, rec, slot.rank is not None, ex.succeeded, ex.requested))
    st.wake.set()


def _local_replicas(shm: str, st: NodeState, rank: int) -> tuple[NodeLocalCopy, ...]:
    """The replicas the dead worker of ``rank`` held in this node's shm dir, every chunk checked now
    (~25 ms per 256 MiB, like its own image): a live worker on this node can adopt them (R11), so a
    lost host's copies of the ranks it hosted, or of its mirrored peers, are not lost with it."""
    from ckptless.mirror import verified_copies
    from ckptless.state import manifest_layout_key
    from ckptless.state import first_held_chunk, region_of

    try:
        found = verified_copies(shm, st.cfg.run_id, st.node_id, rank)
        out = []
        for m in found:
            first = first_held_chunk(m)
            region = region_of(m) if first else None
            out.append(NodeLocalCopy(m.owner, rank, st.node_id, m.version, len(m.chunk_checksums), m.generation,
                                     manifest_layout_key(m), first, None if region is None else region.ranks))
        return tuple(c for c in out if c.owner != rank)
    except Exception:  # never lose an exit record to a failed look at shm: it only offers more copies
        log.exception("rank %d: checking the replicas it held in %s failed", rank, shm)
        return ()


def _gpu_failed(st: NodeState, local_rank: int, worker_id: str, spare: bool, error: ErrorSummary | None) -> bool:
    """Mark the worker's GPU bad (for good: a GPU that failed once is not trusted again by this agent)
    and move its slot to another free good GPU; whether one was left (the record's ``respawnable``)."""
    bad, respawnable = st.slots.device_failed(local_rank)
    what = error.one_line() if error is not None else "no error recorded"
    if bad is None:
        # A CPU job as the agent decides it (agent.py gives such workers CKPTLESS_CUDA_BACKEND=none).
        cpu_job = not st.slots.gpus and environment.current().cuda_backend in (None, "none")
        if cpu_job or (error is not None and error.type == "SilentDataCorruption" and not st.slots.gpus):
            # A rank whose replicated state the replica check found corrupt (mirror/replica_check.py, policy
            # replace; on a CPU job the only device exit) on a node whose agent manages no GPU: none to mark,
            # and never "its GPU failed" (issue 35: a CPU job said so); it starts again here, rebuilt from its
            # replicas.
            why = ("a CPU node has no GPU to mark bad" if cpu_job else "this agent assigns no GPU to its workers "
                   f"(CUDA backend {environment.current().cuda_backend}, none counted for this node), so it marks "
                   "none bad")
            log.warning("%s left as failed hardware (%s): its device or memory is suspect; %s, so its rank may "
                        "start again here", worker_id, what, why)
            return True
        log.warning("%s: its GPU failed (%s), and this agent does not know which GPU it used: its rank is "
                    "not started again on this node", worker_id, what)
        return False
    if spare:
        then = "the spare leaves the pool"
    elif respawnable:
        then = f"its rank may start again here on GPU {st.slots.get(local_rank).device}"
    else:
        then = "no other good GPU is free, so its rank is not started again on this node"
    log.warning("GPU %d is marked bad: %s failed on it (%s); %s", bad, worker_id, what, then)
    return respawnable
