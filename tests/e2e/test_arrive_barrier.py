"""The formation's arrival barrier on a real TCPStore (``worker/groups.py arrive``, issue 20).

Each rank adds itself once and polls the counter at an interval that grows with W, so the whole
job makes at most ~100,000 store operations per second of formation whatever W is; ``abort()`` and
the deadline end the wait within one interval.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptless.worker import groups
from ckptless.worker.groups import FormationAborted


def test_the_poll_rate_of_the_whole_job_is_bounded() -> None:
    for world in (2, 100, 500, 1000, 10_000, 100_000):
        interval = groups.poll_interval(world)
        assert 0.005 <= interval <= 0.1
        assert world / interval <= max(groups.POLLS_PER_S, 2 / 0.005) * 1.0001 or interval == 0.1
    assert groups.poll_interval(500) == 0.005 and groups.poll_interval(10_000) == 0.1


@pytest.fixture()
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                         timeout=timedelta(seconds=30))


def _client(server: dist.TCPStore, prefix: str) -> dist.Store:
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                                  timeout=timedelta(seconds=30)))


def test_every_rank_leaves_when_the_last_arrives(server: dist.TCPStore) -> None:
    world = 32  # arriving at once: what a generation's formation does
    clients = [_client(server, "job/") for _ in range(world)]
    left: dict[int, float] = {}
    straggler = threading.Event()

    def rank(i: int) -> None:
        if i == world - 1:
            straggler.wait(10)  # the straggler arrives only once the others are waiting
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
    straggler.set()
    for t in threads:
        t.join(20)
    assert sorted(left) == list(range(world)) and all(v >= arrived for v in left.values())
    assert max(left.values()) - arrived < 2  # within a poll interval or so, not a connect back-off


def test_abort_and_deadline_end_the_wait(server: dist.TCPStore) -> None:
    c = _client(server, "job/")
    t0 = time.monotonic()
    with pytest.raises(FormationAborted, match="abandoned: gone"):
        groups.arrive(c, 5, 2, time.monotonic() + 20, abort=lambda: "gone" if time.monotonic() - t0 > 0.2 else None)
    assert time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    with pytest.raises(FormationAborted, match="arrived in time"):
        groups.arrive(c, 6, 2, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 1.5
    assert c.add("still-fine", 1) == 1


def test_a_waiting_rank_backs_off_to_the_slow_interval() -> None:
    for world in (2, 32, 500, 5_000, 10_000, 100_000):
        gen = groups.poll_intervals(world)
        seq = [next(gen) for _ in range(40)]
        assert seq[0] == groups.poll_interval(world)  # a barrier all reach together still ends within 5 ms
        assert all(b >= a for a, b in zip(seq, seq[1:]))
        cap = max(groups.SLOW_POLL_S, groups.poll_interval(world))
        assert seq[-1] == cap and max(seq) == cap
        # the job's rate once every rank waits long: at most 100,000 per second up to W = 10,000
        assert world / cap <= max(groups.POLLS_PER_S, 2 / groups.SLOW_POLL_S) * 1.0001 or cap == 0.1
    # one rank waiting a second (a replacement's setup): ~25 polls, not 200
    gen, waited, polls = groups.poll_intervals(32), 0.0, 0
    while waited < 1.0:
        waited += next(gen)
        polls += 1
    assert polls <= 26
