"""The agent's outbox: records that must reach etcd even while it is away, off the reaper thread.

Why a thread per record: the reaper records a worker's exit the moment it is
reaped and must never block on etcd (an outage, a partition). Each record is
put by its own daemon thread, retried for up to ``retry_s``; an exiting agent
drains the outbox (bounded) so its last records land before it leaves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptless.coordinator import EtcdClient
from ckptless.errors import CoordinatorError

log = logging.getLogger("ckptless.agent")

EXIT_RECORD_RETRY_S = 300.0  # an exit record waits this long for etcd to come back
OUTBOX_DRAIN_S = 15.0  # an exiting agent waits this long for its pending exit records


class Outbox:
    def __init__(self, client: Callable[[], EtcdClient | None], stopping: threading.Event,
                 retry_s: float = EXIT_RECORD_RETRY_S) -> None:
        self._client = client
        self._stopping = stopping
        self._retry_s = retry_s
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # put() runs on the reaper thread, drain() on the agent's

    def put(self, key: str, value: bytes | Callable[[], bytes], what: str) -> None:
        """Put with retries while etcd is away (bounded); returns at once (a callable value is
        built on the sending thread)."""
        def run() -> None:
            deadline = time.monotonic() + self._retry_s
            raw = value() if callable(value) else value
            while True:
                try:
                    client = self._client()
                    assert client is not None
                    client.put(key, raw)
                    return
                except CoordinatorError as exc:
                    if self._stopping.is_set():  # shutting down (a private etcd may already be gone)
                        log.info("did not record %s in etcd while stopping: %s", what, exc)
                        return
                    if time.monotonic() >= deadline:
                        log.error("could not record %s in etcd: %s", what, exc)
                        return
                    self._stopping.wait(1.0)
        t = threading.Thread(target=run, name="ckptless-outbox", daemon=True)
        t.start()  # before it is listed: drain() on another thread joins only started threads
        with self._lock:
            self._threads.append(t)

    def delete(self, key: str, what: str) -> None:
        """Delete once (a dead spare's key): a failure is logged, its lease removes the key anyway."""
        try:
            client = self._client()
            assert client is not None
            client.delete(key)
        except CoordinatorError as exc:
            log.warning("could not remove %s from etcd: %s", what, exc)

    def drain(self, timeout: float = OUTBOX_DRAIN_S) -> None:
        """Before leaving: let pending records reach etcd (bounded). Without this, an agent whose
        last worker just finished could exit before its record landed, and the store's host
        would wait for that rank's exit forever."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
