# mypy: disable-error-code="attr-defined, call-arg"
# (torch 2.13's stubs, which type-check this project, have no reconfigure API)
"""torch 2.14's experimental reconfigure API on Gloo, on CPU (docs/compatibility.md, "What torch 2.14 offers").

Forms a world-2 default group in the reconfigure regime (``init_process_group(enable_reconfigure=True)``:
no communicator until ``dist._reconfigure``), lets rank 1 exit, then re-forms the survivor's *same* group
object with a fresh process as rank 1 (a new uuid, handles exchanged through the store), and all-reduces
after each. Prints each process's result; needs torch >= 2.14 (the compat venv):

    .venv-compat/bin/python tools/reconfigure_probe.py

Not a test of ckptless: a measured fact about torch, for deciding whether to build on it. It does not
show a survivor blocked in a collective on the dead peer (where a recovery starts from).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta
from typing import Any


def worker(role: str, port: int, results: Any, go: Any) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    # Every member's group over the same store prefix: reconfigure's own keys live beneath it.
    dist.init_process_group("gloo", store=dist.PrefixStore("init/", store), rank=0 if role == "r0" else 1,
                            world_size=2, enable_reconfigure=True, timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    out: dict[str, Any] = {"role": role, "supports_reconfigure": dist._supports_reconfigure()}

    def reconfigure(uuid: int, members: list[str]) -> tuple[float, float]:
        store.set(f"handle/{uuid}/{role}", dist._get_reconfigure_handle())
        handles = [store.get(f"handle/{uuid}/{m}").decode() for m in members]
        t = time.monotonic()
        dist._reconfigure(uuid, handles, timeout=timedelta(seconds=20)).wait()
        took = time.monotonic() - t
        x = torch.ones(1)
        dist.all_reduce(x)
        return round(took, 4), float(x)

    if role in ("r0", "r1"):
        out["generation 1 (s, all_reduce)"] = reconfigure(1, ["r0", "r1"])
    if role == "r0":
        go.wait()  # rank 1 has exited; a fresh process stands in for it
    if role in ("r0", "new"):
        out["generation 2 (s, all_reduce)"] = reconfigure(2, ["r0", "new"])
        out["same group object"] = group is dist.group.WORLD
    results.put(out)
    time.sleep(1)  # let the queue's feeder thread flush before the process ends


def main() -> None:
    import torch
    import torch.distributed as dist

    print(f"torch {torch.__version__}")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    r0 = ctx.Process(target=worker, args=("r0", master.port, results, go))
    r1 = ctx.Process(target=worker, args=("r1", master.port, results, go))
    r0.start()
    r1.start()
    r1.join(60)
    print("rank 1 exited:", r1.exitcode)
    new = ctx.Process(target=worker, args=("new", master.port, results, go))
    new.start()
    go.set()
    for _ in range(3):
        print(results.get(timeout=60))
    r0.join(30)
    new.join(30)
    print("exit codes:", r0.exitcode, new.exitcode)


if __name__ == "__main__":
    main()
