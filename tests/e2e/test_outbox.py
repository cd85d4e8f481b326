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


def test_drain_during_a_held_thread_start_never_joins_an_unstarted_thread(
        client: EtcdClient, job_id: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Deterministic form of the race: put()'s thread is held inside start() while drain() runs on
    another thread. Listing a thread before it started (the old order) made drain() raise
    "cannot join thread before it is started"; now it finds nothing to wait for, and the record lands."""
    import ckptless.launcher.outbox as outbox_mod

    in_start, release = threading.Event(), threading.Event()
    real_thread = threading.Thread

    class HeldThread(real_thread):
        def start(self) -> None:
            if self.name == "ckptless-outbox":  # only the outbox's own record threads are held
                in_start.set()
                release.wait(10)
            super().start()

    monkeypatch.setattr(outbox_mod.threading, "Thread", HeldThread)
    box = Outbox(lambda: client, threading.Event())
    errors: list[BaseException] = []

    def put() -> None:
        try:
            box.put(f"/{job_id}/held", b"x", "the held record")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    p = real_thread(target=put)
    p.start()
    assert in_start.wait(10)
    box.drain(timeout=1.0)  # while the record's thread is held in start(): must not raise
    release.set()
    p.join(10)
    box.drain(timeout=30.0)
    assert not errors
    assert client.get(f"/{job_id}/held") is not None
