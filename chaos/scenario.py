"""Scenario runner: a fault-free baseline, the same job with faults, health checks, a verdict.

Why a baseline run instead of stored reference numbers: the decisive check
is that a run with failures ends *bitwise* identical to the same run without
them (params, optimizer state, LR, RNG draws, data position; ``torch.equal``,
no tolerance). Any stored number would go stale with torch versions; a fresh
baseline from the same script and seeds cannot.

Health checks besides equality: every agent exits 0 except the ones killed on
purpose; no process of the job is left behind (``/proc``); the fenced
generation advanced at least once per incident (exactly 0 if nothing was
lost); ranks that were not hit kept their first process (survivors are not
restarted); a loss beyond K was served from disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptless.chaos.cluster import ClusterSpec, LocalCluster, wait_gone
from ckptless.chaos.faults import Injection, disarm_leader_hold, inject_step, leader_points, pause_spec
from ckptless.chaos.schedule import Fault, FaultKind, Schedule
from ckptless.errors import CkptlessError

RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str                 # one line: what is injected
    expected: str              # one line: what must happen
    spec: ClusterSpec
    schedule: Schedule
    expect_disk: bool = False
    # Partitions: the final generation must lie in [lo, hi] (hi None: unbounded); None: the
    # default rule (>= 1 per step that loses ranks, exactly 0 when nothing is lost).
    generation: tuple[int, int | None] | None = None
    # Non-empty: the job may also END (status "failed") instead of finishing, but then its
    # status reason must contain one of these phrases (the cause, named) -- see _check_end.
    end_causes: tuple[str, ...] = ()
    run_timeout_s: float = RUN_TIMEOUT_S
    # A node or leader loss kills the node's whole process tree (agent, workers, spares, fork
    # server) instead of the agent alone (its workers then die by PDEATHSIG).
    whole_node: bool = False


@dataclass
class Verdict:
    scenario: Scenario
    passed: bool
    reasons: list[str] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    generation: int | None = None
    ended: str | None = None  # the job's status reason when it ended instead of finishing
    notes: list[str] = field(default_factory=list)  # observations that do not fail the verdict
    downtimes_s: list[float] = field(default_factory=list)
    kill_to_step_s: list[float] = field(default_factory=list)
    goodput: float | None = None
    wall_s: float = 0.0
    out: Path | None = None
    incidents: list[Any] = field(default_factory=list)  # the goodput model's incidents of the faulty run
    load: list[float] = field(default_factory=list)  # 1-min load average: start, at each injection, end
    faulty_s: float = 0.0  # the faulty run alone (start of the cluster to its teardown)


def _flatten(obj: object, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}.{i}"))
    else:
        out[prefix] = obj
    return out


def load_finals(out: Path, world: int) -> dict[int, dict[str, object]]:
    return {r: torch.load(out / f"final_rank{r}.pt", weights_only=True)
            for r in range(world) if (out / f"final_rank{r}.pt").exists()}


def bitwise_diff(got: dict[int, dict[str, object]], want: dict[int, dict[str, object]]) -> list[str]:
    """Every leaf that is not ``torch.equal`` (or ``==``); generation/recoveries are expected to differ."""
    problems: list[str] = []
    for rank in sorted(want):
        if rank not in got:
            problems.append(f"rank {rank}: no final state written")
            continue
        a, b = _flatten(got[rank]), _flatten(want[rank])
        for k in sorted(set(b) - {".generation", ".recoveries"}):
            if k not in a:
                problems.append(f"rank {rank}: {k} missing")
                continue
            x, y = a[k], b[k]
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
            if not same:
                problems.append(f"rank {rank}: {k} differs")
    return problems


def baseline_spec(spec: ClusterSpec) -> ClusterSpec:
    """The fault-free twin: same script, steps, width and world; no spares, watchdog or snapshots
    (none of them changes what is computed)."""
    return dataclasses.replace(spec, spares_per_node=0, spare_nodes=0, hang_timeout=None, snapshot_every=0,
                               netns=False, node_grace=None)


class BaselineCache:
    """One baseline per training configuration, reused across scenarios of a matrix."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._finals: dict[tuple[Any, ...], tuple[dict[int, dict[str, object]], float | None]] = {}

    def get(self, spec: ClusterSpec, log: Callable[[str], None]) -> tuple[dict[int, dict[str, object]], float | None]:
        base = baseline_spec(spec)
        key = (str(base.script), base.steps, base.width, base.world_size, base.nodes, tuple(sorted(base.env.items())))
        if key not in self._finals:
            out = self.root / f"baseline-{len(self._finals)}"
            shutil.rmtree(out, ignore_errors=True)
            log(f"baseline: {base.nodes} node(s) x {base.nproc_per_node} workers, {base.steps} steps -> {out}")
            with LocalCluster(base, out, "baseline") as c:
                c.start()
                codes = c.wait(RUN_TIMEOUT_S)
                if any(code != 0 for code in codes.values()):
                    raise CkptlessError(f"baseline run failed (agent exit codes {codes}):\n{c.tail()}")
            finals = load_finals(out, base.world_size)
            if len(finals) != base.world_size:
                raise CkptlessError(f"baseline wrote {len(finals)} of {base.world_size} final states")
            self._finals[key] = (finals, goodput_of(out / "goodput")[0])
        return self._finals[key]


