"""What a survivor swaps for a hosted rank's micro-batch, and which state cannot host (issue 22).

Pure parts of ``ckptless.worker.hosted``; the micro-batches themselves run on real Gloo processes in
tests/e2e/test_hosted_micro_batches.py and in a whole job in tests/e2e/test_shrink_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ckptless.data import ResumableLoader, ResumableSampler
from ckptless.state.registry import StateRegistry
from ckptless.worker import hosted


class Cursor:
    """A user's own per-rank position: rank-bound, swapped like the RNG."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.n = int(s["n"])


def test_rank_bound_entries_are_everything_but_the_replicas_common_state() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    loader = ResumableLoader(ds, ResumableSampler(8, rank=0, world_size=2), batch_size=2)
    reg = StateRegistry()
    reg.protect(model=model, opt=opt, sched=sched, data=loader, cursor=Cursor())
    assert hosted.rank_bound(reg) == ["data", "cursor", "rng"]


def test_state_that_cannot_host_says_why() -> None:
    reg = StateRegistry()
    assert "no DDP model" in (hosted.why_not_shrinkable(reg, []) or "")
    plain = SimpleNamespace(module=nn.Linear(2, 2), find_unused_parameters=False)
    assert "data position" in (hosted.why_not_shrinkable(reg, [plain]) or "")  # type: ignore[list-item]
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    reg.protect(data=ResumableLoader(ds, ResumableSampler(8, rank=0, world_size=2), batch_size=2))
    assert hosted.why_not_shrinkable(reg, [plain]) is None  # type: ignore[list-item]
    bn = SimpleNamespace(module=nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), find_unused_parameters=False)
    why = hosted.why_not_shrinkable(reg, [bn])  # type: ignore[list-item]
    assert why is not None and "running_mean" in why and "BatchNorm" in why
    unused = SimpleNamespace(module=nn.Linear(2, 2), find_unused_parameters=True)
    assert "find_unused_parameters" in (hosted.why_not_shrinkable(reg, [unused]) or "")  # type: ignore[list-item]
    reg.protect(scaler=torch.amp.GradScaler("cpu"))
    assert "GradScaler" in (hosted.why_not_shrinkable(reg, [plain]) or "")  # type: ignore[list-item]
