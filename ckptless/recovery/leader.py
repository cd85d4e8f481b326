"""The coordinator leader's driver: the I/O around :mod:`ckptless.recovery.leader_machine`.

Every agent runs one :class:`RecoveryLeader`; only the elected one acts. The
driver campaigns, reads the job's keys into a :class:`JobView`, feeds it to
the pure machine and executes the actions it returns:

* ``OpenIncident``: put ``incident/g<G>`` (workers watch it and stop to report);
* ``RequestPlan``: build facts from the last view (plus the newest verified
  disk snapshot), run the pure planner, answer ``Planned``;
* ``Publish``: generation bump + membership + spare removals in ONE
  transaction fenced on the generation key's revision and on our election
  key. A lost reply is resolved by re-reading the token we wrote, so a plan
  is never published twice nor assumed published when it was not;
* ``EndJob``: put ``status`` (agents stop their workers and print it);
* ``Resign``: a leader that lost a fencing race deletes its election key and
  campaigns again, so the job is never left without a planner.

The machine's clock is the monotonic clock minus time spent with etcd
unreachable: deadlines wait for facts in etcd, and none can arrive while it is
down, so an outage does not turn into silent ranks declared lost.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable

from ckptless import chaos_hooks
from ckptless.coordinator import Compare, Delete, EtcdClient, Get, Put, WatchEvent
from ckptless.coordinator import Election
from ckptless.coordinator import Keyspace
from ckptless.coordinator import NodeInfo, Session
from ckptless.errors import CkptlessError, CoordinatorError, CoordinatorUnavailable, NotLeader, RendezvousError
from ckptless.recovery.facts import PlanPolicy
from ckptless.recovery.store_choice import store_for_generation
from ckptless.recovery.gather import plan_from_view
from ckptless.recovery.leader_machine import (
    INITIAL,
    Action,
    AskGrow,
    Deposed,
    EndJob,
    Ended,
    Event,
    Fenced,
    LeaderConfig,
    Log,
    NoteWaiting,
    Observed,
    OpenIncident,
    Planned,
    PlanFailed,
    Publish,
    Published,
    PublishRejected,
    RequestPlan,
    Resign,
    State,
    replacement_key,
    step,
)
from ckptless.recovery.decision import DiskFallback, RecoveryPlan
from ckptless.recovery.view import JobStatus, JobView, parse_records
from ckptless.recovery.wire import Membership, membership_from_json, membership_to_json, spare_from_json

log = logging.getLogger(__name__)

POLL_S = 0.5  # re-read facts at least this often (deadlines); watches wake us sooner


class RecoveryLeader:
    def __init__(
        self,
        client: EtcdClient,
        keyspace: Keyspace,
        session: Session,
        store_host: str,
        store_port: int,
        config: LeaderConfig,
        snapshot_step: Callable[[int, frozenset[int]], int | None] | None = None,
        on_event: Callable[[str, dict[str, object]], None] | None = None,
    ) -> None:
        self.config = config
        self._client = client
        self._ks = keyspace
        self._session = session
        self.store_host, self.store_port = store_host, store_port
        self._snapshot_step = snapshot_step or (lambda _world, _exclude: None)
        self._bad_snapshots: set[int] = set()  # steps a worker failed to load: never chosen again
        self._bad_copies: set[tuple[str, int, int, int]] = set()  # node-local copies that failed adoption
        self._on_event = on_event or (lambda _kind, _attrs: None)
        self._election = Election(client, session, keyspace.election_prefix)
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ckptless-leader", daemon=True)
        self.is_leader = threading.Event()
        self.state: State = INITIAL
        self._view: JobView | None = None
        self._outage_s = 0.0  # total time etcd was unreachable while we led

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=5)

    def _now(self) -> float:
        return time.monotonic() - self._outage_s

    # --- main loop ---------------------------------------------------------------------------
    def _main(self) -> None:
        while not self._stop.is_set() and not self._session.done.is_set():
            if not self._campaign():
                return
            self.is_leader.set()
            log.info("this agent leads job %s", self._ks.job_id)
            self.state = INITIAL
            try:
                self._lead()
            except Exception as exc:  # a bug in the leader: one clear line, a terminal state, no retry loop
                log.exception("the coordinator leader failed")
                self._end_after_bug(exc)
                return
            finally:
                self.is_leader.clear()
            if isinstance(self.state, Ended):
                return
            # Deposed: our key is gone (resigned); queue up again behind the new leader.

    def _campaign(self) -> bool:
        while not self._stop.is_set():
            try:
                self._session.check()
                # Waits on etcd until we lead (or stop): no re-campaign, no events while we wait.
                self._election.campaign(self._session.name, timeout_s=math.inf, stop=self._stop)
                return True
            except CoordinatorError:
                if self._session.done.is_set():
                    return False  # our lease is gone: this agent is finished, nothing to lead
                self._stop.wait(0.1)  # etcd briefly away: campaign again (keeping our place)
        return False

    def _lead(self) -> None:
        watch = self._client.watch_prefix(self._ks.prefix, self._on_events)
        down_since: float | None = None
        try:
            while not self._stop.is_set() and not self._session.done.is_set():
                self._changed.clear()
                try:
                    view = self.read_view()
                except CoordinatorUnavailable as exc:
                    if down_since is None:
                        down_since = time.monotonic()
                        log.warning("etcd unreachable (%s): recovery decisions wait for it", exc)
                    self._changed.wait(POLL_S)
                    continue
                if down_since is not None:
                    self._outage_s += time.monotonic() - down_since
                    log.warning("etcd reachable again after %.1fs", time.monotonic() - down_since)
                    down_since = None
                self._view = view
                self._bad_snapshots |= view.bad_snapshots
                self._bad_copies |= view.bad_copies
                self._feed(Observed(view, self._now()))
                if isinstance(self.state, (Ended, Deposed)):
                    return
                self._changed.wait(POLL_S)
        finally:
            watch.cancel()

    def _on_events(self, events: list[WatchEvent]) -> None:
        self._changed.set()

    def _feed(self, event: Event) -> None:
        pending: list[Event] = [event]
        while pending:
            self.state, actions = step(self.state, pending.pop(0), self.config)
            for action in actions:
                follow = self._execute(action)
                if isinstance(follow, Fenced):  # not ours to act on any more: nothing else of this step
                    pending = [follow]
                    break
                if follow is not None:
                    pending.append(follow)

    # --- facts -----------------------------------------------------------------------------------
    def read_view(self) -> JobView:
        """Every record the leader decides on, read in one etcd transaction (one revision).

        Why one: read one by one, the nine reads were nine round trips between a survivor's last
        report and the plan, each waiting for etcd's turn on a busy machine (issue 35), and each read
        at another revision. The records of the newest generation are read with the rest for the
        generation the last view saw; when the membership read shows a newer one, a second
        transaction reads that generation's (its reports, ready marks, incident)."""
        ks = self._ks
        known = self._view.membership.generation if self._view is not None and self._view.membership else None
        fixed = [Get(ks.membership), Get(ks.exits_prefix, prefix=True), Get(ks.nodes_prefix, prefix=True),
                 Get(ks.spares_prefix, prefix=True), Get(ks.status), Get(ks.ported)]
        reads = self._client.txn([], [*fixed, *(self._generation_reads(known) if known is not None else [])]).reads
        membership, exits, nodes, spares, status, ported = reads[:6]
        m = membership_from_json(membership[0].value) if membership else None
        reports: list[tuple[str, bytes]] = []
        ready: list[str] = []
        incident = False
        if m is not None:
            own = reads[6:] if m.generation == known else self._client.txn([], self._generation_reads(m.generation)).reads
            facts, marks, opened = own
            reports, ready, incident = [(r.key, r.value) for r in facts], [r.key for r in marks], bool(opened)
        view = parse_records(
            m, [(e.key, e.value) for e in exits], [n.key.rsplit("/", 1)[1] for n in nodes], reports, ready,
            [(s.key, s.value) for s in spares], status[0].value if status else None, incident, bool(ported))
        for key in view.malformed:
            log.warning("ignoring malformed record %s", key)
        return view

    def _generation_reads(self, generation: int) -> list[Get]:
        ks = self._ks
        return [Get(ks.facts_prefix(generation), prefix=True), Get(ks.ready_prefix(generation), prefix=True),
                Get(ks.incident(generation))]

    # --- actions ------------------------------------------------------------------------------------
    def _execute(self, action: Action) -> Event | None:
        if isinstance(action, Log):
            getattr(log, action.level)("%s", action.message)
        elif isinstance(action, OpenIncident):
            fenced = self._write(Put(self._ks.incident(action.generation), json.dumps(
                {"lost": list(action.lost), "reason": action.reason[:1000], "t": time.time()})), "an incident")
            if fenced is not None:
                return fenced
            self._on_event("incident_opened", {"generation": action.generation,
                                               "lost": ",".join(map(str, action.lost))})
        elif isinstance(action, NoteWaiting):
            return self._note_waiting(action)
        elif isinstance(action, AskGrow):
            return self._write(Put(self._ks.grow(action.generation), json.dumps({"hosted": list(action.hosted),
                                                                                "t": time.time()})), "a grow request")
        elif isinstance(action, RequestPlan):
            return self._plan(action)
        elif isinstance(action, Publish):
            return self._publish(action.decision, action.from_generation)
        elif isinstance(action, EndJob):
            return self._end(action.status)
        elif isinstance(action, Resign):
            log.warning("resigning leadership: %s", action.reason)
            try:
                self._election.resign()
            except CoordinatorError:
                log.info("resign failed; our key expires with our lease", exc_info=True)
        return None

    def _write(self, op: Put, what: str, guard: tuple[Compare, ...] = ()) -> Fenced | None:
        """One write of the leader's, fenced on our election key (as a publish is): a leader whose lease
        lapsed while it was paused resumes with its old state and a clock that jumped (a report deadline,
        a replacement deadline long past) before its session notices; its successor leads by then, and
        an incident, a note or the job's end it wrote now would be decided on nothing (issue 35).
        ``guard``: the write's own conditions; when only those fail, nothing is written and we still lead."""
        try:
            fence = self._election.fence
        except NotLeader as exc:
            return Fenced(f"{what} not written: {exc}", self._now())
        if self._client.txn([fence, *guard], [op]).succeeded:
            return None
        if not guard or not self._client.txn([fence]).succeeded:
            return Fenced(f"{what} not written: our election key {self._election.key} is gone or another's "
                          "(our lease lapsed: another agent leads)", self._now())
        return None

    def _note_waiting(self, action: NoteWaiting) -> Fenced | None:
        """The incident record says the job waits for a replacement, since when and until when (read by
        ``ckptless status``); one etcd write per incident that waits."""
        key, now = self._ks.incident(action.generation), time.time()
        kv = self._client.get(key)
        try:
            record = json.loads(kv.value) if kv is not None else {}
        except ValueError:
            record = {}
        record["waiting"] = {"since": now, "until": now + action.deadline_in_s, "ranks": list(action.lost),
                             "reason": action.reason[:500]}
        fenced = self._write(Put(key, json.dumps(record)), "the note of a wait for a replacement")
        if fenced is None:
            self._on_event("replacement_waiting", {"generation": action.generation,
                                                   "lost": ",".join(map(str, action.lost))})
        return fenced

    def _plan(self, action: RequestPlan) -> Event:
        view = self._view
        assert view is not None and view.membership is not None
        try:
            snap = self._snapshot_step(view.membership.world_size, frozenset(self._bad_snapshots))
            policy = PlanPolicy(lost_node="shrink" if self.config.lost_node == "shrink" else "wait",
                                min_nodes=self.config.min_nodes)
            decision, notes = plan_from_view(view, self._ks.job_id, action.lost, self.config.replicas,
                                             self.config.placement, snap, policy, frozenset(self._bad_copies))
        except CkptlessError as exc:
            return PlanFailed(f"{type(exc).__name__}: {exc}", self._now())
        return Planned(decision, tuple(notes), self._now(), replacement_key(view))

    def _live_stores(self) -> list[tuple[str, tuple[str, int]]]:
        """(node id, its store's address) of every agent whose lease is alive (one read: O(nodes))."""
        out = []
        for kv in self._client.get_prefix(self._ks.nodes_prefix)[0]:
            try:
                info = NodeInfo.from_json(json.loads(kv.value))
            except (ValueError, RendezvousError):
                continue  # a malformed record: that node's store is not kept
            out.append((info.node_id, (info.host, info.store_port)))
        return out

    def _publish(self, decision: RecoveryPlan | DiskFallback, from_generation: int) -> Event:
        view = self._view
        assert view is not None and view.membership is not None
        m = view.membership
        gen_kv = self._client.get(self._ks.generation)
        current = 0 if gen_kv is None else int(json.loads(gen_kv.value)["generation"])
        if current != from_generation:
            return PublishRejected(True, f"generation is {current}, the plan is for {from_generation}", self._now())
        store_host, store_port = store_for_generation((m.store_host, m.store_port), (self.store_host, self.store_port),
                                                      self._live_stores(), (a.worker_id for a in decision.assignments))
        new = Membership(decision.generation, m.world_size, store_host, store_port, decision.assignments, decision)
        token = uuid.uuid4().hex
        spare_ids = {a.worker_id for a in decision.assignments if a.source == "spare"}
        ops: list[Put | Delete] = [
            Put(self._ks.generation, json.dumps({"generation": new.generation, "reason": "recovery", "token": token})),
            Put(self._ks.membership, membership_to_json(new)),
        ]
        kvs, _ = self._client.get_prefix(self._ks.spares_prefix)
        ops += [Delete(kv.key) for kv in kvs if spare_from_json(kv.value).worker_id in spare_ids]
        guard = Compare(self._ks.generation, "mod", "==", 0 if gen_kv is None else gen_kv.mod_revision)
        chaos_hooks.pause_point("leader:before_publish", generation=new.generation)
        try:
            if self._client.txn([guard, self._election.fence], ops).succeeded:
                return self._published(decision)
        except CoordinatorError as exc:
            log.warning("publishing generation %d: %s; checking whether it committed", new.generation, exc)
        # The reply may have been lost after the transaction committed (a retried txn then
        # fails its compare): our token in the generation record is the proof either way.
        try:
            kv = self._client.get(self._ks.generation)
            if kv is not None and token.encode() in kv.value:
                return self._published(decision)
            still = self._client.txn([self._election.fence]).succeeded
        except CoordinatorError as exc:
            return PublishRejected(True, f"outcome unknown ({exc}); re-reading", self._now())
        return PublishRejected(still, "the generation or the leadership changed while publishing", self._now())

    def _published(self, decision: RecoveryPlan | DiskFallback) -> Event:
        resume = decision.resume_version if isinstance(decision, RecoveryPlan) else decision.snapshot_step
        # The ranks the plan replaces: a node loss is often known only now (the incident opened on a
        # survivor's report, before the node's lease ran out), so the report takes them from here too.
        replaced = sorted(a.rank for a in decision.assignments if a.source != "survivor")
        self._on_event("plan_published", {"generation": decision.generation, "resume_step": resume,
                                          "decision": "memory" if isinstance(decision, RecoveryPlan) else "disk",
                                          "lost": ",".join(map(str, replaced))})
        return Published(decision.generation, self._now())

    def _end(self, status: JobStatus) -> Fenced | None:
        # Create-if-absent: the first ending wins, a later one (another leader) never overwrites it.
        return self._write(Put(self._ks.status, status.to_json()), "the job's end",
                           guard=(Compare(self._ks.status, "create", "==", 0),))

    def _end_after_bug(self, exc: BaseException) -> None:
        try:
            self._end(JobStatus("failed", f"internal error in the coordinator leader: {type(exc).__name__}: {exc}"))
        except CoordinatorError:
            log.error("could not record the leader's failure in etcd")


