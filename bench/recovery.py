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

# This file is the command line and the cases: flags -> (state size, world, repetitions) -> the runs
# -> the printed tables. Each part it drives is its own module beside it: _recovery_ckptless (the
# ckptless recoveries, every mode), _recovery_torchrun (the torchrun + DCP baseline),
# _recovery_bandwidth (the raw Gloo reference), _recovery_report (the tables) and _recovery_common
# (the plumbing both runs share).

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _recovery_bandwidth import raw_bandwidth
from _recovery_ckptless import MODE_LABELS, Recovery, run_ckptless
from _recovery_common import MIB
from _recovery_report import memory_table, resumed_table, table, torchrun_table
from _recovery_torchrun import Restart, run_torchrun
from ckptless import environment


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
    memory: list[dict[str, Any]] = []  # one row per ckptless case
    work = Path(tempfile.mkdtemp(prefix="ckptless-bench-rec-", dir=environment.environ().get("BENCH_DIR", "/tmp")))
    etcd = EmbeddedEtcd(data_dir=work / "etcd", log_path=work / "etcd.log")
    etcd.start()
    try:
        for size, world, n in cases:
            ck += run_ckptless(etcd.endpoint, size, world, spares=n if "spare" in ns.modes else 0,
                               respawns=n if "respawn" in ns.modes else 0, workdir=work, log=log,
                               mirror_buffers=ns.mirror_buffers, shm_root=ns.shm_dir, memory=memory)
            for extra in ("spare-other", "spare-any", "standby"):
                if extra in ns.modes and world >= 2 * n:  # victims must differ from the standby ranks
                    ck += run_ckptless(etcd.endpoint, size, world, spares=n, respawns=0, workdir=work, log=log,
                                       spare_mode=extra, mirror_buffers=ns.mirror_buffers, shm_root=ns.shm_dir,
                                       memory=memory)
            if not ns.no_torchrun:
                tr += run_torchrun(size, world, caches=["cold", "warm"] * n, workdir=work, log=log)
    except BaseException:
        log(f"failed; logs kept in {work}")
        raise
    else:
        if environment.environ().get("BENCH_KEEP"):
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
    print(memory_table(memory))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"bw": {str(k): v for k, v in bw.items()}, "ckptless": [r.__dict__ for r in ck],
                       "torchrun": [r.__dict__ for r in tr], "memory": memory, "wall_s": wall}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