def goodput_of(directory: Path) -> tuple[float | None, list[Any]]:
    """(goodput, incidents) from the run's ledgers, through the ``ckptless report`` loader."""
    from ckptless.cli import load_ledgers
    from ckptless.goodput import account

    if not directory.is_dir() or not any(directory.glob("*.jsonl")):
        return None, []
    rep = account(load_ledgers(directory), ref_rank=0)
    return rep.goodput, list(rep.incidents)


def _expected_incidents(schedule: Schedule) -> int:
    return len({f.step for f in schedule.faults if f.kind.loses_ranks})


def run_scenario(sc: Scenario, root: Path, baselines: BaselineCache,
                 log: Callable[[str], None] = print) -> Verdict:
    """Baseline (cached), faulty run, checks. Never raises for a failing job: that is a FAIL verdict."""
    import time

    t0 = time.monotonic()
    v = Verdict(sc, passed=False)
    want, _ = baselines.get(sc.spec, log)
    out = root / sc.name
    shutil.rmtree(out, ignore_errors=True)
    v.out = out
    log(f"[{sc.name}] {sc.fault}; logs in {out / 'logs'}")
    hold = any(f.kind is FaultKind.KILL_IN_RECOVERY for f in sc.schedule.faults)
    t1 = time.monotonic()
    v.load.append(os.getloadavg()[0])
    with LocalCluster(sc.spec, out, sc.name, pauses=pause_spec(sc.schedule.faults, sc.spec.steps, sc.spec.world_size),
                      points=leader_points() if hold else "") as c:
        if hold:
            disarm_leader_hold(out)  # armed for its incident only (faults.py, "the leader's hold")
        try:
            c.start()
            by_step: dict[int, list[tuple[int, Fault]]] = {}
            for i, f in enumerate(sc.schedule.faults):
                by_step.setdefault(f.step, []).append((i, f))
            for step in sorted(by_step):
                for inj in inject_step(c, by_step[step], whole_node=sc.whole_node):
                    v.injections.append(inj)
                    log(f"[{sc.name}]   injected {inj.fault.describe()} ({inj.note})")
                v.load.append(os.getloadavg()[0])
            codes = c.wait(sc.run_timeout_s)
        except CkptlessError as exc:
            v.reasons.append(f"run aborted: {exc}")
            codes = {}
        if not codes or None in codes.values():
            c.kill_all()  # a stuck job: stop it first, so the orphan check reports only real leftovers
        v.ended = _ended(c, sc) if sc.end_causes else None
        if v.ended is not None:
            _check_end(c, sc, v, codes)
        else:
            _check_health(c, sc, v, codes)
    v.faulty_s = time.monotonic() - t1
    v.load.append(os.getloadavg()[0])
    if v.ended is None:
        got = load_finals(out, sc.spec.world_size)
        v.reasons += bitwise_diff(got, want)[:8]
    _measure(v, out)
    if not v.reasons and sc.schedule.expect:
        v.notes += [f"fault {r.index}: {r.note}" for r in fault_rows(v) if r.note]
    v.passed = not v.reasons
    v.wall_s = time.monotonic() - t0
    return v


