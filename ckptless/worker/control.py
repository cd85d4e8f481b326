"""A worker's control-plane handle: report facts, learn the next generation.

Why workers talk to etcd at all: only at the edges of a recovery (never per
step). A survivor reports what it holds (a typed WorkerReport) and waits for
the membership of the next generation; a replacement or spare reads which
rank it takes. A background watch raises a flag when the leader marks an
incident, so a worker that is not blocked in a collective still notices.
"""

from __future__ import annotations

import json
import threading
import time

from ckptless.coordinator.client import EtcdClient, WatchEvent
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.keyspace import Keyspace
from ckptless.errors import RecoveryError, UnrecoverableError
from ckptless.recovery.facts import WorkerReport
from ckptless.recovery.wire import Membership, membership_from_json, report_to_json


class WorkerControl:
    def __init__(self, endpoint: str, job_id: str, worker_id: str) -> None:
        self.keyspace = Keyspace(job_id)
        self.worker_id = worker_id
        self.client = EtcdClient(EtcdConfig(tuple(endpoint.split(","))))
        self._incidents: set[int] = set()
        self._changed = threading.Event()
        self._watch = self.client.watch_prefix(self.keyspace.prefix, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        for e in events:
            if e.key.startswith(self.keyspace.prefix + "incident/g") and e.kind == "put":
                try:
                    self._incidents.add(int(e.key.rsplit("/g", 1)[1]))
                except ValueError:
                    pass
        self._changed.set()

    def incident(self, generation: int) -> bool:
        """True once the leader declared generation ``generation`` failed."""
        return generation in self._incidents

    def membership(self) -> Membership | None:
        kv = self.client.get(self.keyspace.membership)
        return None if kv is None else membership_from_json(kv.value)

    def report(self, generation: int, rank: int, report: WorkerReport) -> None:
        self.client.put(self.keyspace.facts(generation, rank), report_to_json(report))

    def _check_status(self) -> None:
        kv = self.client.get(self.keyspace.status)
        if kv is not None:
            doc = json.loads(kv.value)
            if doc.get("state") == "failed":
                raise UnrecoverableError(f"the job was ended by its coordinator: {doc.get('reason')}")

    def wait_membership(self, timeout_s: float, after: int = -1, need_worker: bool = True) -> Membership:
        """Block until a membership newer than ``after`` (that includes us) exists."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            m = self.membership()
            if m is not None and m.generation > after:
                if not need_worker or m.rank_of(self.worker_id) is not None:
                    return m
                if after >= 0:  # a newer generation without us: we were declared lost
                    raise RecoveryError(f"worker {self.worker_id} is not part of generation {m.generation}")
            self._check_status()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RecoveryError(f"no membership after generation {after} within {timeout_s}s")
            self._changed.wait(min(left, 0.5))

    def close(self) -> None:
        self._watch.cancel()
        self.client.close()
