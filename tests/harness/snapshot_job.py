"""The single-process job the snapshot tests save and restore: a small model with dropout, Adam, a
step LR schedule and a data position whose state has non-tensor values of several types."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptless.snapshot import SnapshotConfig, SnapshotWriter
from ckptless.state import StateRegistry

JOB = "job-a"


class Data:
    """A data-loader position with non-tensor state of several types."""

    def __init__(self) -> None:
        self.index, self.epoch, self.order = 0, 0, (3, 1, 2)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "epoch": self.epoch, "order": self.order, "name": "shard-0",
                "weights": np.array([0.5, 0.25]), "tup": (torch.tensor([1, 2]), "x")}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.index, self.epoch, self.order = sd["index"], sd["epoch"], sd["order"]
        assert type(self.order) is tuple and sd["name"] == "shard-0"
        assert isinstance(sd["weights"], np.ndarray) and torch.equal(sd["tup"][0], torch.tensor([1, 2]))


class Job:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.data = Data()
        self.reg = StateRegistry()
        self.reg.protect(model=self.model, optimizer=self.opt, scheduler=self.sched, data=self.data)

    def step(self) -> None:
        x = torch.randn(4, 8) + random.random() + float(np.random.rand()) + self.data.index
        self.opt.zero_grad()
        self.model(x).pow(2).mean().backward()
        self.opt.step()
        self.sched.step()
        self.data.index += 1

    def facts(self) -> dict[str, Any]:
        return {"params": [p.detach().clone() for p in self.model.parameters()],
                "opt": self.opt.state_dict()["state"], "lr": self.sched.get_last_lr(),
                "index": self.data.index, "rand": torch.rand(5), "py": random.random(), "np": np.random.rand()}


def cfg(tmp: Path, **kw: Any) -> SnapshotConfig:
    kw.setdefault("every", 2)
    kw.setdefault("completion_timeout_s", 30.0)
    return SnapshotConfig(tmp / "snaps", JOB, **kw)


def run_and_snapshot(tmp: Path, steps: int, **kw: Any) -> tuple[Job, SnapshotWriter]:
    job = Job()
    w = SnapshotWriter(cfg(tmp, **kw), job.reg, 0, 1)
    for s in range(1, steps + 1):
        job.step()
        if w.maybe_snapshot(s):
            w.wait(30)
    return job, w


def world_snapshots(tmp: Path, world: int, seeds: Iterable[int], steps: int = 6, keep: int = 2) -> Path:
    """A world-``world`` run's snapshots (``world`` writers in one process: completion is file based, no
    collective), one job per seed; every 2 steps, the newest ``keep`` kept."""
    jobs = [Job(seed=s) for s in seeds]
    assert len(jobs) == world
    writers = [SnapshotWriter(cfg(tmp, keep=keep), j.reg, r, world) for r, j in enumerate(jobs)]
    for s in range(1, steps + 1):
        for j in jobs:
            j.step()
        started = [w.maybe_snapshot(s) for w in writers]
        assert len(set(started)) == 1
        if started[0]:
            waits = [threading.Thread(target=w.wait, args=(30,)) for w in writers]
            for t in waits:
                t.start()
            for t in waits:
                t.join(60)
    for w in writers:
        w.close(30)
    return tmp / "snaps"
