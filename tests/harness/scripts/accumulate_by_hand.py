"""A ``job.train`` loop that accumulates gradients by hand (issue 38): DDP, ``no_sync`` inside a window.

The shape of most pretraining loops: ``backward()`` on every micro-batch (under DDP's ``no_sync()``
but the window's last, which all-reduces the sum), ``optimizer.step()`` and ``zero_grad()`` every
``--accumulation`` micro-batches, counted on a protected counter (a resumed pass's own index starts
at 0 again). Windows run across the epoch boundary (18 batches an epoch per rank at 2 ranks).
Dropout draws from the global torch stream, the loader shuffles with a ``DistributedSampler``.
``ckptless-chaos run kill-worker --script THIS --at S`` at any S must PASS: a kill between a window's
micro-batches resumes at the window's start and runs it again (ckptless/state/window.py).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ckptless


class MicroBatches:
    """The loop's micro-batch counter: which micro-batch of its window the next batch is."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=4)
    args = p.parse_args()

    job = ckptless.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(144, 8, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(ds, shuffle=True, seed=5)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    micro = MicroBatches()
    job.protect(model=model, optimizer=opt, micro=micro)

    def train(epochs: int) -> None:
        for epoch in ckptless.epochs(range(epochs)):
            sampler.set_epoch(epoch)
            for xb, yb in ckptless.batches(loader):
                last = (micro.n + 1) % args.accumulation == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.mse_loss(model(xb), yb) / args.accumulation
                    loss.backward()
                micro.n += 1
                if last:
                    opt.step()
                    opt.zero_grad()

    job.train(train, args.epochs)
    job.close()


if __name__ == "__main__":
    main()
