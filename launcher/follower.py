"""The membership follower: how a node agent carries out what the coordinator decided.

Why a module of its own: the agent never plans a recovery; the leader
publishes a new membership (generation) and every agent follows it from its
etcd watch: a spare of ours that was assigned a rank takes it, a rank this
node must run again is respawned (launcher/respawn.py), a worker that is no
longer part of the generation is killed and its slot unassigned (its rank
now runs elsewhere). The same watch brings the job's ``status`` (its end,
see launcher/completion.py) and each incident's opening (for the metrics).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

from ckptless.coordinator.client import WatchEvent
from ckptless.errors import CkptlessError
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.respawn import reexec_if_assigned, respawn_all
from ckptless.recovery.view import JobStatus
from ckptless.recovery.wire import Membership, membership_from_json

log = logging.getLogger("ckptless.agent")


def on_events(st: NodeState, events: list[WatchEvent]) -> None:
    """The etcd watch's callback over the job's ``job/`` keys (membership, status, incidents: all an agent
    follows; the exits, reports and spares are the leader's to read)."""
    for ev in events:
        if ev.key == st.keyspace.membership and ev.kind == "put":
            apply_membership(st, membership_from_json(ev.value))
        elif ev.key == st.keyspace.status and ev.kind == "put":
            try:
                st.status = JobStatus.from_json(ev.value)
            except CkptlessError:
                st.status = JobStatus("failed", "the job's status record is malformed")
        elif ev.kind == "put" and (g := st.keyspace.incident_generation(ev.key)) is not None:
            if g not in st.incident_t:
                st.incident_t[g] = time.monotonic()
                if st.metrics is not None:
                    st.metrics.record_incident()
            since = _waiting_since(ev.value)
            if since is not None and st.metrics is not None:  # the leader noted that the job waits for a node
                st.metrics.set_replacement_waiting(since)
    st.wake.set()


def _waiting_since(raw: bytes) -> float | None:
    """When the job started waiting for a replacement, from an incident record (None: it does not wait)."""
    try:
        w = json.loads(raw).get("waiting")
        return float(w["since"]) if isinstance(w, dict) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def apply_membership(st: NodeState, m: Membership) -> None:
    """Follow a new generation: adopt assigned spares, respawn here, kill the dropped."""
    with st.membership_lock:
        if st.membership is not None and m.generation <= st.membership.generation:
            return
        st.membership = m
        st.published_t.setdefault(m.generation, time.monotonic())
        if st.metrics is not None:
            st.metrics.set_generation(m.generation)
            st.metrics.set_replacement_waiting(0.0)  # a new generation: nothing waits any more
        group = st.group
        if group is None:
            return
        # A hosted rank's entry names its host (fewer ranks): the host's slot keeps its own rank.
        by_worker = {a.worker_id: a for a in m.ranks if a.source != "hosted"}
        for slot in st.slots.all():
            a = by_worker.get(slot.worker_id)
            if a is not None:
                if slot.spare and slot.alive:
                    st.spares.took_rank()  # --spare-refill: the pool owes one
                st.slots.assign(slot.local_rank, a.rank)
            elif slot.rank is not None:
                if slot.alive:
                    log.warning("worker %s is not part of generation %d: killing it", slot.worker_id, m.generation)
                    group.send_signal(slot.local_rank, signal.SIGKILL)
                st.slots.assign(slot.local_rank, None)  # its rank now runs elsewhere
        respawns = [a for a in m.ranks if a.node_id == st.node_id and a.source == "respawn"]
    if respawns:  # off the watch thread: each waits (bounded) for the process it replaces to be reaped
        threading.Thread(target=respawn_all, args=(st, group, respawns, m.generation),
                         name="ckptless-respawn", daemon=True).start()
    for lr in list(st.reexec_pending):
        reexec_if_assigned(st, lr)
    if st.cfg.shm_dir:  # a node lost on this host: its shm files go now, not at the end (issue 17)
        from ckptless.mirror.shm import remove_dead_groups

        remove_dead_groups(st.cfg.shm_dir, st.cfg.run_id)
