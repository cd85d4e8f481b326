"""A typical torchrun DDP training script, ported to ckptless (docs/porting.md shows the diff).

    ckptless-run --standalone --nproc-per-node 4 examples/ddp_train.py --out OUT
    ckptless-run --standalone --nproc-per-node 4 examples/ddp_train.py --bucket-view

What it keeps from the plain script: ``DistributedDataParallel`` with default
arguments (``--bucket-view``: ``gradient_as_bucket_view=True``), a
``DistributedSampler`` with shuffle behind a stock ``DataLoader``, AdamW, a
OneCycle LR schedule, dropout and gradient clipping. What the port changed:
``ckptless.init()`` instead of ``init_process_group``, the loader wrapped with
``ckptless.data.resumable`` (exact data position), one ``job.protect`` call,
and the epoch loops flattened into ``for step in job.steps(n): with job.guard():``.

Options beyond the plain script (for CI and the tests):
  --steps N       train N steps instead of --epochs full epochs
  --loader shuffle
                  a plain ``DataLoader(shuffle=True)`` (no DistributedSampler),
                  sharded by the ``resumable(..., rank=, world_size=)`` helper
  --out DIR       write DIR/final_rank<R>.pt at the end: parameters, optimizer
                  state, LR, draws from every RNG stream, data position
  --device cuda   train on the rank's GPU (``job.device``: ``ckptless.init()`` made it
                  current), deterministic algorithms on (tests/gpu)
  EXAMPLE_PAUSE=R:S[:where]  (environment; tests only)
                  rank R, about to run step S (``where`` = ``start``, default) or
                  inside that step's backward (``backward``: a hook on the loss,
                  while its peers are already in DDP's gradient all-reduce),
                  writes DIR/paused_rank<R>.json ({pid, step}) and holds (at most
                  120 s) so a test can SIGKILL it exactly there. Fires once per
                  job: the file is the latch, so the replacement does not pause.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ckptless
from ckptless.data import resumable


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=0, help="train this many steps (0: --epochs full epochs)")
    p.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    p.add_argument("--loader", choices=("distributed", "shuffle"), default="distributed",
                   help="DistributedSampler(shuffle=True) (default) or a plain DataLoader(shuffle=True)")
    p.add_argument("--out", default="", help="write OUT/final_rank<R>.pt at the end")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the rank's GPU (job.device)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    job = ckptless.init()  # creates the default process group
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(0)  # every RNG stream seeded: a rerun draws the same numbers
    np.random.seed(0)
    torch.manual_seed(0)
    device = job.device if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)  # bitwise reruns (needs CUBLAS_WORKSPACE_CONFIG)
        model = DDP(build_model().to(device), device_ids=[device], gradient_as_bucket_view=args.bucket_view)
    else:
        model = DDP(build_model(), gradient_as_bucket_view=args.bucket_view)
    ds = dataset()
    if args.loader == "distributed":
        sampler = DistributedSampler(ds, shuffle=True, seed=0)
        loader = resumable(DataLoader(ds, batch_size=args.batch_size, sampler=sampler))
    else:  # a plain shuffled loader: the helper defines its order (seed 0) and shards it like DDP would
        loader = resumable(DataLoader(ds, batch_size=args.batch_size, shuffle=True), rank=rank, world_size=world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.steps or args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)
    job.protect(model=model, optimizer=opt, scheduler=sched, data=loader)
    pause = PausePoint.from_env(args.out, rank)

    for step in job.steps(steps):
        with job.guard():
            pause.maybe_hold(step, "start")
            x, y = loader.next_batch()
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            pause.arm_backward(step, loss)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and (step + 1) % len(loader) == 0:
                print(f"epoch {step // len(loader)} loss {loss.item():.4f}", flush=True)

    if args.out:
        save_final_state(args.out, rank, model.module, opt, sched, loader, job.recoveries)
    job.close()


# --- for CI and the tests: final state and an exact kill point ----------------------------------


def save_final_state(out: str, rank: int, module: nn.Module, opt: torch.optim.Optimizer, sched: object,
                     loader: object, recoveries: int) -> None:
    """OUT/final_rank<R>.pt: plain tensors only (``torch.load(..., weights_only=True)``)."""
    pos = loader.state_dict()  # type: ignore[attr-defined]
    final = {
        "params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
        "optimizer": _to_cpu(opt.state_dict()),
        "lr": torch.tensor(sched.get_last_lr()),  # type: ignore[attr-defined]
        "rng_torch": torch.rand(4),
        "rng_python": torch.tensor([random.random() for _ in range(4)]),
        "rng_numpy": torch.from_numpy(np.random.rand(4)),
        **({"rng_cuda": torch.rand(4, device="cuda").cpu()} if torch.cuda.is_available() and torch.cuda.is_initialized()
           else {}),
        "data": torch.tensor([pos["epoch"], pos["index"]]),
        "recoveries": torch.tensor(recoveries),
        "pid": torch.tensor(os.getpid()),  # which process finished this rank (not state: tests drop it)
    }
    tmp = os.path.join(out, f".final_rank{rank}.pt.tmp")
    torch.save(final, tmp)
    os.replace(tmp, os.path.join(out, f"final_rank{rank}.pt"))


def _to_cpu(x: object) -> object:
    """Tensors on the host, containers recursively (a GPU run's final state loads anywhere)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


class PausePoint:
    """``EXAMPLE_PAUSE=R:S[:start|backward]``: see the module docstring. Inactive unless set."""

    LIMIT_S = 120.0

    def __init__(self, out: str, step: int = -1, where: str = "") -> None:
        self.out, self.step, self.where = out, step, where

    @classmethod
    def from_env(cls, out: str, rank: int) -> PausePoint:
        spec = os.environ.get("EXAMPLE_PAUSE", "")
        if not spec or not out:
            return cls(out)
        r, s, *rest = spec.split(":")
        where = rest[0] if rest else "start"
        if where not in ("start", "backward"):
            raise ValueError(f"EXAMPLE_PAUSE: unknown point {where!r}")
        if int(r) != rank or os.path.exists(cls.latch(out, rank)):
            return cls(out)  # not this rank, or already fired (we are the replacement)
        return cls(out, int(s), where)

    @staticmethod
    def latch(out: str, rank: int) -> str:
        return os.path.join(out, f"paused_rank{rank}.json")

    def maybe_hold(self, step: int, where: str) -> None:
        if step != self.step or where != self.where:
            return
        rank = dist.get_rank()
        tmp = self.latch(self.out, rank) + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "step": step, "where": where}, f)
        os.replace(tmp, self.latch(self.out, rank))
        self.step = -1
        deadline = time.monotonic() + self.LIMIT_S
        while time.monotonic() < deadline:  # held here until the test's SIGKILL
            time.sleep(0.01)

    def arm_backward(self, step: int, loss: torch.Tensor) -> None:
        if step == self.step and self.where == "backward":
            loss.register_hook(lambda grad: self.maybe_hold(step, "backward"))


if __name__ == "__main__":
    main()
