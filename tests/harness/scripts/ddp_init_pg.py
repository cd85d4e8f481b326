"""A ported DDP script that still calls ``init_process_group`` after ``ckptless.init()``.

    ddp_init_pg.py OUT MODE [destroy]
MODE ``guarded``: ``if not dist.is_initialized(): dist.init_process_group("gloo")``
(the common idiom) after ``ckptless.init()``; ``always``: an unconditional
``dist.init_process_group("gloo")`` after it; ``before``: the script's own call first,
then ``ckptless.init()``. Trains 3 DDP steps and writes OUT/ok_rank<R>.json (with the
backend name torch reports). ``destroy``: keep the plain script's
``dist.destroy_process_group()`` after ``job.close()``.
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
    if mode == "before":
        dist.init_process_group("gloo")
    job = ckptless.init()
    if mode == "guarded":
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    elif mode == "always":
        dist.init_process_group("gloo")
    elif mode != "before":
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
    if sys.argv[3:] == ["destroy"]:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
