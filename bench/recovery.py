"""Benchmark: recovery time after a SIGKILL, ckptless vs torchrun restart + DCP load.

Run:  .venv/bin/python bench/recovery.py            (full: 64 + 256 MiB/rank at world 4, 64 MiB at world 8)
      .venv/bin/python bench/recovery.py --quick    (64 MiB/rank, world 4, one repetition)

Everything is measured in one run, on this machine, with one clock (time.monotonic is
CLOCK_MONOTONIC: shared by every process on the host). The worker is
bench/_recovery_worker.py: per rank one parameter shard + AdamW state of S bytes in all.

ckptless   One cluster per (S, world): an etcd (embedded, in this process), one agent
           `ckptless-run --nnodes 1 --nproc-per-node W --goodput-dir ...` and a spare-only
           agent `--nproc-per-node 0 --spares N`. The victim rank announces that it is about
           to run step s and holds; after a settle time (the mirror of the last version is
           committed, CPUs quiet) the bench records t_kill and SIGKILLs it. The planner's
           default policy (PlanPolicy.prefer == "spare") gives the lost rank to a warm spare
           while one is left; once the spares are used up, the next kills are respawned
           cold on the victim's own node. Phases come from the goodput ledgers:
             detect    t_kill -> first failure_detected of a survivor
             reform    -> last survivor's groups_reformed (report, plan, new membership,
                          replacement joined, new Gloo groups)
             transfer  -> last transfer_done (replacement pulled its image in stripes)
             rollback  -> last rollback_done (state restored in place on every rank)
             reprot+step -> last first_step_after_recovery (re-mirror of the resume
                          version to K holders + commit, then one training step)
             repl      t_kill -> the replacement's job_start (it has its rank)
torchrun   `torchrun --standalone --nproc-per-node W --max-restarts R` with
           TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; incarnation 0 saves a DCP checkpoint
           (S bytes/rank, distinct keys per rank, local disk) and later holds a victim;
           the bench SIGKILLs it; torchrun stops the others and restarts all ranks, which
           DCP-load and run one step. Total = t_kill -> last rank's first step done.
           cold: before the kill the bench fsyncs the checkpoint files and drops them
           from the page cache (os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), checked
           with fincore), as a replacement node would read them; warm: left cached.
resumed    (second table) t_kill -> every rank holds the resume state and starts its first step:
           ckptless the last rollback_done, torchrun the last rank's DCP load done; next to it
           the same for the first step done, and each system's first step's own duration.
reference  detect + reform (of that ckptless recovery) + S / raw Gloo p2p bandwidth
           (one pair, isend/irecv of S bytes, measured in this run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "_recovery_worker.py")
PY = sys.executable
MIB = 1 << 20


# --- raw Gloo p2p bandwidth ------------------------------------------------------------
def _bw_worker(rank: int, store_path: str, sizes: list[int], reps: int, q: Any) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    out = {}
    for n in sizes:
        buf = torch.ones(n, dtype=torch.uint8)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
            dist.barrier()  # receiver done
            if i:  # first round touches pages
                times.append(time.perf_counter() - t0)
        out[n] = min(times)
        del buf
    if rank == 1:
        q.put(out)
    dist.destroy_process_group()


def raw_bandwidth(sizes: list[int], reps: int = 3) -> dict[int, float]:
    """bytes/s of one Gloo send/recv pair over loopback, best of ``reps`` (per size)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_bw_worker, args=(r, os.path.join(tmp, "store"), sizes, reps, q)) for r in range(2)]
        for p in procs:
            p.start()
        res = q.get(timeout=300)
        for p in procs:
            p.join(60)
    return {n: n / t for n, t in res.items()}


