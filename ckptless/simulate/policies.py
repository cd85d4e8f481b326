"""The three ways to meet the same failures, each driving a :class:`~ckptless.simulate.engine.Timeline` (pure).

* :func:`run_ckptless`: a lost rank is replaced by a warm spare (if the pool has one), a
  warm respawn on its node (a process that died on a healthy node), or, for a device or node
  that is gone with no spare, a replacement from the scheduler (``lost_node="wait"``) or the
  survivors training on at half speed until it comes (``"shrink"``: each survivor runs a lost
  rank's micro-batch too, so a step takes twice as long; nothing is mirrored meanwhile). The
  job rolls back to the newest committed version (every N steps, usable one round after);
  a failure set that defeats the placement (:mod:`ckptless.simulate.placement`) falls back to
  the last disk snapshot (or the job's start without snapshots).
* :func:`run_restart`: restart-from-disk (torchrun + DCP, or a requeued job): checkpoints every
  interval (the Young/Daly optimum unless given), each failure stops every rank, restarts
  the job (the scheduler's requeue, every process's start), forms the world's communicators,
  loads the checkpoint, and redoes the work since it. A device or node that is gone needs a
  spare node or the scheduler's replacement before the restart.
* :func:`run_torchft`: drop a data-parallel replica group, as TorchFT does: the other R - 1
  groups stall for detection and a quorum, lose the step in flight, and train on at
  (R - down) / R of the throughput; the dropped group restarts, forms its own communicators,
  heals from a live replica and rejoins (one more quorum). With one group (R = 1) it is
  restart-from-disk.

Spares (ranks, on spare nodes) serve every system alike: one taken for a device or node loss
comes back when the scheduler replaces the broken hardware (``replace_s``); one taken for a
process crash on a healthy node is rebuilt there (``--spare-refill``) after a setup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ckptless.simulate import costs
from ckptless.simulate.engine import Timeline, committed_point
from ckptless.simulate.failures import Failure
from ckptless.simulate.params import Params
from ckptless.simulate.placement import Unit, defeats

HARDWARE = ("accelerator", "node")


@dataclass
class Outcome:
    """One system's run: the timeline's seconds plus what only some systems count."""

    timeline: Timeline
    defeats: int = 0
    windows: list[float] = field(default_factory=list)  # per failure: how long its loss stayed unprotected


@dataclass
class SparePool:
    ranks: int
    refills: list[tuple[float, int]] = field(default_factory=list)

    def at(self, now: float) -> None:
        due = [r for r in self.refills if r[0] <= now]
        self.refills = [r for r in self.refills if r[0] > now]
        self.ranks += sum(n for _, n in due)

    def take(self, n: int, back_at: float) -> bool:
        if self.ranks < n:
            return False
        self.ranks -= n
        self.refills.append((back_at, n))
        return True


def landed(p: Params, f: Failure, tl: Timeline) -> Failure:
    """With ``defer_in_recovery`` (a chaos run's kills), an arrival during a recovery lands one
    step after the job resumed; otherwise where it comes."""
    if f.t < p.startup_s:
        f = replace(f, t=p.startup_s + p.step_s)
    if p.defer_in_recovery and tl.down_until > f.t:
        return replace(f, t=tl.down_until + p.step_s)
    return f


def _start(p: Params) -> Timeline:
    tl = Timeline(p.step_s)
    if p.startup_s:
        tl.go_down(0.0, [("startup", p.startup_s)], incident=False)
    return tl


def _ranks(p: Params, f: Failure) -> int:
    return p.nproc_per_node if f.local is None else 1


def run_ckptless(p: Params, failures: list[Failure], horizon: float) -> Outcome:
    tl = _start(p)
    out = Outcome(tl)
    every_work = p.mirror_every * p.step_s
    mirror = {"mirror": p.mirror_block_s / every_work} if p.replicas else {}
    snap = p.snapshot_every_s
    if snap:
        mirror["checkpoint_save"] = p.snapshot_block_s / snap
    pool = SparePool(p.spares)
    down: dict[Unit, float] = {}         # unprotected losses -> until when (inf: its incident not resumed yet)
    pending: list[Unit] = []
    failed_at: dict[Unit, float] = {}
    shrink_until = -1.0                  # training on fewer ranks until the replacement comes
    reprotect = costs.reprotect_window_s(p)

    def advance(to: float) -> None:
        nonlocal shrink_until
        while shrink_until >= 0 and shrink_until <= to:
            tl.train_until(max(tl.t, shrink_until), speed=0.5)
            at = max(shrink_until, tl.down_until)
            if at >= to:  # still recovering when ``to`` comes: grow back once that recovery is over
                shrink_until = max(at, math.nextafter(to, math.inf))
                break
            tl.spend_down(at)
            tl.go_down(at, [("reformation", costs.ckptless_reform_s(p))], incident=False)  # grow back
            shrink_until = -1.0
            _resume(tl.down_until)
        tl.train_until(to, speed=0.5 if shrink_until >= 0 else 1.0, overheads={} if shrink_until >= 0 else mirror)

    def _resume(t_resume: float) -> None:
        for u in pending:
            down[u] = t_resume + reprotect
        pending.clear()

    for f0 in failures:
        f = landed(p, f0, tl)
        if f.t >= horizon:
            break
        advance(f.t)
        pool.at(f.t)
        for u in [u for u, until in down.items() if until <= f.t]:
            out.windows.append(down.pop(u) - failed_at.pop(u))
        unit: Unit = (f.node, f.local)
        # with the node-local tier a crashed process's image outlives it on its node: no copy is lost
        survives = p.node_local and f.kind == "software"
        beaten = not survives and defeats(unit, list(down) + pending, p)
        # a failure during a recovery restarts it; the loss rule applies either way (idempotent after a rollback)
        tail = tl.interrupt(f.t) if tl.down else []
        if shrink_until < 0:
            tl.lose(committed_point(tl.progress, tl.resume_point, every_work, p.round_s))
        else:
            tl.lose(tl.resume_point)  # a generation with fewer ranks mirrors nothing
        if beaten:
            out.defeats += 1
            tl.lose((tl.progress // snap) * snap if snap else 0.0)
        n = _ranks(p, f)
        hardware = f.kind in HARDWARE
        spare = pool.take(n, f.t + (p.replace_s if hardware else p.respawn_s + costs.setup_s(p)))
        shrink = hardware and not spare and p.lost_node == "shrink"  # the survivors host the lost ranks
        parts = costs.ckptless_phases(p, kind=f.kind, spare=spare or shrink, disk=beaten, ranks_lost=n)
        if hardware and not spare and not shrink:
            parts.insert(1, ("replacement_wait", p.replace_s))
        if shrink:
            shrink_until = max(shrink_until, f.t + p.replace_s)
        t_resume = tl.go_down(f.t, parts, tail=tail)
        tl.resume_point = tl.progress
        pending.extend(u for u in list(down) if down[u] > f.t)  # losses not yet re-protected stay pending
        for u in pending:
            down.pop(u, None)
        if not survives:
            pending.append(unit)
            failed_at.setdefault(unit, f.t)
        if shrink_until < 0:
            _resume(t_resume)
        else:
            for u in pending:
                down[u] = shrink_until + costs.ckptless_reform_s(p) + reprotect
            pending.clear()
    advance(horizon)
    tl.finish(horizon)
    return out


def run_restart(p: Params, failures: list[Failure], horizon: float) -> Outcome:
    tl = _start(p)
    interval = p.restart_interval_s
    save = {"checkpoint_save": p.save_s / interval}
    pool = SparePool(p.spares)
    for f0 in failures:
        f = landed(p, f0, tl)
        if f.t >= horizon:
            break
        tl.train_until(f.t, overheads=save)
        pool.at(f.t)
        tail = tl.interrupt(f.t) if tl.down else []
        tl.lose((tl.progress // interval) * interval)
        parts = costs.restart_phases(p, kind=f.kind)
        if f.kind in HARDWARE and not pool.take(_ranks(p, f), f.t + p.replace_s):
            parts.insert(1, ("replacement_wait", p.replace_s))
        tl.go_down(f.t, parts, tail=tail)
        tl.resume_point = tl.progress
    tl.train_until(horizon, overheads=save)
    tl.finish(horizon)
    return Outcome(tl)


def run_torchft(p: Params, failures: list[Failure], horizon: float) -> Outcome:
    r = p.ft_groups
    if r == 1:
        return run_restart(p, failures, horizon)
    tl = _start(p)
    per_step = {"step_quorum": p.ft_overhead} if p.ft_overhead else {}
    pool = SparePool(p.spares)
    back: dict[int, float] = {}  # group -> when it rejoins
    rejoin_stall = [("reformation", p.ft_quorum_s + costs.comm_init_s(p, r))]

    def advance(to: float) -> None:
        while True:
            due = sorted(t for t in back.values() if t <= to)
            speed = (r - len(back)) / r
            if not due:
                tl.train_until(to, speed=speed, overheads=per_step)
                return
            t = due[0]
            tl.train_until(max(tl.t, t), speed=speed, overheads=per_step)
            at = max(t, tl.down_until)
            returning = [g for g, tb in back.items() if tb == t]
            if at >= to:  # the job is down when ``to`` comes: these groups rejoin once it is up again
                for g in returning:
                    back[g] = max(at, math.nextafter(to, math.inf))
                continue
            for g in returning:
                del back[g]
            tl.spend_down(at)
            tl.go_down(at, rejoin_stall, incident=False)

    for f0 in failures:
        f = landed(p, f0, tl)
        if f.t >= horizon:
            break
        advance(f.t)
        pool.at(f.t)
        g = (f.node * p.nproc_per_node + (f.local or 0)) // p.group_ranks
        tail = tl.interrupt(f.t) if tl.down else []
        tl.lose((tl.progress // p.step_s) * p.step_s)  # the step in flight is discarded by every group
        stall = costs.torchft_stall(p, f.kind)
        t_resume = tl.go_down(f.t, stall, tail=tail)
        wait = 0.0
        if f.kind in HARDWARE and not pool.take(_ranks(p, f), f.t + p.replace_s):
            wait = p.replace_s
        back[g] = max(back.get(g, 0.0), t_resume + wait + costs.torchft_rejoin_s(p))
    advance(horizon)
    tl.finish(horizon)
    return Outcome(tl)
