"""A standard Hugging Face Trainer script (a tiny GPT-2 built from a config), recovered by ckptless.

    ckptless-run --standalone --nproc-per-node 2 examples/hf_trainer.py --epochs 2

What differs from the same script under torchrun (docs/porting.md, "Hugging
Face Trainer"): ``ckptless.init()`` before ``TrainingArguments`` (it creates
the process group the Trainer then uses), ``ckptless.integrations.hf.train(trainer)``
instead of ``trainer.train()``, and ``job.close()``. Nothing is downloaded:
the model is built from a ``GPT2Config``, the data is a character-level
encoding of a fixed text. Needs ``pip install 'ckptless[hf]'``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ckptless
import ckptless.integrations.hf

TEXT = ("a checkpoint is a promise to the future written in the past; a peer's memory is a promise kept in "
        "the present. ") * 12


class CharBlocks(Dataset):
    """Blocks of ``block`` characters (as token ids), labels the same ids (the model shifts them)."""

    def __init__(self, text: str, block: int) -> None:
        vocab = {c: i for i, c in enumerate(sorted(set(text)))}
        ids = torch.tensor([vocab[c] for c in text], dtype=torch.long)
        self.blocks = [ids[i : i + block] for i in range(0, len(ids) - block, block // 2)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "hf_trainer_out"))
    args = p.parse_args()

    job = ckptless.init()
    config = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=CharBlocks(TEXT, 32))
    ckptless.integrations.hf.train(trainer)
    job.close()


if __name__ == "__main__":
    main()
