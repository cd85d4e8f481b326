"""A Hugging Face Accelerate custom loop (gradient accumulation, a scheduler), recovered by ckptless.

    ckptless-run --standalone --nproc-per-node 2 examples/accelerate_train.py --epochs 3

The loop is Accelerate's own shape: ``accelerator.prepare(...)``,
``with accelerator.accumulate(model):``, ``accelerator.backward(loss)``, the
prepared optimizer's and scheduler's ``step`` inside it. What differs from the
same script under ``accelerate launch``/torchrun (docs/porting.md,
"Hugging Face Accelerate"): ``ckptless.init()`` before the ``Accelerator`` (it
creates the process group Accelerate then finds), ``job.protect(...)`` of the
prepared objects, ``ckptless.epochs``/``ckptless.batches`` around the loops,
``job.train(ckptless.integrations.accelerate.loop(accelerator, train), ...)``
instead of ``train(...)`` (it protects the Accelerator's own state: its
gradient-accumulation counter, ``GradientState``, the prepared loaders' epoch
counters), and ``job.close()``; the ``save_state``/``skip_first_batches``
resume is not needed. Needs ``pip install 'ckptless[hf]'``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptless
import ckptless.integrations.accelerate


@dataclass
class Config:
    n_in: int = 16
    hidden: int = 64
    n_out: int = 4
    dropout: float = 0.1


class Classifier(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.n_in, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(cfg.hidden, cfg.n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dataset(n: int = 240) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x[:, :4].argmax(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=0, help="loader worker processes")
    args = p.parse_args()

    job = ckptless.init()  # creates the process group the Accelerator finds
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
    model = Classifier(Config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_dl = DataLoader(dataset(), batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    # Accelerate steps a prepared scheduler once per process at each optimizer step: one per batch of
    # the whole (unsharded) loader is enough room for the updates of any world size
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_dl))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    job.protect(model=model, optimizer=optimizer, scheduler=scheduler)

    def train(epochs: int) -> None:
        for epoch in ckptless.epochs(range(epochs)):
            model.train()
            total = torch.zeros(())
            for x, y in ckptless.batches(train_dl):
                with accelerator.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                total += loss.detach()
            accelerator.print(f"epoch {epoch} loss {total.item() / max(1, len(train_dl)):.4f} "
                              f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

    job.train(ckptless.integrations.accelerate.loop(accelerator, train), args.epochs)
    accelerator.end_training()  # (it destroys the process group: job.close() after it still ends cleanly)
    job.close()


if __name__ == "__main__":
    main()
