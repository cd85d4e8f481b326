"""A Lightning script as people write it (a transformer, DDP, a train and a val loader, validation
inside the epoch, the default checkpoint callback), recovered by ckptless at any world size.

    ckptless-run --nnodes 2 --nproc-per-node 2 ... examples/lightning_transformer.py --epochs 3

What differs from the same script under torchrun (docs/porting.md, "PyTorch Lightning"):
``ckptless.init()`` before the ``Trainer``, ``ckptless.integrations.lightning.fit(trainer, model,
train_loader, val_loader)`` instead of ``trainer.fit(...)``, and ``job.close()``. Issue 38's report:
at 4 ranks, a kill left the replacement and the survivors in different collectives generation after
generation. tests/e2e/test_lightning_e2e.py kills it at 4 ranks, once and twice.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ckptless
import ckptless.integrations.lightning

VOCAB, CONTEXT = 32, 8


class TinyTransformer(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, 16)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, 16))
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        return self.head(self.encoder(self.embed(x) + self.pos, mask=mask, is_causal=True))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)}


def tokens(n: int, seed: int) -> TensorDataset:
    """Sequences with a learnable rule (each token the previous plus a per-sequence stride)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=288, help="training samples (split over the ranks)")
    p.add_argument("--val-check-interval", type=float, default=0.5, help="validations per epoch: 1 / this")
    args = p.parse_args()

    job = ckptless.init()
    pl.seed_everything(0)
    train, val = tokens(args.samples, 0), tokens(64, 1)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=DistributedSampler(train, shuffle=True, seed=0))
    val_loader = DataLoader(val, batch_size=args.batch_size, sampler=DistributedSampler(val, shuffle=False))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=job.world_size // devices,
                         max_epochs=args.epochs, val_check_interval=args.val_check_interval, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    ckptless.integrations.lightning.fit(trainer, TinyTransformer(lr=3e-3), train_loader, val_loader)
    job.close()


if __name__ == "__main__":
    main()
