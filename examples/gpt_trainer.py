"""A tiny GPT trained by a Trainer class with a train and an eval pass per epoch, ported to ckptless.

    ckptless-run --standalone --nproc-per-node 2 examples/gpt_trainer.py --epochs 3

The shape of PyTorch's minGPT-ddp example: a model built from a config
dataclass (never downloaded), a ``Trainer`` whose ``train()`` counts epochs
from 1 (``epoch += 1`` before ``set_epoch``), one ``_run_epoch`` used for the
train loader and the test loader, a snapshot every few epochs. docs/porting.md
("Your own loop") shows the lines that differ from the torchrun script. Both
passes go through ``ckptless.batches``: a recovery inside the eval pass
resumes there, and the train pass of that epoch is not run again.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ckptless

TEXT = ("it is a truth universally acknowledged that a single process in possession of a good state "
        "must be in want of a peer to hold it. ") * 8


@dataclass
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int) -> None:
        stoi = {c: i for i, c in enumerate(sorted(set(TEXT)))}
        self.data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Parameter(torch.zeros(1, cfg.block_size, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        layer = nn.TransformerEncoderLayer(cfg.n_embd, cfg.n_head, 4 * cfg.n_embd, cfg.dropout, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.n_layer)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        mask = torch.triu(torch.full((cfg.block_size, cfg.block_size), -math.inf), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos[:, :t])
        return self.head(self.blocks(x, mask=self.mask[:t, :t], is_causal=True))


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_set: Dataset, test_set: Dataset,
                 batch_size: int, save_every: int, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.train_loader = self._prepare_dataloader(train_set, batch_size)
        self.test_loader = self._prepare_dataloader(test_set, batch_size)
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, weights_only=True)
            model.load_state_dict(snapshot["model_state"])
            self.epochs_run = snapshot["finished_epoch"]
        self.model = DDP(model)

    def _prepare_dataloader(self, dataset: Dataset, batch_size: int) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor, train: bool = True) -> float:
        with torch.set_grad_enabled(train):
            logits = self.model(source)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if train:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int, dataloader: DataLoader, train: bool = True) -> None:
        dataloader.sampler.set_epoch(epoch)
        self.model.train(train)
        for it, (source, targets) in enumerate(ckptless.batches(dataloader)):
            batch_loss = self._run_batch(source, targets, train)
            if it % 20 == 0 and self.local_rank == 0:
                print(f"epoch {epoch} | iter {it} | {'train' if train else 'eval'} loss {batch_loss:.4f}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        torch.save({"model_state": self.model.module.state_dict(), "finished_epoch": epoch}, self.snapshot_path)

    def train(self, max_epochs: int) -> None:
        for epoch in ckptless.epochs(range(self.epochs_run, max_epochs)):
            epoch += 1
            self._run_epoch(epoch, self.train_loader, train=True)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            self._run_epoch(epoch, self.test_loader, train=False)


def main(max_epochs: int, batch_size: int, save_every: int, snapshot_path: str) -> None:
    job = ckptless.init()
    torch.manual_seed(0)
    cfg = GPTConfig()
    split = len(TEXT) * 9 // 10
    train_set, test_set = CharDataset(TEXT[:split], cfg.block_size), CharDataset(TEXT[split:], cfg.block_size)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    trainer = Trainer(model, optimizer, train_set, test_set, batch_size, save_every, snapshot_path)
    job.protect(model=trainer.model, optimizer=trainer.optimizer)
    job.train(trainer.train, max_epochs)
    job.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a Trainer-class GPT job with train and eval passes")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--snapshot-path", default="gpt_snapshot.pt")
    args = parser.parse_args()
    main(args.epochs, args.batch_size, args.save_every, args.snapshot_path)
