"""Benchmark: steady-state step time of a DDP training loop under ckptless vs plain torchrun.

Run:  .venv/bin/python bench/ddp_step.py                 (2 ranks, 60 steps, 16 + 48 MiB of state)
      .venv/bin/python bench/ddp_step.py --hidden 512 --steps 40

The same worker (bench/_ddp_step_worker.py) runs twice in this one run:
  torchrun   ``torchrun --standalone --nproc-per-node N`` with ``dist.init_process_group("gloo")``
             and a plain ``for step in range(n)`` loop: no mirroring, no coordinator.
  ckptless   ``ckptless-run --standalone --nproc-per-node N`` (embedded etcd, K = 1, mirror every
             step): ``ckptless.init()``, ``job.protect(model=ddp, optimizer=opt, data=...)`` and
             ``for step in job.steps(n): with job.guard():``.
Both wrap the model in ``DistributedDataParallel`` with default arguments. Each rank records the
wall time of every step (``time.perf_counter`` around the step body); the table shows the median
over steps after a warm-up, per mode, and the ratio. ``--step-sleep S`` adds S seconds of
CPU-releasing "device time" to each step (as a GPU job's host thread waits on its device), which
is where background mirroring has free cores to use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckptless import environment

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "_ddp_step_worker.py")
BIN = Path(sys.executable).parent


def _run(mode: str, nproc: int, out: Path, env: dict[str, str]) -> list[float]:
    out.mkdir(parents=True)
    if mode == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), WORKER, mode, str(out)]
    else:
        cmd = [str(BIN / "ckptless-run"), "--standalone", "--nproc-per-node", str(nproc), WORKER, mode, str(out)]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({res.returncode}):\n{res.stdout[-3000:]}")
    print(f"  {mode}: {time.monotonic() - t0:.1f} s wall", file=sys.stderr, flush=True)
    times: list[float] = []
    for f in sorted(out.glob("steps_rank*.json")):
        times.extend(json.loads(f.read_text())["step_s"])
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    ap.add_argument("--hidden", type=int, default=1024, help="MLP width (state = params + AdamW moments)")
    ap.add_argument("--step-sleep", type=float, nargs="*", default=[0.0, 0.2],
                    help="CPU-releasing device time per step, seconds (one row each)")
    ns = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckptless-bench-ddp-") as tmp:
        for sleep in ns.step_sleep:
            env = dict(environment.environ(), BENCH_STEPS=str(ns.steps), BENCH_HIDDEN=str(ns.hidden),
                       BENCH_STEP_SLEEP=str(sleep), CKPTLESS_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1")
            med = {}
            for mode in ("torchrun", "ckptless"):
                times = _run(mode, ns.nproc, Path(tmp) / f"{mode}-{sleep}", env)
                per_rank = len(times) // ns.nproc
                kept = [t for i, t in enumerate(times) if i % per_rank >= ns.warmup]
                med[mode] = statistics.median(kept)
            rows.append((sleep, med["torchrun"], med["ckptless"]))
    state_mib = (4 * ns.hidden * ns.hidden + 3 * ns.hidden * 32) * 4 * 3 / 2**20
    print(f"DDP step time, {ns.nproc} ranks on {os.cpu_count()} cores, MLP width {ns.hidden} "
          f"(~{state_mib:.0f} MiB params + AdamW state per rank), {ns.steps} steps, median after {ns.warmup}; "
          f"load avg at start {load0:.1f}, at end {os.getloadavg()[0]:.1f}")
    print()
    print("| device time per step (sleep) | torchrun step s | ckptless step s (K=1, mirror every step) | ckptless / torchrun |")
    print("|---|---|---|---|")
    for sleep, tr, ck in rows:
        print(f"| {sleep:.2f} s | {tr:.4f} | {ck:.4f} | {ck / tr:.3f}x (+{(ck / tr - 1) * 100:.1f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
