"""``ckptless-chaos goodput``: the same script, the same timed failures, under ckptless and under torchrun + DCP.

    ckptless-chaos goodput --script PATH [--every-s T | --schedule FILE] --duration-s D
                           [--nnodes N --nproc-per-node P --spares S] [--ckpt-every N] [--max-restarts M]
                           [--json FILE] [--seed S] [--out DIR] [--env K=V ...] [-- ARGS]

Why measured, not estimated: what a user buys ckptless for is goodput, and the only honest
comparison runs the other system. Each system runs the script for D seconds of wall time (the
tool stops it; a script that finishes sooner ends sooner; a job that fails counts to D) with the
same seeded schedule of SIGKILLs (:mod:`ckptless.chaos.goodput_plan`):

1. ckptless: ``ckptless-run`` agents on a real etcd (:class:`~ckptless.chaos.cluster.LocalCluster`),
   a lost rank respawned (or taken by a warm spare) and rebuilt from its peers' memory;
2. torchrun + DCP: ``python -m torch.distributed.run --standalone --nproc-per-node W --max-restarts M``
   on the same script, unchanged: ``ckptless.init()`` outside ``ckptless-run`` is a plain init whose
   loop writes DCP checkpoints every N steps and resumes from the newest (docs/porting.md, "Without
   ckptless-run"). N is ``--ckpt-every``, by default Young/Daly's optimum from the save time measured
   in a short fault-free torchrun run and the schedule's failure rate.

A fault names a rank; it hits the process that trains that rank at that moment (each announces itself,
:func:`ckptless.chaos_hooks.announce_rank`). When none does (a restart or a respawn still starting),
the fault waits until one does: failures during start-up are not in the mix, for either system.
Goodput = productive step time / wall time, from each run's own ledgers (:func:`goodput_plan.figures`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptless.chaos.cluster import REPO, RUN_MARK, ClusterSpec, LocalCluster, child_env, job_processes_of, wait_gone
from ckptless.chaos.goodput_plan import RunFigures, TimedFault, figures, save_seconds, young_daly_steps
from ckptless.chaos.proctable import alive
from ckptless.errors import CkptlessError, ConfigError
from ckptless.goodput import Event, EventKind
from ckptless.report import load_run

CALIBRATION_S = 45.0  # the fault-free torchrun run that measures the save time (when --ckpt-every is not given)
POLL_S = 0.02


@dataclass(frozen=True)
class GoodputJob:
    script: Path
    args: tuple[str, ...] = ()  # ``{out}``: each run's own output dir
    nnodes: int = 2
    nproc_per_node: int = 2
    spares: int = 0  # warm spares on a spare-only node (ckptless only: torchrun has none)
    env: Mapping[str, str] = field(default_factory=dict)
    duration_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self) -> None:
        if not self.script.is_file():
            raise ConfigError("script", str(self.script), "no such file")
        if self.world_size < 2:
            raise ConfigError("nproc_per_node", self.nproc_per_node, "the world must have >= 2 ranks")
        if self.spares < 0:
            raise ConfigError("spares", self.spares, "must be >= 0")
        if not self.duration_s > 0:
            raise ConfigError("duration_s", self.duration_s, "must be > 0")


def _rank_pid(chaos: Path, rank: int) -> int | None:
    """The live process that announced ``rank`` last (None: nobody trains it right now)."""
    try:
        pid = int(json.loads((chaos / f"rank{rank}.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if alive(pid) else None


def _record(goodput: Path, f: TimedFault, pid: int, t_mono: float, late_s: float) -> None:
    """A ``fault_injected`` event in the run's goodput dir: the report starts the incident at the kill."""
    ev = Event(EventKind.FAULT_INJECTED, t_mono, None, 0, None,
               {"kind": f.kind, "target": f.rank, "note": f"SIGKILL pid {pid}"
                + (f", {late_s:.2f}s after its time (nobody trained rank {f.rank} before)" if late_s > 0.05 else "")},
               t_wall=time.time() - (time.monotonic() - t_mono))
    goodput.mkdir(parents=True, exist_ok=True)
    with open(goodput / "chaos.jsonl", "a", encoding="utf-8") as fh:
        fh.write(ev.to_json() + "\n")


