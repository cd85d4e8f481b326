"""Leader election, like etcd's ``clientv3/concurrency.Election``.

Each contender creates ``election/<lease-hex>`` on its session's lease in a
transaction guarded by ``create_revision == 0``. The contender with the lowest
create revision leads; every other one watches only its predecessor (no herd).
When the leader dies its lease expires, its key is deleted and the next
contender leads within one TTL. ``proclaim`` and ``resign`` are fenced on the
leader key's create revision, so a deposed leader can never overwrite its
successor's value.
"""

from __future__ import annotations

import threading
import time

from ckptless.coordinator.client import Compare, Delete, EtcdClient, KeyValue, Put, WatchEvent
from ckptless.coordinator.session import Session
from ckptless.errors import CoordinatorTimeout, FencingError, NotLeader, SessionExpired


class Election:
    def __init__(self, client: EtcdClient, session: Session, prefix: str) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self._client = client
        self._session = session
        self.prefix = prefix
        self.key = f"{prefix}{session.lease_id:x}"
        self._create_revision: int | None = None

    @property
    def fence(self) -> Compare:
        """A transaction guard that holds only while we are (still) this leader key."""
        if self._create_revision is None:
            raise NotLeader(f"{self.key} has not campaigned")
        return Compare(self.key, "create", "==", self._create_revision)

    def _contenders(self) -> list[KeyValue]:
        kvs, _ = self._client.get_prefix(self.prefix)
        return sorted(kvs, key=lambda kv: kv.create_revision)

    def campaign(self, value: bytes | str, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Block until we lead, ``stop`` is set, or ``timeout_s`` passes (then withdraw and raise).

        The wait is on etcd (a watch on the predecessor's deletion), not a poll: a contender that
        keeps its place costs nothing while it waits. Before, the agents re-campaigned once a second
        (timeout 1 s: a delete and a put of the key), which every watcher of the job received,
        2 (W + 4) events a second with nothing failing (docs/scale.md)."""
        deadline = time.monotonic() + timeout_s
        self._session.check()
        res = self._client.txn(
            [Compare(self.key, "create", "==", 0)],
            [Put(self.key, value, lease=self._session.lease_id)],
        )
        kv = self._client.get(self.key)
        if kv is None:
            raise SessionExpired(f"election key {self.key} vanished right after creation")
        if not res.succeeded:  # we already campaigned (e.g. a retried call): keep our place
            self._client.put(self.key, value, lease=self._session.lease_id)
        self._create_revision = kv.create_revision
        while True:
            contenders = self._contenders()
            mine = [c for c in contenders if c.key == self.key]
            if not mine:
                self._create_revision = None
                raise SessionExpired(f"election key {self.key} was deleted (lease lost)")
            ahead = [c for c in contenders if c.create_revision < self._create_revision]
            if not ahead:
                return
            predecessor = ahead[-1]
            gone = threading.Event()

            def on_events(events: list[WatchEvent], key: str = predecessor.key) -> None:
                if any(e.kind == "delete" and e.key == key for e in events):
                    gone.set()

            watch = self._client.watch_prefix(predecessor.key, on_events, start_revision=predecessor.mod_revision + 1)
            try:
                if self._client.get(predecessor.key) is None:
                    continue
                while not gone.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                    self._session.check()
                    stopped = stop is not None and stop.is_set()
                    if time.monotonic() >= deadline or stopped:
                        self.resign()
                        raise CoordinatorTimeout(f"not elected leader of {self.prefix} "
                                                 f"{'before the stop' if stopped else f'within {timeout_s}s'}")
            finally:
                watch.cancel()

    def is_leader(self) -> bool:
        if self._create_revision is None or self._session.done.is_set():
            return False
        contenders = self._contenders()
        return bool(contenders) and contenders[0].key == self.key and contenders[0].create_revision == self._create_revision

    def proclaim(self, value: bytes | str) -> None:
        """Update the leader's value, fenced on our key's create revision."""
        res = self._client.txn([self.fence], [Put(self.key, value, lease=self._session.lease_id)])
        if not res.succeeded:
            raise FencingError(f"proclaim on {self.key}: no longer the leader")

    def resign(self) -> None:
        """Give up leadership (or our place in the queue); fenced like proclaim."""
        if self._create_revision is None:
            return
        self._client.txn([self.fence], [Delete(self.key)])
        self._create_revision = None

    def leader(self) -> KeyValue | None:
        """The current leader's key and value, or None when nobody campaigns."""
        contenders = self._contenders()
        return contenders[0] if contenders else None
