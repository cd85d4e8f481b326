"""A ported DDP script that still calls ``init_process_group`` after ``ckptless.init()``.

    ddp_init_pg.py OUT MODE
MODE ``guarded``: ``if not dist.is_initialized(): dist.init_process_group("gloo")``
(the common idiom); ``always``: an unconditional ``dist.init_process_group("gloo")``.
Trains 3 DDP steps and writes OUT/ok_rank<R>.json (with the backend name torch reports).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import ckptless


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    job = ckptless.init()
    if mode == "guarded":
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    elif mode == "always":
        dist.init_process_group("gloo")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Position:  # a trivial data position: the batches below depend on the step only
        __ckptless_data_position__ = True

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            pass

    job.protect(model=model, optimizer=opt, data=Position())
    for step in job.steps(3):
        with job.guard():
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with open(os.path.join(out, f"ok_rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"backend": str(dist.get_backend()), "world": dist.get_world_size()}, f)
    job.close()


if __name__ == "__main__":
    main()
