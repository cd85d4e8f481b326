"""Benchmark: what a spare buys a script whose setup reads its rank, against a warm respawn (issue 38).

Run:  .venv/bin/python bench/spare_setup.py                      (256 MiB/rank, world 4, 2 kills per mode)
      .venv/bin/python bench/spare_setup.py --size 64 --reps 1   (quicker)

Why: a pre-built spare runs the script's setup before any failure. If that setup reads its rank (a
per-rank seed, ``master_process``, ``dist.get_rank()`` right after init: nearly every real script),
the spare takes only its own standby rank as built; for any other rank it restarts as that rank and
runs the setup again on the recovery's critical path, as a respawn does (issue 38: 2.92 s against
3.02 s for a respawn). This bench measures it, in one run, on one clock, with bench/recovery.py's
procedure (bench/_recovery_ckptless.py: one job per row, W ranks on one agent, the spares on a
spare-only agent, a victim held at a step and SIGKILLed, phases from the goodput ledgers):

  reads rank   BENCH_READ_RANK=1: the worker calls ``dist.get_rank()`` right after ``ckptless.init()``
    spare        --spares N (pre-built, any-rank on: the default); each kill hits a rank no spare was
                 built as: the spare sees its setup read the rank and restarts as the lost one (warm)
    spare-wait   --spares N --no-spare-prebuild: the spares wait in ``init()``; once given a rank
                 they run the setup after it, in the process they have (imports and init kept)
    respawn      no spare: the victim's own agent respawns it from its fork server (warm)
  rank-agnostic the same worker without the read
    spare        the spare takes the lost rank with its objects as built (any-rank adoption)
    respawn      as above

Every setup also sleeps ``--setup-s`` after ``init()`` (what a real model's build, tokenizer and
loaders cost; 0 leaves only the bench's own build of S bytes). Reported per row: kill -> every rank's
first step done (min / median), the ratio to the same script's respawn, and where the replacement's
time went from the kill: start (its process: a fork or re-exec, the interpreter), imports (to its call
of ``ckptless.init()``), init (in it; a waiting spare waits there for its rank), build (the setup after
init), transfer (its image over the network, net of its build), and the survivors' detect + reform.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _recovery_ckptless import Recovery, run_ckptless
from _recovery_common import MIB
from ckptless import environment

REPO = Path(__file__).resolve().parent.parent
CASES = [("reads rank", "1", "spare-any", "spare (re-exec as the rank)"),
         ("reads rank", "1", "spare-wait", "spare waiting in init()"),
         ("reads rank", "1", "respawn", "warm respawn"),
         ("rank-agnostic", "", "spare-any", "spare (takes it as built)"),
         ("rank-agnostic", "", "respawn", "warm respawn")]
PARTS = ("repl_start", "repl_imports", "repl_init", "repl_build", "transfer_net", "detect", "reform")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()


def _cell(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f}" if xs else "-"


def report(rows: list[dict[str, Any]]) -> str:
    """The table: one line per (script, mode), ratios against the same script's warm respawn."""
    head = (f"| script | recovery | kill -> first step (s) | / respawn | "
            + " | ".join(p.replace("repl_", "") for p in PARTS) + " |")
    lines = [head, "|" + "---|" * (4 + len(PARTS))]
    for script, _, _, label in CASES:
        mine = [r for r in rows if r["script"] == script and r["label"] == label]
        if not mine:
            continue
        base = [r["total"] for r in rows if r["script"] == script and r["label"] == "warm respawn"]
        tot = [r["total"] for r in mine]
        ratio = f"{statistics.median(tot) / statistics.median(base):.2f}x" if base else "-"
        parts = [_cell([r["phases"][p] for r in mine if p in r["phases"]]) for p in PARTS]
        lines.append(f"| {script} | {label} | {_cell(tot)} | {ratio} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="state MiB per rank (default 256)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="kills per row (default 2; world >= 2 x reps)")
    ap.add_argument("--setup-s", type=float, default=1.0, help="the setup's extra time after init (default 1.0)")
    ap.add_argument("--json", type=str, default=None, help="also write the raw rows here")
    ns = ap.parse_args(argv)
    if ns.world < 2 * ns.reps:
        ap.error("--world must be >= 2 x --reps (the victims are ranks no spare was built as)")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from ckptless.coordinator.embedded import EmbeddedEtcd

    up0, t0 = _uptime(), time.monotonic()
    rows: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="ckptless-bench-spare-", dir=environment.environ().get("BENCH_DIR", "/tmp")))
    etcd = EmbeddedEtcd(data_dir=work / "etcd", log_path=work / "etcd.log")
    etcd.start()
    try:
        for script, reads, mode, label in CASES:
            spare = mode != "respawn"
            log(f"{script}: {label}")
            got: list[Recovery] = run_ckptless(
                etcd.endpoint, ns.size * MIB, ns.world, spares=ns.reps if spare else 0,
                respawns=0 if spare else ns.reps, workdir=work, log=log, spare_mode=mode if spare else "spare",
                mirror_buffers=2, shm_root="", memory=memory,
                extra_env={"BENCH_READ_RANK": reads, "BENCH_SETUP_S": str(ns.setup_s)})
            rows += [{"script": script, "label": label, "source": r.source, "total": r.total, "phases": r.phases}
                     for r in got]
    except BaseException:
        log(f"failed; logs kept in {work}")
        raise
    else:
        shutil.rmtree(work, ignore_errors=True)
    finally:
        etcd.close()
    print(f"bench/spare_setup.py --size {ns.size} --world {ns.world} --reps {ns.reps} --setup-s {ns.setup_s}; "
          f"commit {_commit()}; wall {time.monotonic() - t0:.0f} s; {os.cpu_count()} cores")
    print(f"uptime at start: {up0}")
    print(f"uptime at end:   {_uptime()}")
    print("cells: min / median over the kills; parts are the replacement's, from the kill")
    print(report(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns), "commit": _commit(), "uptime": [up0, _uptime()], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
