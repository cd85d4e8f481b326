"""`ckptless status` against a real etcd: the keys the agents and the leader write, with their own encoders."""

from __future__ import annotations

import json
import time

import pytest

from ckptless.cli import main
from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import NodeInfo
from ckptless.recovery.decision import Assignment
from ckptless.recovery.facts import Worker, WorkerReport
from ckptless.recovery.wire import Membership, membership_to_json, report_to_json, spare_to_json


def write_job(client: EtcdClient, ks: Keyspace) -> None:
    """Generation 1 after rank 1 was lost and a spare took it; one spare left; two agents alive."""
    lease = client.grant_lease(30)
    for node, port in (("n0", 29500), ("n1", 29501)):
        client.put(ks.node(node), json.dumps(NodeInfo(node, "127.0.0.1", 2, port).to_json()), lease=lease)
    client.put(f"{ks.election_prefix}{lease:x}", "agent n0", lease=lease)   # first contender: the leader
    lease2 = client.grant_lease(30)
    client.put(f"{ks.election_prefix}{lease2:x}", "agent n1", lease=lease2)
    ranks = (Assignment(0, "n0/w0", "n0", "survivor"), Assignment(1, "n1/spare0", "n1", "spare"),
             Assignment(2, "n1/w0", "n1", "survivor"), Assignment(3, "n1/w1", "n1", "survivor"))
    client.put(ks.membership, membership_to_json(Membership(1, 4, "127.0.0.1", 29500, ranks)))
    client.put(ks.generation, json.dumps({"generation": 1, "reason": "rank 1 lost", "token": "t"}))
    w = Worker("n1/spare1", "n1")
    client.put(f"{ks.spares_prefix}{w.worker_id.replace('/', ':')}", spare_to_json(w), lease=lease)
    client.put(ks.incident(0), json.dumps({"lost": [1], "reason": "exit", "t": time.time()}))
    for rank, committed in ((0, 10), (2, 10), (3, 11)):
        client.put(ks.facts(0, rank), report_to_json(WorkerReport(f"w{rank}", 12, committed,
                                                                  frozenset({committed, 12}), ())))


def test_status_json_and_text(etcd: EmbeddedEtcd, client: EtcdClient, job_id: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    ks = Keyspace(job_id)
    write_job(client, ks)
    before = client.revision()
    assert main(["status", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", job_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["generation"] == 1 and doc["state"] == "running" and doc["world_size"] == 4
    assert [(m["rank"], m["worker_id"], m["source"]) for m in doc["members"]][:2] == [
        (0, "n0/w0", "survivor"), (1, "n1/spare0", "spare")]
    assert doc["spares"] == [{"worker_id": "n1/spare1", "node_id": "n1"}]
    assert doc["leader"] == "agent n0" and doc["election_contenders"] == 2
    assert [n["node_id"] for n in doc["nodes"]] == ["n0", "n1"]
    assert doc["incidents"] == [{"generation": 0, "lost": "1"}]
    assert doc["committed_step"] is None and "10 when generation 0 failed" in doc["committed_note"]
    assert main(["status", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", job_id]) == 0
    out = capsys.readouterr().out
    for needle in ("state running", "generation 1", "leader agent n0", "committed step unknown", "n1/spare0",
                   "spares (1 free)", "nodes (2 live)", "generation 0 failed (lost 1)"):
        assert needle in out, needle
    assert client.revision() == before  # read-only
    client.put(ks.status, json.dumps({"state": "failed", "reason": "no replica of rank 2", "root_cause": None}))
    assert main(["status", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", job_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "failed" and doc["state_reason"] == "no replica of rank 2"


def test_status_errors_are_one_line(etcd: EmbeddedEtcd, job_id: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", job_id]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no job" in err and job_id in err
    t0 = time.monotonic()
    assert main(["status", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", job_id, "--timeout", "1"]) == 2
    assert time.monotonic() - t0 < 15
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ckptless status: error:")
    assert main(["status", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "bad id!"]) == 2
    assert "rdzv_id" in capsys.readouterr().err
