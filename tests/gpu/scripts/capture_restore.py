"""One GPU, one process: the asynchronous capture and the restore, bitwise, for a plain model, DDP and FSDP2.

Usage: capture_restore.py KIND OUT_JSON, KIND one of plain, ddp, fsdp2, writer.

Every step is captured the way a ckptless worker captures it: ``checksum_now=False``
into a page-locked pool buffer, the fence handed to a stand-in for the mirror
thread (waits for the copies, seals, checksums), the write order installed on
the optimizer. At each capture a synchronous reference copy of the state is
taken too, and each image, once sealed, must equal it byte for byte, unless the
fence called it torn. ``writer``: the script clamps a parameter in place before
its optimizer step (a write the fence must see). Then the state is restored
from a kept image, training continues, and it must retrace the first run bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from datetime import timedelta
from queue import Queue

import torch
import torch.distributed as dist
from torch import nn

from ckptless.state import StateRegistry, host_memory, restore
from ckptless.state.capture import Capturer, StateImage
from ckptless.state.checksum import chunk_checksums
from ckptless.state.fence import WriteOrder

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

        mesh = init_device_mesh("cuda", (1,))
        fully_shard(inner, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, inner, opt


def main() -> None:
    if KIND in ("ddp", "fsdp2"):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=DEV,
                                timeout=timedelta(seconds=60))
    model, inner, opt = build()
    reg = StateRegistry()
    reg.protect(model=inner if KIND != "ddp" else model, optimizer=opt)
    order = WriteOrder()
    order.install(obj for _, obj in reg.items())
    cap = Capturer(reg, "gpu", 0, timeout_s=60)
    nbytes = cap.required_bytes() * 2
    pool = [host_memory.empty(nbytes) for _ in range(2)]
    assert all(host_memory.pinned(b) for b in pool), "pool buffers are not page-locked"
    results: dict[str, object] = {"torn": 0, "clean": 0, "kind": KIND}
    kept: dict[int, StateImage] = {}
    free = [threading.Event(), threading.Event()]
    for e in free:
        e.set()
    todo: Queue[tuple[int, StateImage, torch.Tensor, threading.Event] | None] = Queue()
    problems: list[str] = []

    def mirror_thread() -> None:
        """What the mirror engine does with an asynchronous image: wait, seal, checksum (and here: compare)."""
        while (item := todo.get()) is not None:
            version, img, ref, done = item
            assert img.fence is not None
            img.fence.wait(60, "test")
            torn = img.fence.seal()
            body = img.buffer[: img.manifest.total_bytes]
            if torn is not None:
                results["torn"] = int(results["torn"]) + 1  # type: ignore[call-overload]
            elif not torch.equal(body, ref):
                problems.append(f"image v{version} is not the state it captured, and not called torn")
            else:
                results["clean"] = int(results["clean"]) + 1  # type: ignore[call-overload]
                if version == 4:
                    sums = tuple(chunk_checksums(body, img.manifest.chunk_bytes, img.manifest.total_bytes))
                    kept[4] = StateImage(dataclasses.replace(img.manifest, chunk_checksums=sums), body.clone())
            done.set()

    t = threading.Thread(target=mirror_thread, daemon=True)
    t.start()
    gen = torch.Generator(device=DEV).manual_seed(1)
    xs = [torch.randn(8, 16, 256, device=DEV, generator=gen) for _ in range(12)]
    losses: list[float] = []

    def step(i: int) -> None:
        order.before_step()
        out = model(xs[i])
        loss = out.float().square().mean()
        opt.zero_grad()
        loss.backward()
        if KIND == "writer":
            with torch.no_grad():
                next(inner.parameters()).clamp_(-10, 10)  # a parameter written outside the optimizer's step
        opt.step()
        losses.append(float(loss.detach()))

    for i in range(10):
        step(i)
        b = i % 2
        assert free[b].wait(60), "the stand-in mirror thread never finished an image"
        free[b].clear()
        img = cap.capture(i + 1, 0, out=pool[b], checksum_now=False)
        assert img.fence is not None, "a GPU capture must be asynchronous"
        tree = json.dumps(img.manifest.tree)
        assert '"cuda"' in tree and '"cuda:' not in tree, "an image records the device type, never an index"
        # The reference: the same state captured synchronously (it waits for the GPU) before the next step.
        ref = Capturer(reg, "gpu", 0).capture(i + 1, 0).buffer[: img.manifest.total_bytes].clone()
        order.captured(img.fence)
        todo.put((i + 1, img, ref, free[b]))
    todo.put(None)
    t.join(60)
    assert not problems, problems
    first = list(losses)
    if KIND == "writer":
        results["conservative"] = order.conservative
    else:
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
