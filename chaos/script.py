"""Chaos on the user's own script: ``ckptless-chaos run SCENARIO --script PATH [-- ARGS]``.

Why this needs nothing from the script: exact-step injection and the bitwise
record both live in the library. A worker started with
``CKPTLESS_CHAOS_DIR``/``CKPTLESS_CHAOS_POINTS`` holds at the named step and
announces its pid (:mod:`ckptless.chaos_hooks`); with ``CKPTLESS_DIGEST_DIR``
every rank writes a SHA-256 of each protected object (RNG streams included) at
``job.close()`` (:mod:`ckptless.state.digest`). So any script that uses
``ckptless.init/protect/run`` (or ``job.steps``/``job.guard``) and closes its
job can be judged:

1. the fault-free run: the same script, arguments, environment and world, no
   spares and no watchdog (neither changes what is computed). Its digests
   also give the step count, from which the default fault steps are chosen;
2. the faulty run under the real launcher with the scenario's faults, each
   landing at an exact step (the victim is held there until the signal);
3. the verdict: PASS only if every rank's digest of every protected object
   equals the fault-free run's; a FAIL names the objects that differ. The job
   must also have finished (every agent not killed on purpose exits 0, no
   process left behind) and recovered (the fenced generation advanced once
   per incident). A script that leaves its data position unprotected replays
   other batches after a recovery: its model digest differs and it FAILs.

Every injection is also written to the faulty run's goodput dir as a
``fault_injected`` event (``chaos.jsonl``), so ``ckptless report`` starts the
incident at the kill and shows kill -> first step.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptless import environment
from ckptless.chaos.cluster import REPO, ClusterSpec, LocalCluster, wait_gone
from ckptless.chaos.faults import Injection, inject_step, pause_tag
from ckptless.chaos.schedule import Fault, FaultKind
from ckptless.errors import CkptlessError, ConfigError

DEFAULT_HANG_TIMEOUT_S = 3.0
# Python's `random` and NumPy's global RandomState are seeded from OS entropy at import: a script
# that never seeds them (most never touch NumPy's) would differ between ANY two runs, since the
# library digest covers every global stream. So both runs pin them per rank before the script
# starts (a sitecustomize first on PYTHONPATH, chaining to any it shadows), and PYTHONHASHSEED.
# What a recovery must get right is unchanged: a replacement restores every stream from its image.
SITE_CUSTOMIZE = """\
# Written by ckptless-chaos (ckptless.chaos.script): pin the process-global random streams of a
# worker that the script may leave unseeded, so that two runs of the same script are comparable.
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
if _os.getenv("LOCAL_RANK") is not None:
    import random as _random

    _seed = 1_000_003 * int(_os.getenv("RANK") or 0) + 12345
    _random.seed(_seed)
    try:
        import numpy as _np

        _np.random.seed(_seed % 2**32)
    except ImportError:
        pass
# then the sitecustomize this one shadows, if any (run under another module name)
import importlib.machinery as _machinery
import importlib.util as _util

