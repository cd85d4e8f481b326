"""A standard PyTorch Lightning script (DDP, a small classifier), recovered by ckptless.

    ckptless-run --standalone --nproc-per-node 2 examples/lightning_train.py --epochs 2

What differs from the same script under torchrun (docs/porting.md, "PyTorch
Lightning"): ``ckptless.init()`` before the ``Trainer`` (it creates the process
group Lightning then finds), ``ckptless.integrations.lightning.fit(trainer, model, loader)``
instead of ``trainer.fit(model, loader)``, and ``job.close()``. The loader
carries its own ``DistributedSampler`` (Lightning does not inject one through
ckptless's wrapper). Needs ``pip install 'ckptless[lightning]'``.
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


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(768, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    args = p.parse_args()

    job = ckptless.init()
    pl.seed_everything(0, workers=True)
    ds = dataset()
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds, shuffle=True, seed=0))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=job.world_size // devices,
                         max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    ckptless.integrations.lightning.fit(trainer, Classifier(lr=3e-3), train_dataloaders=loader)
    job.close()


if __name__ == "__main__":
    main()
