"""What the coordinator knows about a job: typed facts read from etcd, and what they imply.

Why a separate, pure module: the leader's state machine
(:mod:`ckptless.recovery.leader_machine`) must decide from *facts only*
(DESIGN: "recovery must not guess"), and the same facts must be testable
without etcd. The driver reads the job's keys, parses them here strictly
(never unpickled; a malformed record is dropped and named, never trusted) and
hands the machine one immutable :class:`JobView`.

The one judgement made here is how a worker's end is classified
(:func:`exit_outcome`), because it decides between recovering and ending the
job:

* killed by a signal (SIGKILL, the OOM killer, a crash, the hang watchdog)
  -> ``fault``: recover;
* exit code 0 -> ``finished``;
* non-zero exit after the worker classified its own error as a fault
  (``kind`` "fault"/"internal", e.g. ckptless itself could not continue)
  -> ``fault``;
* ``kind`` "device": the GPU itself failed (an uncorrectable ECC error, a GPU
  off the bus, see ``ckptless/worker/faults.py``) -> ``fault``: recover, but
  not on that GPU; the record's ``respawnable`` says whether the node has
  another good GPU free for the rank (else the planner gives it a spare or
  waits, ``ckptless/recovery/plan.py`` R2);
* non-zero exit the worker marked ``job_ended``/``fenced`` (it only followed
  the coordinator) or ``reexec`` (a spare restarting as its assigned rank) ->
  ``other``: no new fact;
* any other non-zero exit (the user's exception, ``sys.exit(3)``, a script
  that does not exist, an unported script) -> ``user_error``: the job fails
  fast and is never respawned into the same bug.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ckptless.errors import CkptlessError, RecoveryError
from ckptless.recovery.facts import NodeLocalCopy, NodeLocalImage, Worker, WorkerReport
from ckptless.recovery.wire import Membership, report_from_json, spare_from_json
from ckptless.state import ReplicaSet

ExitKind = Literal["user_error", "fault", "internal", "device", "job_ended", "fenced", "reexec"]
EXIT_KINDS: tuple[str, ...] = ("user_error", "fault", "internal", "device", "job_ended", "fenced", "reexec")
Outcome = Literal["finished", "fault", "user_error", "other"]
MAX_TRACEBACK_CHARS = 4000


@dataclass(frozen=True)
class ErrorSummary:
    """The first facts a human needs about a failed rank (torchrun's ChildFailedError fields)."""

    type: str
    message: str
    traceback: str = ""

    def to_doc(self) -> dict[str, str]:
        return {"type": self.type, "message": self.message, "traceback": self.traceback[-MAX_TRACEBACK_CHARS:]}

    @classmethod
    def from_doc(cls, doc: Any) -> ErrorSummary | None:
        if not isinstance(doc, dict):
            return None
        return cls(str(doc.get("type", "")), str(doc.get("message", "")),
                   str(doc.get("traceback", ""))[-MAX_TRACEBACK_CHARS:])

    def one_line(self) -> str:
        text = f"{self.type}: {self.message}" if self.message else self.type
        return text.splitlines()[0][:300] if text else "(no message)"


@dataclass(frozen=True)
class ExitRecord:
    """One worker incarnation's end, as its agent wrote it to ``exits/<rank>``."""

    rank: int
    worker_id: str
    node_id: str
    pid: int
    exitcode: int | None
    signal: int | None
    time: float
    requested: bool = False
    kind: ExitKind | None = None
    error: ErrorSummary | None = None
    # The node-local tier: the dead worker's own committed image, found intact (every chunk
    # checksummed) in this node's shm dir by its agent; None: none, not checked, or corrupt.
    local_image: NodeLocalImage | None = None
    # The replicas the dead worker held, found intact in its files in this node's shm dir by its agent
    # (a host's copies of the ranks it hosted among them): any live worker there can adopt one (R11).
    local_replicas: tuple[NodeLocalCopy, ...] = ()
    # False: this node cannot start the rank again (its GPU failed and no other good one is free, or
    # a planned respawn found none): the planner must not respawn it here. Absent in older records.
    respawnable: bool = True

    @property
    def outcome(self) -> Outcome:
        return exit_outcome(self)

    def describe(self) -> str:
        err = f": {self.error.one_line()}" if self.error is not None else ""
        # A spare's record has no rank (-1): it is named by its worker id (was logged as "rank -1").
        who, ids = (f"rank {self.rank}", [self.worker_id]) if self.rank >= 0 else (f"spare {self.worker_id}", [])
        if self.pid < 0:  # its agent never started it (a respawn with no GPU left)
            return f"{who}{''.join(f' ({i})' for i in ids)} was not started{err}"
        how = f"signal {self.signal}" if self.signal is not None else f"exit code {self.exitcode}"
        return f"{who} ({', '.join([*ids, f'pid {self.pid}'])}) ended by {how}{err}"

    def to_json(self) -> bytes:
        return json.dumps({
            "rank": self.rank, "worker_id": self.worker_id, "node_id": self.node_id, "pid": self.pid,
            "exitcode": self.exitcode, "signal": self.signal, "time": self.time, "requested": self.requested,
            "kind": self.kind, "error": None if self.error is None else self.error.to_doc(),
            "local_image": None if self.local_image is None else {
                "version": self.local_image.version, "n_chunks": self.local_image.n_chunks,
                "generation": self.local_image.generation},
            "respawnable": self.respawnable,
            **({"local_replicas": [[c.owner, c.version, c.n_chunks, c.generation, c.layout, c.first_chunk]
                                   + ([c.peers.to_json()] if c.peers is not None else [])
                                   for c in self.local_replicas]} if self.local_replicas else {}),
        }).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ExitRecord:
        try:
            doc = json.loads(raw)
            kind = doc.get("kind")
            if kind is not None and kind not in EXIT_KINDS:
                raise RecoveryError(f"exit record: unknown kind {kind!r}")
            rank, node_id = int(doc["rank"]), str(doc.get("node_id", ""))
            local = _local_image(doc.get("local_image"), rank, node_id)
            return cls(
                rank=rank, worker_id=str(doc["worker_id"]), node_id=node_id,
                pid=int(doc.get("pid", -1)),
                exitcode=None if doc.get("exitcode") is None else int(doc["exitcode"]),
                signal=None if doc.get("signal") is None else int(doc["signal"]),
                time=float(doc.get("time", 0.0)), requested=bool(doc.get("requested", False)),
                kind=kind, error=ErrorSummary.from_doc(doc.get("error")), local_image=local,
                local_replicas=_local_replicas(doc.get("local_replicas"), rank, node_id),
                # absent (an older agent) or malformed: the default, never a reason to drop the exit
                respawnable=doc.get("respawnable") is not False,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise RecoveryError(f"exit record is malformed: {raw[:200]!r}") from exc


def _local_image(doc: Any, rank: int, node_id: str) -> NodeLocalImage | None:
    """The record's node-local image; None when absent (an older agent) or malformed (never trusted,
    and never a reason to drop the exit itself: the image is then pulled from peers)."""
    if doc is None:
        return None
    try:
        return NodeLocalImage(rank, node_id, int(doc["version"]), int(doc["n_chunks"]), int(doc.get("generation", 0)))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _local_replicas(doc: Any, rank: int, node_id: str) -> tuple[NodeLocalCopy, ...]:
    """The record's node-local replicas: ``[owner, version, n_chunks, generation, layout, first_chunk
    (, peers)]`` each. A malformed entry is dropped alone (never trusted, never a reason to drop the exit)."""
    if not isinstance(doc, list) or rank < 0:
        return ()
    out: dict[tuple[int, int], NodeLocalCopy] = {}
    for e in doc:
        try:
            peers = ReplicaSet.from_json(e[6]) if len(e) > 6 else None
            c = NodeLocalCopy(int(e[0]), rank, node_id, int(e[1]), int(e[2]), int(e[3]), str(e[4]), int(e[5]), peers)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, CkptlessError):
            continue
        if c.owner != rank:
            out.setdefault((c.owner, c.version), c)
    return tuple(out[k] for k in sorted(out))


def exit_outcome(rec: ExitRecord) -> Outcome:
    """Classify a worker's end (see the module docstring for the rules and why)."""
    if rec.signal is not None:
        return "fault"
    if rec.exitcode == 0:
        return "finished"
    if rec.kind in ("fault", "internal", "device"):
        return "fault"
    if rec.kind in ("job_ended", "fenced", "reexec"):
        return "other"
    return "user_error"


@dataclass(frozen=True)
class JobStatus:
    """``status``: set once, when the job ended for good."""

    state: Literal["succeeded", "failed"]
    reason: str
    root_cause: ExitRecord | None = None

    def to_json(self) -> bytes:
        return json.dumps({"state": self.state, "reason": self.reason,
                           "root_cause": None if self.root_cause is None
                           else json.loads(self.root_cause.to_json())}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> JobStatus:
        try:
            doc = json.loads(raw)
            state = doc["state"]
            if state not in ("succeeded", "failed"):
                raise RecoveryError(f"job status: unknown state {state!r}")
            rc = doc.get("root_cause")
            return cls(state, str(doc.get("reason", "")),
                       None if rc is None else ExitRecord.from_json(json.dumps(rc).encode()))
        except (ValueError, TypeError, KeyError) as exc:
            raise RecoveryError(f"job status record is malformed: {raw[:200]!r}") from exc


@dataclass(frozen=True)
class ReportRecord:
    """A worker's report for the generation it left: what it holds, why it left, and (after a
    failed disk restore) which snapshot step could not be loaded, so it is never chosen again."""

    report: WorkerReport
    reason: str = ""
    bad_snapshot: int | None = None
    # node-local copies (node, holder, owner, version) this worker failed to adopt (R11): never planned again
    bad_copies: tuple[tuple[str, int, int, int], ...] = ()
    timed_out: bool = False  # it left after a collective waited out its timeout (no abort ended it)


def report_record_to_json(report: WorkerReport, reason: str, bad_snapshot: int | None = None,
                          bad_copies: tuple[tuple[str, int, int, int], ...] = (), timed_out: bool = False) -> bytes:
    from ckptless.recovery.wire import report_to_json

    doc = json.loads(report_to_json(report))
    doc["reason"] = reason[:500]
    doc["bad_snapshot"] = bad_snapshot
    if bad_copies:
        doc["bad_copies"] = [list(k) for k in bad_copies]
    if timed_out:
        doc["timed_out"] = True
    return json.dumps(doc).encode()


def report_record_from_json(raw: bytes) -> ReportRecord:
    try:
        doc = json.loads(raw)
        reason = str(doc.get("reason", ""))
        bad = doc.get("bad_snapshot")
        bad_snapshot = None if bad is None else int(bad)
        copies = tuple((str(n), int(h), int(o), int(v)) for n, h, o, v in doc.get("bad_copies", ()))
        timed_out = doc.get("timed_out", False) is True
    except (ValueError, AttributeError, TypeError) as exc:
        raise RecoveryError(f"worker report is malformed: {raw[:200]!r}") from exc
    return ReportRecord(report_from_json(raw), reason, bad_snapshot, copies, timed_out)


@dataclass(frozen=True)
class JobView:
    """Everything the leader may look at, read from etcd at one moment.

    ``exits`` holds the newest record per rank (of whichever incarnation);
    ``worker_exits`` the newest per worker id, spares included (a spare's
    record carries rank -1: it had none when its agent saw it die, possibly
    just after the leader assigned it one); ``reports`` and ``ready`` are
    those of the current generation only;
    ``malformed`` names records that failed to parse (they are ignored, and
    said so, never trusted).
    """

    membership: Membership | None
    exits: Mapping[int, ExitRecord] = field(default_factory=dict)
    live_nodes: frozenset[str] = frozenset()
    reports: Mapping[int, ReportRecord] = field(default_factory=dict)
    ready: frozenset[int] = frozenset()
    spares: tuple[Worker, ...] = ()
    status: JobStatus | None = None
    incident_open: bool = False
    malformed: tuple[str, ...] = ()
    malformed_reports: frozenset[int] = frozenset()
    ported: bool = True  # some worker of this job called ckptless.init()
    worker_exits: Mapping[str, ExitRecord] = field(default_factory=dict)

    @property
    def generation(self) -> int:
        return -1 if self.membership is None else self.membership.generation

    @property
    def bad_copies(self) -> frozenset[tuple[str, int, int, int]]:
        """Node-local copies a worker of this generation failed to adopt (R11)."""
        return frozenset(k for r in self.reports.values() for k in r.bad_copies)

    @property
    def bad_snapshots(self) -> frozenset[int]:
        """Snapshot steps a worker of this generation failed to load."""
        return frozenset(r.bad_snapshot for r in self.reports.values() if r.bad_snapshot is not None)

    def current_exit(self, rank: int) -> ExitRecord | None:
        """The exit record of the worker that holds ``rank`` now (older incarnations ignored)."""
        if self.membership is None:
            return None
        worker_id = self.membership.worker_of(rank).worker_id
        rec = self.worker_exits.get(worker_id)
        if rec is not None:
            # A spare that died as it was assigned the rank: its record says rank -1.
            return rec if rec.rank == rank else replace(rec, rank=rank)
        rec = self.exits.get(rank)
        return rec if rec is not None and rec.worker_id == worker_id else None

    def ranks_with(self, outcome: Outcome) -> frozenset[int]:
        if self.membership is None:
            return frozenset()
        out = set()
        for a in self.membership.ranks:
            rec = self.current_exit(a.rank)
            if rec is not None and rec.outcome == outcome and not rec.requested:
                out.add(a.rank)
        return frozenset(out)

    @property
    def finished(self) -> frozenset[int]:
        return self.ranks_with("finished")

    @property
    def faulted(self) -> frozenset[int]:
        return self.ranks_with("fault")

    @property
    def user_errors(self) -> tuple[ExitRecord, ...]:
        """Current workers that ended by a user error, earliest first (the root cause first)."""
        recs = [self.current_exit(r) for r in self.ranks_with("user_error")]
        return tuple(sorted((r for r in recs if r is not None), key=lambda r: (r.time, r.rank)))

    @property
    def missing_nodes(self) -> frozenset[str]:
        """Nodes running unfinished ranks whose lease key is gone (lost, paused or partitioned).

        A node whose ranks all finished leaves when its agent exits: that is not a loss.
        """
        if self.membership is None:
            return frozenset()
        done = self.finished
        return frozenset(a.node_id for a in self.membership.ranks
                         if a.node_id not in self.live_nodes and a.rank not in done)

    def ranks_on(self, nodes: frozenset[str]) -> frozenset[int]:
        if self.membership is None:
            return frozenset()
        return frozenset(a.rank for a in self.membership.ranks if a.node_id in nodes)

    @property
    def hosted(self) -> frozenset[int]:
        """Ranks a survivor runs as micro-batches in this generation (fewer ranks): no process of their own."""
        return frozenset(self.membership.hosted) if self.membership is not None else frozenset()

    @property
    def fresh(self) -> frozenset[int]:
        """Replacements admitted by the current plan that have not resumed yet: they hold nothing.

        A respawn or spare only holds state after it restored and resumed
        (``ready``); until then its rank needs an image like a lost one, which
        is a fact, not a loss: its report may be missing without delaying the plan.
        """
        m = self.membership
        if m is None or m.decision is None:
            return frozenset()
        return frozenset(a.rank for a in m.ranks if a.source in ("respawn", "spare") and a.rank not in self.ready)

    def usable_spares(self) -> tuple[Worker, ...]:
        """Spares whose process did not exit (a dead spare is never assigned) and whose node is alive."""
        dead = {rec.worker_id for rec in self.exits.values()} | set(self.worker_exits)
        return tuple(w for w in self.spares if w.worker_id not in dead and w.node_id in self.live_nodes)


def parse_records(
    membership: Membership | None,
    exits: list[tuple[str, bytes]],
    nodes: list[str],
    reports: list[tuple[str, bytes]],
    ready: list[str],
    spares: list[tuple[str, bytes]],
    status: bytes | None,
    incident_open: bool,
    ported: bool = True,
) -> JobView:
    """Build a :class:`JobView` from raw ``(key, value)`` records; drop and name what does not parse."""
    bad: list[str] = []
    by_rank: dict[int, ExitRecord] = {}
    by_worker: dict[str, ExitRecord] = {}
    for key, raw in exits:
        try:
            rec = ExitRecord.from_json(raw)
        except CkptlessError:
            bad.append(key)
            continue
        seen = by_worker.get(rec.worker_id)
        if seen is None or rec.time >= seen.time:
            by_worker[rec.worker_id] = rec
        if rec.rank < 0:
            continue  # a spare's: by worker only
        prev = by_rank.get(rec.rank)
        if prev is None or rec.time >= prev.time:
            by_rank[rec.rank] = rec
    reps: dict[int, ReportRecord] = {}
    bad_reports: set[int] = set()
    for key, raw in reports:
        try:
            rank = int(key.rsplit("/", 1)[1])
        except ValueError:
            bad.append(key)
            continue
        try:
            reps[rank] = report_record_from_json(raw)
        except CkptlessError:
            bad.append(key)
            bad_reports.add(rank)
    ready_ranks = set()
    for key in ready:
        try:
            ready_ranks.add(int(key.rsplit("/", 1)[1]))
        except ValueError:
            bad.append(key)
    spare_workers = []
    for key, raw in spares:
        try:
            spare_workers.append(spare_from_json(raw))
        except (ValueError, KeyError, TypeError, CkptlessError):
            bad.append(key)
    st = None
    if status is not None:
        try:
            st = JobStatus.from_json(status)
        except CkptlessError:
            bad.append("status")
    return JobView(membership, by_rank, frozenset(nodes), reps, frozenset(ready_ranks),
                   tuple(sorted(spare_workers, key=lambda w: w.worker_id)), st, incident_open, tuple(bad),
                   frozenset(bad_reports), ported, by_worker)


def finished_line(m: Membership) -> str:
    """The success line. With fewer ranks (never grown back) a hosted rank finished only as its host's
    micro-batches: no process of its own ran the script past the last step, so what the script writes at
    its end (a final state, a file per rank) was not written for it (was: "all 4 ranks finished")."""
    hosted = m.hosted
    if not hosted:
        return f"all {m.world_size} ranks finished"
    hosts = sorted({r for r in map(m.rank_of, hosted.values()) if r is not None})
    return (f"all {m.world_size} ranks' steps finished on {m.world_size - len(hosted)} processes: ranks "
            f"{sorted(hosted)} ran as micro-batches hosted by ranks {hosts} (the job never grew back), so no "
            f"process of theirs ran the script past its last step and wrote their final state")
