"""The demo job: a tiny transformer classifier on synthetic tokens, protected by ckptless.

Run it under ``ckptless-run`` (``ckptless-chaos demo`` does, with faults, as any user script:
``run --script``, faults at exact steps through the library's pause points, verdict from the
library's digests):

    ckptless-run --standalone --nproc-per-node 4 examples/train_demo.py OUT_DIR

What makes it a real test of recovery: dropout (global torch RNG), a
``random``/``numpy`` draw per step, AdamW state, a warmup+cosine LR schedule,
gradient clipping and a resumable data position. Gradients are all-reduced by
hand (DDP is not rebound after a recovery); after a recovery the default
``torch.distributed`` group is valid again and ``train_step`` just continues.

Environment knobs (the chaos runner sets them):
  DEMO_STEPS     number of steps (default 30)
  DEMO_WIDTH     model width (default 32)
  CHAOS_PAUSES   (the chaos matrix) ``tag:rank:step,...``: that rank, about to run that step,
                 writes ``OUT/chaos/paused_<tag>.json`` ({pid, rank, step}) and
                 holds until ``OUT/chaos/release_<tag>`` exists (bounded) -- so
                 the runner's real signal lands at an exact step. Each pause
                 fires once per job (the marker file is the latch), also in a
                 replacement process.
Writes ``OUT/final_rank<R>.pt`` (params, optimizer, LR, RNG draws, data
position) for the bitwise check and ``OUT/pids_rank<R>.jsonl`` (every process
that ran rank R, with its role) for the health checks.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import ckptless
from ckptless.chaos.final_state import write_final_state
from ckptless.data import ResumableLoader, ResumableSampler

VOCAB, SEQ, CLASSES = 64, 12, 4
PAUSE_LIMIT_S = 120.0  # a pause is a sync point, never a hang of the job: bounded


def _write_json(path: str, doc: dict[str, object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)  # readers never see half a file


class TinyTransformer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, width))
        self.block = torch.nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, dropout=0.1,
                                                      batch_first=True)
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(width, CLASSES))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(tokens) + self.pos)
        return self.head(h.mean(dim=1))


def synthetic_dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    """Tokens whose class is a function of their content (learnable), same on every rank."""
    g = torch.Generator().manual_seed(2024)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = (tokens[:, :4].sum(dim=1) % CLASSES).long()
    return torch.utils.data.TensorDataset(tokens, labels)


def _pauses(out: str) -> dict[tuple[int, int], str]:
    spec = os.environ.get("CHAOS_PAUSES", "").strip()
    found: dict[tuple[int, int], str] = {}
    for item in filter(None, spec.split(",")):
        tag, rank, step = item.split(":")
        found[(int(rank), int(step))] = tag
    if found:
        os.makedirs(os.path.join(out, "chaos"), exist_ok=True)
    return found


def _hold(out: str, tag: str, rank: int, step: int) -> None:
    chaos = os.path.join(out, "chaos")
    marker = os.path.join(chaos, f"paused_{tag}.json")
    if os.path.exists(marker):
        return  # this pause already fired (maybe in the process we replace)
    _write_json(marker, {"pid": os.getpid(), "rank": rank, "step": step})
    release = os.path.join(chaos, f"release_{tag}")
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.005)  # held until the runner's signal (or its release file) arrives


def main() -> None:
    out = sys.argv[1]
    steps = int(os.environ.get("DEMO_STEPS", "30"))
    width = int(os.environ.get("DEMO_WIDTH", "32"))
    job = ckptless.init()
    # The setup reads no rank (a pre-built spare may then take any lost rank with it as built) and
    # does not seed: ckptless.init() seeds torch, random and numpy, the same on every rank.
    world = dist.get_world_size()
    recorded: list[int] = []

    def record_pid() -> None:
        """Which process ran this rank, written at its first step: a pre-built spare runs this setup
        as its standby rank before it is assigned one, so setup is not the moment to record it."""
        if not recorded:
            recorded.append(os.getpid())
            with open(os.path.join(out, f"pids_rank{job.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "role": job.ctx.role, "generation": job.generation}) + "\n")

    model = TinyTransformer(width)
    with torch.no_grad():  # identical initial weights on every rank
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 4
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    dataset = synthetic_dataset()
    loader = ResumableLoader(dataset, ResumableSampler(len(dataset), seed=11),
                             batch_size=16)
    job.protect(model=model, optimizer=opt, scheduler=sched, data=loader)
    pauses = _pauses(out)
    params = list(model.parameters())
    every = max(10, steps // 10)  # ~10 progress lines per run

    # After the setup the rank is job.rank, never the ``rank`` read above: a pre-built spare ran the
    # setup as its standby rank and, with --spare-any-rank, may take another rank as built.
    def train_step(step: int) -> None:
        record_pid()
        tag = pauses.get((job.rank, step))
        if tag is not None:
            _hold(out, tag, job.rank, step)
        tokens, labels = loader.next_batch()
        # Label smoothing drawn from python and numpy RNG: both streams must be restored exactly.
        smooth = 0.05 + 0.01 * random.random() + 0.01 * float(np.random.rand())
        loss = torch.nn.functional.cross_entropy(model(tokens), labels, label_smoothing=smooth)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        assert len(grads) == len(params), "every parameter takes part in the loss"
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # by hand, to keep the demo small (examples/ddp_train.py wraps the model in DDP)
        flat /= world
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off: off + n].view_as(g))
            off += n
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if job.rank == 0 and (step + 1) % every == 0:
            print(f"[train_demo] step {step + 1}/{steps} loss {loss.item():.4f} gen {job.generation}", flush=True)

    result = job.run(train_step, steps)
    write_final_state(out, job.rank, model, opt, sched, loader, result)
    job.close()


if __name__ == "__main__":
    main()