_spec = _machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _mod = _util.module_from_spec(_spec)
    _sys.modules["_shadowed_sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
"""
# Library warnings that explain a FAIL (printed as a hint beside it). A pattern's match is the hint:
# the loop-carried check's names the loop and its unprotected locals (ckptless/loop_check.py).
HINTS = (r"the loop at \S+ carries unprotected from one iteration to the next: \w+(?:, \w+)*",
         re.escape("no protected object holds a data position"), re.escape("nothing protected besides RNG"))


@dataclass(frozen=True)
class ScriptScenario:
    name: str
    fault: str       # one line: what is injected (steps are fractions of the run)
    expected: str    # one line: what must happen


SCRIPT_SCENARIOS = {s.name: s for s in (
    ScriptScenario("kill-worker", "SIGKILL one rank at 1/3 of the run",
                   "a spare (if any) or a respawn takes the rank from peer memory; bitwise equal"),
    ScriptScenario("hang-worker", "SIGSTOP one rank at 1/3 of the run (agents run with --hang-timeout)",
                   "the agent's watchdog SIGKILLs the frozen rank, then as kill-worker; bitwise equal"),
    ScriptScenario("kill-node", "SIGKILL a whole node (its agent and every process under it) at 1/2 of the run",
                   "warm spares on a spare-only node take the node's ranks; bitwise equal"),
    ScriptScenario("kill-twice", "SIGKILL one rank at 1/3 of the run, then its replacement at 2/3",
                   "recovered twice, the second time from the replacement's own mirrors; bitwise equal"),
)}


@dataclass(frozen=True)
class ScriptJob:
    """The user's job as the runner starts it (``ckptless-run`` flags and the script)."""

    script: Path
    args: tuple[str, ...] = ()       # ``{out}`` is replaced by each run's own output dir
    nnodes: int = 2
    nproc_per_node: int = 2
    spares: int = 0                   # warm spares on one extra spare-only node (faulty run only)
    spare_args: tuple[str, ...] = ()  # extra ckptless-run flags of that node (e.g. --spare-any-rank)
    env: Mapping[str, str] = field(default_factory=dict)
    hang_timeout: float | None = None  # --hang-timeout of the faulty run (None: only for hang faults)
    lease_ttl: float = 1.0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self) -> None:
        if not self.script.is_file():
            raise ConfigError("script", str(self.script), "no such file")
        for name in ("nnodes", "nproc_per_node"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ConfigError(name, v, "must be an int >= 1")
        if self.world_size < 2:
            raise ConfigError("nproc_per_node", self.nproc_per_node,
                              "the world must have >= 2 ranks: a lost rank is rebuilt from a peer's memory")
        if type(self.spares) is not int or self.spares < 0:
            raise ConfigError("spares", self.spares, "must be an int >= 0")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise ConfigError("hang_timeout", self.hang_timeout, "must be > 0 seconds")

    def spec(self, faulty: bool, hang: bool = False, site: Path | None = None) -> ClusterSpec:
        """The cluster of one run; the fault-free one has no spares and no watchdog.
        ``site``: a directory holding :data:`SITE_CUSTOMIZE` (pins unseeded global RNGs)."""
        env = dict(self.env)
        env.setdefault("PYTHONHASHSEED", "0")
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", ""), str(REPO),
                                                            environment.environ().get("PYTHONPATH", "")) if p)
        return ClusterSpec(
            nodes=self.nnodes, nproc_per_node=self.nproc_per_node, script=self.script.resolve(),
            script_args=self.args, env=env, lease_ttl=self.lease_ttl,
            spare_nodes=1 if faulty and self.spares else 0, spares_per_spare_node=max(self.spares, 1),
            spare_node_args=self.spare_args,
            hang_timeout=(self.hang_timeout or (DEFAULT_HANG_TIMEOUT_S if hang else None)) if faulty else None)


@dataclass
class JobRun:
    """One run of the job: what it left behind."""

    out: Path
    codes: dict[int, int | None]
    digests: dict[int, dict[str, Any]]
    wall_s: float
    injections: list[Injection] = field(default_factory=list)
    generation: int | None = None
    problems: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    tail: str = ""
    t0: float = 0.0  # monotonic time the run was launched (injections' times are on the same clock)


@dataclass
class ScriptVerdict:
    scenario: str
    script: Path
    passed: bool
    line: str                                  # the one-line verdict
    reasons: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    baseline: JobRun | None = None
    faulty: JobRun | None = None
    incidents: list[dict[str, Any]] = field(default_factory=list)  # from the faulty run's report
    goodput: float | None = None


# --- the plan ---------------------------------------------------------------------------------
def read_digests(directory: Path, name: str = "digest") -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for p in sorted(directory.glob(f"{name}_rank*.json")):
        doc = json.loads(p.read_text())
        found[int(doc["rank"])] = doc
    return found


