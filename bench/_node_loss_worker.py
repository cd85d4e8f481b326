"""The training job of bench/node_loss.py, under ckptless-run (``ckptless``) or torchrun (``torchrun``).

A DDP model whose every micro-batch also holds the "device" for ``BENCH_MICRO_S`` seconds
(a sleep: what a GPU's forward and backward cost the host, which a 2-core machine cannot
compute for four ranks; the sleeps of a survivor that runs two micro-batches add up, as on a
GPU). Global batch: ``world x 8`` samples from a ``DistributedSampler``. Rank 0 appends
``{"step", "t", "world"}`` to ``OUT/steps.jsonl`` after each step (wall clock, shared by all
processes of the host).

``torchrun``: the plain elastic script torchrun users write: ``init_process_group``, a
checkpoint (``torch.save`` by rank 0, every ``BENCH_CKPT_EVERY`` steps, to local disk) loaded at
start when present, the sampler sharded by the *current* world size (torchrun re-forms the
job at whatever size it has: the global batch changes with it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS = int(os.environ.get("BENCH_STEPS", "60"))
MICRO_S = float(os.environ.get("BENCH_MICRO_S", "0.25"))
CKPT_EVERY = int(os.environ.get("BENCH_CKPT_EVERY", "10"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 4))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))


def _rank0_pid(out: str) -> None:
    """Rank 0's first process says who it is: the bench loses the *other* node, so one process logs every step."""
    path = os.path.join(out, "rank0.pid")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)


def _log(out: str, step: int, world: int) -> None:
    with open(os.path.join(out, "steps.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "t": time.time(), "world": world}) + "\n")


def _micro(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    time.sleep(MICRO_S)  # the device's share of this micro-batch
    opt.step()


def run_ckptless(out: str) -> None:
    import ckptless
    from ckptless.data import resumable

    job = ckptless.init()
    model = DDP(_model())
    loader = resumable(DataLoader(_data(), batch_size=8, sampler=DistributedSampler(_data(), shuffle=True, seed=0)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job.protect(model=model, optimizer=opt, data=loader)
    if job.rank == 0:
        _rank0_pid(out)
    for step in job.steps(STEPS):
        with job.guard():
            x, y = loader.next_batch()
            _micro(model, opt, x, y)
            if job.rank == 0 and job.hosted_rank is None:
                _log(out, step + 1, dist.get_world_size())
    job.close()


def run_torchrun(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        _rank0_pid(out)
    model = DDP(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = os.path.join(out, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    sampler = DistributedSampler(_data(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    per_epoch = len(sampler) // 8
    it = None
    for step in range(start, STEPS):
        epoch, index = divmod(step, per_epoch)
        if it is None or index == 0:
            sampler.set_epoch(epoch)
            it = iter(DataLoader(_data(), batch_size=8, sampler=sampler))
            for _ in range(index):  # resume mid-epoch: skip what was consumed
                next(it)
        x, y = next(it)
        _micro(model, opt, x, y)
        if rank == 0:
            _log(out, step + 1, world)
            if (step + 1) % CKPT_EVERY == 0:
                tmp = ckpt + ".tmp"
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    (run_ckptless if sys.argv[1] == "ckptless" else run_torchrun)(sys.argv[2])
