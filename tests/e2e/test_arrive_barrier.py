"""The formation's arrival barrier on a real TCPStore (``worker/groups.py arrive``, issue 20).

Each rank adds itself once and the last one sets ``<key>/all``; the others wait for that key on a
cloned connection, off the calling thread, so ``abort()`` and the deadline still end the wait at once
(O(1) store operations per rank instead of a 5 ms poll of the counter).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptless.worker import groups
from ckptless.worker.groups import FormationAborted


@pytest.fixture()
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                         timeout=timedelta(seconds=30))


def _client(server: dist.TCPStore, prefix: str) -> dist.Store:
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                                  timeout=timedelta(seconds=30)))


def test_every_rank_leaves_when_the_last_arrives(server: dist.TCPStore) -> None:
    world = 4
    clients = [_client(server, "job/") for _ in range(world)]
    left: dict[int, float] = {}
    last_arrival = threading.Event()

    def rank(i: int) -> None:
        if i == world - 1:
            last_arrival.wait(10)  # the straggler arrives only once the others are waiting
        groups.arrive(clients[i], 3, world, time.monotonic() + 20)
        left[i] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while clients[0].add("ckptless/gen3/arrived", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, "a rank left the barrier before the last one arrived"
    arrived = time.monotonic()
    last_arrival.set()
    for t in threads:
        t.join(20)
    assert sorted(left) == list(range(world)) and all(v >= arrived for v in left.values())
    assert clients[0].get("ckptless/gen3/arrived/all") == b"1"


def test_abort_and_deadline_end_the_wait_and_the_store_stays_usable(server: dist.TCPStore) -> None:
    c = _client(server, "job/")
    t0 = time.monotonic()
    with pytest.raises(FormationAborted, match="abandoned: gone"):
        groups.arrive(c, 5, 2, time.monotonic() + 2, abort=lambda: "gone" if time.monotonic() - t0 > 0.2 else None)
    assert time.monotonic() - t0 < 1.5  # at the abort, not at the 2 s deadline
    t0 = time.monotonic()
    with pytest.raises(FormationAborted, match="arrived in time"):
        groups.arrive(c, 6, 2, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5
    assert c.add("still-fine", 1) == 1  # the caller's own connection was never used for the wait
    # The abandoned waits end at their deadline (a process leaving with one inside the store's native wait
    # would abort; a worker's exit guard covers that): let them end before this test does.
    for t in threading.enumerate():
        if t.name.startswith("ckptless-arrive-"):
            t.join(10)
            assert not t.is_alive()
