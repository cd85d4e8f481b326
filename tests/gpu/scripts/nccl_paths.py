"""One GPU, one process: ckptless's NCCL communicators are created, used, aborted and made again.

Usage: nccl_paths.py CASE OUT_JSON, CASE one of:

* ``cycle``: 50 times a world-1 communicator the way a generation forms one
  (:func:`ckptless.worker.nccl.build`: eager, bound to the GPU, non-blocking
  init, checked), an all-reduce, ``abort()``, dropped. Records GPU memory
  (the device's free memory: NCCL's buffers are not torch's), threads and
  file descriptors after 5 and after 50 cycles: nothing may grow.
* ``forming``: a world-2 communicator whose second rank never comes (a peer
  that died during formation): the formation's helper thread is stuck in the
  connect or its check; ``rebindable.abort_forming`` must free it.
* ``hung``: a kernel that spins, as a survivor's all-reduce does when its
  peer died; a thread waits for it in a CUDA sync; the abort path must
  release that thread. With two GPUs: a world-2 communicator whose peer (a
  second process, ``peer`` case, on GPU 1) is SIGKILLed once it has formed,
  then an all-reduce; torch's error handling off (0), so only the abort can
  end it. With one GPU: a receive from oneself, which NCCL 2.28 refuses
  (``ncclInvalidUsage``) instead of spinning: reported as skipped.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckptless.worker import forming, nccl

CASE, OUT = sys.argv[1], sys.argv[2]  # the ``peer`` case: OUT is the store's port
DEV = torch.device("cuda", 1 if CASE == "peer" else 0)
torch.cuda.set_device(DEV)
TIMEOUT = timedelta(seconds=60)


def counts() -> dict[str, int]:
    free, _ = torch.cuda.mem_get_info(DEV)
    return {"gpu_free": int(free), "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "torch_allocated": int(torch.cuda.memory_allocated(DEV))}


def cycle() -> dict[str, Any]:
    store = dist.HashStore()
    samples: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i in range(50):
        b = nccl.build(dist.PrefixStore(f"g{i}/", store), 0, 1, TIMEOUT, f"g{i}", [0], DEV)
        nccl.check_members(b, DEV, 1, f"cycle {i}", 60)
        x = torch.ones(1 << 20, device=DEV)
        b.allreduce([x]).wait()
        torch.cuda.synchronize()
        assert float(x[0]) == 1.0
        b.abort()
        del b, x
        gc.collect()
        torch.cuda.synchronize()
        if i + 1 in (5, 50):
            samples[f"after_{i + 1}"] = counts()
    samples["seconds_per_cycle"] = (time.perf_counter() - t0) / 50
    return samples


def forming() -> dict[str, Any]:
    store = dist.HashStore()
    made: list[Any] = []
    error: list[str] = []

    def created(b: Any) -> None:
        made.append(b)
        forming.add(7, b)

    def form() -> None:
        try:
            b = nccl.build(dist.PrefixStore("w2/", store), 0, 2, TIMEOUT, "w2", [0, 1], DEV,
                           on_created=created)
            nccl.check_members(b, DEV, 2, "the world-2 group", 60)
            error.append("formed without its second rank")
        except Exception as exc:  # noqa: BLE001 - the expected way out
            error.append(f"{type(exc).__name__}: {exc}"[:300])

    th = threading.Thread(target=form, daemon=True)
    th.start()
    th.join(3.0)
    stuck = th.is_alive()
    t0 = time.monotonic()
    aborted = forming.abort(7)
    th.join(30)
    return {"stuck_before_abort": stuck, "aborted": aborted, "released": not th.is_alive(),
            "released_after_s": time.monotonic() - t0, "thread_error": error}


def _aborted_out_of(backend: Any, start: Callable[[], None]) -> dict[str, Any]:
    """``start()`` enqueues a kernel that never ends; a thread then waits in a CUDA sync, as the training
    thread does at its next ``loss.item()``. If it is still there after 3 s, ``backend.abort()`` from this
    thread: whether, and how soon, that released it (``stuck`` False: the kernel did not hang)."""
    outcome: list[str] = []

    def waiter() -> None:
        try:
            start()
            torch.cuda.synchronize()  # the training thread's next sync
            outcome.append("returned")
        except Exception as exc:  # noqa: BLE001 - raised after the abort: the thread is out
            outcome.append(f"raised {type(exc).__name__}: {exc}"[:300])

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    th.join(3.0)
    if not th.is_alive():
        return {"stuck": False, "outcome": outcome}
    t0 = time.monotonic()
    backend.abort()
    th.join(30)
    return {"stuck": True, "released": not th.is_alive(), "released_after_s": time.monotonic() - t0,
            "outcome": outcome}


def hung_with_peer() -> dict[str, Any]:
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # nothing but the abort below may end the kernel
    # wait_for_workers=False: the peer that would connect is started below, once the port is known
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, __file__, "peer", str(store.port)], env=dict(os.environ))
    try:
        b = nccl.build(dist.PrefixStore("p/", store), 0, 2, TIMEOUT, "p", [0, 1], DEV)
        nccl.check_members(b, DEV, 2, "the world-2 group", 60)
        store.wait(["peer_formed"], timedelta(seconds=60))
    finally:
        peer.send_signal(signal.SIGKILL)  # the peer dies with the communicator formed
        peer.wait(30)
    buf = torch.ones(1 << 20, device=DEV)
    r = _aborted_out_of(b, lambda: b.allreduce([buf]).wait())
    if not r["stuck"]:
        return {"failed": f"the all-reduce with a dead peer did not hang: {r['outcome']}"}
    return {**r, "gpus": 2}


def peer() -> None:
    """Rank 1 of ``hung_with_peer``'s communicator, on GPU 1: forms it, says so, and waits to be killed."""
    store = dist.TCPStore("127.0.0.1", int(OUT), 2, False, timeout=timedelta(seconds=60))
    b = nccl.build(dist.PrefixStore("p/", store), 1, 2, TIMEOUT, "p", [0, 1], DEV)
    nccl.check_members(b, DEV, 2, "the world-2 group", 60)
    store.set("peer_formed", "1")
    threading.Event().wait(120)  # a deadline, not a pause: the parent SIGKILLs this process as soon as it reads the key


def hung() -> dict[str, Any]:
    if torch.cuda.device_count() >= 2:
        return hung_with_peer()
    store = dist.HashStore()
    b = nccl.build(dist.PrefixStore("h/", store), 0, 1, TIMEOUT, "h", [0], DEV)
    nccl.check_members(b, DEV, 1, "the world-1 group", 60)
    buf = torch.zeros(16, device=DEV)
    r = _aborted_out_of(b, lambda: b.recv([buf], 0, 0))  # nobody sends: it would spin
    if not r["stuck"]:
        return {"skipped": f"the self-receive did not hang: {r['outcome']}"}
    return r


if __name__ == "__main__":
    if CASE == "peer":
        peer()
        sys.exit(0)
    result = {"cycle": cycle, "forming": forming, "hung": hung}[CASE]()
    with open(OUT, "w") as f:
        json.dump(result, f)
    if CASE == "hung":
        os._exit(0)  # an aborted communicator with a dead peer must not hang the interpreter's teardown
    sys.stdout.flush()
    os._exit(0)  # a thread may still be inside NCCL after a failed case: do not wait for it
