"""Benchmark (issue 21): what mirroring costs a data-parallel job when replicas are mirrors already.

Run:  .venv/bin/python bench/replicas.py                 (DDP and HSDP, world 4 and 8, ~64 MiB state)
      .venv/bin/python bench/replicas.py --worlds 4 --kinds ddp --mib 32    (quicker)

Each case runs W real processes on this machine (Gloo over loopback, one thread each) training a real
model with AdamW, capturing and mirroring every step through ckptless's own ``Capturer`` and
``MirrorEngine`` (K = 1, ring), twice in the same run:

* **before**: the replicated state mirrored like everything else (``mirror_replicated=True``: what
  every version of ckptless did before issue 21, and what ``--mirror-replicated`` still does);
* **two copies**: a holder receives and keeps only what no replica holds, and every capture copies
  the whole image (each rank keeps the prefix twice: the committed version and the one in flight);
* **after**: the default: as *two copies*, and a capture after the first leaves the replicated prefix
  in the live tensors until its round commits (``ckptless/state/live_prefix.py``), through the
  product's own rule (``worker/deferral.py``) and optimizer pre-hook (``WriteOrder``): one copy.

DDP: ``DistributedDataParallel`` over the world, every rank's image holds the whole model and
optimizer. HSDP: FSDP2 on a (2, W / 2) mesh, replicate x shard: each shard is held by 2 ranks.

Per rank (mean over ranks): state bytes S (the image), bytes a round sends, bytes its peer store
keeps, peak host memory over the run's start (``VmHWM`` after the rounds minus ``VmRSS`` before the
first capture, so it counts the capture pool and the store, and whatever the steps themselves allocate
anew), the bytes of the rank's own capture buffers at the end (``MirrorEngine.pool_bytes``), and the mean step time with mirroring
against the same steps without (overhead). On 2 cores with W processes the step times are noisy:
compare bytes and memory, and the ratios in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import run_ranks  # noqa: E402

MIB = 1 << 20
MODES = ("before", "two copies", "after")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(val.split()[0]) * 1024
    return out


def _model(kind: str, mib: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, round(mib * MIB / (width * width * 4 * 3)))  # parameters + two AdamW moments
    torch.manual_seed(0)
    blocks = [nn.Linear(width, width) for _ in range(layers)]
    model: nn.Module = nn.Sequential(*blocks)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def case(rank: int, world: int, kind: str, mode: str, args: dict[str, Any]) -> dict[str, Any]:
    from ckptless.mirror import MirrorConfig, MirrorEngine
    from ckptless.state import Capturer, StateRegistry
    from ckptless.state.fence import WriteOrder
    from ckptless.worker import deferral

    model, opt = _model(kind, args["mib"], world)
    reg = StateRegistry()
    reg.protect(model=model, optimizer=opt)  # before the first step (DDP's reducer state)
    x = torch.randn(8, 1024)
    for _ in range(2):
        _step(model, opt, x)  # the AdamW moments exist
    base = []
    for _ in range(args["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, x)
        base.append(time.perf_counter() - t0)
    cap = Capturer(reg, "bench", rank, mirror_replicated=(mode == "before"))
    cfg = MirrorConfig.build(replicas=1, timeout_s=600.0)
    engine = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg)
    order = WriteOrder()  # the optimizer's pre-hook waits for a deferred capture's round, as in a job
    order.install([opt])

    def settle() -> None:
        engine.settle_prefix(600.0)

    order.before_optimizer = settle
    deferred = 0
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    before = _status()["VmRSS"]
    timed = []
    for v in range(1, args["steps"] + 1):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, x)
        plan = cap.plan()
        defer = mode == "after" and deferral.may_defer(engine, plan, order.optimizers, cap.mirror_replicated,
                                                       None, 600.0)
        deferred += defer
        buf = engine.acquire_buffer(plan.nbytes(defer), shrink=defer)
        img = cap.capture(v, 0, out=buf, checksum_now=False, plan=plan, defer_prefix=defer)
        engine.submit(img.manifest, img.buffer, live=img.live)
        timed.append(time.perf_counter() - t0)
    assert engine.wait_committed(args["steps"], timeout=600) and engine.settle_prefix(600.0)
    pool = engine.pool_bytes()
    order.install([])
    after = _status()
    sent = [r.bytes_sent for r in engine.history]
    out = {"state": img.manifest.total_bytes, "sent": statistics.mean(sent), "held": engine.store.bytes_held,
           "peak_over_start": after["VmHWM"] - before, "step_base": statistics.median(base),
           "step_mirror": statistics.median(timed), "deferred": deferred, "pool": pool}
    engine.close()
    return out


def worker(rank: int, store_path: str, out_path: str, args: dict[str, Any]) -> None:
    world = args["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    res = {f"{kind}/{mode}": case(rank, world, kind, mode, args) for kind in args["kinds"] for mode in MODES}
    with open(out_path, "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, args: dict[str, Any]) -> list[dict[str, Any]] | None:
    return run_ranks(worker, world, (args,), 1800)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--kinds", nargs="+", choices=["ddp", "hsdp"], default=["ddp", "hsdp"])
    ap.add_argument("--mib", type=int, default=64, help="model + AdamW state of the whole model, MiB")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", help="write the raw per-rank results here")
    a = ap.parse_args(argv)
    args = {"kinds": a.kinds, "mib": a.mib, "steps": a.steps}
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    print("| W | kind | S per rank MiB | sent per round MiB (before -> after, ratio) | store keeps MiB "
          "(before -> after) | peak host memory / S (before -> two copies -> after) | captures deferred | "
          "own images / S (before -> two copies -> after) | step overhead (before -> two copies -> after) |")
    print("|---|---|---|---|---|---|---|---|---|")
    raw: dict[str, Any] = {}
    for world in a.worlds:
        per_rank = run(world, dict(args, world=world))
        if per_rank is None:
            return 1
        raw[str(world)] = per_rank
        for kind in a.kinds:
            def mean(mode: str, key: str) -> float:
                return statistics.mean(r[f"{kind}/{mode}"][key] for r in per_rank)

            s = mean("after", "state")
            sent_b, sent_a = mean("before", "sent"), mean("after", "sent")
            over = {m: mean(m, "step_mirror") / mean(m, "step_base") - 1 for m in MODES}
            peak = " -> ".join(f"{mean(m, 'peak_over_start') / s:.2f}" for m in MODES)
            print(f"| {world} | {kind} | {s / MIB:.1f} | {sent_b / MIB:.2f} -> {sent_a / MIB:.3f} "
                  f"({sent_a / sent_b * 100:.2f} %) | {mean('before', 'held') / MIB:.1f} -> "
                  f"{mean('after', 'held') / MIB:.3f} | {peak} | {mean('after', 'deferred'):.0f} of {args['steps']} | "
                  + " -> ".join(f"{mean(m, 'pool') / s:.2f}" for m in MODES) + " | "
                  + " -> ".join(f"{over[m] * 100:+.0f} %" for m in MODES) + " |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
