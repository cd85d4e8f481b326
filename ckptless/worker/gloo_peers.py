"""Which peers a lazily connected Gloo group talks to: learnt from the store lookups Gloo makes.

Why: the user's Gloo groups and the mirror group are built lazily
(``TORCH_GLOO_LAZY_INIT``): a pair connects on its first message, so a rank
holds O(log W) connections (ring allreduce and allgather: 2; binomial
broadcast and dissemination barrier: about log2 W; measured at W = 12: 2, 2,
at most 4, 6) instead of Gloo's full mesh of W - 1, and makes O(peers) store
lookups instead of W (W^2 per generation in all). But a connection opened on
the first message opens in the user's step, after the generation's formation,
so the socket recording of :mod:`ckptless.worker.sockets` (the descriptors
that appear *during* the formation) cannot see it, and a failure could not
end it.

Gloo looks each peer up in the store exactly once, just before it connects to
that peer's listener (``tcp::Context::getPair``: ``wait_get("<rank>")``, whose
value is the peer's ``tcp::Rank`` record: hostname, then its device address,
a ``sockaddr``). :class:`PeerRecordingStore` wraps the generation's store,
passes every call through, and notes each peer listener address it hands to
Gloo as the generation's (``sockets.note_peer``). A connection whose far end
is one of those addresses, or whose near end is one of this rank's own
listeners of the generation (recorded while it formed), is the generation's,
whenever it opened; :func:`ckptless.worker.sockets.shutdown` ends them.

A record that does not parse (a future Gloo with another layout) is passed
through unchanged and logged once: the group works, its late connections are
not ended by a failure (they still end when a peer dies or the group is
released), which is what every connection was before recording existed.

Cost: one Python call per store operation Gloo makes (the set of its own
record, one lookup per peer it connects to), nothing per collective.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import struct
import threading
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ckptless.worker import sockets

log = logging.getLogger(__name__)

# Gloo prefixes its keys with a context id: "<id>/<rank>" is a rank's record.
_RANK_KEY = re.compile(rb"^(?:\d+/)?\d+$")
_warned = [False]
_U64 = struct.Struct("<Q")
# The wrappers handed to Gloo, by generation. Gloo holds only the C++ half of a Python store: once the
# Python object is collected, its next lookup fails ("pure virtual ... Store::wait"), so each is kept
# until its generation is released (:func:`forget`), and no longer: it holds the generation's store
# client, a connection of its own.
_alive: dict[int, list["PeerRecordingStore"]] = {}
_alive_lock = threading.Lock()


def parse_rank_record(value: bytes) -> tuple[str, int] | None:
    """The listener address (ip, port) in Gloo's ``tcp::Rank`` record, or None if it does not parse.

    Layout (``gloo/transport/tcp/context.cc``, ``Rank::bytes``): u64 hostname length, hostname,
    u64 address length, address (``tcp::Address``: a ``sockaddr_storage`` then a sequence number),
    then optional u64 pair identifiers. The ``sockaddr`` is the kernel's: family in host order,
    port in network order."""
    try:
        (host_len,) = _U64.unpack_from(value, 0)
        off = _U64.size + host_len
        (addr_len,) = _U64.unpack_from(value, off)
        addr = value[off + _U64.size: off + _U64.size + addr_len]
        if len(addr) != addr_len or addr_len < 8:
            return None
        family = struct.unpack_from("=H", addr, 0)[0]
        (port,) = struct.unpack_from("!H", addr, 2)
        if family == socket.AF_INET:
            return socket.inet_ntop(socket.AF_INET, addr[4:8]), port
        if family == socket.AF_INET6 and addr_len >= 24:
            return normalise(socket.inet_ntop(socket.AF_INET6, addr[8:24])), port
    except (struct.error, ValueError, OSError):
        return None
    return None


def normalise(ip: str) -> str:
    """An IPv4-mapped IPv6 address as its IPv4 form (a v6 socket's peer may show either)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def forget(upto: int) -> None:
    """Let the wrappers of generations up to ``upto`` go (their groups were released)."""
    with _alive_lock:
        for g in [g for g in _alive if g <= upto]:
            del _alive[g]


def _key_bytes(key: Any) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def collective_peers(rank: int, size: int) -> list[int]:
    """The ranks Gloo's barrier, broadcast from rank 0 and allreduce on a small tensor talk to from ``rank``.

    Measured on torch 2.13's Gloo by the peers each rank looks up (W = 8 and 12, ``tests/unit/test_gloo_peers.py``
    holds the tables): the dissemination barrier pairs ``rank`` with ``rank +- 2^k`` (mod W); the binomial
    broadcast tree from 0 with ``rank - 2^(bits(rank) - 1)`` (its parent) and ``rank + 2^j`` for every
    ``2^j`` above its highest bit (its children); the allreduce with its ring neighbours ``rank +- 1``, also
    for a 4 MiB tensor. Symmetric: j is in i's list iff i is in j's. About 2 log2 W + 1 ranks."""
    peers: set[int] = set()
    step = 1
    while step < size:
        peers.update(((rank + step) % size, (rank - step) % size))
        step *= 2
    if rank > 0:
        peers.add(rank - (1 << (rank.bit_length() - 1)))
    step = 1 << rank.bit_length() if rank > 0 else 1
    while rank + step < size:
        peers.add(rank + step)
        step *= 2
    peers.discard(rank)
    return sorted(peers)


#: The tag of the formation's one message each way between a user group's collective peers (a fresh
#: communicator of the generation: nothing of the user's is in flight on it yet).
_HELLO_TAG = 0x7FF00010


def connect_collective_peers(pg: Any, rank: int, size: int) -> None:
    """Connect the pairs of a lazy ``ProcessGroupGloo`` that its barrier, broadcast from 0 and allreduce
    will use (collective).

    One message each way with each of :func:`collective_peers`, all posted at once: one round trip. Until
    issue 35 the formation ran those three collectives on one element instead; the ring alone is
    2 (W - 1) hops one after another (0.1-0.2 s of every recovery at W = 32 on this machine's two
    cores), and the first step's allreduce pays them again. Each wait is bounded by the group's
    timeout; the formation's deadline aborts it sooner (it runs on the formation's thread)."""
    peers = collective_peers(rank, size)
    if not peers:
        return
    out = torch.zeros(1)
    ins = [torch.zeros(1) for _ in peers]
    works = [pg.recv([t], p, _HELLO_TAG) for t, p in zip(ins, peers)]
    works += [pg.send([out], p, _HELLO_TAG) for p in peers]
    for w in works:
        w.wait()


class PeerRecordingStore(dist.Store):
    """``inner`` unchanged, except that every Gloo rank record read through it is noted as one of
    ``generation``'s peer listeners (see the module doc), and that the records of ``expect`` (the peers
    the caller is about to connect) are fetched together.

    Why together: Gloo looks its peers up one after another, each under its context's lock and each
    two store round trips (``wait``, then ``get``), so a rank connecting to P peers waits 2P round trips
    in a row. At W = 32 on this machine's two cores (P = 11 for a user group) that was 0.06-0.19 s of
    every recovery's formation while the ranks' own CPU in it was ~4 ms (issue 35). On Gloo's first
    lookup of a rank record under a key prefix, every expected peer's record under that prefix is
    fetched at once (``wait`` on all of them, then one ``multi_get``: 2 round trips), and the later
    lookups are answered from them. Gloo's own timeout bounds the wait, as it bounded each lookup.
    A lookup outside ``expect`` (a pair connected on its first message) goes to the store as before."""

    def __init__(self, inner: dist.Store, generation: int, expect: Sequence[int] = ()) -> None:
        super().__init__()
        self.inner = inner
        self.generation = generation
        self._expect = sorted(set(expect))
        self._fetched: dict[bytes, bytes] = {}  # the expected peers' records, by Gloo's key
        self._prefixes: set[bytes] = set()  # the key prefixes already fetched
        self._lock = threading.Lock()
        with _alive_lock:
            _alive.setdefault(generation, []).append(self)

    def get(self, key: str) -> bytes:
        value = self._fetched.get(_key_bytes(key))
        if value is None:
            value = bytes(self.inner.get(key))
        if _RANK_KEY.match(_key_bytes(key)):
            endpoint = parse_rank_record(bytes(value))
            if endpoint is not None:
                sockets.note_peer(self.generation, endpoint)
            elif not _warned[0]:
                _warned[0] = True
                log.warning("a Gloo rank record (key %r, %d bytes) did not parse: connections opened after "
                            "formation will not be ended by a failure", key, len(value))
        return value

    def _fetch_expected(self, key: bytes, timeout: timedelta | None) -> None:
        """Fetch the records of every expected peer under ``key``'s prefix, once per prefix."""
        prefix = key[: key.rfind(b"/") + 1]
        with self._lock:
            if prefix in self._prefixes:
                return
            keys = [prefix + str(p).encode() for p in self._expect]
            if key not in keys:
                keys.append(key)
            names = [k.decode() for k in keys]
            if timeout is None:
                self.inner.wait(names)
            else:
                self.inner.wait(names, timeout)
            multi_get = getattr(self.inner, "multi_get", None)
            values = multi_get(names) if multi_get is not None else [self.inner.get(n) for n in names]
            self._fetched.update(zip(keys, (bytes(v) for v in values)))
            self._prefixes.add(prefix)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wanted = [_key_bytes(k) for k in keys]
        if self._expect and len(wanted) == 1 and _RANK_KEY.match(wanted[0]):
            self._fetch_expected(wanted[0], timeout)
        if all(k in self._fetched for k in wanted):
            return
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
