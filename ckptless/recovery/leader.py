"""The coordinator leader: turns reported facts into the next generation.

Every agent runs one :class:`RecoveryLeader`; only the elected one acts. It
watches the job's keys (exit records, node keys, spares, worker reports) and
on a failure in generation G:

1. marks the incident (``incident/gG``) so every worker stops and reports;
2. waits (bounded) for a :class:`WorkerReport` from every surviving rank;
3. calls the pure :func:`plan_recovery` on those facts;
4. writes the new generation and its membership in ONE transaction fenced on
   the generation key's revision and on its own election key, so a deposed
   leader can never publish a plan.

It never guesses: a rank is lost only by an exit record of its current worker,
by its node's key vanishing, or by not reporting before the deadline.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from ckptless.coordinator.client import Compare, Delete, EtcdClient, Put, WatchEvent
from ckptless.coordinator.election import Election
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.session import Session
from ckptless.errors import CkptlessError, CoordinatorError, FencingError
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.facts import PlanningFacts, RankSlot, Worker, WorkerReport
from ckptless.recovery.plan import DiskFallback, RecoveryPlan, Unrecoverable, WaitForReplacement, plan_recovery
from ckptless.recovery.wire import (
    Membership,
    membership_from_json,
    membership_to_json,
    report_from_json,
    spare_from_json,
)

log = logging.getLogger(__name__)


class RecoveryLeader:
    def __init__(
        self,
        client: EtcdClient,
        keyspace: Keyspace,
        session: Session,
        store_host: str,
        store_port: int,
        replicas: int,
        placement: str,
        report_timeout_s: float = 15.0,
        replacement_timeout_s: float = 60.0,
        snapshot_step: Callable[[int], int | None] | None = None,
        fresh_grace_s: float = 2.0,
        max_recoveries: int = 50,
    ) -> None:
        self.max_recoveries = max_recoveries
        self.fresh_grace_s = fresh_grace_s
        self._client = client
        self._ks = keyspace
        self._session = session
        self.store_host, self.store_port = store_host, store_port
        self.replicas, self.placement = replicas, placement
        self.report_timeout_s = report_timeout_s
        self.replacement_timeout_s = replacement_timeout_s
        self._snapshot_step = snapshot_step or (lambda _world: None)
        self._election = Election(client, session, keyspace.election_prefix)
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ckptless-leader", daemon=True)
        self.is_leader = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=5)

    # --- main loop -----------------------------------------------------------
    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self._election.campaign(self._session.name, timeout_s=1.0)
                break
            except CoordinatorError:
                continue  # not yet: campaign again (our key keeps its place in the queue)
            except CkptlessError:
                log.exception("leader election failed")
                return
        if self._stop.is_set():
            return
        self.is_leader.set()
        log.info("this agent leads job %s", self._ks.job_id)
        watch = self._client.watch_prefix(self._ks.prefix, self._on_events)
        try:
            while not self._stop.is_set() and not self._session.done.is_set():
                self._changed.clear()
                try:
                    self._evaluate()
                except FencingError as exc:
                    log.warning("lost leadership while planning: %s", exc)
                    return
                except CkptlessError:
                    log.exception("recovery evaluation failed; retrying on the next change")
                self._changed.wait(1.0)
        finally:
            watch.cancel()

    def _on_events(self, events: list[WatchEvent]) -> None:
        self._changed.set()

    # --- facts -----------------------------------------------------------------
    def membership(self) -> tuple[Membership | None, int]:
        kv = self._client.get(self._ks.membership)
        if kv is None:
            return None, 0
        return membership_from_json(kv.value), kv.mod_revision

    def _lost_ranks(self, m: Membership) -> tuple[set[int], set[str]]:
        nodes, _ = self._client.get_prefix(self._ks.nodes_prefix)
        live_nodes = {kv.key.rsplit("/", 1)[1] for kv in nodes}
        exits, _ = self._client.get_prefix(self._ks.exits_prefix)
        lost: set[int] = set()
        finished: set[int] = set()
        for kv in exits:
            try:
                rec = json.loads(kv.value)
            except ValueError:
                continue
            rank = int(rec.get("rank", -1))
            if not (0 <= rank < m.world_size and rec.get("worker_id") == m.worker_of(rank).worker_id):
                continue  # an earlier incarnation's record
            if rec.get("signal") is not None or rec.get("exitcode") not in (0, None):
                lost.add(rank)
            elif rec.get("exitcode") == 0:
                finished.add(rank)
        dead_nodes = {a.node_id for a in m.ranks if a.node_id not in live_nodes}
        # A rank that finished the job is not lost when its node leaves afterwards.
        lost |= {a.rank for a in m.ranks if a.node_id in dead_nodes and a.rank not in finished}
        if len(finished) == m.world_size:
            return set(), dead_nodes  # the job is complete: nothing to recover
        return lost, dead_nodes

    def _reports(self, generation: int) -> dict[int, WorkerReport]:
        kvs, _ = self._client.get_prefix(self._ks.facts_prefix(generation))
        out: dict[int, WorkerReport] = {}
        for kv in kvs:
            try:
                out[int(kv.key.rsplit("/", 1)[1])] = report_from_json(kv.value)
            except (ValueError, CkptlessError):
                log.warning("ignoring malformed report at %s", kv.key)
        return out

    def _spares(self) -> tuple[Worker, ...]:
        kvs, _ = self._client.get_prefix(self._ks.spares_prefix)
        return tuple(spare_from_json(kv.value) for kv in kvs)

    # --- decision ------------------------------------------------------------------
    def _evaluate(self) -> None:
        m, _ = self.membership()
        if m is None:
            return
        lost, _ = self._lost_ranks(m)
        if not lost:
            return
        t_detect = time.monotonic()
        g = m.generation
        self._client.put(self._ks.incident(g), json.dumps({"lost": sorted(lost), "t": time.time()}))
        log.warning("generation %d: ranks %s lost; collecting reports", g, sorted(lost))
        start = time.monotonic()
        deadline = start + self.report_timeout_s
        # Workers admitted by this generation's plan may still be booting (a cold
        # process takes seconds): after a short grace they are known to hold
        # nothing yet, which is a fact, not a loss.
        fresh = {a.rank for a in m.ranks if a.source in ("respawn", "spare")} if m.decision is not None else set()
        while True:
            lost, dead_nodes = self._lost_ranks(m)
            reports = self._reports(g)
            valid = {r: rep for r, rep in reports.items() if r not in lost and rep.worker_id == m.worker_of(r).worker_id}
            missing = [a.rank for a in m.ranks if a.rank not in lost and a.rank not in valid]
            if missing and time.monotonic() - start >= self.fresh_grace_s:
                for r in [r for r in missing if r in fresh]:
                    valid[r] = WorkerReport(m.worker_of(r).worker_id, None, None)
                missing = [r for r in missing if r not in fresh]
            if not missing:
                break
            if time.monotonic() >= deadline:
                log.warning("generation %d: ranks %s did not report in %.1fs; treating them as lost", g, missing, self.report_timeout_s)
                lost |= set(missing)
                break
            self._changed.clear()
            self._changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        self._decide(m, lost, dead_nodes, valid, t_detect)

    def _facts(self, m: Membership, lost: set[int], dead_nodes: set[str], reports: dict[int, WorkerReport]) -> PlanningFacts:
        node_of = [m.worker_of(r).node_id for r in range(m.world_size)]
        placement = compute_placement(m.world_size, self.replicas, self.placement, node_of) if self.replicas else None
        return PlanningFacts(
            job_id=self._ks.job_id,
            generation=m.generation,
            world_size=m.world_size,
            members=tuple(RankSlot(a.rank, Worker(a.worker_id, a.node_id), a.rank not in lost) for a in m.ranks),
            reports=tuple(reports[r] for r in sorted(reports) if r not in lost),
            spares=self._spares(),
            placement={o: placement.holders(o) for o in range(m.world_size)} if placement else {},
            snapshot_step=self._snapshot_step(m.world_size),
            dead_nodes=frozenset(dead_nodes),
        )

    def _decide(self, m: Membership, lost: set[int], dead_nodes: set[str], reports: dict[int, WorkerReport], t_detect: float) -> None:
        deadline = time.monotonic() + self.replacement_timeout_s
        while True:
            decision = plan_recovery(self._facts(m, lost, dead_nodes, reports))
            if not isinstance(decision, WaitForReplacement):
                break
            if time.monotonic() >= deadline:
                decision = Unrecoverable(self._ks.job_id, m.generation,
                                         f"no replacement for ranks {list(decision.unassigned_ranks)} within "
                                         f"{self.replacement_timeout_s}s: {decision.reason}", ())
                break
            log.warning("waiting for a replacement: %s", decision.reason)
            self._changed.clear()
            self._changed.wait(0.5)
        if not isinstance(decision, Unrecoverable) and m.generation >= self.max_recoveries:
            decision = Unrecoverable(self._ks.job_id, m.generation,
                                     f"gave up after {m.generation} recoveries (limit {self.max_recoveries}): "
                                     "failures keep recurring", ())
        if isinstance(decision, Unrecoverable):
            log.error("job %s is unrecoverable: %s", self._ks.job_id, decision.reason)
            self._client.put(self._ks.status, json.dumps({"state": "failed", "reason": decision.reason}))
            self._stop.set()
            return
        assert isinstance(decision, (RecoveryPlan, DiskFallback))
        self.publish(m, decision)
        log.warning(
            "generation %d -> %d: %s (decided %.3fs after detection)", m.generation, decision.generation,
            "memory, resume at v%d" % decision.resume_version if isinstance(decision, RecoveryPlan)
            else f"disk snapshot step {decision.snapshot_step}", time.monotonic() - t_detect,
        )

    def publish(self, m: Membership, decision: RecoveryPlan | DiskFallback) -> None:
        """Generation bump + new membership in one transaction, fenced twice."""
        gen_kv = self._client.get(self._ks.generation)
        current = 0 if gen_kv is None else int(json.loads(gen_kv.value)["generation"])
        if current != m.generation:
            raise FencingError(f"generation is {current}, membership says {m.generation}")
        new = Membership(decision.generation, m.world_size, self.store_host, self.store_port, decision.assignments, decision)
        spare_ids = {a.worker_id for a in decision.assignments if a.source == "spare"}
        ops: list[Put | Delete] = [
            Put(self._ks.generation, json.dumps({"generation": new.generation, "reason": "recovery"})),
            Put(self._ks.membership, membership_to_json(new)),
        ]
        kvs, _ = self._client.get_prefix(self._ks.spares_prefix)
        ops += [Delete(kv.key) for kv in kvs if spare_from_json(kv.value).worker_id in spare_ids]
        guard = Compare(self._ks.generation, "mod", "==", 0 if gen_kv is None else gen_kv.mod_revision)
        res = self._client.txn([guard, self._election.fence], ops)
        if not res.succeeded:
            raise FencingError("generation or leadership changed while publishing the plan")


def write_initial_membership(client: EtcdClient, ks: Keyspace, m: Membership) -> Membership:
    """Generation 0's membership, written once (create-if-absent) by whichever agent gets there first."""
    client.txn(
        [Compare(ks.membership, "create", "==", 0)],
        [Put(ks.membership, membership_to_json(m)), Put(ks.generation, json.dumps({"generation": 0, "reason": "start"}))],
    )
    kv = client.get(ks.membership)
    assert kv is not None
    return membership_from_json(kv.value)
