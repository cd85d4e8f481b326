"""What a training script under test writes at the end, for the bitwise verdict.

Why here: the reference test script and the demo must record exactly the same
things (parameters, optimizer state, LR, draws from every RNG stream, the
rank's GPU generator included, the data position), and the runner compares them leaf by leaf with ``torch.equal``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def write_final_state(out_dir: str, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: Any, loader: Any, result: Any) -> str:
    """Save ``final_rank<R>.pt`` (tensors only: loaded back with ``weights_only=True``)."""
    pos = loader.state_dict()
    final = {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler_lr": torch.tensor(scheduler.get_last_lr()),
        "rng_torch": torch.rand(4),
        "rng_python": torch.tensor([random.random() for _ in range(4)]),
        "rng_numpy": torch.from_numpy(np.random.rand(4)),
        "data": torch.tensor([pos["epoch"], pos["index"]]),
        "generation": torch.tensor(result.generation),
        "recoveries": torch.tensor(result.recoveries),
    }
    gpu = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if gpu is not None:  # a GPU rank: draws from its own device's generator too
        final["rng_cuda"] = torch.rand(4, device=gpu).cpu()
    path = os.path.join(out_dir, f"final_rank{rank}.pt")
    torch.save(final, path)
    return path
