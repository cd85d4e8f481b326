"""Pretrain a tiny character GPT with its own loop (nanoGPT's shape): ckptless-run --nproc-per-node 2 train_gpt.py

The loop carries three values from one iteration to the next: the batch it
prefetched for the next step (``X, Y = get_batch("train")`` between the forward
and the backward, as nanoGPT does) and the best validation loss so far. They
are in no module or optimizer, so the port protects them in one line,
``c = job.carry(X=X, Y=Y, best_val_loss=best_val_loss)``, and the loop reads
and assigns ``c.X``, ``c.Y``, ``c.best_val_loss`` (docs/porting.md,
"Loop-carried values"). Each version's image holds them as the step's body
left them: the batch prefetched for the next step, with the RNG already past
it; a recovery puts them back before the loop gets the resume step.

Batches are sampled from the global torch RNG (protected automatically), each
rank seeded with its own rank as nanoGPT does; gradient accumulation over
``--grad-accum`` micro-batches happens inside one step (DDP's
``require_backward_grad_sync``). tests/e2e/test_carried_e2e.py kills
rank 0 twice under ``ckptless-chaos run kill-twice`` (bitwise), and the same
loop with the values left in plain locals (not bitwise; the start-up check
names them).
"""

import argparse
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptless

TEXT = ("it is a truth universally acknowledged that a single process in possession of a good state "
        "must be in want of a peer to hold it. ") * 16


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 2, 2 * dim, 0.1, batch_first=True), 1)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.blocks(x, mask=self.mask, is_causal=True))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-iters", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=2)
    args = p.parse_args()

    job = ckptless.init()  # creates the default process group
    rank = dist.get_rank()
    torch.manual_seed(1337 + rank)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = splits[split]
        ix = torch.randint(len(d) - args.block_size, (args.batch_size,))
        x = torch.stack([d[i : i + args.block_size] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + args.block_size] for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss() -> float:
        raw_model.eval()
        losses = [raw_model(*get_batch("val"))[1].item() for _ in range(4)]
        raw_model.train()
        return sum(losses) / len(losses)

    def get_lr(it: int) -> float:
        return 1e-3 * 0.5 * (1.0 + math.cos(math.pi * it / args.max_iters))

    model = DDP(GPT(len(chars), args.block_size))
    raw_model = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    job.protect(model=model, optimizer=optimizer)

    X, Y = get_batch("train")  # the first batch, fetched before the loop
    best_val_loss = 1e9
    c = job.carry(X=X, Y=Y, best_val_loss=best_val_loss)  # what the loop carries, protected
    for iter_num in job.steps(args.max_iters):
        with job.guard():
            for group in optimizer.param_groups:
                group["lr"] = get_lr(iter_num)
            if iter_num % args.eval_interval == 0:
                val_loss = estimate_loss()
                if val_loss < c.best_val_loss:
                    c.best_val_loss = val_loss
                    if rank == 0:
                        print(f"iter {iter_num}: val loss {val_loss:.4f} (best so far)", flush=True)
            for micro_step in range(args.grad_accum):
                model.require_backward_grad_sync = micro_step == args.grad_accum - 1
                logits, loss = model(c.X, c.Y)
                c.X, c.Y = get_batch("train")  # prefetch the next batch while the backward runs
                (loss / args.grad_accum).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"done: best val loss {c.best_val_loss:.4f}", flush=True)
    job.close()


if __name__ == "__main__":
    main()
