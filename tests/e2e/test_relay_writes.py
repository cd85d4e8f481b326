"""Workers' writes through their node's control relay (issue 20): no etcd connection per worker.

Real etcd, the product's RelayServer with its RelayWriter (as ``launcher/agent.py`` builds them) and
the product's WorkerControl. What is guarded:

* a relayed worker's report, ready mark and ported mark land in etcd under the same keys as before,
  and the worker never connects to etcd itself;
* writes that arrive together go out as one transaction;
* a key outside what workers write is refused, named, and not written;
* a relay that ends, or does not answer, costs no write: the worker puts it itself;
* an agent that cannot reach etcd makes the worker retry (bounded by its outage timeout), not bypass
  the relay.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.relay_client import RelaySubscription
from ckptless.coordinator.relay_server import RelayServer
from ckptless.coordinator.relay_wire import SNAPSHOT_END, encode
from ckptless.coordinator.relay_writer import RelayWriter
from ckptless.errors import CoordinatorError, CoordinatorUnavailable
from ckptless.recovery.facts import WorkerReport
from ckptless.recovery.view import report_record_from_json
from ckptless.worker import control as control_mod
from ckptless.worker.control import WorkerControl

from ..harness.waiting import wait_until

JOB = "relaywrites"


class _GatedClient:
    """The real client, whose first transaction waits for the test (so the next writes queue up);
    ``refuse_batches``: a transaction of more than one put fails as etcd fails a request it refuses."""

    def __init__(self, client: EtcdClient, refuse_batches: bool = False) -> None:
        self.client, self.gate, self.entered, self.txns = client, threading.Event(), threading.Event(), 0
        self.refuse_batches = refuse_batches
        self.sizes: list[int] = []

    def txn(self, compare: Any, success: Any = (), *args: Any, **kwargs: Any) -> Any:
        self.txns += 1
        self.sizes.append(len(success))
        self.entered.set()
        self.gate.wait(10)
        if self.refuse_batches and len(success) > 1:
            raise CoordinatorError("etcd txn failed: INVALID_ARGUMENT: etcdserver: request is too large")
        return self.client.txn(compare, success, *args, **kwargs)


def _queued_behind_a_slow_write(relay: RelayServer, gated: _GatedClient, first: WorkerControl,
                                rest: list[threading.Thread]) -> None:
    """``first`` writes and its transaction waits; ``rest`` start and queue behind it; then it goes."""
    t0 = threading.Thread(target=first.mark_ready, args=(0, 99))
    t0.start()
    assert gated.entered.wait(10), "the first write never reached the writer"
    for t in rest:
        t.start()
    wait_until(lambda: relay._writer is not None and relay._writer._queue.qsize() == len(rest), 10,
               "the other writes queued behind the first")
    gated.gate.set()
    for t in [t0, *rest]:
        t.join(20)


@pytest.fixture
def ks() -> Keyspace:
    return Keyspace(JOB)


@pytest.fixture
def relay(client: EtcdClient, ks: Keyspace) -> Iterator[RelayServer]:
    r = RelayServer(writer=RelayWriter(lambda: client, ks.worker_writes))
    yield r
    r.close()


def test_relayed_writes_land_in_etcd_and_no_worker_connects_to_it(etcd: EmbeddedEtcd, client: EtcdClient,
                                                                  ks: Keyspace, relay: RelayServer) -> None:
    workers = [WorkerControl(etcd.endpoint, JOB, f"n0/w{r}", relay_path=relay.path) for r in range(4)]
    try:
        for r, w in enumerate(workers):
            w.mark_ported()
            w.report(0, r, WorkerReport(w.worker_id, 4, 4, frozenset({4}), ()), "incident")
            w.mark_ready(1, r)
        for r in range(4):
            facts = client.get(ks.facts(0, r))
            assert facts is not None and report_record_from_json(facts.value).report.worker_id == f"n0/w{r}"
            ready = client.get(ks.ready(1, r))
            assert ready is not None and json.loads(ready.value)["worker_id"] == f"n0/w{r}"
        assert client.get(ks.ported) is not None
        assert not any(w.has_own_client for w in workers), "a relayed worker connected to etcd itself"
    finally:
        for w in workers:
            w.close()


@contextmanager
def _gated_node(etcd: EmbeddedEtcd, client: EtcdClient, ks: Keyspace, n: int,
                refuse_batches: bool = False) -> Iterator[tuple[_GatedClient, RelayServer, list[WorkerControl]]]:
    """A node's relay whose writer uses a gated client, and ``n`` relayed workers."""
    gated = _GatedClient(client, refuse_batches)
    relay = RelayServer(writer=RelayWriter(lambda: gated, ks.worker_writes))  # type: ignore[arg-type, return-value]
    workers = [WorkerControl(etcd.endpoint, JOB, f"n0/w{r}", relay_path=relay.path) for r in range(n)]
    try:
        yield gated, relay, workers
    finally:
        gated.gate.set()
        for w in workers:
            w.close()
        relay.close()


