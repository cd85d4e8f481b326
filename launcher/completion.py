"""How a node's part in the job ends: the job's status record, this agent's exit code, the failure it prints.

Why a module of its own: when to leave is the agent's most consequential
decision and the one with the most cases. A stop signal exits 128+N; a job
that failed (its ``status`` record) exits 1 with the root cause printed; a
node whose ranks all finished exits 0 -- but the store's host waits for the
other nodes' exit records first (they may still need its store), and not on
an etcd that is gone: a finished job never exits non-zero (a scheduler reads
that as a failed job). "All its ranks" are the ranks the membership it
follows places on it, each finished by the worker that membership names
(:func:`node_part`), never "no slot holds a rank right now". A node cut off
from etcd past the node grace, with none of its workers left, or whose ranks
the membership moved to other nodes while it keeps no spare, exits 1 with
one line saying so: the job went on without it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Literal

from ckptless.coordinator.client import Compare, Put
from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.slots import Slot
from ckptless.launcher.summary import render_failure
from ckptless.recovery.view import ExitRecord, JobStatus

log = logging.getLogger("ckptless.agent")


class AgentOutcome:
    def __init__(self, exit_code: int, failed_ranks: tuple[int, ...]) -> None:
        self.exit_code = exit_code
        self.failed_ranks = failed_ranks


def send_status(st: NodeState, status: JobStatus) -> None:
    """Record the job's end in etcd (the first writer wins) and here."""
    try:
        assert st.client is not None
        st.client.txn([Compare(st.keyspace.status, "create", "==", 0)],
                      [Put(st.keyspace.status, status.to_json())])
    except CoordinatorError as exc:
        log.error("could not record the job's end in etcd: %s", exc)
    if st.status is None:
        st.status = status


def read_status(st: NodeState) -> JobStatus | None:
    assert st.client is not None
    kv = st.client.get(st.keyspace.status)
    return None if kv is None else JobStatus.from_json(kv.value)


def print_failure(st: NodeState, status: JobStatus) -> None:
    lr = {s.rank: s.local_rank for s in st.slots.all() if s.rank is not None}
    text = render_failure(st.cfg.training_script, status, st.local_failures, lr)
    print(text, file=sys.stderr, flush=True)


def done(st: NodeState) -> int | None:
    """The exit code once this agent is done, else None."""
    if st.stop_signal is not None:
        return 128 + st.stop_signal
    status = st.status
    if status is not None and status.state == "failed":
        return 1
    part = node_part(st.slots.all(), my_ranks(st))
    if part == "finished":
        # Our ranks passed the final commit: the job's training is complete. The store's host
        # waits for the others' exit records (they may still need the store), but not on an
        # etcd that is gone: a finished job never exits non-zero (a scheduler reads that as
        # a failed job).
        if not _hosts_store(st):
            return 0
        if _all_ranks_finished(st):
            _record_success(st)
            return 0
        if _etcd_gone_past_grace(st):
            print("ckptless-run: this node's ranks all finished the job; etcd has been unreachable for "
                  f"{time.monotonic() - (st.lost_since or 0.0):.0f}s, so the other nodes' exit records "
                  "cannot be read: leaving with success", file=sys.stderr, flush=True)
            return 0
    if status is not None and status.state == "succeeded":
        return 0
    if part in ("spare_only", "spares") and _all_ranks_finished(st):
        return 0  # a node that only keeps spares outlives nobody
    if part == "moved" and not _hosts_store(st):
        _say_moved(st)
        return 1
    if _cut_off(st):
        return 1
    return None


def _record_success(st: NodeState) -> None:
    """The store's host, the last to leave, records the job's success unless the leader did already (the
    leader's agent may leave first): an agent started after the job reads it and exits 0 at once
    (launcher/admission.py) instead of waiting for a round of its own. Only with recovery: a relaunch
    clears the old run's records only then (recovery/leader.py, write_initial_membership), and a job
    without recovery would otherwise find its last run's success and end at once."""
    # Note: a job that ended shrunk (--lost-node shrink, never grown back) says "all N ranks finished" of
    # its last generation's N, though the others wrote no final state (issue 35 finding 9); the branch
    # loaderseed rewrites the finished-job message in completion/summary: make this reason say the same
    # once both are merged.
    if st.recovery and st.status is None and st.membership is not None:
        send_status(st, JobStatus("succeeded", f"all {st.membership.world_size} ranks finished"))


Part = Literal["spare_only", "running", "finished", "spares", "moved"]


