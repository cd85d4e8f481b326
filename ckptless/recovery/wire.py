"""Typed JSON for what recovery puts in etcd: worker reports, memberships, decisions.

Why hand-written decoders: these records cross process boundaries through
etcd, so they are parsed strictly (never unpickled) and a malformed record
fails with an error naming the field instead of a KeyError deep inside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ckptless.errors import ManifestError, RecoveryError
from ckptless.recovery import roster
from ckptless.recovery.facts import ReplicaFact, Worker, WorkerReport
from ckptless.state import ReplicaSet
from ckptless.recovery.decision import (Adoption, Assignment, Decision, DiskFallback, LocalRestore, RecoveryPlan, Stripe,
                                       Transfer, Unrecoverable, WaitForReplacement)


@dataclass(frozen=True)
class Membership:
    """Who runs which rank in one generation, and where its store is.

    Written by the leader together with the generation bump (one fenced txn);
    ``decision`` is the plan that produced it (None for generation 0).
    """

    generation: int
    world_size: int
    store_host: str
    store_port: int
    ranks: tuple[Assignment, ...]
    decision: Decision | None = None

    @cached_property
    def _by_rank(self) -> dict[int, Assignment]:
        return {a.rank: a for a in self.ranks}

    @cached_property
    def _by_worker(self) -> dict[str, int]:
        """A worker's own rank (a hosted rank's assignment names its host, who is not that rank)."""
        return {a.worker_id: a.rank for a in self.ranks if a.source != "hosted"}

    @cached_property
    def hosted(self) -> dict[int, str]:
        """Rank -> its host's worker id, for the ranks run as micro-batches by a survivor (fewer ranks)."""
        return {a.rank: a.worker_id for a in self.ranks if a.source == "hosted"}

    @cached_property
    def _processes(self) -> list[str]:
        """The workers of this generation, one per process, in the order of their own ranks."""
        return [a.worker_id for a in sorted(self.ranks, key=lambda x: x.rank) if a.source != "hosted"]

    def hosted_by(self, worker_id: str) -> list[int]:
        """The ranks ``worker_id`` runs as micro-batches besides its own, ascending."""
        return sorted(r for r, w in self.hosted.items() if w == worker_id)

    def physical(self, worker_id: str) -> tuple[int, int] | None:
        """``(index, count)`` of ``worker_id`` among this generation's processes when some rank is hosted
        (its communicators span the processes only); None when every rank has a process of its own."""
        if not self.hosted:
            return None
        return self._processes.index(worker_id), len(self._processes)

    def worker_of(self, rank: int) -> Assignment:
        """O(1) after the first call (a lookup per rank over W ranks was O(W^2) per generation)."""
        a = self._by_rank.get(rank)
        if a is None:
            raise RecoveryError(f"generation {self.generation} has no worker for rank {rank}")
        return a

    def rank_of(self, worker_id: str) -> int | None:
        return self._by_worker.get(worker_id)


