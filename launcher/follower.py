"""The membership follower: how a node agent carries out what the coordinator decided.

Why a module of its own: the agent never plans a recovery; the leader
publishes a new membership (generation) and every agent follows it from its
etcd watch. This module turns what the watch brings (a membership, the
job's ``status``, an incident's opening) into events of the node's machine;
the machine (launcher/node_machine.py) decides what follows: a spare of ours
that was assigned a rank takes it, a rank this node must run again is
respawned (launcher/respawn.py), a worker that is no longer part of the
generation is killed and its slot unassigned (its rank now runs elsewhere).
"""

from __future__ import annotations

import json

from ckptless.coordinator import WatchEvent
from ckptless.errors import CkptlessError
from ckptless.launcher.node_machine import IncidentSeen, MembershipSeen, StatusSeen
from ckptless.launcher.node_state import NodeState
from ckptless.recovery import JobStatus
from ckptless.recovery import membership_from_json


def on_events(st: NodeState, events: list[WatchEvent]) -> None:
    """The etcd watch's callback over the job's ``job/`` keys (membership, status, incidents: all an agent
    follows; the exits, reports and spares are the leader's to read): each becomes an event of the node's
    machine, which decides what follows (launcher/node_machine.py)."""
    for ev in events:
        if ev.key == st.keyspace.membership and ev.kind == "put":
            m = membership_from_json(ev.value)
            st.feed(lambda slots: MembershipSeen(m, slots))
        elif ev.key == st.keyspace.status and ev.kind == "put":
            try:
                status = JobStatus.from_json(ev.value)
            except CkptlessError:
                status = JobStatus("failed", "the job's status record is malformed")
            st.feed(StatusSeen(status))
        elif ev.kind == "put" and (g := st.keyspace.incident_generation(ev.key)) is not None:
            st.feed(IncidentSeen(g, _waiting_since(ev.value)))
    st.wake.set()


def _waiting_since(raw: bytes) -> float | None:
    """When the job started waiting for a replacement, from an incident record (None: it does not wait)."""
    try:
        w = json.loads(raw).get("waiting")
        return float(w["since"]) if isinstance(w, dict) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