def node_part(slots: Sequence[Slot], mine: Mapping[int, str]) -> Part:
    """Where this node's part in the job stands: from its slot table and the ranks the membership it
    follows places here (``mine``: rank -> worker id, a hosted rank excluded: its host runs it).

    * ``spare_only``: no slot ever ran a rank (a spare-only or late node still waiting to serve);
    * ``running``: a slot runs a rank, or a rank placed here has not ended well here yet (a respawn
      the follower is starting, or a failure the leader has yet to re-plan);
    * ``finished``: every rank placed here ended well in the worker the membership names;
    * ``spares``: the membership places no rank here any more and live spares of ours remain;
    * ``moved``: the membership places no rank here and nothing of ours is left to serve: the job went
      on without this node (e.g. its agent was paused past ``--node-grace`` and its ranks run elsewhere).

    Why the membership and not the slots alone: between a membership that moves a rank's worker (the
    follower unassigns the old slot) and the respawn that starts it again in this node, no slot holds a
    rank; judged by the slots alone that read as "all our ranks finished", and an agent paused past the
    node grace exited 0 there, before respawning its ranks, while its job waited for them and failed
    (issue 35)."""
    if not any(s.ever_ranked for s in slots):
        return "spare_only"
    if any(s.alive and s.rank is not None for s in slots):
        return "running"
    if mine:
        by_worker = {s.worker_id: s for s in slots}
        placed = [by_worker.get(w) for w in mine.values()]
        ended_well = all(s is not None and s.succeeded and not s.alive for s in placed)
        assigned_well = all(s.succeeded for s in slots if s.rank is not None)
        return "finished" if ended_well and assigned_well else "running"
    return "spares" if any(s.spare and s.alive for s in slots) else "moved"


def my_ranks(st: NodeState) -> dict[int, str]:
    """The ranks the membership this agent follows places on this node, with their worker ids."""
    m = st.membership
    if m is None:
        return {}
    return {a.rank: a.worker_id for a in m.ranks if a.node_id == st.node_id and a.source != "hosted"}


def _say_moved(st: NodeState) -> None:
    """One line: why this agent leaves while its job goes on (exit 1: this node failed the job)."""
    m = st.membership
    ran = sorted({r for s in st.slots.all() for r in (s.rank, s.last_rank) if r is not None})
    why = ("this agent lost its lease (paused, or cut off from etcd) and the coordinator gave the node up "
           f"after --node-grace {st.cfg.node_grace:.0f}s" if st.lease_lapsed_at is not None
           else "the coordinator re-planned them")
    print(f"ckptless-run: this node's ranks {ran} run on other nodes since generation "
          f"{m.generation if m is not None else '?'} ({why}), and it keeps no spare: leaving; the job goes on "
          "without this node", file=sys.stderr, flush=True)


def _etcd_gone_past_grace(st: NodeState) -> bool:
    lost = st.lost_since
    return lost is not None and time.monotonic() - lost > st.cfg.node_grace + st.cfg.lease_ttl


def _cut_off(st: NodeState) -> bool:
    """Cut from etcd past the node grace with none of our workers left: the job went on without us.

    While etcd is merely down for everyone, our workers keep training and we stay;
    only once they have all ended (not by finishing) is there nothing left to wait for.
    """
    if not st.slots.ever_ranked() or not _etcd_gone_past_grace(st):
        return False
    if any(s.alive for s in st.slots.all() if s.rank is not None):
        return False
    lost = st.lost_since or 0.0
    print(f"ckptless-run: this node was cut off from etcd for {time.monotonic() - lost:.0f}s (more than "
          f"--node-grace {st.cfg.node_grace:.0f}s) and its workers have ended: its ranks were re-planned "
          "elsewhere; leaving", file=sys.stderr, flush=True)
    return True


def _hosts_store(st: NodeState) -> bool:
    """This agent hosts the current generation's store (others may still need it to finish)."""
    m = st.membership
    return m is not None and m.store_port == st.store_port and m.store_host == st.host


def _all_ranks_finished(st: NodeState) -> bool:
    m = st.membership
    if m is None or st.client is None:
        return False
    try:
        # A poll of the main loop: a short deadline, so an etcd that is gone does not hold the loop
        # (and the lease renewal that notices the outage) for the client's whole call deadline.
        exits, _ = st.client.get_prefix(st.keyspace.exits_prefix, timeout_s=2.0)
    except CoordinatorError:
        return False
    ok = set()
    for kv in exits:
        try:
            rec = ExitRecord.from_json(kv.value)
        except CkptlessError:
            continue
        if 0 <= rec.rank < m.world_size and rec.exitcode == 0 and rec.worker_id == m.worker_of(rec.rank).worker_id:
            ok.add(rec.rank)
    return len(ok) == m.world_size
