"""The ckptless side of bench/recovery.py: one job per case, SIGKILLs at chosen steps, and each
recovery's phases from the goodput ledgers, in every recovery mode (:data:`MODE_LABELS`).

Why its own module: it is one measurement procedure -- start the agents for a mode, kill a held
victim, wait for every rank's first step after the recovery, split the time into phases, record
who replaced the victim and the job's peak memory -- independent of the torchrun baseline
(:mod:`_recovery_torchrun`) and of how the results are printed (:mod:`_recovery_report`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _recovery_common import MIB, PY, WORKER, child_env, kill_group, read_events, settle_s, wait_file


@dataclass
class Recovery:
    size: int
    world: int
    mode: str  # "spare" / "respawn"
    total: float
    detect: float
    reform: float
    transfer: float
    rollback: float
    reprotect_step: float
    repl: float
    source: str
    phases: dict[str, float] = field(default_factory=dict)


def _phases(evs: list[dict[str, Any]], t_kill: float, gen: int, victim: int) -> dict[str, float]:
    after = [e for e in evs if e["t_monotonic"] >= t_kill]
    det = [e["t_monotonic"] for e in after if e["kind"] == "failure_detected" and e["generation"] == gen - 1]
    ref = [e["t_monotonic"] for e in after if e["kind"] == "groups_reformed" and e["generation"] == gen]
    tra = [e["t_monotonic"] for e in after if e["kind"] == "transfer_done" and e["generation"] == gen]
    rol = [e["t_monotonic"] for e in after if e["kind"] == "rollback_done" and e["generation"] == gen]
    fst = [e["t_monotonic"] for e in after if e["kind"] == "first_step_after_recovery" and e["generation"] == gen]
    start = [e["t_monotonic"] for e in after if e["kind"] == "job_start" and e["generation"] == gen
             and e["rank"] == victim]
    rep = [e["t_monotonic"] for e in after if e["kind"] == "reprotect_done" and e["generation"] == gen]
    t_det, t_ref, t_tra, t_rol, t_fst = min(det), max(ref), max(tra), max(rol), max(fst)
    # The window a second loss would hit: every rank resumed -> every rank's image held by K peers
    # again (the last reprotect_done). Without the node-local tier, a holder lost there loses a K=1 job.
    return {"detect": t_det - t_kill, "reform": t_ref - t_det, "transfer": t_tra - t_ref,
            "rollback": t_rol - t_tra, "reprotect_step": t_fst - t_rol, "total": t_fst - t_kill,
            "repl": (min(start) - t_kill) if start else float("nan"),
            "unprotected": (max(rep) - t_rol) if rep else float("nan")}


def _steady_step(evs: list[dict[str, Any]], gen: int) -> float:
    """Median time between consecutive steps of generation ``gen`` (each step ends when its
    slowest rank's step_done lands; step 1 is warm-up): a ckptless step with mirroring, what the
    first step after a recovery is compared with."""
    ends: dict[int, float] = {}
    for e in evs:
        if e["kind"] in ("step_done", "first_step_after_recovery") and e["generation"] == gen and e["step"]:
            ends[e["step"]] = max(ends.get(e["step"], 0.0), e["t_monotonic"])
    steps = sorted(k for k in ends if k >= 2)
    gaps = [ends[b] - ends[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
    return statistics.median(gaps) if gaps else float("nan")


#: Bench modes -> the label their rows carry. "spare": the victim is the spare's standby rank (it
#: only receives bytes: the best case); "spare-other": another rank dies, so the rank-exact spare
#: bound to it (--no-spare-any-rank) restarts as it (setup on the critical path);
#: "spare-any": another rank dies and the spare takes it as built (any-rank adoption, the default).
#: "standby": no spare node; the ranks' own agent keeps one spare (--spares 1 --spare-any-rank
#: --spare-refill), every kill hits a rank it was not built as, and each recovery's refill is
#: pre-built before the next kill: what a respawn costs when every node keeps a standby.
#: "spare-wait": the spares wait in ckptless.init() for their rank and build once given it
#: (--no-spare-prebuild; bench/spare_setup.py).
MODE_LABELS = {"spare": "spare", "spare-other": "spare, other rank (re-exec, --no-spare-any-rank)",
               "spare-any": "spare, other rank (any-rank, default)",
               "spare-wait": "spare waiting in init() (--no-spare-prebuild)",
               "standby": "standby on the node (any rank, refilled)", "respawn": "respawn"}


def run_ckptless(etcd_ep: str, size: int, world: int, spares: int, respawns: int, workdir: Path,
                 log: Any, spare_mode: str = "spare", *, mirror_buffers: int, shm_root: str,
                 memory: list[dict[str, Any]], extra_env: dict[str, str] | None = None) -> list[Recovery]:
    """``spares`` + ``respawns`` recoveries of one job of ``world`` ranks with ``size`` bytes of state
    each; ``mirror_buffers`` (--mirror-buffers) and ``shm_root`` (--shm-dir, "" for none) as given on
    the command line; ``extra_env`` goes to every worker. Appends the job's peak-memory row to ``memory``."""
    job = f"bench-{uuid.uuid4().hex[:6]}"
    out = workdir / job
    gdir = out / "goodput"
    out.mkdir(parents=True)
    kills = spares + respawns
    # Spares pre-build as standby ranks 0, 1, ... (the agent gives each the lowest rank no other
    # spare covers), so the spare cases kill those ranks: the spare then only receives bytes.
    # Respawns hit the last rank (still on the main agent).
    # "spare-other"/"spare-any": kill ranks W-1, W-2, ... which no spare stands by for.
    other = spare_mode in ("spare-other", "spare-any", "standby", "spare-wait")
    victims = [world - 1 - i if other else i for i in range(spares)] + [world - 1] * respawns
    gap = 3
    pauses = [(victims[i], 4 + gap * i) for i in range(kills)]
    steps = pauses[-1][1] + 3 if pauses else 6
    env = child_env({"BENCH_STATE_BYTES": str(size), "BENCH_STEPS": str(steps),
                     "BENCH_PAUSES": ",".join(f"{r}:{s}" for r, s in pauses),
                     "CKPTLESS_LOG_LEVEL": "WARNING", "CKPTLESS_COLLECTIVE_TIMEOUT": "60",
                     "CKPTLESS_RECOVERY_TIMEOUT": "120", "CKPTLESS_MIRROR_BUFFERS": str(mirror_buffers),
                     **(extra_env or {})})
    common = ["--rdzv-id", job, "--rdzv-endpoint", etcd_ep, "--lease-ttl", "1", "--goodput-dir", str(gdir)]
    if shm_root:  # the node-local tier: a respawn restores its own image from this node's shm
        shm = Path(shm_root) / job
        shm.mkdir(parents=True)
        common += ["--shm-dir", str(shm)]
    else:  # replicas in worker memory only (the launcher's default is /dev/shm where writable)
        common += ["--no-shm-dir"]
    procs: list[subprocess.Popen[bytes]] = []
    logs = []

    def agent(*extra: str) -> subprocess.Popen[bytes]:
        lf = open(out / f"agent{len(procs)}.log", "wb")
        logs.append(lf)
        p = subprocess.Popen([PY, "-m", "ckptless.launcher.main", "--nnodes", "1", *common, *extra,
                              WORKER, "ckptless", str(out)], env=env, stdout=lf, stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        return p

    results: list[Recovery] = []
    try:
        standby = spare_mode == "standby"
        agent("--nproc-per-node", str(world),
              *(["--spares", "1", "--spare-any-rank", "--spare-refill"] if standby and spares else []))
        if spares and not standby:
            agent("--nproc-per-node", "0", "--spares", str(spares),
                  *(["--no-spare-any-rank"] if spare_mode == "spare-other" else []),
                  *(["--no-spare-prebuild"] if spare_mode == "spare-wait" else []))
        for i, (victim, step) in enumerate(pauses):
            doc = wait_file(out / f"pause{i}.json", 300, procs)
            if i < spares:  # the spares must be warm and built (a refilled standby: the new one too)
                need = i + 1 if spare_mode == "standby" else spares
                deadline = time.monotonic() + 120
                ready = "spare_ready_*.json" if spare_mode == "spare-wait" else "spare_built_*.json"
                while len(list(out.glob(ready))) < need and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(settle_s(size, world))
            t_kill = time.monotonic()
            os.kill(int(doc["pid"]), signal.SIGKILL)
            gen = i + 1
            deadline = time.monotonic() + 180
            while True:
                evs = read_events(gdir)
                done = {e["rank"] for e in evs if e["kind"] == "first_step_after_recovery" and e["generation"] >= gen}
                if len(done) == world:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"recovery {i} did not finish")
                if any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError("an agent failed during recovery")
                time.sleep(0.05)
            gens = {e["generation"] for e in evs if e["kind"] == "first_step_after_recovery" and e["generation"] >= gen}
            if gens != {gen}:
                log(f"  warning: recovery {i} went through generations {sorted(gens)}")
            ph = _phases(evs, t_kill, max(gens), victim)
            built = [json.loads(x) for x in (out / f"built_rank{victim}.jsonl").read_text().splitlines() if x.strip()]
            mine = [b for b in built if b["generation"] == max(gens)]
            # Only the part of the build after the kill is on the critical path (a pre-built spare: 0).
            ph["repl_build"] = max(0.0, mine[0]["t_built"] - max(mine[0]["t0"], t_kill)) if mine else float("nan")
            # The replacement builds its model + optimizer after it has its rank (ckptless.init()
            # blocks a spare until then) and before it can receive: split that out of "transfer".
            t_xfer = max(e["t_monotonic"] for e in evs if e["kind"] == "transfer_done" and e["generation"] == max(gens))
            ph["transfer_net"] = (t_xfer - max(mine[0]["t_built"], t_kill + ph["detect"] + ph["reform"])) if mine \
                else ph["transfer"]
            ph["steady_step"] = _steady_step(evs, max(gens) - 1)
            ph["load1"] = os.getloadavg()[0]
            role = _role_of(out, victim, max(gens))
            ph.update(_replacement_parts(out, victim, max(gens), t_kill))
            mode = MODE_LABELS[spare_mode] if role == "spare" else ("respawn (node-local)" if shm_root else "respawn")
            results.append(Recovery(size, world, mode, ph["total"], ph["detect"], ph["reform"], ph["transfer"],
                                    ph["rollback"], ph["reprotect_step"], ph["repl"], role, ph))
            log(f"  ckptless S={size // MIB} MiB W={world} kill {i} (rank {victim}, step {step}) -> {role}: "
                + " ".join(f"{k}={v:.3f}" for k, v in ph.items()))
        # Done when every rank of the final generation has ended its job. The agents should
        # then exit 0, but one whose worker's rank went to a spare on another node never
        # does (launcher/agent.py _apply_membership keeps the dead slot's rank; see
        # docs/benchmarks.md): give them a moment, then stop them.
        final = len(pauses)
        deadline = time.monotonic() + 120
        while len({e["rank"] for e in read_events(gdir)
                   if e["kind"] == "job_end" and e["generation"] == final}) < world:
            if time.monotonic() > deadline:
                raise TimeoutError("the job did not end")
            time.sleep(0.1)
        for p in procs:
            try:
                p.wait(30)  # the store host waits for every exit record; slow under load
            except subprocess.TimeoutExpired:
                log(f"  BUG: agent {p.pid} still running 30 s after the job ended; stopped. Its log:")
                idx = procs.index(p)
                logs[idx].flush()
                log((out / f"agent{idx}.log").read_text(errors="replace")[-4000:])
        memory.append(_memory_row(out, size, world, mirror_buffers))  # the workers wrote theirs when they ended
    except BaseException:
        for lf in logs:
            lf.flush()
        for f in sorted(out.glob("agent*.log")):
            log(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
        raise
    finally:
        for p in procs:
            kill_group(p)
        for lf in logs:
            lf.close()
        if shm_root:
            shutil.rmtree(Path(shm_root) / job, ignore_errors=True)
    return results


def _memory_row(out: Path, size: int, world: int, buffers: int) -> dict[str, Any]:
    """Peak memory of every process that ran a rank (the workers write mem_rank*.json at close)."""
    docs = [json.loads(p.read_text()) for p in sorted(out.glob("mem_rank*.json"))]
    over = [(d["peak_rss"] - d["rss_before_state"]) / size for d in docs]
    return {"size": size, "world": world, "buffers": buffers, "processes": len(docs),
            "peak_rss": max((d["peak_rss"] for d in docs), default=0),
            "base_rss": max((d["rss_before_state"] for d in docs), default=0),
            "peak_over_base_in_S": max(over, default=float("nan")),
            "shmem": max((d.get("rss_shmem", 0) for d in docs), default=0),
            "per_rank": {d["rank"]: round((d["peak_rss"] - d["rss_before_state"]) / size, 2) for d in docs}}


def _replacement_parts(out: Path, rank: int, gen: int, t_kill: float) -> dict[str, float]:
    """Where the replacement's time went, from the kill (seconds; what ran before the kill, e.g. a
    pre-built spare's setup, counts 0): ``repl_start`` to its script's first line (a process started:
    a fork or an exec, with the interpreter), ``repl_imports`` to its call of ``ckptless.init()``,
    ``repl_init`` in ``init()`` (a waiting spare waits there for its rank)."""
    lines = [json.loads(x) for x in (out / f"pids_rank{rank}.jsonl").read_text().splitlines() if x.strip()]
    hits = [d for d in lines if d["generation"] == gen]
    if not hits or "t_init_called" not in hits[-1]:
        return {}
    d = hits[-1]
    marks = [t_kill, d["t_process"], d["t_init_called"], d["t_init"]]
    clipped = [max(t_kill, m) for m in marks]
    return {"repl_start": clipped[1] - clipped[0], "repl_imports": clipped[2] - clipped[1],
            "repl_init": clipped[3] - clipped[2]}


def _role_of(out: Path, rank: int, gen: int) -> str:
    lines = [json.loads(x) for x in (out / f"pids_rank{rank}.jsonl").read_text().splitlines() if x.strip()]
    hits = [d for d in lines if d["generation"] == gen]
    return hits[-1]["role"] if hits else "?"
