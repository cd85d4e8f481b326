"""Worker processes for tests/e2e/test_state_ddp_fsdp.py: DDP + FSDP2 training killed and recovered in-process.

Every rank trains three models per step: ``a`` (DDP, default arguments),
``b`` (DDP, ``gradient_as_bucket_view=True``) and ``c`` (FSDP2: ``fully_shard``
per Linear and on the root, on ``init_device_mesh("cpu", (4,))``, with uneven
shards: rank 3 holds an empty shard of the last layer). Inputs are drawn from
a generator seeded by (step, rank), so a resumed step sees the same batch.

The victim blocks inside a hook at the kill point (so its peers are stuck in
a collective with it), tells the test through the store, and is SIGKILLed by
the test. Survivors see the failure, release their groups, reset FSDP2,
bind the next generation (which waits for the replacement), restore the
image of their last completed step inside ``groups.local_only()`` and train
on. A replacement (fresh process, same setup code on unbound groups) binds the
same generation and restores the dead rank's last image from the file the
victim wrote. Every rank writes its final state to ``out/rank<r>.pt``.
Synchronisation is by store keys and collectives only (no sleeps).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (DDP's constructor imports it lazily: ~4 s per forked worker otherwise)
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ckptless.errors import StateError
from ckptless.state import Capturer, StateImage, StateRegistry, restore
from ckptless.state.dtensor import is_dtensor
from ckptless.state.manifest import Manifest
from ckptless.worker import groups

WORLD = 4
STEPS = 5
TIMEOUT_S = 60.0
POINTS = ("ddp_a_bwd", "ddp_b_bwd", "fsdp_fwd", "fsdp_bwd")


@dataclass(frozen=True)
class Args:
    rank: int
    port: int
    out: str
    point: str = ""  # kill point ("" for a fault-free run)
    kill_step: int = -1
    victim: int = -1
    generation: int = 0  # > 0: a replacement joining this generation
    image: str = ""  # the replacement's image (path prefix: .json manifest, .bin buffer)
    lag: int = 0  # restore the image this many steps before the last completed one (commit lag)
    without_reset_api: bool = False  # play a torch without FSDPModule.reset_iter_state (2.11, the GPU machine's)


def build() -> dict[str, Any]:
    """The user's setup code: the same in every process (a replacement runs it on unbound groups)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    b = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 4))
    c = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 6))
    ddp_a = nn.parallel.DistributedDataParallel(a, bucket_cap_mb=0.01)  # several buckets once rebuilt
    ddp_b = nn.parallel.DistributedDataParallel(b, gradient_as_bucket_view=True)
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(c[0], mesh=mesh)
    fully_shard(c[2], mesh=mesh)
    fully_shard(c, mesh=mesh)
    return {
        "a": ddp_a, "b": ddp_b, "c": c,
        "opt_a": torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9),
        "opt_b": torch.optim.AdamW(b.parameters(), lr=0.01),
        "opt_c": torch.optim.AdamW(c.parameters(), lr=0.01),
    }


def _block(store: dist.Store, what: str) -> None:
    store.set("victim_ready", what)
    threading.Event().wait()  # until the test's SIGKILL


