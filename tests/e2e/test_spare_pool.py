"""The agent's SparePool against real etcd: standby ranks, records kept across a lease renewal (the refills
owed are the node machine's: tests/unit/test_node_machine.py).

Found while writing --spare-any-rank: after a lease renewal the agent re-put its spares' records
without their standby rank, so a pre-built spare lost its preference (and its any-rank flag).
"""

from __future__ import annotations

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.keyspace import Keyspace
from ckptless.launcher.spares import SparePool
from ckptless.recovery.wire import spare_from_json


def _records(client: EtcdClient, ks: Keyspace) -> dict[str, tuple[int | None, bool]]:
    kvs, _ = client.get_prefix(ks.spares_prefix)
    return {w.worker_id: (w.standby_rank, w.any_rank) for w in (spare_from_json(kv.value) for kv in kvs)}


def test_records_survive_a_new_lease_as_first_written(client: EtcdClient, job_id: str) -> None:
    ks = Keyspace(job_id)
    pool = SparePool(ks, "n1", lambda: client, any_rank=True)
    assert pool.standby_ranks(4, 2) == [0, 1]
    first = client.grant_lease(5)
    pool.offer("n1/spare0", 0, first)
    pool.offer("n1/spare1", None, first)
    assert pool.standby_ranks(4, 2) == [1, 2], "rank 0 is covered now"
    client.revoke_lease(first)  # the lease is gone (a paused agent): so are its records
    assert _records(client, ks) == {}
    second = client.grant_lease(5)
    pool.offer_again(["n1/spare0", "n1/spare1"], second)
    assert _records(client, ks) == {"n1/spare0": (0, True), "n1/spare1": (None, False)}