def _check_health(c: LocalCluster, sc: Scenario, v: Verdict, codes: dict[int, int | None]) -> None:
    killed = {i for inj in v.injections for i in inj.agents_killed}
    cut_off = {i for inj in v.injections for i in inj.cut_off}
    for a in c.agents:
        code = codes.get(a.index)
        if a.index in killed:
            continue
        if a.index in cut_off:  # replaced while unreachable: may exit non-zero, but must exit by itself
            if code is None:
                v.reasons.append(f"agent{a.index} (cut off from etcd for good) never exited by itself")
            continue
        if code != 0:
            v.reasons.append(f"agent{a.index} exited {code if code is not None else 'never (timeout)'}")
    if v.reasons:
        v.reasons.append(f"see {c.out / 'logs'}")
    leftover = wait_gone(c.job_processes(), 15.0)
    if leftover:
        v.reasons.append(f"orphan processes left: {leftover}")
    try:
        v.generation = c.generation()
    except CkptlessError as exc:
        v.reasons.append(f"cannot read the generation: {exc}")
    want_min = _expected_incidents(sc.schedule)
    if v.generation is not None and sc.generation is not None:
        lo, hi = sc.generation
        if v.generation < lo or (hi is not None and v.generation > hi):
            v.reasons.append(f"generation {v.generation} outside [{lo}, {'inf' if hi is None else hi}]")
    elif v.generation is not None:
        if want_min == 0 and v.generation != 0:
            v.reasons.append(f"generation advanced to {v.generation} without a lost rank")
        elif v.generation < want_min:
            v.reasons.append(f"generation {v.generation} < {want_min} incidents")
    lost = {r for inj in v.injections for r in inj.lost}
    may = {r for inj in v.injections for r in inj.may_lose}
    for r in range(sc.spec.world_size):
        pids = c.pids(r)
        if r in may and len(pids) > 1:
            v.notes.append(f"rank {r} was replaced ({len(pids) - 1}x): the partition cost it")
        if r not in lost and r not in may and len(pids) > 1:
            v.reasons.append(f"survivor rank {r} was restarted: {[p['pid'] for p in pids]}")
        if r in lost and len(pids) < 2:
            v.reasons.append(f"lost rank {r} was never replaced")
    if sc.expect_disk:
        text = c.logs_text()
        if "restored disk snapshot" not in text and "disk snapshot step" not in text:
            v.reasons.append("expected a disk fallback; the logs show none")


def _ended(c: LocalCluster, sc: Scenario) -> str | None:
    """The job's status reason if the coordinator ended it as failed (None: it did not)."""
    try:
        kv = c.client().get(c.keyspace.status)
    except CkptlessError:
        return None
    if kv is None:
        return None
    try:
        doc = json.loads(kv.value)
    except ValueError:
        return "the job's status record is malformed"
    return str(doc.get("reason", "")) if doc.get("state") == "failed" else None


def _check_end(c: LocalCluster, sc: Scenario, v: Verdict, codes: dict[int, int | None]) -> None:
    """The job ended instead of finishing: acceptable only as a clear, correct end.

    The status reason names one of ``sc.end_causes`` (case-insensitive); every agent exited (none hung)
    and non-zero; every agent that exited non-zero printed the cause (its failure
    summary); no process of the job is left behind.
    """
    assert v.ended is not None
    if not any(cause.lower() in v.ended.lower() for cause in sc.end_causes):
        v.reasons.append(f"the job ended, but its reason names none of {list(sc.end_causes)}: {v.ended!r}")
    for a in c.agents:
        code = codes.get(a.index)
        if code is None:
            v.reasons.append(f"agent{a.index} never exited after the job ended (timeout)")
        elif code == 0:
            v.reasons.append(f"agent{a.index} exited 0 although the job failed")
        elif v.ended[:60] not in a.log.read_text(errors="replace"):
            v.reasons.append(f"agent{a.index} exited {code} without printing the cause")
    leftover = wait_gone(c.job_processes(), 15.0)
    if leftover:
        v.reasons.append(f"orphan processes left: {leftover}")
    try:
        v.generation = c.generation()
    except CkptlessError as exc:
        v.reasons.append(f"cannot read the generation: {exc}")
    if v.reasons:
        v.reasons.append(f"see {c.out / 'logs'}")


def _measure(v: Verdict, out: Path) -> None:
    try:
        v.goodput, incidents = goodput_of(out / "goodput")
    except CkptlessError as exc:
        v.reasons.append(f"goodput ledger unreadable: {exc}")
        return
    v.incidents = list(incidents)
    v.downtimes_s = [round(i.downtime_s, 3) for i in incidents]
    for inj in v.injections:
        if not inj.fault.kind.loses_ranks and not inj.fault.kind.is_partition:
            continue
        after = [i.ended_at for i in incidents if i.ended_at >= inj.t_monotonic]
        if after:
            v.kill_to_step_s.append(round(min(after) - inj.t_monotonic, 3))


