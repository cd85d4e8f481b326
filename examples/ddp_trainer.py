"""A DDP job whose epoch loop lives in a Trainer class, ported to ckptless with its loop kept.

    ckptless-run --standalone --nproc-per-node 2 examples/ddp_trainer.py --epochs 4

The shape of PyTorch's DDP tutorial (a ``Trainer`` with ``train()`` over
epochs and ``_run_epoch()`` over a ``DistributedSampler``'s batches, a probe
of the batch size, ``set_epoch`` every epoch, a snapshot every few epochs that
a restarted run resumes from). docs/porting.md ("Your own loop") shows the
seven lines that differ from the torchrun script: ``ckptless.init()``, one
``job.protect``, ``job.train(trainer.train, ...)``, the epoch loop through
``ckptless.epochs``, the batch loop through ``ckptless.batches``, and
``job.close()``. After a recovery the resumed ranks continue inside the
epoch, at the batch the resume version had reached, in the sampler's order.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ckptless


class RandomPairs(Dataset):
    def __init__(self, size: int) -> None:
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, weights_only=True)
            model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
        self.model = DDP(model)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        self.train_data.sampler.set_epoch(epoch)
        total = 0.0
        for source, targets in ckptless.batches(self.train_data):
            total += self._run_batch(source, targets)
        if self.local_rank == 0:
            print(f"epoch {epoch} | batch size {b_sz} | steps {len(self.train_data)} | loss {total:.4f}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs: int) -> None:
        for epoch in ckptless.epochs(range(self.epochs_run, max_epochs)):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main(total_epochs: int, save_every: int, batch_size: int, snapshot_path: str) -> None:
    job = ckptless.init()
    dataset = RandomPairs(512)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    job.protect(model=trainer.model, optimizer=trainer.optimizer)
    job.train(trainer.train, total_epochs)
    job.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a Trainer-class DDP job")
    parser.add_argument("--epochs", type=int, default=4, help="total epochs to train")
    parser.add_argument("--save-every", type=int, default=2, help="snapshot every this many epochs")
    parser.add_argument("--batch-size", type=int, default=16, help="batch size per rank")
    parser.add_argument("--snapshot-path", default="snapshot.pt")
    args = parser.parse_args()
    main(args.epochs, args.save_every, args.batch_size, args.snapshot_path)
