"""A collective that waits out its whole timeout is typed ``CollectiveTimeout`` where it fails (issue 38).

Why: a replacement and the survivors in different collectives after a resume (a framework's setup) each
wait out Gloo's timeout; the leader ends such a job after two in a row (recovery/give_up.py), which needs
the worker to say that its generation timed out, measured at the process-group boundary, not read from
torch's message. Two real Gloo ranks in one process (threads): rank 1 never enters the all-reduce.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ckptless.errors import CollectiveError, CollectiveTimeout
from ckptless.worker import groups
from ckptless.worker.rebindable import RebindableGroup, new_gloo

TIMEOUT = timedelta(seconds=1)


def _pair() -> list[RebindableGroup]:
    store = dist.HashStore()
    built: dict[int, dist.ProcessGroup] = {}

    def build(rank: int) -> None:
        built[rank] = new_gloo(store, rank, 2, TIMEOUT)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out = []
    for r in (0, 1):
        g = RebindableGroup(r, 2, [0, 1], TIMEOUT)
        g._set_group_name(f"timeout-test-{r}")
        g.install(5, built[r], [built[r]])
        out.append(g)
    return out


def test_a_wait_of_the_whole_timeout_is_a_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    g0, _g1 = _pair()
    monkeypatch.setattr(groups, "groups", lambda: [g0])
    with pytest.raises(CollectiveTimeout):
        g0.allreduce([torch.ones(4)]).wait()  # rank 1 is in no collective: Gloo's timeout
    assert g0.timed_out_generation == 5 and groups.timed_out(5) and not groups.timed_out(6)


def test_a_failure_before_the_timeout_is_not_one() -> None:
    """An abort (or a dead peer's closed socket) ends a wait at once: an ordinary CollectiveError."""
    g = RebindableGroup(0, 2, [0, 1], timedelta(seconds=90))
    assert not g.mark_broken(3, waited_s=0.2) and g.timed_out_generation is None
    assert g.mark_broken(4, waited_s=89.0) and g.timed_out_generation == 4
    assert issubclass(CollectiveTimeout, CollectiveError)
