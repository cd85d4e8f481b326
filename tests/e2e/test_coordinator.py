"""Coordinator primitives against the real etcd binary and real processes."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ckptless.coordinator.client import Compare, EtcdClient, Get, Put, WatchEvent
from ckptless.coordinator.config import EtcdConfig, parse_endpoint
from ckptless.coordinator.election import Election
from ckptless.coordinator.embedded import EmbeddedEtcd, free_port
from ckptless.coordinator.generation import GenerationCounter
from ckptless.coordinator.session import Session
from ckptless.errors import ConfigError, CoordinatorUnavailable, FencingError

from ..harness.repo import ACTORS, PYTHON, child_env
from ..harness.waiting import wait_json, wait_until

ACTOR = str(ACTORS / "etcd_actor.py")


def _actor(endpoint: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PYTHON, ACTOR, endpoint, *args], env=child_env())


def test_kv_and_txn_roundtrip(client: EtcdClient) -> None:
    rev = client.put("/ckptless/t/a", b"1")
    kv = client.get("/ckptless/t/a")
    assert kv is not None and kv.value == b"1" and kv.mod_revision == rev
    first = client.txn([Compare("/ckptless/t/b", "create", "==", 0)], [Put("/ckptless/t/b", "x")], [Get("/ckptless/t/b")])
    again = client.txn([Compare("/ckptless/t/b", "create", "==", 0)], [Put("/ckptless/t/b", "y")], [Get("/ckptless/t/b")])
    assert first.succeeded and not again.succeeded
    assert again.reads[0][0].value == b"x"
    kvs, _ = client.get_prefix("/ckptless/t/")
    assert [k.key for k in kvs] == ["/ckptless/t/a", "/ckptless/t/b"]
    assert client.delete_prefix("/ckptless/t/") == 2


def test_unreachable_endpoint_is_a_clear_typed_error() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match=f"127.0.0.1:{port}"):
        EtcdClient(EtcdConfig((f"127.0.0.1:{port}",), connect_timeout_s=0.5))
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("endpoints", {"endpoints": ()}),
        ("endpoints", {"endpoints": ("host:notaport",)}),
        ("request_timeout_s", {"endpoints": ("h:1",), "request_timeout_s": 0}),
        ("password", {"endpoints": ("h:1",), "user": "root"}),
        ("cert_key", {"endpoints": ("h:1",), "ca_cert": "ca.pem", "cert_key": "k.pem"}),
    ],
)
def test_bad_config_names_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as err:
        EtcdConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_parse_endpoint_forms() -> None:
    assert parse_endpoint("http://10.0.0.1:2379") == ("10.0.0.1", 2379)
    assert parse_endpoint("example") == ("example", 2379)
    assert parse_endpoint("[::1]:23") == ("::1", 23)


def test_session_close_revokes_and_orphan_expires(client: EtcdClient) -> None:
    s1 = Session(client, ttl_s=1)
    client.put("/ckptless/s/closed", "x", lease=s1.lease_id)
    s1.close()
    assert client.get("/ckptless/s/closed") is None
    s2 = Session(client, ttl_s=1)
    client.put("/ckptless/s/orphan", "x", lease=s2.lease_id)
    s2.orphan()
    start = time.monotonic()
    wait_until(lambda: client.get("/ckptless/s/orphan") is None, 1 + 1.5, "orphaned lease expiry")
    assert time.monotonic() - start <= 1 + 1.0


def test_session_keeps_lease_alive_past_ttl(client: EtcdClient) -> None:
    s = Session(client, ttl_s=1)
    client.put("/ckptless/s/alive", "x", lease=s.lease_id)
    # Wait on etcd's own clock: the lease must outlive three TTLs of keepalives.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert client.get("/ckptless/s/alive") is not None
        threading.Event().wait(0.2)
    s.close()


def test_killed_holder_key_vanishes_within_ttl_and_watcher_sees_it(client: EtcdClient, etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    ttl = 1
    key = "/ckptless/job/nodes/victim"
    deleted: list[float] = []
    seen = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        if any(e.kind == "delete" and e.key == key for e in events):
            deleted.append(time.monotonic())
            seen.set()

    watch = client.watch_prefix("/ckptless/job/nodes/", on_events)
    proc = _actor(etcd.endpoint, "hold", key, str(ttl), str(tmp_path / "ready"))
    try:
        wait_json(tmp_path / "ready", 30)
        assert client.get(key) is not None
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert seen.wait(ttl + 2.0), "watcher never saw the lease key deleted"
        latency = deleted[0] - killed
        print(f"lease key gone {latency:.3f}s after SIGKILL (ttl {ttl}s)")
        assert latency <= ttl + 0.5
    finally:
        proc.kill()
        watch.cancel()


def test_leader_killed_successor_leads_within_ttl(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    ttl = 1
    first = _actor(etcd.endpoint, "campaign", "/ckptless/job/election/", str(ttl), "a", str(tmp_path / "a"))
    try:
        wait_json(tmp_path / "a", 30)
        second = _actor(etcd.endpoint, "campaign", "/ckptless/job/election/", str(ttl), "b", str(tmp_path / "b"))
        try:
            with EtcdClient(EtcdConfig((etcd.endpoint,))) as c:
                wait_until(lambda: len(c.get_prefix("/ckptless/job/election/")[0]) == 2, 30, "second contender")
            assert not (tmp_path / "b").exists()
            killed = time.time()
            first.send_signal(signal.SIGKILL)
            took = wait_json(tmp_path / "b", ttl + 5)["t"] - killed
            print(f"successor led {took:.3f}s after the leader's SIGKILL (ttl {ttl}s)")
            assert took <= ttl + 0.5
        finally:
            second.kill()
    finally:
        first.kill()


def test_election_fencing(client: EtcdClient) -> None:
    s1, s2 = Session(client, ttl_s=2), Session(client, ttl_s=2)
    e1, e2 = Election(client, s1, "/ckptless/j/election"), Election(client, s2, "/ckptless/j/election")
    e1.campaign("one", timeout_s=5)
    assert e1.is_leader()
    got = threading.Event()
    t = threading.Thread(target=lambda: (e2.campaign("two", timeout_s=10), got.set()))
    t.start()
    wait_until(lambda: len(client.get_prefix("/ckptless/j/election/")[0]) == 2, 5, "second contender")
    stale_fence = e1.fence
    e1.resign()
    assert got.wait(5) and e2.is_leader()
    # The deposed leader's fence no longer holds: a fenced bump by it fails.
    counter = GenerationCounter(client, "/ckptless/j/generation")
    with pytest.raises(FencingError):
        counter.bump("stale leader", fence=stale_fence)
    assert counter.bump("leader", fence=e2.fence).generation == 1
    t.join(5)
    s1.close()
    s2.close()


def test_concurrent_generation_bumps_never_skip_or_repeat(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    procs, per = 4, 15
    outs = [tmp_path / f"bump{i}" for i in range(procs)]
    actors = [_actor(etcd.endpoint, "bump", "/ckptless/j/generation", str(per), str(o)) for o in outs]
    try:
        values = [v for o in outs for v in wait_json(o, 60)["values"]]
    finally:
        for a in actors:
            a.kill()
    assert sorted(values) == list(range(1, procs * per + 1))


def test_etcd_restart_client_and_watch_recover(client: EtcdClient, etcd: EmbeddedEtcd) -> None:
    seen: list[WatchEvent] = []
    got = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        seen.extend(events)
        got.set()

    watch = client.watch_prefix("/ckptless/r/", on_events)
    client.put("/ckptless/r/before", "1")
    assert got.wait(5)
    session = Session(client, ttl_s=2)
    client.put("/ckptless/r/leased", "x", lease=session.lease_id)
    etcd.kill()
    got.clear()
    etcd.start()
    client.put("/ckptless/r/after", "2")  # retried across the restart
    wait_until(lambda: any(e.key == "/ckptless/r/after" for e in seen), 10, "watch event after restart")
    keys = [e.key for e in seen]
    assert keys.count("/ckptless/r/before") == 1, "an event was repeated after the watch was re-created"
    assert watch.reconnects >= 1
    # The lease kept alive across the restart: the leased key is still there after 2 TTLs.
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        threading.Event().wait(0.25)
    assert client.get("/ckptless/r/leased") is not None and not session.done.is_set()
    session.close()
    watch.cancel()


def test_embedded_instances_do_not_collide(tmp_path: Path) -> None:
    with EmbeddedEtcd(data_dir=tmp_path / "a") as a, EmbeddedEtcd(data_dir=tmp_path / "b") as b:
        assert {a.client_port, a.peer_port}.isdisjoint({b.client_port, b.peer_port})
        for server in (a, b):
            with EtcdClient(EtcdConfig((server.endpoint,))) as c:
                c.put("/ckptless/x", server.endpoint)
                kv = c.get("/ckptless/x")
                assert kv is not None and kv.value.decode() == server.endpoint