def plan_faults(name: str, job: ScriptJob, steps: int, rank: int | None = None,
                at: Sequence[int] = ()) -> list[Fault]:
    """The scenario's faults for a job of ``steps`` steps (from the fault-free run's digests).

    Default victim: the last rank (it lives on the last node, away from the leader's); default
    steps: 1/3 of the run (a node: 1/2; the second kill: 2/3). ``at`` overrides the steps.
    """
    if name not in SCRIPT_SCENARIOS:
        raise ConfigError("scenario", name, f"for --script, one of {sorted(SCRIPT_SCENARIOS)}")
    world = job.world_size
    victim = world - 1 if rank is None else rank
    if not 0 <= victim < world:
        raise ConfigError("rank", victim, f"must be in [0, {world})")
    wanted = 2 if name == "kill-twice" else 1
    default = [max(1, steps // 2)] if name == "kill-node" else [max(1, steps // 3), max(2, 2 * steps // 3)]
    chosen = list(at) if at else default[:wanted]
    if len(chosen) != wanted:
        raise ConfigError("at", ",".join(map(str, at)), f"{name} needs {wanted} step(s)")
    for s in chosen:
        if not 1 <= s < steps:
            raise ConfigError("at", s, f"a fault step must be in [1, {steps}) (the job runs {steps} steps)")
    if chosen != sorted(set(chosen)):
        raise ConfigError("at", ",".join(map(str, chosen)), "steps must increase")
    if name == "kill-worker":
        return [Fault(chosen[0], FaultKind.KILL_WORKER, (victim,))]
    if name == "hang-worker":
        return [Fault(chosen[0], FaultKind.HANG_WORKER, (victim,))]
    if name == "kill-twice":
        return [Fault(s, FaultKind.KILL_WORKER, (victim,)) for s in chosen]
    if job.spares < job.nproc_per_node:
        raise ConfigError("spares", job.spares, f"kill-node loses {job.nproc_per_node} ranks at once and a dead "
                                                "node cannot respawn them: give --spares >= --nproc-per-node")
    return [Fault(chosen[0], FaultKind.KILL_AGENT, (victim,))]


def points_spec(faults: Sequence[Fault]) -> str:
    """``CKPTLESS_CHAOS_POINTS`` for the library: one pause per (fault, target rank)."""
    return ",".join(f"{pause_tag(i, r)}=step:r{r}:{f.step}" for i, f in enumerate(faults) for r in f.targets)


def describe(f: Fault) -> str:
    what = {FaultKind.KILL_WORKER: "SIGKILL rank", FaultKind.HANG_WORKER: "SIGSTOP rank",
            FaultKind.KILL_AGENT: "SIGKILL the node of rank"}.get(f.kind, f.kind.value)
    return f"{what} {','.join(map(str, f.targets))} at step {f.step}"


# --- running ----------------------------------------------------------------------------------
def run_job(spec: ClusterSpec, out: Path, name: str, faults: Sequence[Fault] = (), timeout_s: float = 600.0,
            pause_timeout_s: float = 600.0, log: Callable[[str], None] = print) -> JobRun:
    """Start the job, inject ``faults`` at their steps (whole-node kills), wait, collect. Never raises
    for a failing job: its problems are in the result."""
    t0 = time.monotonic()
    run = JobRun(out, {}, {}, 0.0, t0=t0)
    with LocalCluster(spec, out, name, points=points_spec(faults), digest=True) as c:
        try:
            c.start()
            by_step: dict[int, list[tuple[int, Fault]]] = {}
            for i, f in enumerate(faults):
                by_step.setdefault(f.step, []).append((i, f))
            for step in sorted(by_step):
                for inj in inject_step(c, by_step[step], pause_timeout_s=pause_timeout_s, whole_node=True):
                    run.injections.append(inj)
                    log(f"  injected: {describe(inj.fault)} ({inj.note}"
                        + (f"; ranks lost: {','.join(map(str, inj.lost))}" if inj.lost else "") + ")")
            run.codes = c.wait(max(timeout_s - (time.monotonic() - t0), 1.0))
        except CkptlessError as exc:
            run.problems.append(f"run aborted: {exc}")
        if not run.codes or None in run.codes.values():
            c.kill_all()
        killed = {i for inj in run.injections for i in inj.agents_killed}
        for a in c.agents:
            code = run.codes.get(a.index)
            if a.index not in killed and code != 0 and run.codes:
                run.problems.append(f"agent{a.index} exited {code if code is not None else 'never (timeout)'}")
        leftover = wait_gone(c.job_processes(), 15.0)
        if leftover:
            run.problems.append(f"processes left behind: {leftover}")
        try:
            run.generation = c.generation()
        except CkptlessError as exc:
            run.problems.append(f"cannot read the generation: {exc}")
        text = c.logs_text()
        run.hints = [m.group(0) for m in (re.search(h, text) for h in HINTS) if m is not None]
        if run.problems:
            run.tail = c.tail()
    run.digests = read_digests(out / "digest")
    run.wall_s = time.monotonic() - t0
    return run


def compare_digests(got: Mapping[int, Mapping[str, Any]], want: Mapping[int, Mapping[str, Any]],
                    world: int) -> list[str]:
    """One line per rank whose digests differ, naming the objects; ranks with the same objects
    differing are listed together."""
    problems: list[str] = []
    by_diff: dict[tuple[str, ...], list[int]] = {}
    for r in range(world):
        if r not in got:
            problems.append(f"rank {r} wrote no digest in the faulty run (it never finished training)")
            continue
        a, b = got[r], want[r]
        if a.get("step") != b.get("step"):
            problems.append(f"rank {r}: final step {a.get('step')} != {b.get('step')} of the fault-free run")
        oa, ob = dict(a.get("objects", {})), dict(b.get("objects", {}))
        diff = tuple(sorted(k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k)))
        if diff:
            by_diff.setdefault(diff, []).append(r)
    for diff, ranks in by_diff.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        problems.append(f"{who}: {', '.join(diff)} differ")
    return problems


def _ranges(ranks: list[int]) -> str:
    parts: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [-2]:
        if r != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    return ",".join(parts)


def _incidents(goodput_dir: Path) -> tuple[float | None, list[dict[str, Any]]]:
    """(goodput, per-incident figures) of a run, from the same model ``ckptless report`` uses."""
    from ckptless.report import load_run
    from ckptless.report import build_report

    if not goodput_dir.is_dir() or not any(goodput_dir.glob("rank*.jsonl")):
        return None, []
    a = build_report(load_run(goodput_dir)).analysis
    return a.goodput, [{"generation": i.generation, "lost": list(i.lost_ranks), "downtime_s": i.downtime_s,
                        "kill_to_first_step_s": i.kill_to_first_step_s, "decision": i.decision}
                       for i in a.incidents]


def run_script(name: str, job: ScriptJob, out: Path, rank: int | None = None, at: Sequence[int] = (),
               faults: Callable[[int], list[Fault]] | None = None, timeout_s: float | None = None,
               log: Callable[[str], None] = print, baseline: JobRun | None = None) -> ScriptVerdict:
    """Fault-free run, faulty run, verdict. ``faults``: a plan from the step count (default:
    :func:`plan_faults` for ``name``). ``baseline``: the fault-free run of an earlier call with the
    same job (its ``ScriptVerdict.baseline``), compared with instead of running it again. Raises
    :class:`ConfigError` for bad input and :class:`CkptlessError` when the fault-free run itself fails
    (nothing to compare with)."""
    job.validate()
    if faults is None:
        plan_faults(name, job, 10**9, rank, [])  # check the scenario and flags before running anything
    script = job.script
    log(f"[{name}] {script}: {job.nnodes} node(s) x {job.nproc_per_node} workers"
        + (f" + {job.spares} warm spare(s) on a spare node" if job.spares else "")
        + (f", args {list(job.args)}" if job.args else ""))
    site = out / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE_CUSTOMIZE)
    if baseline is None:
        log(f"fault-free run -> {out / 'fault-free'}")
        base = run_job(job.spec(faulty=False, site=site), out / "fault-free", "fault-free",
                       timeout_s=timeout_s or 1800.0, log=log)
    else:
        log(f"fault-free run: {baseline.out} (reused)")
        base = baseline
    world = job.world_size
    if base.problems or len(base.digests) != world:
        why = "; ".join(base.problems) or f"{len(base.digests)} of {world} ranks wrote a digest at the end of training"
        hint = ("" if base.digests or base.problems else " -- does the script train with ckptless.init/protect and "
                "job.run() or job.steps()?")
        raise CkptlessError(f"the fault-free run failed: {why}{hint}\n{base.tail}")
    steps = int(base.digests[0]["step"])
    plan = faults(steps) if faults is not None else plan_faults(name, job, steps, rank, at)
    hang = any(f.kind is FaultKind.HANG_WORKER for f in plan)
    limit = timeout_s or max(300.0, 4 * base.wall_s + 60.0 * len(plan))
    log(f"  {steps} steps in {base.wall_s:.0f}s; faulty run -> {out / name}: "
        + "; ".join(describe(f) for f in plan))
    bad = run_job(job.spec(faulty=True, hang=hang, site=site), out / name, name, plan, timeout_s=limit,
                  pause_timeout_s=limit, log=log)
    v = ScriptVerdict(name, script, False, "", faults=plan, baseline=base, faulty=bad)
    v.reasons += bad.problems
    start_diff = compare_digests(read_digests(out / name / "digest", "init"),
                                 read_digests(base.out / "digest", "init"), world)
    if start_diff:  # not a recovery verdict: the two runs never started from the same state
        v.reasons.append("the two runs started from different states (" + "; ".join(start_diff)[:400]
                         + "): seed every random stream before building the model and data")
    elif not bad.problems or bad.digests:
        v.reasons += compare_digests(bad.digests, base.digests, world)
    incidents = len({f.step for f in plan})
    if bad.generation is not None and bad.generation < incidents:
        v.reasons.append(f"generation {bad.generation} < {incidents} incident(s): a fault did not cause a recovery")
    if len(bad.injections) != len(plan):
        v.reasons.append(f"{len(bad.injections)} of {len(plan)} faults were injected")
    try:
        v.goodput, v.incidents = _incidents(out / name / "goodput")
    except Exception as exc:  # noqa: BLE001 - a report problem must not hide the verdict
        v.reasons.append(f"goodput ledgers unreadable: {exc}")
    v.passed = not v.reasons
    v.line = verdict_line(v, world)
    return v


