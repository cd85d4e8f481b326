"""Worker process for the 2-rank Gloo snapshot test in tests/e2e/test_snapshot.py.

``python -m tests.harness.snapshot_workers MODE RANK WORLD STORE_FILE SNAP_DIR OUT_DIR``

- ``save``: train steps 1..4 with gradient all_reduce on the default group,
  snapshot every 2 steps (the write overlaps the next step's collectives),
  then keep training steps 5..6 and record the result: the uninterrupted run.
- ``load``: build the model from a *different* seed, restore the newest
  complete snapshot (step 4), train steps 5..6 and record the same facts.

Each rank writes ``OUT_DIR/<mode>_rank<r>.pt`` (tensors only; the test reads
it with ``weights_only=True``). Synchronisation is by collectives only.
"""

from __future__ import annotations

import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptless.snapshot import SnapshotConfig, SnapshotWriter, latest_complete, load_snapshot
from ckptless.state import StateRegistry

JOB = "gloo-job"


class DataPos:
    """A per-rank data-loader position (each rank reads its own shard)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.index = rank, 0

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "index": self.index}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rank, self.index = sd["rank"], sd["index"]


def build(seed: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, DataPos, StateRegistry]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = DataPos(rank)
    reg = StateRegistry()
    reg.protect(model=model, optimizer=opt, scheduler=sched, data=data)
    # per-rank streams differ, as in real data-parallel jobs
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    return model, opt, sched, data, reg


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, data: DataPos, world: int) -> None:
    x = torch.randn(8, 16) + data.index + random.random() + float(np.random.rand())
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    sched.step()
    data.index += 1


def main() -> None:
    mode, rank, world, store_file, snap_dir, out_dir = sys.argv[1:7]
    r, w = int(rank), int(world)
    store = dist.FileStore(store_file, w)
    dist.init_process_group("gloo", store=store, rank=r, world_size=w, timeout=timedelta(seconds=60))
    model, opt, sched, data, reg = build(0 if mode == "save" else 99, r)
    if mode == "save":
        cfg = SnapshotConfig(Path(snap_dir), JOB, every=2, keep=2, on_busy="wait", completion_timeout_s=60)
        writer = SnapshotWriter(cfg, reg, r, w)
        for step in range(1, 5):
            train_step(model, opt, sched, data, w)
            writer.maybe_snapshot(step)
        writer.close(timeout=60)
        start = 4
    else:
        info = latest_complete(Path(snap_dir), JOB, w)
        assert info is not None, "no complete snapshot"
        start = load_snapshot(info, reg, r)
    for _ in range(start + 1, 7):
        train_step(model, opt, sched, data, w)
    out: dict[str, torch.Tensor] = {f"param.{n}": p.detach() for n, p in model.named_parameters()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{i}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    out["start"] = torch.tensor(start)
    out["lr"] = torch.tensor(sched.get_last_lr()[0], dtype=torch.float64)
    out["data_index"] = torch.tensor(data.index)
    out["draw_torch"] = torch.rand(4)
    out["draw_python"] = torch.tensor(random.random(), dtype=torch.float64)
    out["draw_numpy"] = torch.from_numpy(np.random.rand(3))
    torch.save(out, Path(out_dir) / f"{mode}_rank{r}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
