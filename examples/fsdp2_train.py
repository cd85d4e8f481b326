"""A typical FSDP2 training script (``fully_shard`` per block, then the root), ported to ckptless.

    ckptless-run --standalone --nproc-per-node 4 examples/fsdp2_train.py --out OUT

CPU/Gloo: the mesh is ``init_device_mesh("cpu", (world,))`` over the default
group that ``ckptless.init()`` created. The model is a residual MLP: an input
projection, two pre-norm blocks (each its own ``fully_shard`` unit) and a head
(in the root unit; its 6 output rows shard unevenly over 4 ranks, so rank 3
holds an empty shard). AdamW's moments are sharded DTensors like the
parameters. docs/porting.md shows the diff against the plain script.

Options beyond the plain script (for CI and the tests):
  --steps N       train N steps instead of --epochs full epochs
  --hsdp R        HSDP: a (R, world / R) mesh, replicate x shard; each parameter and
                  optimizer shard is then held by R ranks, and ckptless recovers a lost
                  one from a live replica instead of mirroring it (docs/state.md)
  --device cuda   train on the rank's GPU (``job.device``), a CUDA mesh, deterministic
                  algorithms on (tests/gpu)
  --out DIR       write DIR/final_rank<R>.pt at the end: this rank's parameter
                  shards, optimizer state (local shards), LR, draws from every RNG
                  stream, data position
  EXAMPLE_PAUSE=R:S[:where]  (environment; tests only)
                  rank R, about to run step S (``where`` = ``start``, default) or
                  inside that step's backward (``backward``: a hook on the loss,
                  while its peers are already in FSDP2's reduce-scatter), writes
                  DIR/paused_rank<R>.json ({pid, step}) and holds (at most 120 s)
                  so a test can SIGKILL it exactly there. Fires once per job.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ckptless
from ckptless.data import resumable


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(nn.functional.gelu(self.fc1(self.norm(x)))))


class MLP(nn.Module):
    def __init__(self, dim: int = 32, n_in: int = 20, n_out: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 20, generator=g)
    y = (x[:, :6].argmax(1) + (x[:, 6:] > 0).sum(1)) % 6
    return TensorDataset(x, y)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=0, help="train this many steps (0: --epochs full epochs)")
    p.add_argument("--out", default="", help="write OUT/final_rank<R>.pt at the end")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the rank's GPU (job.device)")
    p.add_argument("--hsdp", type=int, default=1, help="HSDP: this many replicas of a sharded model (a 2-D mesh)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    job = ckptless.init()  # creates the default process group
    rank, world = dist.get_rank(), dist.get_world_size()
    device = job.device if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)  # bitwise reruns (needs CUBLAS_WORKSPACE_CONFIG)
    mesh = init_device_mesh(device.type, (world,))
    if args.hsdp > 1:  # HSDP: replicate x shard (each shard held by --hsdp ranks, recovered from them)
        mesh = init_device_mesh(device.type, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
    random.seed(0)  # every RNG stream seeded: a rerun draws the same numbers
    np.random.seed(0)
    torch.manual_seed(0)
    model = MLP().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ds = dataset()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = resumable(DataLoader(ds, batch_size=args.batch_size, sampler=sampler))
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
        save_final_state(args.out, rank, model, opt, sched, loader, job.recoveries)
    job.close()


# --- for CI and the tests: final state and an exact kill point ----------------------------------


def _local(x: Any) -> Any:
    """DTensors as this rank's local shard; containers recursively; tensors cloned."""
    if isinstance(x, DTensor):
        return x.to_local().detach().cpu().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_local(v) for v in x]
    return x


def save_final_state(out: str, rank: int, module: nn.Module, opt: torch.optim.Optimizer, sched: Any,
                     loader: Any, recoveries: int) -> None:
    """OUT/final_rank<R>.pt: plain tensors only (``torch.load(..., weights_only=True)``)."""
    pos = loader.state_dict()
    final = {
        "params": {k: _local(v) for k, v in module.state_dict().items()},
        "optimizer": _local(opt.state_dict()),
        "lr": torch.tensor(sched.get_last_lr()),
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


class PausePoint:
    """``EXAMPLE_PAUSE=R:S[:start|backward]`` (several, comma-separated: one per rank): see the module
    docstring. Inactive unless set."""

    LIMIT_S = 120.0

    def __init__(self, out: str, step: int = -1, where: str = "") -> None:
        self.out, self.step, self.where = out, step, where

    @classmethod
    def from_env(cls, out: str, rank: int) -> PausePoint:
        specs = [x for x in os.environ.get("EXAMPLE_PAUSE", "").split(",") if x]
        spec = next((x for x in specs if x.split(":")[0] == str(rank)), "")
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
