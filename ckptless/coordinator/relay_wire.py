"""The node-local control relay's frames: one watch event per frame, no pickle.

Why a wire format of its own: the relay (``coordinator/relay_server.py``) sends
a node's workers what its agent's etcd watch sees under ``job/``; the workers
parse it. A frame is a fixed header (kind, key length, value length, the
event's etcd revision) then the key (UTF-8) and the value bytes, so nothing
but lengths and bytes is ever decoded from the socket.

Kinds: ``P`` a put, ``D`` a delete, ``S`` the end of the snapshot a new
subscriber gets first (every current key as a put), after which frames are
live events in revision order.
"""

from __future__ import annotations

import socket
import struct

from ckptless.coordinator.client import WatchEvent
from ckptless.errors import CoordinatorError

HEADER = struct.Struct("!cIIQ")  # kind, key bytes, value bytes, mod_revision
MAX_KEY = 4096
MAX_VALUE = 64 * 1024 * 1024  # a membership at 100,000 ranks is ~1 MB; anything near this is corrupt
PUT, DELETE, SNAPSHOT_END = b"P", b"D", b"S"


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


def read_frame(sock: socket.socket) -> tuple[bytes, WatchEvent | None]:
    """The next frame: (kind, its event; None for the snapshot's end). Raises RelayClosed at the end of
    the stream and CoordinatorError on a frame that cannot be one."""
    kind, key_len, value_len, revision = HEADER.unpack(_read_exactly(sock, HEADER.size))
    if kind not in (PUT, DELETE, SNAPSHOT_END) or key_len > MAX_KEY or value_len > MAX_VALUE:
        raise CoordinatorError(f"the control relay sent a malformed frame (kind {kind!r}, key {key_len} bytes, "
                               f"value {value_len} bytes)")
    try:
        key = _read_exactly(sock, key_len).decode() if key_len else ""
    except UnicodeDecodeError as exc:
        raise CoordinatorError("the control relay sent a malformed frame (a key that is not UTF-8)") from exc
    value = _read_exactly(sock, value_len) if value_len else b""
    if kind == SNAPSHOT_END:
        return kind, None
    return kind, WatchEvent("put" if kind == PUT else "delete", key, value, revision, 0)
