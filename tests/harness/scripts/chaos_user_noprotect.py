"""The same kind of script with the classic mistake: its data position is not protected.

Model and optimizer are protected, but batches come from a plain iterator
over a shuffled ``DataLoader`` with its own generator. After a recovery a
respawned rank starts that iterator afresh and the survivors' iterators are a
batch ahead, so the resumed run trains on other batches than the fault-free
run: ``ckptless-chaos run kill-worker --script THIS`` must FAIL, naming the
model and optimizer digests that differ.

    --steps N      training steps (default 30)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ckptless


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()

    job = ckptless.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(11 + rank))

    def forever() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    batches = forever()  # NOT protected: where this iterator stands is lost in a recovery
    job.protect(model=model, optimizer=opt)

    def train_step(step: int) -> None:
        xb, yb = next(batches)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            assert prm.grad is not None
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()

    job.run(train_step, args.steps)
    job.close()


if __name__ == "__main__":
    main()