def train_step(o: dict[str, Any], step: int, rank: int, store: dist.Store, kill: str) -> None:
    """One step; ``kill`` names the point where this process blocks for its SIGKILL ("" = none)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    for name, width in (("a", 32), ("b", 16)):
        loss = o[name](torch.randn(8, width, generator=g)).pow(2).mean()
        if kill == f"ddp_{name}_bwd":
            loss.register_hook(lambda grad: _block(store, kill))
        loss.backward()
        o[f"opt_{name}"].step()
        o[f"opt_{name}"].zero_grad()
    c = o["c"]
    handles = []
    if kill == "fsdp_fwd":  # after the first layer's all-gather, before the second's
        handles.append(c[2].register_forward_pre_hook(lambda m, a: _block(store, kill)))
    if kill == "fsdp_bwd":  # after the last layer's reduce-scatter, before the first layer's backward
        def arm(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda grad: _block(store, kill))

        handles.append(c[1].register_forward_hook(arm))
    loss = c(torch.randn(8, 16, generator=g)).pow(2).mean()
    loss.backward()
    for h in handles:
        h.remove()
    o["opt_c"].step()
    o["opt_c"].zero_grad()
    flag = torch.tensor([float(step)])
    dist.all_reduce(flag)


def _plain(x: Any) -> Any:
    if is_dtensor(x):
        return x.to_local().detach().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _write_image(img: StateImage, prefix: str) -> None:
    for ext, data in ((".json", img.manifest.to_bytes()),
                      (".bin", img.buffer[: img.manifest.total_bytes].numpy().tobytes())):
        with open(prefix + ext + ".tmp", "wb") as f:
            f.write(data)
        os.replace(prefix + ext + ".tmp", prefix + ext)


def image_path(out: str, rank: int, version: int) -> str:
    return os.path.join(out, f"image{rank}.v{version}")


def _read_image(prefix: str) -> StateImage:
    with open(prefix + ".json", "rb") as f:
        manifest = Manifest.from_bytes(f.read())
    with open(prefix + ".bin", "rb") as f:
        buf = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    return StateImage(manifest, buf)


def _summary(report: Any, reg: StateRegistry) -> dict[str, Any]:
    return {"objects": [(o.name, o.in_place, o.reason) for o in report.objects],
            "ddp": {k: getattr(reg[f"__ddp__{k}"], "last_action") for k in ("a", "b")}}


def worker(args: Args) -> None:
    torch.set_num_threads(1)
    if args.without_reset_api and hasattr(FSDPModule, "reset_iter_state"):  # a survivor's reset takes ckptless's fallback
        delattr(FSDPModule, "reset_iter_state")
    rank = args.rank
    replacement = args.generation > 0
    facts: dict[str, Any] = {"failures": [], "restores": [], "replacement": replacement, "t": [("start", time.time())]}
    store = groups.connect_store("127.0.0.1", args.port, TIMEOUT_S)
    groups.ensure_default_group(store, rank, WORLD, TIMEOUT_S)
    o = build()
    reg = StateRegistry()
    reg.protect(a=o["a"], b=o["b"], c=o["c"], opt_a=o["opt_a"], opt_b=o["opt_b"], opt_c=o["opt_c"])
    cap = Capturer(reg, "ddp-fsdp", rank)
    gen = args.generation
    facts["t"].append(("built", time.time()))
    groups.bind_all(store, gen, rank, WORLD, TIMEOUT_S, time.monotonic() + TIMEOUT_S)
    facts["t"].append(("bound", time.time()))
    images: dict[int, StateImage] = {}
    if replacement:
        image = _read_image(args.image)
        try:  # outside local_only a DDP replay would leave the process: refused before touching the reducer
            restore(reg, image)
            facts["outside_local_only"] = "restored"
        except StateError as exc:
            facts["outside_local_only"] = str(exc)
        with groups.local_only():
            facts["restores"].append(_summary(restore(reg, image), reg))
    else:
        image = cap.capture(0, gen)
    step = image.manifest.version
    images[step] = image
    if rank == args.victim and not replacement:
        _write_image(image, image_path(args.out, rank, step))
    while step < STEPS:
        kill = args.point if (not replacement and rank == args.victim and step == args.kill_step) else ""
        failed = False
        try:
            train_step(o, step, rank, store, kill)
        except Exception:
            if not groups.collective_failed(gen):
                raise  # our own bug, not the fault under test: fail the run at once
            failed = True
            facts["failures"].append((step, traceback.format_exc(limit=1).splitlines()[-1][:200]))
        if not failed:
            reg.step_done()
            step += 1
            image = images[step] = cap.capture(step, gen)  # fresh buffer: sizes grow once moments exist
            if rank == args.victim and not replacement:
                _write_image(image, image_path(args.out, rank, step))
            continue
        # Survivor recovery, outside the except block (a live traceback keeps the failed Work's sockets).
        facts["t"].append(("failed", time.time()))
        groups.release_all()
        facts["fsdp_reset"] = reg.reset_after_failure()
        gen += 1
        groups.bind_all(store, gen, rank, WORLD, TIMEOUT_S, time.monotonic() + TIMEOUT_S)
        facts["t"].append(("rebound", time.time()))
        image = images[max(0, step - args.lag)]
        with groups.local_only():
            facts["restores"].append(_summary(restore(reg, image), reg))
        step = image.manifest.version
    facts["t"].append(("trained", time.time()))
    final = {k: _plain(o[k].module.state_dict() if k in ("a", "b") else o[k].state_dict()) for k in o}
    final["ddp"] = {k: reg[f"__ddp__{k}"].state_dict() for k in ("a", "b")}
    final["facts"] = facts
    final["generation"] = gen
    torch.save(final, os.path.join(args.out, f"rank{rank}.pt"))
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(WORLD)])  # nobody leaves while a peer may still read from it