def write_initial_membership(client: EtcdClient, ks: Keyspace, m: Membership, round_: int = 0,
                             writer: bool = True, deadline: float | None = None) -> Membership:
    """Generation 0's membership for rendezvous round ``round_``.

    The ``writer`` (node rank 0) clears what a previous run of the same job id
    left (its membership, generation, exits, reports, status: a whole-job
    restart must not inherit them), then writes generation 0 and the round;
    every other agent waits until the round is this one before reading, so
    nobody ever reads the previous run's membership.
    """
    kv = client.get(ks.round)
    if writer and (kv is None or int(kv.value) != round_):
        for prefix in ks.run_state_prefixes():
            client.delete_prefix(prefix)
        client.txn([], [Put(ks.membership, membership_to_json(m)),
                        Put(ks.generation, json.dumps({"generation": 0, "reason": "start"})),
                        Put(ks.round, str(round_))])
    end = time.monotonic() + (900.0 if deadline is None else max(0.0, deadline - time.monotonic()))
    while True:
        kv = client.get(ks.round)
        if kv is not None and int(kv.value) == round_:
            mk = client.get(ks.membership)
            if mk is not None:
                return membership_from_json(mk.value)
        if time.monotonic() >= end:
            raise CoordinatorError(f"generation 0 of round {round_} was not written in time")
        time.sleep(0.05)  # written by node rank 0 right after the same rendezvous: bounded above
