"""The agent's outbox: a record put on one thread while another drains is never lost or crashes."""

from __future__ import annotations

import threading

from ckptless.coordinator.client import EtcdClient
from ckptless.launcher.outbox import Outbox


def test_drain_while_records_are_put_from_another_thread(client: EtcdClient, job_id: str) -> None:
    """The reaper puts exit records while the agent drains before leaving (a race seen in CI:
    drain() joined a thread listed but not yet started). Every record lands in real etcd."""
    stopping = threading.Event()
    box = Outbox(lambda: client, stopping)
    n = 200
    started = threading.Event()

    def reaper() -> None:
        started.set()
        for i in range(n):
            box.put(f"/{job_id}/exit/{i}", f"rank {i}".encode(), f"record {i}")

    t = threading.Thread(target=reaper)
    t.start()
    started.wait(10)
    while t.is_alive():
        box.drain(timeout=5.0)  # must not raise while put() runs
    t.join(10)
    box.drain(timeout=30.0)
    kvs, _ = client.get_prefix(f"/{job_id}/exit/")
    assert len(kvs) == n