def verdict_line(v: ScriptVerdict, world: int) -> str:
    faults = "; ".join(describe(f) for f in v.faults)
    if v.passed:
        objs = len(v.faulty.digests[0]["objects"]) if v.faulty and v.faulty.digests else 0
        k2s = [i["kill_to_first_step_s"] for i in v.incidents if i["kill_to_first_step_s"] is not None]
        times = f", kill -> first step {', '.join(f'{x:.2f}' for x in k2s)} s" if k2s else ""
        gen = v.faulty.generation if v.faulty else None
        return (f"PASS {v.scenario} ({faults}): {world} ranks x {objs} protected objects bitwise equal to the "
                f"fault-free run; generation {gen}{times}")
    hint = ""
    if v.faulty and v.faulty.hints:
        hint = f" [ckptless warned: {v.faulty.hints[0]}]"
    first = re.sub(r"\s+", " ", v.reasons[0])
    more = f" (+{len(v.reasons) - 1} more)" if len(v.reasons) > 1 else ""
    return f"FAIL {v.scenario} ({faults}): {first}{more}{hint}"


def render_details(v: ScriptVerdict) -> str:
    """What the one-line verdict summarises: every reason, incident figures, where the logs are."""
    lines: list[str] = []
    for r in v.reasons:
        lines.append(f"  {r}")
    for i in v.incidents:
        dt = "-" if i["downtime_s"] is None else f"{i['downtime_s']:.2f}s"
        k2s = "-" if i["kill_to_first_step_s"] is None else f"{i['kill_to_first_step_s']:.2f}s"
        lines.append(f"  incident -> generation {i['generation']}: lost ranks {i['lost'] or '-'}, "
                     f"{i['decision'] or '?'}, downtime {dt}, kill -> first step {k2s}")
    if v.goodput is not None:
        lines.append(f"  goodput of the faulty run {v.goodput:.1%}")
    if v.faulty is not None:
        lines.append(f"  faulty run: {v.faulty.out} (logs/, goodput/, digest/; "
                     f"`ckptless report {v.faulty.out / 'goodput'}`)")
    if v.faulty is not None and v.faulty.tail and not v.passed:
        lines.append(v.faulty.tail)
    return "\n".join(lines) + ("\n" if lines else "")
