"""Synthetic multi-rank ledgers in the format the job loop, leader and chaos injector write.

One job: world 4, a step every 0.2 s after a 1.5 s start, rank 1 SIGKILLed
during step 13, rank 2 notices first, a spare takes rank 1, resume from the
committed step 10, background re-protection finishes after the first step.
Every figure the tests check is derived by hand in the comments below.
"""

from __future__ import annotations

from pathlib import Path

from ckptless.goodput import Event, EventKind, Ledger

K = EventKind
WALL0 = 1_790_000_000.0   # t_wall = t_monotonic + WALL0 (any fixed offset)
STEP = 0.2
START = 100.0             # job_start on every rank (monotonic)
T12 = START + 1.5 + 11 * STEP   # step 12 done at 103.7 (step 1 at 101.5)
FAULT = T12 + 0.05        # 103.75: the kill
DETECT = {2: FAULT + 0.03, 0: FAULT + 0.05, 3: FAULT + 0.07}   # last at 103.82
OPENED = FAULT + 0.06
REFORMED = {0: FAULT + 0.90, 1: FAULT + 0.92, 2: FAULT + 0.91, 3: FAULT + 0.93}  # last 104.68
TRANSFER = {0: FAULT + 0.95, 1: FAULT + 1.40, 2: FAULT + 0.96, 3: FAULT + 0.94}  # last 105.15 (the spare)
ROLLBACK = {0: FAULT + 1.00, 1: FAULT + 1.42, 2: FAULT + 1.01, 3: FAULT + 1.02}  # last 105.17
FIRST = {0: FAULT + 1.80, 1: FAULT + 1.82, 2: FAULT + 1.81, 3: FAULT + 1.80}     # last 105.57: step 11
REPROTECT = {r: FAULT + 2.30 + r * 0.01 for r in range(4)}                       # last 106.08
RESUME = 10
LAST_STEP = 20


def ev(what: EventKind, t: float, rank: int | None, gen: int = 0, step: int | None = None,
       wall: bool = True, **attrs: object) -> Event:
    return Event(what, t, rank, gen, step, attrs, (t + WALL0) if wall else None)  # type: ignore[arg-type]


def rank_events(rank: int, wall: bool = True) -> list[Event]:
    es = [ev(K.JOB_START, START, rank, wall=wall, role="member")]
    for s in range(1, 13):
        es.append(ev(K.STEP_DONE, START + 1.5 + (s - 1) * STEP, rank, 0, s, wall))
    if rank == 1:  # killed during step 13; a spare takes the rank
        es.append(ev(K.JOB_START, FAULT + 0.80, 1, 1, wall=wall, role="spare"))
    else:
        es.append(ev(K.FAILURE_DETECTED, DETECT[rank], rank, 0, wall=wall, reason="RuntimeError: peer closed"))
    es.append(ev(K.GROUPS_REFORMED, REFORMED[rank], rank, 1, wall=wall))
    es.append(ev(K.TRANSFER_DONE, TRANSFER[rank], rank, 1, wall=wall, bytes=1000 if rank == 1 else 0))
    es.append(ev(K.ROLLBACK_DONE, ROLLBACK[rank], rank, 1, RESUME, wall))
    es.append(ev(K.FIRST_STEP_AFTER_RECOVERY, FIRST[rank], rank, 1, RESUME + 1, wall))
    t = FIRST[rank]
    for s in range(RESUME + 2, LAST_STEP + 1):
        t = FIRST[0] + (s - RESUME - 1) * STEP + rank * 0.001
        es.append(ev(K.STEP_DONE, t, rank, 1, s, wall))
        if s == RESUME + 3:
            es.append(ev(K.REPROTECT_DONE, REPROTECT[rank], rank, 1, wall=wall, version=RESUME))
    es.sort(key=lambda e: e.t_monotonic)
    es.append(ev(K.JOB_END, es[-1].t_monotonic + 0.05, rank, 1, wall=wall))
    return es


def job_events(wall: bool = True) -> list[Event]:
    return [ev(K.FAULT_INJECTED, FAULT, None, 0, wall=wall, kind="kill_worker", target=1)]


def leader_events(wall: bool = True) -> list[Event]:
    return [ev(K.INCIDENT_OPENED, OPENED, None, 0, wall=wall, lost="1", generation=0),
            ev(K.PLAN_PUBLISHED, FAULT + 0.5, None, 1, wall=wall, decision="memory", generation=1,
               resume_step=RESUME)]


def all_events(wall: bool = True) -> list[Event]:
    out = job_events(wall) + leader_events(wall)
    for r in range(4):
        out += rank_events(r, wall)
    return out


def write_run(goodput_dir: Path, wall: bool = True, with_new_kinds: bool = True) -> Path:
    """The run as files: rank<R>.jsonl, leader.jsonl, chaos.jsonl (the last two only with the new kinds)."""
    goodput_dir.mkdir(parents=True, exist_ok=True)
    for r in range(4):
        evs = [e for e in rank_events(r, wall) if with_new_kinds or e.kind is not K.REPROTECT_DONE]
        Ledger(evs).save(goodput_dir / f"rank{r}.jsonl")
    if with_new_kinds:
        Ledger(leader_events(wall)).save(goodput_dir / "leader.jsonl")
        Ledger(job_events(wall)).save(goodput_dir / "chaos.jsonl")
    return goodput_dir
