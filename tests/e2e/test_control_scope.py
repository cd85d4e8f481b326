"""The control plane's O(1) claims, on a real etcd (docs/scale.md, issue 20).

* A worker's watch never sees another rank's report, ready mark, exit record, spare record or node
  key: it covers ``job/`` only (generation, membership, incidents, status), so a worker receives
  O(1) events per incident whatever W is.
* A worker takes each new membership from its watch: it pulls the record's bytes once per incident.
* A contender that waits for leadership costs nothing while it waits: no re-campaign (a delete and a
  put every second, which every watcher of the job received, with nothing failing).
"""

from __future__ import annotations

import json
import threading
import time

from ckptless.coordinator.client import EtcdClient, WatchEvent
from ckptless.coordinator.election import Election
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.session import Session
from ckptless.worker.control import WorkerControl

from ..harness.waiting import wait_until


def test_only_job_keys_are_under_the_job_prefix() -> None:
    ks = Keyspace("j")
    inside = [ks.generation, ks.membership, ks.status, ks.incident(3)]
    outside = [ks.facts(3, 7), ks.ready(3, 7), ks.worker_exit(7), ks.spare_exit("n/spare0"), ks.node("n"),
               f"{ks.spares_prefix}n:spare0", ks.ported, ks.rdzv_state, f"{ks.election_prefix}abc"]
    assert all(k.startswith(ks.job_prefix) for k in inside)
    assert not any(k.startswith(ks.job_prefix) for k in outside), [k for k in outside if k.startswith(ks.job_prefix)]
    assert ks.incident_generation(ks.incident(12)) == 12 and ks.incident_generation(ks.facts(12, 0)) is None


def test_a_workers_watch_never_sees_another_ranks_writes(etcd: EmbeddedEtcd, client: EtcdClient) -> None:
    ks = Keyspace("scope")
    control = WorkerControl(etcd.endpoint, "scope", "n0/w1")
    try:
        for rank in range(8):  # what the other ranks and agents write during an incident
            client.put(ks.facts(0, rank), "{}")
            client.put(ks.ready(1, rank), "{}")
            client.put(ks.worker_exit(rank), "{}")
        client.put(ks.spare_exit("n1/spare0"), "{}")
        client.put(f"{ks.spares_prefix}n1:spare0", "{}")
        client.put(ks.node("n1"), "{}")
        client.put(ks.ported, "n0/w0")
        client.put(ks.incident(0), json.dumps({"lost": [1]}))  # the one this worker acts on
        wait_until(lambda: control.incident(0), 10, "the incident reaching the worker")
        client.put(ks.generation, json.dumps({"generation": 1}))
        wait_until(lambda: control.superseded(0), 10, "the new generation reaching the worker")
        assert control.events_seen == 2, f"the worker's watch delivered {control.events_seen} events, not its 2"
    finally:
        control.close()


def test_a_waiting_contender_makes_no_events(etcd: EmbeddedEtcd, client: EtcdClient) -> None:
    ks = Keyspace("elect")
    seen: list[WatchEvent] = []
    leader_s, waiter_s = Session(client, ttl_s=5, name="a"), Session(client, ttl_s=5, name="b")
    stop = threading.Event()
    try:
        Election(client, leader_s, ks.election_prefix).campaign("a", timeout_s=10)
        waiting = Election(client, waiter_s, ks.election_prefix)
        t = threading.Thread(target=lambda: waiting.campaign("b", timeout_s=float("inf"), stop=stop), daemon=True)
        t.start()
        wait_until(lambda: len(client.get_prefix(ks.election_prefix)[0]) == 2, 10, "the second contender's key")
        watch = client.watch_prefix(ks.election_prefix, seen.extend)
        time.sleep(2.5)  # what is measured is the absence of events over this window (not a synchronisation)
        watch.cancel()
        assert seen == [], f"a waiting contender made {len(seen)} events in 2.5 s"
        leader_s.close()  # the leader goes: the waiter leads, without anyone polling
        t.join(10)
        assert not t.is_alive() and waiting.is_leader()
    finally:
        stop.set()
        for s in (leader_s, waiter_s):
            s.close()


def test_a_new_membership_is_read_once_from_the_watch(etcd: EmbeddedEtcd, client: EtcdClient) -> None:
    """wait_membership takes the record the watch delivered: a worker pulls each membership's bytes
    once per incident, not twice (a get after the event); the record itself is O(nodes)
    (tests/unit/test_roster.py)."""
    from ckptless.recovery.decision import Assignment
    from ckptless.recovery.wire import Membership, membership_to_json

    ks = Keyspace("once")
    ranks = tuple(Assignment(r, f"n{r // 4}/w{r % 4}", f"n{r // 4}", "survivor") for r in range(8))
    client.put(ks.membership, membership_to_json(Membership(0, 8, "h", 1, ranks)))
    control = WorkerControl(etcd.endpoint, "once", "n0/w1")
    reads: list[str] = []
    real_get = control.client.get

    def counting_get(key: str) -> object:
        reads.append(key)
        return real_get(key)

    control.client.get = counting_get  # type: ignore[method-assign]
    try:
        assert control.wait_membership(-1, time.monotonic() + 5) is not None  # the first read, at start
        new = Membership(1, 8, "h", 1, ranks)
        client.put(ks.membership, membership_to_json(new))
        got = control.wait_membership(0, time.monotonic() + 10)
        assert got == new
        assert ks.membership not in reads, f"the membership was read again from etcd: {reads}"
    finally:
        control.close()