# --- helpers ------------------------------------------------------------------------------
def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _wait_file(path: Path, timeout: float, procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a launcher exited ({dead[0].args[:3]}... rc={dead[0].returncode}) while waiting for {path}")
        time.sleep(0.01)
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def _settle(nbytes: int, world: int) -> float:
    """Time for the last mirror round / writes to finish before the kill (CPUs quiet)."""
    return 1.0 + nbytes * world / 4 / 200e6


def _events(gdir: Path) -> list[dict[str, Any]]:
    evs = []
    for f in sorted(gdir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                evs.append(json.loads(line))
    return evs


# --- ckptless ----------------------------------------------------------------------------------
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
MODE_LABELS = {"spare": "spare", "spare-other": "spare, other rank (re-exec, --no-spare-any-rank)",
               "spare-any": "spare, other rank (any-rank, default)",
               "standby": "standby on the node (any rank, refilled)", "respawn": "respawn"}


def run_ckptless(etcd_ep: str, size: int, world: int, spares: int, respawns: int, workdir: Path,
                 log: Any, spare_mode: str = "spare") -> list[Recovery]:
    job = f"bench-{uuid.uuid4().hex[:6]}"
    out = workdir / job
    gdir = out / "goodput"
    out.mkdir(parents=True)
    kills = spares + respawns
    # Spares pre-build as standby ranks 0, 1, ... (the agent gives each the lowest rank no other
    # spare covers), so the spare cases kill those ranks: the spare then only receives bytes.
    # Respawns hit the last rank (still on the main agent).
    # "spare-other"/"spare-any": kill ranks W-1, W-2, ... which no spare stands by for.
    other = spare_mode in ("spare-other", "spare-any", "standby")
    victims = [world - 1 - i if other else i for i in range(spares)] + [world - 1] * respawns
    gap = 3
    pauses = [(victims[i], 4 + gap * i) for i in range(kills)]
    steps = pauses[-1][1] + 3 if pauses else 6
    env = _env({"BENCH_STATE_BYTES": str(size), "BENCH_STEPS": str(steps),
                "BENCH_PAUSES": ",".join(f"{r}:{s}" for r, s in pauses),
                "CKPTLESS_LOG_LEVEL": "WARNING", "CKPTLESS_COLLECTIVE_TIMEOUT": "60",
                "CKPTLESS_RECOVERY_TIMEOUT": "120", "CKPTLESS_MIRROR_BUFFERS": str(MIRROR_BUFFERS)})
    common = ["--rdzv-id", job, "--rdzv-endpoint", etcd_ep, "--lease-ttl", "1", "--goodput-dir", str(gdir)]
    if SHM_ROOT:  # the node-local tier: a respawn restores its own image from this node's shm
        shm = Path(SHM_ROOT) / job
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
                  *(["--no-spare-any-rank"] if spare_mode == "spare-other" else []))
        for i, (victim, step) in enumerate(pauses):
            doc = _wait_file(out / f"pause{i}.json", 300, procs)
            if i < spares:  # the spares must be warm and built (a refilled standby: the new one too)
                need = i + 1 if spare_mode == "standby" else spares
                deadline = time.monotonic() + 120
                while len(list(out.glob("spare_built_*.json"))) < need and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(_settle(size, world))
            t_kill = time.monotonic()
            os.kill(int(doc["pid"]), signal.SIGKILL)
            gen = i + 1
            deadline = time.monotonic() + 180
            while True:
                evs = _events(gdir)
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
            mode = MODE_LABELS[spare_mode] if role == "spare" else ("respawn (node-local)" if SHM_ROOT else "respawn")
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
        while len({e["rank"] for e in _events(gdir) if e["kind"] == "job_end" and e["generation"] == final}) < world:
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
        MEMORY.append(_memory_row(out, size, world))  # the workers wrote theirs when they ended
    except BaseException:
        for lf in logs:
            lf.flush()
        for f in sorted(out.glob("agent*.log")):
            log(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
        raise
    finally:
        for p in procs:
            _kill_group(p)
        for lf in logs:
            lf.close()
        if SHM_ROOT:
            shutil.rmtree(Path(SHM_ROOT) / job, ignore_errors=True)
    return results


MIRROR_BUFFERS = 2  # --mirror-buffers
SHM_ROOT = ""  # --shm-dir
MEMORY: list[dict[str, Any]] = []  # one row per ckptless case


def _memory_row(out: Path, size: int, world: int) -> dict[str, Any]:
    """Peak memory of every process that ran a rank (the workers write mem_rank*.json at close)."""
    docs = [json.loads(p.read_text()) for p in sorted(out.glob("mem_rank*.json"))]
    over = [(d["peak_rss"] - d["rss_before_state"]) / size for d in docs]
    return {"size": size, "world": world, "buffers": MIRROR_BUFFERS, "processes": len(docs),
            "peak_rss": max((d["peak_rss"] for d in docs), default=0),
            "base_rss": max((d["rss_before_state"] for d in docs), default=0),
            "peak_over_base_in_S": max(over, default=float("nan")),
            "shmem": max((d.get("rss_shmem", 0) for d in docs), default=0),
            "per_rank": {d["rank"]: round((d["peak_rss"] - d["rss_before_state"]) / size, 2) for d in docs}}


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| state/rank S | world | pool buffers | processes | peak RSS (max over ranks) | RSS before state "
             "| (peak - before) / S | target (2 + 2K) | shared mem |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size'] // MIB} MiB | {r['world']} | {r['buffers']} | {r['processes']} "
                     f"| {r['peak_rss'] / 2**30:.2f} GiB | {r['base_rss'] / 2**20:.0f} MiB "
                     f"| {r['peak_over_base_in_S']:.2f} (by rank: {r['per_rank']}) | 4 | {r['shmem'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def _role_of(out: Path, rank: int, gen: int) -> str:
    lines = [json.loads(x) for x in (out / f"pids_rank{rank}.jsonl").read_text().splitlines() if x.strip()]
    hits = [d for d in lines if d["generation"] == gen]
    return hits[-1]["role"] if hits else "?"


# --- torchrun + DCP -------------------------------------------------------------------------
def _drop_cache(d: Path) -> tuple[int, int]:
    """fsync + POSIX_FADV_DONTNEED every file under d; returns (bytes, bytes still cached)."""
    total = 0
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total, _cached_bytes(d)


def _cached_bytes(d: Path) -> int:
    files = [str(f) for f in d.rglob("*") if f.is_file()]
    if not files or shutil.which("fincore") is None:
        return -1
    r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True, text=True)
    return sum(int(x) for x in r.stdout.split() if x.isdigit())


@dataclass
class Restart:
    size: int
    world: int
    cache: str
    total: float
    restart: float  # t_kill -> last rank through init_process_group
    load: float  # -> last rank DCP-loaded
    step: float  # -> last rank's first step done
    cached_bytes: int
    save_s: float


def run_torchrun(size: int, world: int, caches: list[str], workdir: Path, log: Any) -> list[Restart]:
    out = workdir / f"torchrun-{uuid.uuid4().hex[:6]}"
    out.mkdir(parents=True)
    save_at, victim = 3, 1
    pauses = [(victim, save_at + 2)] * len(caches)
    env = _env({"BENCH_STATE_BYTES": str(size), "BENCH_STEPS": str(save_at + 4), "BENCH_SAVE_AT": str(save_at),
                "BENCH_PAUSES": ",".join(f"{r}:{s}" for r, s in pauses),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    lf = open(out / "torchrun.log", "wb")
    p = subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                          "--max-restarts", str(len(caches)), WORKER, "torchrun", str(out)],
                         env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    results: list[Restart] = []
    try:
        for i, cache in enumerate(caches):
            doc = _wait_file(out / f"pause{i}.json", 300, [p])
            time.sleep(_settle(size, world))
            cached = _drop_cache(out / "dcp")[1] if cache == "cold" else _cached_bytes(out / "dcp")
            t_kill = time.monotonic()
            os.kill(int(doc["pid"]), signal.SIGKILL)
            deadline = time.monotonic() + 180
            while True:
                recs = {}
                for r in range(world):
                    f = out / f"tr_rank{r}.jsonl"
                    if f.exists():
                        for line in f.read_text().splitlines():
                            d = json.loads(line)
                            if d["inc"] == i + 1:
                                recs[r] = d
                if len(recs) == world:
                    break
                if time.monotonic() > deadline or p.poll() is not None:
                    raise RuntimeError(f"torchrun restart {i} did not finish (rc={p.poll()})")
                time.sleep(0.05)
            save_s = 0.0
            for line in (out / "tr_rank0.jsonl").read_text().splitlines():
                save_s = max(save_s, json.loads(line).get("save_s", 0.0))
            res = Restart(size, world, cache, max(d["t_first_step"] for d in recs.values()) - t_kill,
                          max(d["t_init"] for d in recs.values()) - t_kill,
                          max(d["t_loaded"] for d in recs.values()) - t_kill,
                          max(d["t_first_step"] for d in recs.values()) - t_kill, cached, save_s)
            results.append(res)
            log(f"  torchrun+DCP S={size // MIB} MiB W={world} restart {i} ({cache}, {cached} B cached at kill, "
                f"load avg {os.getloadavg()[0]:.1f}): "
                f"init={res.restart:.3f} loaded={res.load:.3f} first_step={res.total:.3f}")
        if p.wait(300) != 0:
            raise RuntimeError(f"torchrun exited {p.returncode}")
    except BaseException:
        lf.flush()
        log("--- torchrun.log\n" + (out / "torchrun.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        _kill_group(p)
        lf.close()
        shutil.rmtree(out / "dcp", ignore_errors=True)
    return results


# --- report --------------------------------------------------------------------------------------
def _mm(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{min(xs):.2f} / {statistics.median(xs):.2f}"


def table(ck: list[Recovery], tr: list[Restart], bw: dict[int, float]) -> str:
    lines = [
        "| state/rank | world | mode | ckptless total s | detect | reform | repl. build | transfer | rollback | reprotect+step "
        "| repl. ready | torchrun+DCP cold s | torchrun+DCP warm s | torchrun cold / ckptless | reference s "
        "| ckptless / reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r.size, r.world) for r in ck} | {(r.size, r.world) for r in tr}, key=lambda k: (k[1], k[0]))
    for size, world in keys:
        cold = [r.total for r in tr if (r.size, r.world, r.cache) == (size, world, "cold")]
        warm = [r.total for r in tr if (r.size, r.world, r.cache) == (size, world, "warm")]
        for mode in (*MODE_LABELS.values(), "respawn (node-local)"):
            rs = [r for r in ck if (r.size, r.world, r.mode) == (size, world, mode)]
            if not rs:
                continue
            tot = [r.total for r in rs]
            refs = [r.detect + r.reform + size / bw[size] for r in rs]
            ratio_tr = f"{statistics.median(cold) / statistics.median(tot):.1f}x" if cold else "-"
            ratio_ref = statistics.median([r.total / f for r, f in zip(rs, refs)])
            lines.append(
                f"| {size // MIB} MiB | {world} | {mode} | {_mm(tot)} | {_mm([r.detect for r in rs])} "
                f"| {_mm([r.reform for r in rs])} | {_mm([r.phases['repl_build'] for r in rs])} | {_mm([r.phases.get('transfer_net', r.transfer - r.phases['repl_build']) for r in rs])} | {_mm([r.rollback for r in rs])} "
                f"| {_mm([r.reprotect_step for r in rs])} | {_mm([r.repl for r in rs])} | {_mm(cold)} | {_mm(warm)} "
                f"| {ratio_tr} | {_mm(refs)} | {ratio_ref:.2f}x |")
    return "\n".join(lines)


def resumed_table(ck: list[Recovery], tr: list[Restart]) -> str:
    """Both ends of a recovery, for both systems, measured the same way (one clock, same kill).

    resumed: t_kill -> every rank holds the resume state and starts its first step (ckptless: the
    last rollback_done; torchrun: the last rank's DCP load done). first step: -> the last rank's
    first step after the failure is done. The step itself (AdamW over S bytes, 4 ranks on the
    machine's cores) is in the second column for both.
    """
    lines = ["| state/rank | world | mode | ckptless resumed s | torchrun+DCP cold resumed s | ratio "
             "| ckptless first step done s | torchrun+DCP cold first step done s | ratio "
             "| first step's own duration: ckptless / ckptless steady step / torchrun s "
             "| unprotected window s (resumed -> re-protected) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r.size, r.world) for r in ck}, key=lambda k: (k[1], k[0]))
    for size, world in keys:
        cold = [r for r in tr if (r.size, r.world, r.cache) == (size, world, "cold")]
        for mode in (*MODE_LABELS.values(), "respawn (node-local)"):
            rs = [r for r in ck if (r.size, r.world, r.mode) == (size, world, mode)]
            if not rs:
                continue
            res = [r.total - r.reprotect_step for r in rs]
            tot = [r.total for r in rs]
            t_res = [r.load for r in cold]
            t_tot = [r.total for r in cold]
            r1 = f"{statistics.median(t_res) / statistics.median(res):.1f}x" if cold else "-"
            r2 = f"{statistics.median(t_tot) / statistics.median(tot):.1f}x" if cold else "-"
            own = (f"{_mm([r.reprotect_step for r in rs])} / {_mm([r.phases.get('steady_step', float('nan')) for r in rs])}"
                   f" / {_mm([r.total - r.load for r in cold])}")
            window = _mm([r.phases.get("unprotected", float("nan")) for r in rs])
            lines.append(f"| {size // MIB} MiB | {world} | {mode} | {_mm(res)} | {_mm(t_res)} | {r1} "
                         f"| {_mm(tot)} | {_mm(t_tot)} | {r2} | {own} | {window} |")
    return "\n".join(lines)


def torchrun_table(tr: list[Restart]) -> str:
    lines = ["| state/rank | world | cache | kill -> all ranks init'd s | -> DCP loaded s | -> first step s "
             "| ckpt bytes cached at kill | DCP save s (inc 0) |", "|---|---|---|---|---|---|---|---|"]
    for r in tr:
        lines.append(f"| {r.size // MIB} MiB | {r.world} | {r.cache} | {r.restart:.2f} | {r.load:.2f} | {r.total:.2f} "
                     f"| {r.cached_bytes} | {r.save_s:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB/rank, world 4, one repetition (~2 min)")
    ap.add_argument("--sizes", type=int, nargs="*", help="state MiB per rank at world 4 (default 64 256)")
    ap.add_argument("--reps", type=int, default=2, help="recoveries per mode and case (default 2)")
    ap.add_argument("--world8", type=int, default=64, help="MiB/rank for the world-8 case (0: skip)")
    ap.add_argument("--json", type=str, default=None, help="also write raw results here")
    ap.add_argument("--mirror-buffers", type=int, default=2, choices=(1, 2, 3),
                    help="owner capture buffers (CKPTLESS_MIRROR_BUFFERS; 1 = the (2 + 2K) x S budget)")
    ap.add_argument("--modes", nargs="+", choices=tuple(MODE_LABELS), default=["spare", "respawn"],
                    help="which recoveries to run (respawn only: no pre-built spare's memory, e.g. at 1 GiB)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun + DCP runs (memory runs)")
    ap.add_argument("--shm-dir", default="", help="give the agents --shm-dir under this root (e.g. /dev/shm): "
                    "the respawn rows then restore from the node-local tier")
    ns = ap.parse_args(argv)
    global MIRROR_BUFFERS, SHM_ROOT
    MIRROR_BUFFERS = ns.mirror_buffers
    SHM_ROOT = ns.shm_dir
    sizes = [s * MIB for s in (ns.sizes or ([64] if ns.quick else [64, 256]))]
    reps = 1 if ns.quick else ns.reps
    cases = [(s, 4, reps) for s in sizes]
    if ns.world8 and not ns.quick:
        cases.append((ns.world8 * MIB, 8, 1))
    if any(s >= 1024 * MIB for s, _, _ in cases) and ns.mirror_buffers > 1:
        print("note: 1 GiB/rank at world 4 with 2 capture buffers needs ~5 x 1 GiB x 4 ranks + a spare: use "
              "--mirror-buffers 1 ((2 + 2K) x S per rank) on a 24 GiB machine", file=sys.stderr)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from ckptless.coordinator.embedded import EmbeddedEtcd

    import torch

    t0 = time.monotonic()
    load0 = os.getloadavg()
    bw = raw_bandwidth(sorted({s for s, _, _ in cases}))
    log("raw Gloo p2p: " + ", ".join(f"{s // MIB} MiB {b / 1e9:.2f} GB/s" for s, b in bw.items()))
    ck: list[Recovery] = []
    tr: list[Restart] = []
    work = Path(tempfile.mkdtemp(prefix="ckptless-bench-rec-", dir=os.environ.get("BENCH_DIR", "/tmp")))
    etcd = EmbeddedEtcd(data_dir=work / "etcd", log_path=work / "etcd.log")
    etcd.start()
    try:
        for size, world, n in cases:
            ck += run_ckptless(etcd.endpoint, size, world, spares=n if "spare" in ns.modes else 0,
                               respawns=n if "respawn" in ns.modes else 0, workdir=work, log=log)
            for extra in ("spare-other", "spare-any", "standby"):
                if extra in ns.modes and world >= 2 * n:  # victims must differ from the standby ranks
                    ck += run_ckptless(etcd.endpoint, size, world, spares=n, respawns=0, workdir=work, log=log,
                                       spare_mode=extra)
            if not ns.no_torchrun:
                tr += run_torchrun(size, world, caches=["cold", "warm"] * n, workdir=work, log=log)
    except BaseException:
        log(f"failed; logs kept in {work}")
        raise
    else:
        if os.environ.get("BENCH_KEEP"):
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        etcd.close()
    wall = time.monotonic() - t0
    print(f"{datetime.date.today()}; {os.cpu_count()} cores, torch {torch.__version__}, Gloo loopback, K=1 ring, "
          f"mirror every step; wall {wall:.0f}s; load avg (1 min) at start {load0[0]:.1f}, at end "
          f"{os.getloadavg()[0]:.1f}. Cells with two values: min / median.")
    print("raw Gloo p2p (one pair): " + ", ".join(f"{s // MIB} MiB {b / 1e9:.2f} GB/s" for s, b in bw.items()))
    print()
    if tr:
        print(table(ck, tr, bw))
        print()
        print(resumed_table(ck, tr))
        print()
        print(torchrun_table(tr))
    else:
        print("\n".join(f"{r.mode} S={r.size // MIB} MiB W={r.world}: total {r.total:.2f} s" for r in ck))
    print()
    print(memory_table(MEMORY))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"bw": {str(k): v for k, v in bw.items()}, "ckptless": [r.__dict__ for r in ck],
                       "torchrun": [r.__dict__ for r in tr], "memory": MEMORY, "wall_s": wall}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
