"""One GPU, one process: the asynchronous capture and the restore, bitwise, for a plain model, DDP and FSDP2.

Usage: capture_restore.py KIND OUT_JSON, KIND one of plain, ddp, fsdp2, writer, late-writer.

Every step is captured the way a ckptless worker captures it: ``checksum_now=False``
into a page-locked buffer, the fence handed to a stand-in for the mirror thread
(it waits for the copies, seals, and here compares), the write order installed
on the optimizer. At each capture the state's tensors are also cloned on the
compute stream (ordered before the next step, never waiting for the side
stream): each image, once sealed, must equal those clones byte for byte,
unless the fence called it torn. ``writer`` clamps a parameter in place before
every optimizer step (the probe must find it, nothing may tear); ``late-writer``
does so from step 5 on, after the probe, with the stand-in mirror thread slowed
down so that the write comes before the seal (it must be called torn, never
silently wrong). Then (plain, ddp, fsdp2) the state is restored from image v4,
training continues, and it must retrace the first run bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from datetime import timedelta
from queue import Queue

import torch
import torch.distributed as dist
from torch import nn

from ckptless.state import StateRegistry, host_memory, restore
from ckptless.state.capture import Capturer, StateImage
from ckptless.state.checksum import chunk_checksums
from ckptless.state.dtensor import is_dtensor, local_of
from ckptless.state.fence import WriteOrder
from ckptless.state.image import slot
from ckptless.state.manifest import dtype_from_name

KIND, OUT = sys.argv[1], sys.argv[2]
DEV = torch.device("cuda", 0)
torch.cuda.set_device(DEV)
torch.use_deterministic_algorithms(True)


def build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True),
                          nn.LayerNorm(256), nn.Linear(256, 256)).to(DEV)
    model: nn.Module = inner
    if KIND == "ddp":
        model = nn.parallel.DistributedDataParallel(inner, device_ids=[0])
    elif KIND == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(inner, mesh=init_device_mesh("cuda", (1,)))
    return model, inner, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    if KIND in ("ddp", "fsdp2"):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=DEV,
                                timeout=timedelta(seconds=60))
    model, inner, opt = build()
    reg = StateRegistry()
    reg.protect(model=model if KIND == "ddp" else inner, optimizer=opt)
    order = WriteOrder()
    order.install(obj for _, obj in reg.items())
    gen = torch.Generator(device=DEV).manual_seed(1)
    xs = [torch.randn(8, 16, 256, device=DEV, generator=gen) for _ in range(11)]
    losses: list[float] = []

    def step(i: int) -> None:
        order.before_step()
        loss = model(xs[i]).float().square().mean()
        opt.zero_grad()
        loss.backward()
        if KIND == "writer" or (KIND == "late-writer" and i >= 5):
            with torch.no_grad():
                next(inner.parameters()).clamp_(-10, 10)  # a parameter written outside the optimizer's step
        opt.step()
        losses.append(float(loss.detach()))

    step(10)  # warm-up: the AdamW moments exist, so the image has its full size
    losses.clear()
    cap = Capturer(reg, "gpu", 0, timeout_s=60)
    pool = [host_memory.empty(cap.required_bytes()) for _ in range(2)]
    assert all(host_memory.pinned(b) for b in pool), "pool buffers are not page-locked"
    results: dict[str, object] = {"torn": 0, "clean": 0, "kind": KIND}
    kept: dict[int, StateImage] = {}
    free = [threading.Event(), threading.Event()]
    for e in free:
        e.set()
    todo: Queue[tuple[int, StateImage, list[torch.Tensor], threading.Event] | None] = Queue()
    problems: list[str] = []

    def mirror_thread() -> None:
        """What the mirror engine does with an asynchronous image: wait, seal, checksum (here also: compare)."""
        while (item := todo.get()) is not None:
            version, img, ref, done = item
            if KIND == "late-writer":
                time.sleep(0.3)  # a slow round: the next step's write comes before the seal
            assert img.fence is not None
            img.fence.wait(60, "test")
            torn = img.fence.seal()
            body = img.buffer[: img.manifest.total_bytes]
            if torn is not None:
                results["torn"] = int(results["torn"]) + 1  # type: ignore[call-overload]
            else:
                for e, want in zip(img.manifest.tensors, ref):
                    if not torch.equal(slot(body, e, dtype_from_name(e.dtype)), want):
                        problems.append(f"image v{version} is not the state it captured, and not called torn")
                        break
                else:
                    results["clean"] = int(results["clean"]) + 1  # type: ignore[call-overload]
                if version == 4:
                    sums = tuple(chunk_checksums(body, img.manifest.chunk_bytes, img.manifest.total_bytes))
                    kept[4] = StateImage(dataclasses.replace(img.manifest, chunk_checksums=sums), body.clone())
            done.set()

    t = threading.Thread(target=mirror_thread, daemon=True)
    t.start()
    for i in range(10):
        step(i)
        b = i % 2
        assert free[b].wait(60), "the stand-in mirror thread never finished an image"
        free[b].clear()
        img = cap.capture(i + 1, 0, out=pool[b], checksum_now=False)
        assert img.fence is not None, "a GPU capture must be asynchronous"
        tree = json.dumps(img.manifest.tree)
        assert '"cuda"' in tree and '"cuda:' not in tree, "an image records the device type, never an index"
        # The reference: the same tensors cloned on the compute stream, before the next step runs.
        tensors = cap._collect()[1]
        ref = [(local_of(x) if is_dtensor(x) else x).detach().clone() for x in tensors]
        order.captured(img.fence)
        todo.put((i + 1, img, [r.cpu() for r in ref], free[b]))
    todo.put(None)
    t.join(60)
    assert not problems, problems
    first = list(losses)
    results["conservative"] = order.conservative
    if KIND not in ("writer", "late-writer"):
        assert 4 in kept, "image v4 was called torn in a script that writes only in the optimizer's step"
        order.drain(60)
        restore(reg, kept[4])
        losses.clear()
        for i in range(4, 10):
            step(i)
        results["retrace_bitwise"] = losses == first[4:]
    results["losses"] = first
    with open(OUT, "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    main()
