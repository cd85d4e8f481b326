"""Training worker of bench/goodput_check.py (one process = one rank, under ``ckptless-run``).

Usage:  _goodput_worker.py OUT

State per rank: one parameter shard of GOODPUT_STATE_BYTES / 12 float32 elements plus its
AdamW moments (as bench/_recovery_worker.py). A step sleeps GOODPUT_STEP_SLEEP seconds (the
device's time: it releases the CPU, as a GPU step does), updates the shard and all-reduces
one small tensor (so a dead peer is seen by the collective).

Why its own worker: the goodput the simulator predicts is useful work at the *bare* step's
speed over wall time, so the bare step (the user's step body, without ckptless's capture
and mirror round around it) must be timed. Rank 0 appends one line per step to
``OUT/steps.jsonl``: ``{"step", "t0", "t1", "gen", "pid"}`` (time.monotonic, one clock
on this host). Every rank appends its pid at its first step to ``OUT/pids_rank<R>.jsonl``
(the bench picks its victims there).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main(out: str) -> None:
    import ckptless

    steps = int(os.environ.get("GOODPUT_STEPS", "100000"))
    sleep_s = float(os.environ.get("GOODPUT_STEP_SLEEP", "0.2"))
    numel = max(1, int(os.environ.get("GOODPUT_STATE_BYTES", str(1 << 20))) // 12)
    job = ckptless.init()
    w = torch.nn.Parameter(torch.arange(numel, dtype=torch.float32).remainder_(997).mul_(1e-3))
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0, foreach=False)
    opt.state[w] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
    w.grad = torch.zeros_like(w)
    model = torch.nn.Module()
    model.w = w
    job.protect(model=model, optimizer=opt)
    seen: list[int] = []
    log = open(os.path.join(out, "steps.jsonl"), "a", buffering=1) if job.rank == 0 else None

    def train_step(step: int) -> None:
        if not seen:
            seen.append(job.rank)
            with open(os.path.join(out, f"pids_rank{job.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "generation": job.generation}) + "\n")
        t0 = time.monotonic()
        time.sleep(sleep_s)
        torch.mul(w.detach(), 1e-3 * (1 + step % 3), out=w.grad)
        opt.step()
        loss = w.detach()[:1024].sum().reshape(1)
        dist.all_reduce(loss)
        if log is not None:
            log.write(json.dumps({"step": step + 1, "t0": t0, "t1": time.monotonic(), "gen": job.generation,
                                  "pid": os.getpid()}) + "\n")

    job.run(train_step, steps)
    job.close()


if __name__ == "__main__":
    main(sys.argv[1])
