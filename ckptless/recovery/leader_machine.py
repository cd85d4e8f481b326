"""The coordinator leader as an explicit state machine: ``step(state, event, cfg) -> (state, actions)``.

Why a pure machine: every failure mode we must survive (a second, third,
fourth failure at any moment, a replacement that dies while joining or is
slow but alive, a lost etcd reply, losing leadership mid-publish) becomes a
row in a transition table that unit tests can drive with a fake clock and
fake facts. The driver (:mod:`ckptless.recovery.leader`) only does I/O: it
feeds :class:`Observed` views read from etcd and the results of the actions
it executed, and executes the actions returned.

States (one incident = one pass from Watching back to Watching)::

    Watching --failure--> Collecting --all reported--> Planning
    Planning --plan--> Publishing --published--> AwaitingFormation --all ready--> Watching
    Planning --no replacement--> WaitingForReplacement --spare/node--> Planning
    any --user error / unrecoverable / status set--> Ended
    any --a publish or write fenced out--> Deposed (the driver resigns and campaigns again)

Every state has a deadline or is left by the next event: Collecting ends at
the report deadline (silent ranks are lost), WaitingForReplacement at the
replacement deadline (the job ends, naming the ranks), AwaitingFormation at
the formation deadline (a slow replacement that is alive gets a bounded
number of extensions, then the generation is re-planned without it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Union

from ckptless.recovery import give_up
from ckptless.recovery.decision import Decision, DiskFallback, RecoveryPlan, Unrecoverable, WaitForReplacement
from ckptless.recovery.leader_actions import (  # re-exported: the machine's outputs, named from here too
    Action, AskGrow, EndJob, Log, NoteWaiting, OpenIncident, Publish, RequestPlan, Resign)
from ckptless.recovery.view import ExitRecord, JobStatus, JobView, finished_line


@dataclass(frozen=True)
class LeaderConfig:
    """Deadlines and limits of the leader (seconds)."""

    job_id: str
    replicas: int
    placement: str = "ring"
    report_timeout_s: float = 15.0
    # A rank whose process is alive may sit in a collective until the collective timeout
    # before it can notice the incident (e.g. a reset connection it is only receiving on).
    alive_report_timeout_s: float = 70.0
    gone_node_report_grace_s: float = 1.0
    replacement_timeout_s: float = 60.0
    formation_timeout_s: float = 60.0
    formation_extensions: int = 4
    node_grace_s: float = 10.0
    max_recoveries: int = 50  # in a row without progress (ckptless.recovery.give_up)
    lost_node: str = "wait"  # --lost-node: wait for a replacement, or shrink (go on with fewer ranks)
    min_nodes: int = 1  # --nnodes MIN: the fewest nodes a shrunk job runs on


# --- states ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Watching:
    generation: int
    missing_since: tuple[tuple[str, float], ...] = ()  # node -> when its lease key vanished
    grow_asked: bool = False  # fewer ranks: this generation was asked to hand its hosted ranks to spares


@dataclass(frozen=True)
class Collecting:
    generation: int
    lost: frozenset[int]
    opened_at: float
    deadline: float
    others_in_at: float | None = None  # when every rank not on a vanished node had reported
    reason: str = ""


@dataclass(frozen=True)
class Planning:
    generation: int
    lost: frozenset[int]
    opened_at: float
    reason: str = ""
    wait_deadline: float | None = None  # re-planning while waiting for a replacement: the wait's first deadline
    prior: tuple[int, int, int] | None = None  # the recovery in force: (resume version, stalled, timeouts)
    timed_out: bool = False  # the incident is a collective timeout alone (give_up.timed_out)


@dataclass(frozen=True)
class WaitingForReplacement:
    generation: int
    lost: frozenset[int]
    opened_at: float
    deadline: float
    reason: str
    seen: tuple[tuple[str, ...], frozenset[str]] | None = None  # (usable spares, live nodes) at the last plan


@dataclass(frozen=True)
class Publishing:
    generation: int
    decision: RecoveryPlan | DiskFallback
    opened_at: float


@dataclass(frozen=True)
class AwaitingFormation:
    generation: int
    deadline: float
    extensions: int = 0
    missing_since: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Ended:
    state: Literal["succeeded", "failed"]
    reason: str


@dataclass(frozen=True)
class Deposed:
    reason: str


State = Union[Watching, Collecting, Planning, WaitingForReplacement, Publishing, AwaitingFormation, Ended, Deposed]


# --- events ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observed:
    view: JobView
    now: float


@dataclass(frozen=True)
class Planned:
    decision: Decision
    notes: tuple[str, ...]
    now: float
    # The (usable spares, live nodes) of the view the plan was made from: a wait for a replacement
    # re-plans on any change from *these*, so a spare that appeared while planning is not missed.
    seen: tuple[tuple[str, ...], frozenset[str]] | None = None


@dataclass(frozen=True)
class PlanFailed:
    error: str
    now: float


@dataclass(frozen=True)
class Published:
    generation: int
    now: float


@dataclass(frozen=True)
class PublishRejected:
    still_leader: bool
    reason: str
    now: float


@dataclass(frozen=True)
class Fenced:
    """A write of ours failed the fence on our election key: another agent leads (ours lapsed while paused,
    issue 35). Deposes from any state, Ended too: an end refused by the fence ended nothing."""
    reason: str
    now: float


Event = Union[Observed, Planned, PlanFailed, Published, PublishRejected, Fenced]


Step = tuple[State, tuple[Action, ...]]
INITIAL: State = Watching(-1)


def generation_of(state: State) -> int:
    return getattr(state, "generation", -1)


def is_terminal(state: State) -> bool:
    return isinstance(state, (Ended, Deposed))


# --- the transition function -----------------------------------------------------------------
def step(state: State, event: Event, cfg: LeaderConfig) -> Step:
    """The whole leader: pure, total over (state, event)."""
    if isinstance(event, Fenced) and not isinstance(state, Deposed):  # (see Fenced)
        return Deposed(event.reason), (Log("warning", f"no longer the leader: {event.reason}"), Resign(event.reason))
    if is_terminal(state):
        return state, ()
    if isinstance(event, Observed):
        return _observe(state, event.view, event.now, cfg)
    if isinstance(event, Planned):
        return _planned(state, event, cfg)
    if isinstance(event, PlanFailed):
        if not isinstance(state, Planning):
            return state, ()
        return _end("failed", f"internal error while planning generation {state.generation + 1}: {event.error}")
    if isinstance(event, Published):
        if not isinstance(state, Publishing):
            return state, ()
        d = state.decision
        what = (f"memory, resume at v{d.resume_version}" if isinstance(d, RecoveryPlan)
                else f"disk snapshot step {d.snapshot_step}")
        return (AwaitingFormation(event.generation, event.now + cfg.formation_timeout_s),
                (Log("warning", f"generation {state.generation} -> {event.generation}: {what} "
                                f"(decided {event.now - state.opened_at:.3f}s after the incident opened)"),))
    if isinstance(event, PublishRejected):
        if not isinstance(state, Publishing):
            return state, ()
        if not event.still_leader:
            return Deposed(event.reason), (Resign(event.reason),)
        return Watching(state.generation), (Log("warning", f"plan not published: {event.reason}; re-reading"),)
    raise TypeError(f"unknown event {event!r}")


def _end(state: Literal["succeeded", "failed"], reason: str, root: ExitRecord | None = None) -> Step:
    level: Literal["info", "error"] = "info" if state == "succeeded" else "error"
    return Ended(state, reason), (EndJob(JobStatus(state, reason, root)), Log(level, f"job {state}: {reason}"))


def _observe(state: State, view: JobView, now: float, cfg: LeaderConfig) -> Step:
    if view.status is not None:
        return Ended(view.status.state, view.status.reason), ()
    m = view.membership
    if m is None or isinstance(state, (Planning, Publishing)):
        return state, ()  # waiting for our own action's answer; the view is re-read afterwards
    if m.generation > generation_of(state):
        # Someone published (our own reply was lost, or we just took over): follow the record.
        state = (AwaitingFormation(m.generation, now + cfg.formation_timeout_s) if m.decision is not None
                 else Watching(m.generation))
    elif m.generation < generation_of(state):
        return state, ()  # a stale read; the next one will be current
    errors = view.user_errors
    if errors:
        root = errors[0]
        if root.error is not None and root.error.type == "SilentDataCorruption":  # replica_check.py's stop
            return _end("failed", f"{root.describe()} (silent data corruption: replicas that must agree do not; the "
                                  "job stops and is not restarted onto them)", root)
        return _end("failed", f"{root.describe()} (a user error: the job fails fast and is not restarted)", root)
    done = _completion(state, view)
    if done is not None:
        return done
    if isinstance(state, Watching):
        return _watch(state, view, now, cfg)
    if isinstance(state, Collecting):
        return _collect(state, view, now, cfg)
    if isinstance(state, WaitingForReplacement):
        return _wait_replacement(state, view, now, cfg)
    if isinstance(state, AwaitingFormation):
        return _await_formation(state, view, now, cfg)
    return state, ()


def _completion(state: State, view: JobView) -> Step | None:
    """Once any rank finished (exit 0), the job's final version is committed everywhere: never recover.

    Ends the job when the rest finished too (or died after that commit); until
    then holds the current state, opening no incident.
    """
    m = view.membership
    assert m is not None
    finished = view.finished
    if not finished:
        return None
    rest = {a.rank for a in m.ranks} - finished
    if rest - view.faulted:
        return state, ()  # the others are finishing too
    actions: tuple[Log, ...] = ()
    if rest:
        actions = (Log("warning", f"ranks {sorted(rest)} died after the job's final version was committed; "
                                  "not recovered (training is complete)"),)
    st, acts = _end("succeeded", finished_line(m))
    return st, acts + actions


def _missing(prev: tuple[tuple[str, float], ...], view: JobView, now: float) -> dict[str, float]:
    """Since when each node running unfinished ranks has had no lease key."""
    missing = {n: t for n, t in prev if n in view.missing_nodes}
    for n in view.missing_nodes:
        missing.setdefault(n, now)
    return missing


def _failure_symptoms(view: JobView, missing_since: dict[str, float], now: float, cfg: LeaderConfig) -> list[str]:
    reasons = []
    if view.faulted:
        reasons.append("; ".join(rec.describe() for rec in (view.current_exit(r) for r in sorted(view.faulted))
                                 if rec is not None))
    if view.reports:
        left = ", ".join(f"rank {r} ({rec.reason or 'left'})" for r, rec in sorted(view.reports.items()))
        reasons.append(f"ranks left generation {view.generation}: {left}")
    if view.incident_open:
        reasons.append(f"an incident is open for generation {view.generation}")
    overdue = sorted(n for n, t in missing_since.items() if now - t >= cfg.node_grace_s)
    if overdue:
        reasons.append(f"nodes {overdue} lost their lease over {cfg.node_grace_s:.0f}s ago")
    return reasons


def _watch(state: Watching, view: JobView, now: float, cfg: LeaderConfig) -> Step:
    missing = _missing(state.missing_since, view, now)
    reasons = _failure_symptoms(view, missing, now, cfg)
    if not reasons:
        watching = Watching(view.generation, tuple(sorted(missing.items())), state.grow_asked)
        hosted = view.hosted
        if hosted and not state.grow_asked and len(view.usable_spares()) >= len(hosted):
            # Fewer ranks, and a spare for every hosted rank (a scheduler's new node, admitted as spares).
            return replace(watching, grow_asked=True), (
                Log("warning", f"generation {view.generation}: spares for hosted ranks {sorted(hosted)} are at "
                               "hand: growing back to full width at the next step boundary"),
                AskGrow(view.generation, tuple(sorted(hosted))))
        return watching, ()
    return _open(view.generation, view, now, cfg, "; ".join(reasons))


def _open(generation: int, view: JobView, now: float, cfg: LeaderConfig, reason: str,
          lost: frozenset[int] = frozenset()) -> Step:
    lost = lost | view.faulted | view.hosted  # a hosted rank has no process to report: lost to any incident
    opened = Collecting(generation, lost, now, now + cfg.report_timeout_s, reason=reason)
    nxt, actions = _collect(opened, view, now, cfg)
    return nxt, (OpenIncident(generation, tuple(sorted(lost)), reason),
                 Log("warning", f"generation {generation}: incident ({reason}); collecting reports"), *actions)


def _collect(state: Collecting, view: JobView, now: float, cfg: LeaderConfig) -> Step:
    m = view.membership
    assert m is not None
    lost = state.lost | view.faulted
    current = {a.rank: a.worker_id for a in m.ranks}
    reported = {r for r, rec in view.reports.items() if rec.report.worker_id == current.get(r)}
    reported |= view.malformed_reports
    expected = set(current) - lost - view.fresh - view.finished
    missing = expected - reported
    gone = view.ranks_on(view.missing_nodes) & missing
    others_in = state.others_in_at
    if missing and missing <= gone:
        # Everyone else reported; a node whose lease vanished gets a short grace for its
        # workers to report (a paused agent's workers are alive), then its ranks are lost.
        others_in = now if others_in is None else others_in
        if now - others_in >= cfg.gone_node_report_grace_s:
            lost, missing = lost | missing, set()
    logs: list[Action] = []
    if missing and now >= state.deadline and not view.ported:
        # Nobody ever called ckptless.init(): the script is not ported, and nothing can be recovered.
        faults = [rec for rec in (view.current_exit(r) for r in sorted(view.faulted)) if rec is not None]
        what = faults[0].describe() if faults else f"generation {state.generation} failed"
        return _end("failed", f"{what}; no rank of this job ever called ckptless.init(), so it cannot be recovered "
                              "(port the script: docs/porting.md, or run it under torchrun)",
                    faults[0] if faults else None)
    if missing and now >= state.deadline:
        # A live process may still be inside a collective: it gets the collective timeout.
        alive = {r for r in missing if r not in gone and view.current_exit(r) is None}
        late = now >= state.opened_at + max(cfg.alive_report_timeout_s, cfg.report_timeout_s)
        silent = missing if late else missing - alive
        if silent:
            logs.append(Log("warning", f"generation {state.generation}: ranks {sorted(silent)} did not report within "
                                       f"{now - state.opened_at:.0f}s; treating them as lost"))
            lost, missing = lost | silent, missing - silent
    if missing:
        return replace(state, lost=frozenset(lost), others_in_at=others_in), tuple(logs)
    return (Planning(state.generation, frozenset(lost), state.opened_at, state.reason, prior=give_up.prior_of(view),
                     timed_out=give_up.timed_out(view)),
            (*logs, RequestPlan(state.generation, frozenset(lost))))



def _planned(state: State, event: Planned, cfg: LeaderConfig) -> Step:
    if not isinstance(state, Planning):
        return state, ()
    notes = tuple(Log("warning", f"planning generation {state.generation + 1}: {n}") for n in event.notes)
    d = event.decision
    if isinstance(d, Unrecoverable):
        st, acts = _end("failed", f"unrecoverable: {d.reason}")
        return st, notes + acts
    if isinstance(d, WaitForReplacement):
        # One deadline for the whole wait: a re-plan (a spare came and went, a node joined, another rank
        # was lost) never extends it, so nothing waits longer than --replacement-timeout.
        first = state.wait_deadline is None
        deadline = event.now + cfg.replacement_timeout_s if first else state.wait_deadline
        assert deadline is not None
        said: tuple[Action, ...] = (Log("warning", f"waiting for a replacement (up to {deadline - event.now:.0f}s more): "
                                                   f"{d.reason}; a spare, or a new agent with --rdzv-id {cfg.job_id}, "
                                                   "is admitted"),)
        if first:
            said += (NoteWaiting(state.generation, tuple(sorted(state.lost)), deadline - event.now, d.reason),)
        return (WaitingForReplacement(state.generation, state.lost, state.opened_at, deadline, d.reason, event.seen),
                notes + said)
    if isinstance(d, (RecoveryPlan, DiskFallback)):
        d = replace(d, stalled=give_up.stalled(state.prior, d.resume_version),
                    timeouts=give_up.timeouts(state.prior, d.resume_version, state.timed_out))
        why = give_up.diverged(d.timeouts, d.resume_version, state.reason) or \
            give_up.reason(d.stalled, d.resume_version, cfg.max_recoveries, state.reason)
        if why is not None:
            st, acts = _end("failed", why)
            return st, notes + acts
    return Publishing(state.generation, d, state.opened_at), notes + (Publish(d, state.generation),)


def replacement_key(view: JobView) -> tuple[tuple[str, ...], frozenset[str]]:
    """What a wait for a replacement watches: the usable spares and the live nodes."""
    return tuple(w.worker_id for w in view.usable_spares()), view.live_nodes


def _wait_replacement(state: WaitingForReplacement, view: JobView, now: float, cfg: LeaderConfig) -> Step:
    key = replacement_key(view)
    lost = state.lost | view.faulted
    if state.seen is None:  # no key from the plan: the first look after it is the reference
        state = replace(state, seen=key)
    if now >= state.deadline:
        return _end("failed", f"no replacement within {cfg.replacement_timeout_s:.0f}s (--replacement-timeout): "
                              f"{state.reason}; waited for a live spare, a node to respawn them on, or a new agent "
                              f"with --rdzv-id {cfg.job_id}")
    if key != state.seen or lost != state.lost:
        return (Planning(state.generation, lost, state.opened_at, state.reason, wait_deadline=state.deadline,
                         prior=give_up.prior_of(view)),
                (RequestPlan(state.generation, lost),))
    return state, ()


def _await_formation(state: AwaitingFormation, view: JobView, now: float, cfg: LeaderConfig) -> Step:
    m = view.membership
    assert m is not None
    missing = _missing(state.missing_since, view, now)
    reasons = _failure_symptoms(view, missing, now, cfg)
    ready = view.ready | {r for r, w in m.hosted.items() if m.rank_of(w) in view.ready}  # resumed with its host
    not_ready = {a.rank for a in m.ranks} - ready - view.finished
    # A rank still joining on a node that vanished cannot be making progress for long.
    stranded = {r for r in not_ready if m.worker_of(r).node_id in missing
                and now - missing[m.worker_of(r).node_id] >= cfg.gone_node_report_grace_s}
    if stranded:
        reasons.append(f"ranks {sorted(stranded)} were joining on nodes that lost their lease")
    if reasons:
        return _open(state.generation, view, now, cfg, "; ".join(reasons), lost=frozenset(stranded))
    if not not_ready:
        return Watching(state.generation, tuple(sorted(missing.items()))), (
            Log("info", f"generation {state.generation}: every rank resumed"),)
    state = replace(state, missing_since=tuple(sorted(missing.items())))
    if now < state.deadline:
        return state, ()
    if state.extensions < cfg.formation_extensions:
        joining = (not_ready & view.fresh) or not_ready
        return (replace(state, deadline=now + cfg.formation_timeout_s, extensions=state.extensions + 1),
                (Log("warning", f"generation {state.generation}: ranks {sorted(joining)} are still joining after "
                                f"{(state.extensions + 1) * cfg.formation_timeout_s:.0f}s; alive, so waiting "
                                f"{cfg.formation_timeout_s:.0f}s more ({state.extensions + 1}/"
                                f"{cfg.formation_extensions})"),))
    # Survivors that resumed nothing yet are waiting for the joiners at the group barrier:
    # blame the replacements still joining; only if there are none, the ranks not ready.
    slow = (not_ready & view.fresh) or not_ready
    return _open(state.generation, view, now, cfg,
                 f"ranks {sorted(slow)} did not join generation {state.generation} within "
                 f"{(cfg.formation_extensions + 1) * cfg.formation_timeout_s:.0f}s", lost=frozenset(slow))
