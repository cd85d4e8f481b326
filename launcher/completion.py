"""How a node's part in the job ends: the job's status record, this agent's exit code, the failure it prints.

Why a module of its own: when to leave is the agent's most consequential
decision and the one with the most cases. A stop signal exits 128+N; a job
that failed (its ``status`` record) exits 1 with the root cause printed; a
node whose ranks all finished exits 0 -- but the store's host waits for the
other nodes' exit records first (they may still need its store), and not on
an etcd that is gone: a finished job never exits non-zero (a scheduler reads
that as a failed job). A node cut off from etcd past the node grace, with
none of its workers left, exits 1: the job went on without it.
"""

from __future__ import annotations

import logging
import sys
import time

from ckptless.coordinator.client import Compare, Put
from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.launcher.node_state import NodeState
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
    if st.slots.ever_ranked() and st.slots.all_assigned_succeeded():
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
    if not st.slots.ever_ranked() and _all_ranks_finished(st):
        return 0  # a spare-only node outlives nobody
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
