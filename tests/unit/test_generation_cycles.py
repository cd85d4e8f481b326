"""Many generations made, used, aborted and released leak nothing: threads, file descriptors.

Two ranks in one process (a thread each), on real Gloo over loopback, through ckptless's own
path: ``RebindableGroup.build`` (with the NCCL-semantics backend: a lazy communicator connected in
the formation and checked), a collective, the abort of the generation (``abort.abort_now``, which
also shuts its connections down), ``release``. The same cycle with real NCCL runs in ``make test-gpu``
(tests/gpu/scripts/nccl_paths.py, "cycle": GPU memory too).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ckptless import environment
from ckptless.worker import abort, forming, sockets
from ckptless.worker.rebindable import RebindableGroup

from ..harness import nccl_like  # noqa: F401 - registers the backend


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("backend", ["nccl_like", "gloo"])
def test_make_use_abort_release_many_generations_leaks_nothing(monkeypatch: pytest.MonkeyPatch,
                                                               backend: str) -> None:
    monkeypatch.setattr(environment, "_current", environment.ProcessEnv(cpu_backend=backend))
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    stores = [master, dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=timedelta(seconds=20))]
    groups = [RebindableGroup(r, 2, [0, 1], timedelta(seconds=20)) for r in (0, 1)]
    for g in groups:
        g._set_group_name(f"cycle-{backend}")
    samples: dict[int, tuple[int, int]] = {}

    def one(rank: int, generation: int, errors: list[BaseException]) -> None:
        try:
            g = groups[rank]
            with sockets.recording(generation):
                inner, backends = g.build(stores[rank], generation)
            g.install(generation, inner, backends)
            t = torch.ones(4)
            g.allreduce([t]).wait()
            assert float(t[0]) == 2.0
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    for generation in range(1, 13):
        errors: list[BaseException] = []
        threads = [threading.Thread(target=one, args=(r, generation, errors)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        abort.abort_now(generation, "the test's cycle")  # what a failure does: abort, then leave
        for g in groups:
            g.release()
        forming.forget(generation)
        gc.collect()
        if generation in (4, 12):
            deadline = time.monotonic() + 5  # aborts and watchdogs end on threads of their own
            while time.monotonic() < deadline and generation == 12 and _counts()[0] > samples[4][0] + 2:
                time.sleep(0.05)
            samples[generation] = _counts()
    (threads4, fds4), (threads12, fds12) = samples[4], samples[12]
    assert threads12 <= threads4 + 2, samples  # 8 more generations: no thread per generation stays
    assert fds12 <= fds4 + 4, samples  # nor a socket per generation
