"""The node's control relay: one etcd watch per node, its workers fed from it (issue 20).

Real etcd, the product's RelayServer fed the way ``launcher/agent.py`` feeds it (a watch of ``job/``
plus one seeding read) and the product's WorkerControl subscribed to it. What is guarded:

* a relayed worker opens no watch of its own: etcd's watcher count does not grow with the workers;
* it starts with what was there (the snapshot) and learns each incident, generation and membership
  from the relay, and nothing outside ``job/``;
* the relay never rolls a key back (a seeding read older than a watched event);
* when the relay ends (the agent stopped or died), every worker watches etcd itself and reads
  ``job/`` once: what was published while no one listened is not missed;
* a subscriber that stops reading is dropped instead of stalling the agent's watch thread.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

from ckptless.coordinator.client import EtcdClient, KeyValue, WatchEvent
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.relay_server import RelayServer
from ckptless.coordinator.relay_wire import encode, read_frame
from ckptless.recovery.decision import Assignment
from ckptless.recovery.wire import Membership, membership_to_json
from ckptless.worker.control import WorkerControl

from ..harness.waiting import wait_until

JOB = "relay"


def _watchers(etcd: EmbeddedEtcd) -> int:
    """etcd's own count of open watchers (its /metrics)."""
    text = urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("etcd_debugging_mvcc_watcher_total "):
            return int(float(line.split()[1]))
    raise AssertionError("etcd reported no etcd_debugging_mvcc_watcher_total")


def _membership(generation: int) -> Membership:
    ranks = tuple(Assignment(r, f"n{r // 4}/w{r % 4}", f"n{r // 4}", "survivor") for r in range(8))
    return Membership(generation, 8, "h", 1, ranks)


def _agent_relay(client: EtcdClient, ks: Keyspace) -> tuple[RelayServer, object]:
    relay = RelayServer()
    watch = client.watch_prefix(ks.job_prefix, relay.on_events)
    relay.seed(client.get_prefix(ks.job_prefix)[0])
    return relay, watch


def test_relayed_workers_learn_everything_without_watches_of_their_own(etcd: EmbeddedEtcd,
                                                                       client: EtcdClient) -> None:
    ks = Keyspace(JOB)
    client.put(ks.generation, json.dumps({"generation": 0}))
    client.put(ks.membership, membership_to_json(_membership(0)))
    relay, watch = _agent_relay(client, ks)
    base = _watchers(etcd)
    workers = [WorkerControl(etcd.endpoint, JOB, f"n0/w{i}", relay_path=relay.path) for i in range(4)]
    try:
        assert all(w.relayed for w in workers)
        assert _watchers(etcd) == base, "a relayed worker opened a watch of its own"
        for w in workers:  # the snapshot: what was published before it started
            assert w.wait_membership(-1, time.monotonic() + 5) == _membership(0)
        for rank in range(8):  # other ranks' writes: never relayed (the agent watches job/ only)
            client.put(ks.facts(0, rank), "{}")
        client.put(ks.incident(0), json.dumps({"lost": [1]}))
        wait_until(lambda: all(w.incident(0) for w in workers), 10, "the incident reaching every worker")
        client.put(ks.generation, json.dumps({"generation": 1}))
        client.put(ks.membership, membership_to_json(_membership(1)))
        for w in workers:
            assert w.wait_membership(0, time.monotonic() + 10) == _membership(1)
            assert w.events_seen == 5, f"{w.worker_id} saw {w.events_seen} events (snapshot 2 + 3 relayed)"
    finally:
        for w in workers:
            w.close()
        watch.cancel()  # type: ignore[attr-defined]
        relay.close()


def test_a_lost_relay_falls_back_to_etcd_and_misses_nothing(etcd: EmbeddedEtcd, client: EtcdClient) -> None:
    ks = Keyspace(JOB)
    client.put(ks.membership, membership_to_json(_membership(0)))
    relay, watch = _agent_relay(client, ks)
    w = WorkerControl(etcd.endpoint, JOB, "n0/w1", relay_path=relay.path)
    try:
        assert w.relayed
        watch.cancel()  # type: ignore[attr-defined]  # the agent stops listening first...
        client.put(ks.incident(0), json.dumps({"lost": [2]}))  # ...so these reach no relay
        client.put(ks.membership, membership_to_json(_membership(1)))
        relay.close()  # the agent is gone
        wait_until(lambda: not w.relayed, 10, "the worker noticing the relay's end")
        wait_until(lambda: w.incident(0), 10, "the incident published while no one listened")
        assert w.wait_membership(0, time.monotonic() + 10) == _membership(1)
        client.put(ks.membership, membership_to_json(_membership(2)))  # and its own watch works
        assert w.wait_membership(1, time.monotonic() + 10) == _membership(2)
    finally:
        w.close()
        relay.close()


def test_no_relay_at_start_means_a_watch_of_its_own(etcd: EmbeddedEtcd, client: EtcdClient) -> None:
    ks = Keyspace(JOB)
    client.put(ks.membership, membership_to_json(_membership(0)))
    w = WorkerControl(etcd.endpoint, JOB, "n0/w1", relay_path="/nonexistent/ckptless-relay")
    try:
        assert not w.relayed
        assert w.wait_membership(-1, time.monotonic() + 5) == _membership(0)
    finally:
        w.close()


def test_the_relay_never_rolls_a_key_back_and_drops_a_stuck_subscriber() -> None:
    relay = RelayServer()
    try:
        relay.on_events([WatchEvent("put", "job/membership", b"new", 10, 1)])
        relay.seed([KeyValue("job/membership", b"old", 1, 5, 1, 0)])  # a read older than the event
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(relay.path)
        kind, ev = read_frame(s)
        assert ev is not None and ev.value == b"new" and ev.mod_revision == 10
        assert read_frame(s) == (b"S", None)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # ...and it never reads again
        wait_until(lambda: relay.subscribers == 1, 5, "the subscriber registered")
        big = b"x" * (1 << 20)
        t0 = time.monotonic()
        for rev in range(11, 15):  # more than any socket buffer holds
            relay.on_events([WatchEvent("put", "job/membership", big, rev, 1)])
        assert relay.subscribers == 0, "a subscriber that does not read was kept"
        assert time.monotonic() - t0 < 10, "the stuck subscriber stalled the watch thread past its timeout"
        s.close()
    finally:
        relay.close()


def test_a_malformed_frame_is_refused() -> None:
    import pytest

    from ckptless.errors import CoordinatorError

    a, b = socket.socketpair()
    try:
        a.sendall(encode(b"X", "job/k", b"v", 1))
        with pytest.raises(CoordinatorError, match="malformed"):
            read_frame(b)
    finally:
        a.close()
        b.close()
