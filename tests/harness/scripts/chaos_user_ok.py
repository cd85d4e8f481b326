"""A user's training script written the way the README says (for ``ckptless-chaos run --script``).

Nothing in it knows about chaos testing: it protects its model, optimizer (AdamW),
LR schedule and data position, and closes the job. Dropout draws from the
global torch RNG and the noise level from ``random`` (both protected by the
library). ``ckptless-chaos run kill-worker --script THIS -- --steps 30`` must
PASS: a run with a SIGKILLed rank ends bitwise equal to the fault-free run.

    --steps N      training steps (default 30)
    --loop-api     train with ``for step in job.steps(n): with job.guard(): ...`` instead of ``job.run``
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ckptless
from ckptless.data import resumable


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--loop-api", action="store_true")
    args = p.parse_args()

    job = ckptless.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    torch.manual_seed(100 + rank)  # per-rank dropout masks
    random.seed(7 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # its state holds 0-dim `step` tensors
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
    data = resumable(DataLoader(ds, batch_size=16, shuffle=True), rank=rank, world_size=world, seed=11)
    job.protect(model=model, optimizer=opt, scheduler=sched, data=data)

    def train_step(step: int) -> None:
        xb, yb = data.next_batch()
        noise = 0.01 * random.random()
        loss = torch.nn.functional.mse_loss(model(xb + noise), yb)
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            assert prm.grad is not None
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        sched.step()

    if args.loop_api:
        for step in job.steps(args.steps):
            with job.guard():
                train_step(step)
    else:
        job.run(train_step, args.steps)
    job.close()


if __name__ == "__main__":
    main()