def _get(doc: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in doc:
        raise RecoveryError(f"{what}: missing field {name!r}")
    value = doc[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise RecoveryError(f"{what}: field {name!r} has wrong type {type(value).__name__}")
    return value


def _opt_int(doc: dict[str, Any], name: str, what: str) -> int | None:
    return None if doc.get(name) is None else int(_get(doc, name, int, what))


# --- reports -----------------------------------------------------------------
def report_to_json(r: WorkerReport) -> bytes:
    return json.dumps({
        "worker_id": r.worker_id,
        "newest_captured": r.newest_captured,
        "committed": r.committed,
        "local_versions": sorted(r.local_versions),
        "replicas": [[f.owner, f.version, f.n_chunks, f.layout]
                     + ([f.first_chunk, f.peers.to_json()] if f.peers is not None else []) for f in r.replicas],
        "own_layouts": [[v, k] for v, k in r.own_layouts],
        **({"can_host": True} if r.can_host else {}),
    }).encode()


def report_from_json(raw: bytes) -> WorkerReport:
    what = "worker report"
    try:
        doc = json.loads(raw)
        return WorkerReport(
            worker_id=_get(doc, "worker_id", str, what),
            newest_captured=_opt_int(doc, "newest_captured", what),
            committed=_opt_int(doc, "committed", what),
            local_versions=frozenset(int(v) for v in _get(doc, "local_versions", list, what)),
            replicas=tuple(_replica_fact(f) for f in _get(doc, "replicas", list, what)),
            own_layouts=tuple((int(v), str(k)) for v, k in doc.get("own_layouts", ())),
            can_host=doc.get("can_host") is True,
        )
    except (ValueError, TypeError, ManifestError) as exc:
        raise RecoveryError(f"{what} is malformed: {raw[:200]!r}") from exc


def _replica_fact(f: list[Any]) -> ReplicaFact:
    """``[owner, version, n_chunks, layout]``, plus ``[first_chunk, peers]`` for a copy without its
    replicated prefix (an old report has four fields, or three)."""
    peers = ReplicaSet.from_json(f[5]) if len(f) > 5 else None
    return ReplicaFact(int(f[0]), int(f[1]), int(f[2]), str(f[3]) if len(f) > 3 else "",
                       int(f[4]) if len(f) > 5 else 0, peers)


# --- decisions ------------------------------------------------------------------
def _assignment_from(raw: Any) -> Assignment:
    rank, worker_id, node_id, source = raw
    return Assignment(int(rank), str(worker_id), str(node_id), source)


def _assignments(raw: Any, what: str) -> tuple[Assignment, ...]:
    """A roster (:mod:`ckptless.recovery.roster`), or the one-entry-per-rank list of older records."""
    if isinstance(raw, list):
        return tuple(_assignment_from(a) for a in raw)
    return roster.decode(raw, what)


def decision_to_doc(d: Decision) -> dict[str, Any]:
    if isinstance(d, RecoveryPlan):
        return {
            "type": "memory", "job_id": d.job_id, "generation": d.generation,
            "assignments": roster.encode(d.assignments), "lost_ranks": list(d.lost_ranks),
            "resume_version": d.resume_version,
            "rollbacks": roster.encode_rollbacks(d.rollbacks, d.assignments),
            "transfers": [
                {"owner": t.owner, "receiver": t.receiver, "version": t.version, "n_chunks": t.n_chunks,
                 "holders": list(t.holders),
                 "stripes": [[s.owner, s.start, s.stop, s.source, list(s.fallbacks)] + ([1] if s.own else [])
                             for s in t.stripes]}
                for t in d.transfers
            ],
            "replace_mirrors": d.replace_mirrors, "owners_below_k": list(d.owners_below_k), "steps_lost": d.steps_lost,
            "initial_ranks": list(d.initial_ranks), "adopt_prebuilt": list(d.adopt_prebuilt),
            "node_local": [[x.rank, x.worker_id, x.node_id, x.version, x.n_chunks, x.generation]
                           for x in d.node_local],
            **({"adoptions": [[x.worker_id, x.owner, x.holder, x.node_id, x.version, x.n_chunks, x.generation]
                              for x in d.adoptions]} if d.adoptions else {}),
            **({"stalled": d.stalled} if d.stalled else {}),
            **({"timeouts": d.timeouts} if d.timeouts else {}),
        }
    if isinstance(d, DiskFallback):
        return {
            "type": "disk", "job_id": d.job_id, "generation": d.generation,
            "assignments": roster.encode(d.assignments), "lost_ranks": list(d.lost_ranks),
            "snapshot_step": d.snapshot_step, "reason": d.reason,
            "lost_ranks_without_replica": list(d.lost_ranks_without_replica), "steps_lost": d.steps_lost,
            **({"stalled": d.stalled} if d.stalled else {}),
            **({"timeouts": d.timeouts} if d.timeouts else {}),
        }
    if isinstance(d, WaitForReplacement):
        return {"type": "wait", "job_id": d.job_id, "generation": d.generation,
                "unassigned_ranks": list(d.unassigned_ranks), "then": d.then, "reason": d.reason}
    return {"type": "unrecoverable", "job_id": d.job_id, "generation": d.generation, "reason": d.reason,
            "lost_ranks_without_replica": list(d.lost_ranks_without_replica)}


def decision_from_doc(doc: dict[str, Any], assignments_known: tuple[Assignment, ...] | None = None) -> Decision:
    """``assignments_known``: the plan's assignments already decoded (a membership record stores them
    once, as its ranks: decoding them twice was half a worker's O(W) decode per incident)."""
    kind = doc.get("type")
    try:
        if kind == "memory":
            assignments = (assignments_known if assignments_known is not None
                           else _assignments(doc["assignments"], "recovery plan"))
            return RecoveryPlan(
                job_id=str(doc["job_id"]), generation=int(doc["generation"]),
                assignments=assignments,
                lost_ranks=tuple(int(r) for r in doc["lost_ranks"]),
                resume_version=int(doc["resume_version"]),
                rollbacks=roster.decode_rollbacks(doc["rollbacks"], assignments, "recovery plan"),
                transfers=tuple(
                    Transfer(int(t["owner"]), str(t["receiver"]), int(t["version"]), int(t["n_chunks"]),
                             tuple(str(h) for h in t["holders"]),
                             tuple(Stripe(int(s[0]), int(s[1]), int(s[2]), str(s[3]), tuple(str(f) for f in s[4]),
                                          bool(s[5]) if len(s) > 5 else False)
                                   for s in t["stripes"]))
                    for t in doc["transfers"]
                ),
                replace_mirrors=bool(doc["replace_mirrors"]),
                owners_below_k=tuple(int(r) for r in doc["owners_below_k"]),
                steps_lost=int(doc["steps_lost"]),
                initial_ranks=tuple(int(r) for r in doc.get("initial_ranks", ())),
                adopt_prebuilt=tuple(int(r) for r in doc.get("adopt_prebuilt", ())),
                node_local=tuple(LocalRestore(int(r), str(w), str(n), int(v), int(c), int(g))
                                 for r, w, n, v, c, g in doc.get("node_local", ())),
                adoptions=tuple(Adoption(str(w), int(o), int(h), str(n), int(v), int(c), int(g))
                                for w, o, h, n, v, c, g in doc.get("adoptions", ())),
                stalled=int(doc.get("stalled", 0)), timeouts=int(doc.get("timeouts", 0)),
            )
        if kind == "disk":
            return DiskFallback(
                job_id=str(doc["job_id"]), generation=int(doc["generation"]),
                assignments=_assignments(doc["assignments"], "disk fallback"),
                lost_ranks=tuple(int(r) for r in doc["lost_ranks"]), snapshot_step=int(doc["snapshot_step"]),
                reason=str(doc["reason"]),
                lost_ranks_without_replica=tuple(int(r) for r in doc["lost_ranks_without_replica"]),
                steps_lost=int(doc["steps_lost"]),
                stalled=int(doc.get("stalled", 0)), timeouts=int(doc.get("timeouts", 0)),
            )
        if kind == "wait":
            return WaitForReplacement(str(doc["job_id"]), int(doc["generation"]),
                                      tuple(int(r) for r in doc["unassigned_ranks"]), doc["then"], str(doc["reason"]))
        if kind == "unrecoverable":
            return Unrecoverable(str(doc["job_id"]), int(doc["generation"]), str(doc["reason"]),
                                 tuple(int(r) for r in doc["lost_ranks_without_replica"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise RecoveryError(f"malformed recovery decision: {exc!r}") from exc
    raise RecoveryError(f"unknown recovery decision type {kind!r}")


# --- membership -------------------------------------------------------------------
_SAME_AS_RANKS = "=ranks"  # a plan's assignments are the membership's ranks: written once


def membership_to_json(m: Membership) -> bytes:
    ranks = roster.encode(m.ranks)
    decision = None if m.decision is None else decision_to_doc(m.decision)
    if decision is not None and decision.get("assignments") == ranks:
        decision["assignments"] = _SAME_AS_RANKS
    return json.dumps({
        "generation": m.generation, "world_size": m.world_size,
        "store": [m.store_host, m.store_port],
        "ranks": ranks,
        "decision": decision,
    }).encode()


def membership_from_json(raw: bytes) -> Membership:
    what = "membership"
    try:
        doc = json.loads(raw)
        host, port = _get(doc, "store", list, what)
        ranks_doc = _get(doc, "ranks", (list, dict), what)
        dec = doc.get("decision")
        ranks = _assignments(ranks_doc, what)
        same = isinstance(dec, dict) and dec.get("assignments") == _SAME_AS_RANKS
        if same:
            dec = {**dec, "assignments": ranks_doc}
        return Membership(
            generation=int(_get(doc, "generation", int, what)),
            world_size=int(_get(doc, "world_size", int, what)),
            store_host=str(host), store_port=int(port),
            ranks=ranks,
            decision=None if dec is None else decision_from_doc(dec, ranks if same else None),
        )
    except (ValueError, TypeError) as exc:
        raise RecoveryError(f"{what} record is malformed: {raw[:200]!r}") from exc


def spare_to_json(w: Worker) -> bytes:
    return json.dumps({"worker_id": w.worker_id, "node_id": w.node_id, "standby_rank": w.standby_rank,
                       "any_rank": w.any_rank}).encode()


def spare_from_json(raw: bytes) -> Worker:
    doc = json.loads(raw)
    sr = doc.get("standby_rank")
    return Worker(str(doc["worker_id"]), str(doc["node_id"]), None if sr is None else int(sr),
                  bool(doc.get("any_rank", False)))
