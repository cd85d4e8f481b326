"""A lazy Gloo group's peer lookups, fetched together (``gloo_peers.PeerRecordingStore(expect=...)``, issue 35).

Gloo looks each peer up with a ``wait`` then a ``get``, one peer after another under its context's
lock: 2P store round trips in a row for P peers. The wrapper answers them from one ``wait`` on every
expected peer's record and one ``multi_get``. Guarded here: the values and the recording are what
the store holds; a key outside the expected peers, or under another prefix (another device), goes
to the store as before; a record that never comes fails at Gloo's timeout as a lookup did; and on
real Gloo (threads, one TCPStore) a rank of a lazy group makes 3 store operations, not 2P + 1.
"""

from __future__ import annotations

import socket
import struct
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptless.worker import gloo_peers, sockets
from ckptless.worker.rebindable import new_user_gloo


class Counting(dist.Store):
    """``inner``, counting the operations that reach it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.ops: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.ops.append("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.ops.append("get")
        return bytes(self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops.append("multi_get")
        return [bytes(v) for v in self.inner.multi_get(keys)]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.ops.append("wait")
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        self.ops.append("add")
        return int(self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))


def _record(port: int) -> bytes:
    """A Gloo ``tcp::Rank`` record for 127.0.0.1:``port`` (the layout parse_rank_record reads)."""
    host = b"localhost"
    addr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton("127.0.0.1") + bytes(8)
    addr += struct.pack("<Q", 0)  # tcp::Address's sequence number
    return struct.pack("<Q", len(host)) + host + struct.pack("<Q", len(addr)) + addr


def _gloo_lookup(store: dist.Store, key: str) -> bytes:
    store.wait([key], timedelta(seconds=5))  # what Gloo's wait_get does, per peer
    return bytes(store.get(key))


def test_the_expected_peers_are_fetched_with_one_wait_and_one_multi_get() -> None:
    inner = Counting(dist.HashStore())
    for p in (1, 3, 5, 6):
        inner.inner.set(f"0/{p}", _record(40_000 + p))
    rec = gloo_peers.PeerRecordingStore(inner, generation=901, expect=[3, 5, 1])
    try:
        got = {p: _gloo_lookup(rec, f"0/{p}") for p in (1, 3, 5)}
        assert got == {p: _record(40_000 + p) for p in (1, 3, 5)}
        assert inner.ops == ["wait", "multi_get"]
        # Recorded as the generation's peer listeners, as a lookup one by one recorded them.
        assert {("127.0.0.1", 40_001), ("127.0.0.1", 40_003), ("127.0.0.1", 40_005)} <= sockets._peer_listeners[901]
        # A pair outside the expected peers (connected on its first message) goes to the store.
        assert _gloo_lookup(rec, "0/6") == _record(40_006)
        assert inner.ops[2:] == ["wait", "get"]
    finally:
        gloo_peers.forget(901)
        sockets._peer_listeners.pop(901, None)


def test_each_key_prefix_is_fetched_once_and_other_keys_pass_through() -> None:
    inner = Counting(dist.HashStore())
    for dev in (0, 1):
        for p in (2, 4):
            inner.inner.set(f"{dev}/{p}", f"d{dev}p{p}".encode())
    inner.inner.set("other", b"x")
    rec = gloo_peers.PeerRecordingStore(inner, generation=902, expect=[2, 4])
    try:
        assert _gloo_lookup(rec, "0/4") == b"d0p4" and _gloo_lookup(rec, "0/2") == b"d0p2"
        assert _gloo_lookup(rec, "1/2") == b"d1p2" and _gloo_lookup(rec, "1/4") == b"d1p4"  # a second device
        assert inner.ops == ["wait", "multi_get", "wait", "multi_get"]
        rec.wait(["other"], timedelta(seconds=1))
        assert rec.get("other") == b"x"
        assert inner.ops[4:] == ["wait", "get"]
    finally:
        gloo_peers.forget(902)


def test_a_record_that_never_comes_fails_at_the_lookup_timeout() -> None:
    inner = dist.HashStore()
    inner.set("0/1", b"r1")
    rec = gloo_peers.PeerRecordingStore(inner, generation=903, expect=[1, 2])  # rank 2 never sets its record
    try:
        with pytest.raises(RuntimeError):
            rec.wait(["0/1"], timedelta(milliseconds=200))
    finally:
        gloo_peers.forget(903)


def test_a_lazy_user_group_makes_three_store_operations_per_rank() -> None:
    world = 6
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=30))
    counted: dict[int, Counting] = {}
    sums: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                   timeout=timedelta(seconds=30))
            counted[r] = Counting(dist.PrefixStore("gen904/pg/0/", client))
            pg = new_user_gloo(counted[r], 904, r, world, timedelta(seconds=30))
            t = torch.ones(3) * (r + 1)
            pg.allreduce([t]).wait()
            sums[r] = float(t[0])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sums == {r: float(sum(range(1, world + 1))) for r in range(world)}
        for r, c in counted.items():
            # its own record, then every collective peer's at once (before: a wait and a get per peer)
            assert c.ops == ["set", "wait", "multi_get"], (r, c.ops, gloo_peers.collective_peers(r, world))
    finally:
        gloo_peers.forget(904)
        sockets._peer_listeners.pop(904, None)
