"""A ``job.train`` loop over a DataLoader with two worker processes whose samples draw random transforms.

The vision pipeline's shape on CPU: a map-style dataset whose ``__getitem__``
adds noise drawn from the worker's global torch, ``random`` and NumPy streams
(a random crop or flip stands for it), ``DistributedSampler(shuffle=True)``,
``num_workers=2``, DDP. A pass reopened mid-epoch after a kill starts new
workers; the job ends bitwise equal to the fault-free run only if they draw
the numbers the original workers drew for the same samples
(tests/e2e/test_own_loop_e2e.py).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import ckptless


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        jitter = 0.1 * torch.randn(8) + 0.01 * float(np.random.rand()) + 0.01 * random.random()
        return self.x[i] + jitter, self.y[i]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The same samples as a stream (``--iterable``): its persistent workers cannot be seeded per sample."""

    def __init__(self, data: Augmented) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in range(len(self.data)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True (issue 35, finding 7)")
    parser.add_argument("--iterable", action="store_true", help="the data as an IterableDataset (refused persistent)")
    args = parser.parse_args()
    job = ckptless.init()
    data = Augmented(256)
    if args.iterable:
        loader = DataLoader(Stream(data), batch_size=8, num_workers=2, persistent_workers=args.persistent)
    else:
        loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=True, seed=1), num_workers=2,
                            persistent_workers=args.persistent)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    job.protect(model=model, optimizer=optimizer)

    def train(epochs: int) -> None:
        for epoch in ckptless.epochs(range(epochs)):
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)
            for x, y in ckptless.batches(loader):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()

    job.train(train, args.epochs)
    job.close()


if __name__ == "__main__":
    main()
