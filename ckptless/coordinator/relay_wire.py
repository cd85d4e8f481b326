"""The node-local control relay's frames: one watch event or one write per frame, no pickle.

Why a wire format of its own: the relay (``coordinator/relay_server.py``) sends
a node's workers what its agent's etcd watch sees under ``job/``, and takes
their writes to etcd (reports, ready marks) to its agent; both sides parse it.
A frame is a fixed header (kind, key length, value length, a number: the
event's etcd revision, or a write's request id) then the key (UTF-8) and the
value bytes, so nothing but lengths and bytes is ever decoded from the socket.

Kinds from the relay: ``P`` a put, ``D`` a delete, ``S`` the end of the
snapshot a new subscriber gets first (every current key as a put), after
which frames are live events in revision order; ``A`` a write was committed
(the number: its request id; the value: etcd's revision, as decimal digits),
``U`` a write could not reach etcd (retry), ``R`` a write was refused (a key
outside what workers write; the value: why, UTF-8). From a worker: ``W`` put
the value at the key (the number: a request id the answer carries).
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from ckptless.coordinator.client import WatchEvent
from ckptless.errors import CoordinatorError

HEADER = struct.Struct("!cIIQ")  # kind, key bytes, value bytes, mod_revision or request id
MAX_KEY = 4096
MAX_VALUE = 64 * 1024 * 1024  # a membership at 100,000 ranks is ~1 MB; anything near this is corrupt
PUT, DELETE, SNAPSHOT_END = b"P", b"D", b"S"
WRITE, WRITTEN, UNAVAILABLE, REFUSED = b"W", b"A", b"U", b"R"
KINDS = (PUT, DELETE, SNAPSHOT_END, WRITE, WRITTEN, UNAVAILABLE, REFUSED)


class Frame(NamedTuple):
    kind: bytes
    key: str
    value: bytes
    number: int  # an event's mod_revision; a write's (or its answer's) request id

    def event(self) -> WatchEvent:
        """A ``P``/``D`` frame as the watch event it carries."""
        return WatchEvent("put" if self.kind == PUT else "delete", self.key, self.value, self.number, 0)


class RelayClosed(CoordinatorError):
    """The relay's connection ended (the agent stopped or died)."""


def encode(kind: bytes, key: str = "", value: bytes = b"", revision: int = 0) -> bytes:
    k = key.encode()
    return HEADER.pack(kind, len(k), len(value), revision) + k + value


def encode_event(ev: WatchEvent) -> bytes:
    return encode(PUT if ev.kind == "put" else DELETE, ev.key, ev.value, ev.mod_revision)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise RelayClosed("the control relay closed its connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_any(sock: socket.socket) -> Frame:
    """The next frame of any kind. Raises RelayClosed at the end of the stream and CoordinatorError on
    a frame that cannot be one."""
    kind, key_len, value_len, number = HEADER.unpack(_read_exactly(sock, HEADER.size))
    if kind not in KINDS or key_len > MAX_KEY or value_len > MAX_VALUE:
        raise CoordinatorError(f"the control relay sent a malformed frame (kind {kind!r}, key {key_len} bytes, "
                               f"value {value_len} bytes)")
    try:
        key = _read_exactly(sock, key_len).decode() if key_len else ""
    except UnicodeDecodeError as exc:
        raise CoordinatorError("the control relay sent a malformed frame (a key that is not UTF-8)") from exc
    value = _read_exactly(sock, value_len) if value_len else b""
    return Frame(kind, key, value, number)


def read_frame(sock: socket.socket) -> tuple[bytes, WatchEvent | None]:
    """The next frame of a watch stream: (kind, its event; None for the snapshot's end). Raises
    RelayClosed at the end of the stream and CoordinatorError on a frame that cannot be one there."""
    f = read_any(sock)
    if f.kind == SNAPSHOT_END:
        return f.kind, None
    if f.kind not in (PUT, DELETE):
        raise CoordinatorError(f"the control relay sent a {f.kind!r} frame in its snapshot")
    return f.kind, f.event()
