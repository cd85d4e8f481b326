"""The leader driver's publish path against the real etcd: a lost reply, a moved generation, a lost
leadership. The same outcomes the pure machine is tested with (tests/unit/test_leader_machine.py), here
produced by the real transaction and its fences (the contract between the two).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.session import Session
from ckptless.errors import CoordinatorUnavailable
from ckptless.recovery.decision import RecoveryPlan
from ckptless.recovery.leader import RecoveryLeader, write_initial_membership
from ckptless.recovery.leader_machine import (AskGrow, EndJob, Fenced, LeaderConfig, NoteWaiting, OpenIncident, Published,
                                              PublishRejected)
from ckptless.recovery.view import JobStatus
from ckptless.recovery.wire import membership_from_json

from ..harness.leader_sim import World


@pytest.fixture
def leading(client: EtcdClient, job_id: str) -> Iterator[tuple[RecoveryLeader, World, Keyspace]]:
    ks = Keyspace(job_id)
    world = World()
    write_initial_membership(client, ks, world.membership)
    session = Session(client, ttl_s=5, name="n0")
    leader = RecoveryLeader(client, ks, session, "h", 1, LeaderConfig(job_id, replicas=1))
    leader._election.campaign("n0", timeout_s=5)
    world.kill(1)
    world.report_all_alive()
    leader._view = world.view()
    try:
        yield leader, world, ks
    finally:
        session.close()


def _plan(world: World, job_id: str) -> RecoveryPlan:
    from ckptless.recovery.gather import plan_from_view

    d, _ = plan_from_view(world.view(), job_id, frozenset({1}), 1, "ring", None)
    assert isinstance(d, RecoveryPlan)
    return d


def test_publish_writes_generation_and_membership_once(leading: tuple[RecoveryLeader, World, Keyspace],
                                                       client: EtcdClient, job_id: str) -> None:
    leader, world, ks = leading
    ev = leader._publish(_plan(world, job_id), 0)
    assert isinstance(ev, Published) and ev.generation == 1
    kv = client.get(ks.membership)
    assert kv is not None and membership_from_json(kv.value).generation == 1
    again = leader._publish(_plan(world, job_id), 0)
    assert isinstance(again, PublishRejected) and again.still_leader, "the same plan is never published twice"


def test_lost_reply_after_commit_is_recognised_by_its_token(leading: tuple[RecoveryLeader, World, Keyspace],
                                                            client: EtcdClient, job_id: str) -> None:
    leader, world, ks = leading
    real_txn = client.txn
    calls = {"n": 0}

    def txn_that_loses_its_reply(*args: object, **kw: object) -> object:
        calls["n"] += 1
        res = real_txn(*args, **kw)  # type: ignore[arg-type]
        if calls["n"] == 1:
            raise CoordinatorUnavailable("reply lost after the transaction committed")
        return res

    leader._client.txn = txn_that_loses_its_reply  # type: ignore[method-assign]
    ev = leader._publish(_plan(world, job_id), 0)
    assert isinstance(ev, Published) and ev.generation == 1
    gen = client.get(ks.generation)
    assert gen is not None and b'"generation": 1' in gen.value


def test_moved_generation_is_rejected_and_leadership_kept(leading: tuple[RecoveryLeader, World, Keyspace],
                                                          client: EtcdClient, job_id: str) -> None:
    leader, world, ks = leading
    real_txn = client.txn
    raced = {"done": False}

    def txn_after_a_race(*args: object, **kw: object) -> object:
        if not raced["done"]:  # another writer moves the key between our read and our transaction
            raced["done"] = True
            client.put(ks.generation, '{"generation": 1, "reason": "someone else published"}')
        return real_txn(*args, **kw)  # type: ignore[arg-type]

    leader._client.txn = txn_after_a_race  # type: ignore[method-assign]
    ev = leader._publish(_plan(world, job_id), 0)
    assert isinstance(ev, PublishRejected) and ev.still_leader
    kv = client.get(ks.membership)
    assert kv is not None and membership_from_json(kv.value).generation == 0, "our plan was not written"


def test_deposed_leader_cannot_publish(leading: tuple[RecoveryLeader, World, Keyspace], client: EtcdClient,
                                       job_id: str) -> None:
    leader, world, ks = leading
    client.delete(leader._election.key)  # our election key vanished (lease lost while paused)
    ev = leader._publish(_plan(world, job_id), 0)
    assert isinstance(ev, PublishRejected) and not ev.still_leader
    kv = client.get(ks.membership)
    assert kv is not None and membership_from_json(kv.value).generation == 0, "nothing was published"


def test_deposed_leader_writes_no_incident_note_grow_or_end(leading: tuple[RecoveryLeader, World, Keyspace],
                                                           client: EtcdClient) -> None:
    """Issue 35: a leader paused past its lease resumes with its old state before its session notices;
    every write it would make then is fenced out like a publish (was: plain puts, and the job's end a
    create-if-absent: a stale leader could end a job its successor was recovering)."""
    leader, _, ks = leading
    client.delete(leader._election.key)  # our lease lapsed while paused: another agent leads
    for action in (OpenIncident(0, (1,), "stale"), NoteWaiting(0, (1,), 30.0, "stale"), AskGrow(0, (1,)),
                   EndJob(JobStatus("failed", "stale: no replacement within 30s"))):
        ev = leader._execute(action)
        assert isinstance(ev, Fenced), action
    assert client.get(ks.incident(0)) is None and client.get(ks.grow(0)) is None
    assert client.get(ks.status) is None, "the job was not ended by a leader that no longer leads"


def test_the_end_is_written_once_and_a_second_end_keeps_leadership(
        leading: tuple[RecoveryLeader, World, Keyspace], client: EtcdClient) -> None:
    leader, _, ks = leading
    assert leader._execute(EndJob(JobStatus("succeeded", "first"))) is None
    assert leader._execute(EndJob(JobStatus("failed", "second"))) is None, "still the leader: not deposed"
    kv = client.get(ks.status)
    assert kv is not None and JobStatus.from_json(kv.value).reason == "first"