def inject(schedule: Sequence[TimedFault], t0: float, end: float, chaos: Path, goodput: Path,
           running: Callable[[], bool], log: Callable[[str], None]) -> int:
    """Send each fault at ``t0 + f.t`` (monotonic) to the process training its rank; stop at ``end``
    or when the job is gone. Faults due at the same time (a node loss) are one event: every target's
    process is found first, then all are killed at once (else torchrun's restart after the first kill
    would turn the second into a failure of the restarted job). Returns how many were sent."""
    sent = 0
    groups: list[list[TimedFault]] = []
    for f in schedule:
        if groups and groups[-1][0].t == f.t:
            groups[-1].append(f)
        else:
            groups.append([f])
    for group in groups:
        due = t0 + group[0].t
        pids: list[int | None] = [None] * len(group)
        while running() and time.monotonic() < end:
            if time.monotonic() >= due:
                pids = [_rank_pid(chaos, f.rank) for f in group]
                if all(p is not None for p in pids):
                    break
            time.sleep(POLL_S)
        if any(p is None for p in pids):
            return sent
        t = time.monotonic()
        for f, pid in zip(group, pids):
            assert pid is not None
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            sent += 1
            _record(goodput, f, pid, t, t - due)
            log(f"  t={t - t0:6.1f}s SIGKILL rank {f.rank} (pid {pid})"
                + (f", {t - due:.1f}s late" if t - due > 0.05 else ""))
    return sent


def _wait_until(end: float, running: Callable[[], bool]) -> None:
    while running() and time.monotonic() < end:
        time.sleep(0.1)


def _events(goodput: Path) -> list[Event]:
    if not goodput.is_dir() or not any(goodput.glob("*.jsonl")):
        return []
    return list(load_run(goodput).events)


# --- ckptless ---------------------------------------------------------------------------------------
def run_ckptless(job: GoodputJob, schedule: Sequence[TimedFault], out: Path,
                 log: Callable[[str], None] = print) -> RunFigures:
    out.mkdir(parents=True, exist_ok=True)
    env = {**job.env, "CKPTLESS_CHAOS_DIR": str(out / "chaos")}
    spec = ClusterSpec(nodes=job.nnodes, nproc_per_node=job.nproc_per_node, script=job.script.resolve(),
                       script_args=job.args, env=env, spare_nodes=1 if job.spares else 0,
                       spares_per_spare_node=max(job.spares, 1),
                       # a spare that took a rank is replaced once that recovery is over: every failure of the
                       # schedule finds a warm spare, not only the first --spares ones
                       spare_node_args=("--spare-refill",) if job.spares else ())
    ended = "stopped"
    sent = 0
    launch_wall, t0 = time.time(), time.monotonic()
    end = t0 + job.duration_s
    with LocalCluster(spec, out, "goodput-ckptless") as c:
        def running() -> bool:
            return any(a.proc.poll() is None for a in c.agents)
        try:
            c.start()
            sent = inject(schedule, t0, end, out / "chaos", c.goodput_dir, running, log)
            _wait_until(end, running)
        except CkptlessError as exc:
            ended = f"failed: {exc}"
        codes = {a.index: a.proc.poll() for a in c.agents}
        stop_wall = time.time()
        if all(v is not None for v in codes.values()) and ended == "stopped":
            ended = "finished" if all(v == 0 for v in codes.values()) else f"failed: agents exited {codes}"
        c.kill_all()
        wait_gone(c.job_processes(), 15.0)
    if ended.startswith("failed"):
        stop_wall = launch_wall + job.duration_s
    return figures("ckptless", _events(out / "goodput"), launch_wall, stop_wall, ended, sent,
                   {"spares": job.spares, "nnodes": job.nnodes, "nproc_per_node": job.nproc_per_node})


# --- torchrun + DCP ---------------------------------------------------------------------------------
def _torchrun(job: GoodputJob, out: Path, ckpt_every: int, max_restarts: int) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    env = child_env({RUN_MARK: str(out), "CKPTLESS_GOODPUT_DIR": str(out / "goodput"),
                     "CKPTLESS_CHAOS_DIR": str(out / "chaos"), "CKPTLESS_SNAPSHOT_DIR": str(out / "snapshots"),
                     "CKPTLESS_SNAPSHOT_EVERY": str(ckpt_every), **job.env})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    args = [a.replace("{out}", str(out)) for a in job.args]
    log = open(out / "torchrun.log", "wb")
    work = out / "work"
    work.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                             "--nproc-per-node", str(job.world_size), "--max-restarts", str(max_restarts),
                             str(job.script.resolve()), *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=work)


def _stop(p: subprocess.Popen[bytes], out: Path) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for pid in job_processes_of(out):  # workers torchrun started in sessions of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(job_processes_of(out), 15.0)