def test_writes_that_arrive_together_go_out_as_one_transaction(etcd: EmbeddedEtcd, client: EtcdClient,
                                                               ks: Keyspace) -> None:
    with _gated_node(etcd, client, ks, 6) as (gated, relay, workers):
        _queued_behind_a_slow_write(relay, gated, workers[0],
                                    [threading.Thread(target=w.mark_ready, args=(0, r)) for r, w in enumerate(workers) if r])
        assert gated.sizes == [1, 5], f"transactions of {gated.sizes} puts for 6 writes (1, then one batch of 5)"
        assert len(client.get_prefix(ks.ready_prefix(0))[0]) == 6  # 99 and 1..5


def test_one_key_written_by_many_workers_in_one_batch(etcd: EmbeddedEtcd, client: EtcdClient, ks: Keyspace) -> None:
    """Every worker puts the ported mark at init: etcd refuses a transaction that names a key twice,
    which once failed every worker of a node at its start (a full make test run, 2026-11-27)."""
    errors: list[BaseException] = []

    def ported(w: WorkerControl) -> None:
        try:
            w.mark_ported()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    with _gated_node(etcd, client, ks, 5) as (gated, relay, workers):
        _queued_behind_a_slow_write(relay, gated, workers[0],
                                    [threading.Thread(target=ported, args=(w,)) for w in workers[1:]])
        assert not errors, errors
        assert gated.sizes == [1, 1], f"transactions of {gated.sizes} puts (the 4 same-key writes: one put)"
        kv = client.get(ks.ported)
        assert kv is not None and kv.value.decode().startswith("n0/w")


def test_a_batch_etcd_refuses_is_put_write_by_write(etcd: EmbeddedEtcd, client: EtcdClient, ks: Keyspace) -> None:
    with _gated_node(etcd, client, ks, 4, refuse_batches=True) as (gated, relay, workers):
        _queued_behind_a_slow_write(relay, gated, workers[0],
                                    [threading.Thread(target=w.mark_ready, args=(0, r)) for r, w in enumerate(workers) if r])
        assert len(client.get_prefix(ks.ready_prefix(0))[0]) == 4  # 99 and 1..3
        assert not any(w.has_own_client for w in workers)


def test_a_write_outside_the_workers_keys_is_refused(client: EtcdClient, ks: Keyspace, relay: RelayServer) -> None:
    sub = RelaySubscription(relay.path, lambda evs: None, lambda exc: None)
    try:
        with pytest.raises(CoordinatorError, match="does not write .*job/status"):
            sub.put(ks.status, b'{"state": "failed"}', 10)
        assert client.get(ks.status) is None
        assert sub.put(ks.ready(0, 3), b"{}", 10) > 0  # the subscription still works
    finally:
        sub.cancel()


def test_a_relay_that_ends_costs_no_write(etcd: EmbeddedEtcd, client: EtcdClient, ks: Keyspace,
                                          relay: RelayServer) -> None:
    w = WorkerControl(etcd.endpoint, JOB, "n0/w1", relay_path=relay.path)
    try:
        w.mark_ported()
        assert not w.has_own_client
        relay.close()  # the agent is gone
        w.mark_ready(0, 1)
        assert client.get(ks.ready(0, 1)) is not None
        assert w.has_own_client
    finally:
        w.close()


def test_a_relay_that_does_not_answer_costs_no_write(etcd: EmbeddedEtcd, client: EtcdClient, ks: Keyspace,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped agent: its socket takes the write and never answers; the worker writes it itself."""
    path = str(tmp_path / "silent")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        conn.sendall(encode(SNAPSHOT_END))
        held.append(conn)  # reads nothing, answers nothing

    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setattr(control_mod, "RELAY_WRITE_TIMEOUT_S", 0.5)
    w = WorkerControl(etcd.endpoint, JOB, "n0/w2", relay_path=path)
    try:
        assert w.relayed
        t0 = time.monotonic()
        w.mark_ready(0, 2)
        assert client.get(ks.ready(0, 2)) is not None
        assert time.monotonic() - t0 < 10
    finally:
        w.close()
        for c in held:
            c.close()
        listener.close()


def test_an_agent_without_etcd_makes_its_workers_retry_not_bypass(etcd: EmbeddedEtcd, ks: Keyspace) -> None:
    relay = RelayServer(writer=RelayWriter(lambda: None, ks.worker_writes))
    w = WorkerControl(etcd.endpoint, JOB, "n0/w3", outage_timeout_s=1.0, relay_path=relay.path)
    try:
        with pytest.raises(CoordinatorUnavailable, match="ready mark of generation 0: etcd unreachable"):
            w.mark_ready(0, 3)
        assert not w.has_own_client
    finally:
        w.close()
        relay.close()