def render_table(verdicts: list[Verdict]) -> str:
    rows = [("scenario", "fault", "verdict", "gen", "kill->step s", "downtime s", "goodput", "wall s")]
    for v in verdicts:
        verdict = "PASS" if v.passed else "FAIL"
        rows.append((
            v.scenario.name, v.scenario.fault, verdict + (" (ended)" if v.ended is not None else ""),
            "-" if v.generation is None else str(v.generation),
            ",".join(f"{x:.2f}" for x in v.kill_to_step_s) or "-",
            ",".join(f"{x:.2f}" for x in v.downtimes_s) or "-",
            "-" if v.goodput is None else f"{v.goodput:.1%}", f"{v.wall_s:.0f}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for v in verdicts:
        if v.ended is not None:
            lines.append(f"  {v.scenario.name}: job ended: {v.ended}")
        for note in v.notes:
            lines.append(f"  {v.scenario.name}: note: {note}")
        for reason in v.reasons:
            lines.append(f"  {v.scenario.name}: {reason}")
    return "\n".join(lines) + "\n"


# --- one row per fault (long runs) ---------------------------------------------------------------
@dataclass(frozen=True)
class FaultRow:
    """One injected fault as the docs' table shows it."""

    index: int
    step: int
    kind: str
    target: str
    outcome: str
    kill_to_step_s: float | None
    generation: str
    note: str = ""  # the observed outcome differs from the layout model's expectation


def _pid_records(out: Path, world: int) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for r in range(world):
        p = out / f"pids_rank{r}.jsonl"
        found[r] = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
    return found


_ROLE = {"spare": "warm spare", "replacement": "respawn", "member": "member"}
_KIND = {"kill_worker": "kill", "hang_worker": "hang (SIGSTOP)", "kill_agent": "node loss",
         "kill_leader": "leader loss", "kill_in_recovery": "kill during recovery"}


def fault_rows(v: Verdict) -> list[FaultRow]:
    """Per injection: what replaced each lost rank (the n-th loss of rank r is answered by the n+1-th
    process in ``pids_rank<r>.jsonl``: its role and the generation of its first step), kill -> first
    step (to the end of the first incident after the injection that no further failure interrupted,
    from rank 0's ledger) and the generation training resumed in (the replacements' first step)."""
    assert v.out is not None
    pids = _pid_records(v.out, v.scenario.spec.world_size)
    seen: dict[int, int] = {}
    incidents = sorted(v.incidents, key=lambda i: i.detected_at)
    faults = list(v.scenario.schedule.faults)
    expect = v.scenario.schedule.expect
    rows: list[FaultRow] = []
    for n, inj in enumerate(v.injections):
        f = inj.fault
        parts, roles, gens = [], [], []
        for r in inj.lost:
            k = seen.get(r, 0) + 1
            seen[r] = k
            rec = pids[r][k] if k < len(pids[r]) else None
            role = None if rec is None else str(rec.get("role"))
            roles.append(role)
            if rec is not None and isinstance(rec.get("generation"), int):
                gens.append(int(rec["generation"]))
            parts.append(f"r{r}: " + ("never replaced" if rec is None else
                                       f"{_ROLE.get(str(role), role)} (pid {rec.get('pid')}, g{rec.get('generation')})"))
        if f.kind is FaultKind.HANG_WORKER:
            parts.insert(0, "watchdog SIGKILLed it;")
        chain = []
        for i in incidents:
            if i.ended_at >= inj.t_monotonic:
                chain.append(i)
                if not i.interrupted:
                    break
        k2s = round(chain[-1].ended_at - inj.t_monotonic, 2) if chain else None
        gen = str(max(gens)) if gens else "-"
        stale = [(m.group(1), other.fault.targets[0]) for other in v.injections if other.fault.step == f.step
                 for m in [re.search(r"before publishing generation (\d+)", other.note)] if m]
        if stale and gens:
            gen += f" (g{stale[0][0]} was published with rank {stale[0][1]} already dead)"
        note = ""
        if expect and f in faults:
            e = expect[faults.index(f)]
            want = ["spare" if t == "spare" else "replacement" for t in e.to]
            if tuple(sorted(inj.lost)) != tuple(sorted(e.lost)):
                note = f"lost ranks {list(inj.lost)}, the model expected {list(e.lost)}"
            elif roles != [want[e.lost.index(r)] for r in inj.lost]:
                note = f"replaced by {roles}, the model expected {want}"
        target = ",".join(map(str, f.targets))
        if inj.agents_killed:
            target = f"agent{inj.agents_killed[0]} (ranks {','.join(map(str, inj.lost))})"
        else:
            target = f"rank {target}"
        rows.append(FaultRow(n, f.step, _KIND.get(f.kind.value, f.kind.value), target, " ".join(parts), k2s, gen,
                             note))
    return rows


def render_fault_table(v: Verdict) -> str:
    """The per-fault table (markdown), as docs/chaos.md holds it."""
    lines = ["| # | step | fault | target | outcome | kill -> first step s | generation |",
             "|---|---|---|---|---|---|---|"]
    for r in fault_rows(v):
        k2s = "-" if r.kill_to_step_s is None else f"{r.kill_to_step_s:.2f}"
        lines.append(f"| {r.index} | {r.step} | {r.kind} | {r.target} | {r.outcome} | {k2s} | {r.generation} |")
    return "\n".join(lines) + "\n"