def _completions(snapshots: Path) -> dict[int, float]:
    """Step -> the wall time its completion marker was written (the save's end)."""
    found = {}
    for m in snapshots.rglob("COMPLETE.json"):
        try:
            found[int(m.parent.name.split("_")[-1])] = m.stat().st_mtime
        except (OSError, ValueError):
            continue
    return found


def calibrate(job: GoodputJob, out: Path, step_s: float, log: Callable[[str], None] = print,
              seconds: float = CALIBRATION_S) -> tuple[float, float]:
    """(save_s, step_s) of the script under torchrun + DCP, fault-free, checkpointing every ~2 s."""
    every = max(1, round(2.0 / max(step_s, 1e-3)))
    t_end = time.monotonic() + min(seconds, job.duration_s)
    p = _torchrun(job, out, every, 0)
    try:
        _wait_until(t_end, lambda: p.poll() is None)
    finally:
        _stop(p, out)
    events = _events(out / "goodput")
    save = save_seconds(events, _completions(out / "snapshots"))
    steps = sorted(e.t_wall for e in events if e.kind is EventKind.STEP_DONE and e.rank == 0 and e.t_wall)
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]))
    if save is None or not gaps:
        raise CkptlessError(f"calibration: no completed checkpoint in {CALIBRATION_S:g}s of torchrun "
                            f"(every {every} steps; {out / 'torchrun.log'}): give --ckpt-every")
    log(f"  calibration (torchrun, fault-free, checkpoint every {every} steps): save {save:.2f}s, "
        f"step {gaps[len(gaps) // 2]:.4f}s")
    return save, gaps[len(gaps) // 2]


def run_torchrun(job: GoodputJob, schedule: Sequence[TimedFault], out: Path, ckpt_every: int, max_restarts: int,
                 log: Callable[[str], None] = print, extra: Mapping[str, object] | None = None) -> RunFigures:
    launch_wall, t0 = time.time(), time.monotonic()
    end = t0 + job.duration_s
    p = _torchrun(job, out, ckpt_every, max_restarts)
    ended = "stopped"
    try:
        sent = inject(schedule, t0, end, out / "chaos", out / "goodput", lambda: p.poll() is None, log)
        _wait_until(end, lambda: p.poll() is None)
        stop_wall = time.time()
        if p.poll() is not None:
            ended = "finished" if p.returncode == 0 else f"failed: torchrun exited {p.returncode}"
    finally:
        _stop(p, out)
    if ended.startswith("failed"):
        stop_wall = launch_wall + job.duration_s  # a failed job is not a shorter one
    return figures("torchrun", _events(out / "goodput"), launch_wall, stop_wall, ended, sent,
                   {"ckpt_every": ckpt_every, "max_restarts": max_restarts, **(extra or {})})


def compare(job: GoodputJob, schedule: Sequence[TimedFault], out: Path, mtbf_s: float, ckpt_every: int | None,
            max_restarts: int | None, log: Callable[[str], None] = print) -> dict[str, RunFigures]:
    """Both runs, ckptless first (its median step sizes the calibration), then torchrun + DCP."""
    job.validate()
    log(f"ckptless run ({job.nnodes} x {job.nproc_per_node}"
        + (f" + {job.spares} warm spares" if job.spares else "") + f", {job.duration_s:g}s) -> {out / 'ckptless'}")
    ck = run_ckptless(job, schedule, out / "ckptless", log)
    extra: dict[str, object] = {"mtbf_s": mtbf_s}
    if ckpt_every is None:
        log(f"calibration -> {out / 'calibration'}")
        save_s, step_s = calibrate(job, out / "calibration", ck.step_s or 0.05, log)
        ckpt_every = young_daly_steps(save_s, mtbf_s, step_s)
        extra.update({"save_s": save_s, "calibration_step_s": step_s,
                      "ckpt_every_source": f"Young/Daly: sqrt(2 x {save_s:.2f}s x {mtbf_s:g}s) / {step_s:.4f}s"})
    else:
        extra["ckpt_every_source"] = "--ckpt-every"
    restarts = max_restarts if max_restarts is not None else len(schedule) + 1
    log(f"torchrun + DCP run (W={job.world_size}, checkpoint every {ckpt_every} steps, --max-restarts {restarts}, "
        f"{job.duration_s:g}s) -> {out / 'torchrun'}")
    tr = run_torchrun(job, schedule, out / "torchrun", ckpt_every, restarts, log, extra)
    return {"ckptless": ck, "torchrun": tr}
