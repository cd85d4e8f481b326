"""The reference of bench/recovery.py: raw Gloo point-to-point bandwidth, one pair over loopback.

A recovery's floor is detect + reform + S / this bandwidth (the replacement must receive its S
bytes at least once). Why its own module: it is a separate measurement (two spawned processes,
no ckptless, no launcher), made once per run before the recoveries, and only its result (bytes/s
per size) reaches the report.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from typing import Any


def _bw_worker(rank: int, store_path: str, sizes: list[int], reps: int, q: Any) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    out = {}
    for n in sizes:
        buf = torch.ones(n, dtype=torch.uint8)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
            dist.barrier()  # receiver done
            if i:  # first round touches pages
                times.append(time.perf_counter() - t0)
        out[n] = min(times)
        del buf
    if rank == 1:
        q.put(out)
    dist.destroy_process_group()


def raw_bandwidth(sizes: list[int], reps: int = 3) -> dict[int, float]:
    """bytes/s of one Gloo send/recv pair over loopback, best of ``reps`` (per size)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_bw_worker, args=(r, os.path.join(tmp, "store"), sizes, reps, q)) for r in range(2)]
        for p in procs:
            p.start()
        res = q.get(timeout=300)
        for p in procs:
            p.join(60)
    return {n: n / t for n, t in res.items()}
