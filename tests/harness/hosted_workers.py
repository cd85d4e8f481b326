"""Worker processes for tests/e2e/test_hosted_micro_batches.py: survivors running lost ranks' micro-batches.

One spawned process per *physical* rank, real Gloo, the product's own group
(``RebindableGroup``, built with ``physical=`` in the shrunk world) and the
product's :class:`~ckptless.worker.hosted.MicroBatches`. The full world runs
``LOGICAL`` processes; the shrunk world runs the even logical ranks, each
hosting the odd rank after it. The step body is a plain DDP step (dropout,
a shuffled :func:`ckptless.data.resumable` loader, gradient clipping that
clips, AdamW, a LR schedule) with the optimizer's ``zero_grad`` at its start or at its end, or the
model's at its start.
Each process writes ``out_dir/rank{logical}.pt`` (parameters, optimizer
state, every logical rank's RNG draw and data position) for the test to
compare; it loads them with ``weights_only=True``.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from ckptless.data import resumable
from ckptless.state.registry import StateRegistry
from ckptless.worker import groups, hosted, rebindable

LOGICAL = 4
STEPS = 6
TIMEOUT = timedelta(seconds=60)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def _loader(rank: int) -> Any:
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g))
    return resumable(DataLoader(ds, batch_size=8, shuffle=True), rank=rank, world_size=LOGICAL, seed=7)


def _seed_as(rank: int) -> None:
    torch.manual_seed(100 + rank)


def _initial_states(registry: StateRegistry, rank: int) -> hosted.HostedRank:
    """Rank ``rank``'s rank-bound state at step 0 (what its image would hold): its seed, position 0."""
    own = torch.get_rng_state()
    _seed_as(rank)
    states = {name: registry[name].state_dict() for name in hosted.rank_bound(registry)}
    torch.set_rng_state(own)
    return hosted.HostedRank(rank, states)


def run(phys: int, n_phys: int, store_path: str, out_dir: str, zero_at: str) -> None:
    logical = phys if n_phys == LOGICAL else 2 * phys
    try:
        store = dist.FileStore(store_path, n_phys)
        groups.ensure_default_group(store, logical, LOGICAL, TIMEOUT.total_seconds())  # unbound, no I/O
        group = dist.group.WORLD
        assert isinstance(group, rebindable.RebindableGroup)
        model = _model()
        ddp = DDP(model, process_group=group)  # unbound: the constructor's broadcast answers locally
        inner, backends = group.build(store, 0, physical=None if n_phys == LOGICAL else (phys, n_phys))
        group.install(0, inner, backends)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        data = _loader(logical)
        registry = StateRegistry()
        registry.protect(model=ddp, opt=opt, sched=sched, data=data)
        _seed_as(logical)
        hosts = [] if n_phys == LOGICAL else [_initial_states(registry, logical + 1)]
        micro = hosted.MicroBatches(registry, logical, LOGICAL, hosts, [ddp])
        clipped = []

        def body() -> None:
            if zero_at == "start":
                opt.zero_grad()
            elif zero_at == "model":  # what many scripts (and HF's Trainer) call instead
                ddp.zero_grad()
            x, y = data.next_batch()
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            clipped.append(float(nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)))
            opt.step()
            sched.step()
            if zero_at == "end":
                opt.zero_grad()

        for _ in range(STEPS):
            for r in [*micro.order(), None]:
                with micro.micro_batch(r):
                    body()
        micro.close()
        out: dict[str, Any] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
            "lr": torch.tensor(sched.get_last_lr()),
            "grad_norm_max": torch.tensor(max(clipped)),
        }
        ranks = {logical: None, **{h.rank: h for h in hosts}}
        for r, h in ranks.items():
            if h is not None:
                registry["rng"].load_state_dict(h.states["rng"])
                data.sampler.set_world(r, LOGICAL)
                data.load_state_dict(h.states["data"])
            out[f"draw{r}"] = torch.rand(4)
            out[f"position{r}"] = torch.tensor([data.state_dict()["epoch"], data.state_dict()["index"]])
        torch.save(out, Path(out_dir) / f"rank{logical}.pt")
    except BaseException:  # noqa: BLE001 - the test reads the error
        (Path(out_dir) / f"error{logical}.txt").write_text(traceback.format_exc())
