"""Worker of bench/ddp_step.py: one DDP training loop, plain (torchrun) or ported (ckptless).

Usage:  _ddp_step_worker.py torchrun OUT    (under torchrun)
        _ddp_step_worker.py ckptless OUT    (under ckptless-run)
Writes OUT/steps_rank<R>.json: {"step_s": [seconds of each step]}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    steps = int(os.environ.get("BENCH_STEPS", "60"))
    hidden = int(os.environ.get("BENCH_HIDDEN", "1024"))
    sleep = float(os.environ.get("BENCH_STEP_SLEEP", "0"))
    job = None
    if mode == "ckptless":
        import ckptless
        from ckptless.data import resumable

        job = ckptless.init()
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world, rank, shuffle=True, seed=0))
    step_s: list[float] = []

    def one_step(batch: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        x, y = batch
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sleep:
            time.sleep(sleep)  # the device's share of the step: the host CPU is free meanwhile
        step_s.append(time.perf_counter() - t0)

    if job is not None:
        rl = resumable(loader)
        job.protect(model=ddp, optimizer=opt, data=rl)
        for _ in job.steps(steps):
            with job.guard():
                one_step(rl.next_batch())
        job.close()
    else:
        it = iter(loader)
        for _ in range(steps):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            one_step(batch)
        dist.destroy_process_group()
    with open(os.path.join(out, f"steps_rank{rank}.json"), "w") as f:
        json.dump({"step_s": step_s}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
