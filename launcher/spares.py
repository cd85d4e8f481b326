"""This node's warm spares as the job sees them: records in etcd, standby ranks, refills owed.

Why a module of its own: the agent offers its spares on its lease (gone with
the node), offers them again after a lease renewal (exactly as first written:
a pre-built spare keeps its standby rank), picks each pre-built spare's
standby rank from what other spares already cover. The refills a
``--spare-refill`` owes are counted by the node machine
(launcher/node_machine.py; launcher/refill.py starts them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from ckptless.coordinator import EtcdClient
from ckptless.coordinator import Keyspace
from ckptless.errors import CoordinatorError
from ckptless.recovery import Worker
from ckptless.recovery import spare_from_json, spare_to_json

log = logging.getLogger("ckptless.agent")


class SparePool:
    def __init__(self, keyspace: Keyspace, node_id: str, client: Callable[[], EtcdClient | None], *,
                 any_rank: bool) -> None:
        self._keyspace = keyspace
        self._node_id = node_id
        self._client = client
        self._any_rank = any_rank
        self._records: dict[str, Worker] = {}  # worker id -> its record, as first written
        self._lock = threading.Lock()

    def key(self, worker_id: str) -> str:
        return f"{self._keyspace.spares_prefix}{worker_id.replace('/', ':')}"

    def standby_ranks(self, world_size: int, n: int, prefer: Iterable[int] = ()) -> list[int]:
        """Ranks for ``n`` new spares to pre-build as: those no other spare covers yet, those in
        ``prefer`` first (ranks whose node is gone: what a spare is about to take), then lowest first."""
        client = self._client()
        if n == 0 or client is None:
            return []
        kvs, _ = client.get_prefix(self._keyspace.spares_prefix)
        covered = set()
        for kv in kvs:
            try:
                w = spare_from_json(kv.value)
            except (ValueError, KeyError, TypeError):
                continue
            if w.standby_rank is not None:
                covered.add(w.standby_rank)
        free = [r for r in range(world_size) if r not in covered] or list(range(world_size))
        first = {r for r in prefer if 0 <= r < world_size}
        free.sort(key=lambda r: (r not in first, r))
        return [free[i % len(free)] for i in range(n)]

    def offer(self, worker_id: str, standby: int | None, lease_id: int) -> None:
        """Put the spare's record on our lease (raises CoordinatorError; the caller decides)."""
        record = Worker(worker_id, self._node_id, standby, standby is not None and self._any_rank)
        with self._lock:
            self._records[worker_id] = record
        client = self._client()
        assert client is not None
        client.put(self.key(worker_id), spare_to_json(record), lease=lease_id)

    def offer_again(self, worker_ids: Iterable[str], lease_id: int) -> None:
        """After a lease renewal: every live spare's record, as first written, on the new lease."""
        client = self._client()
        assert client is not None
        for wid in worker_ids:
            with self._lock:
                record = self._records.get(wid, Worker(wid, self._node_id))
            client.put(self.key(wid), spare_to_json(record), lease=lease_id)

    def offer_quietly(self, worker_id: str, standby: int | None, lease_id: int) -> None:
        """Offer a refilled spare; a failed put waits for the next lease renewal (it re-offers it)."""
        try:
            self.offer(worker_id, standby, lease_id)
        except CoordinatorError as exc:
            log.warning("spare %s is not offered yet: %s", worker_id, exc)
