"""A worker's subscription to its node's control relay (``coordinator/relay_server.py``).

Why: the worker learns incidents, generations, memberships and the job's end
from the agent's one etcd watch instead of a watch of its own (etcd then has
one watcher per node, not per rank). The subscription delivers the relay's
snapshot synchronously (so the caller starts with every current key, as a
first read of etcd would give it) and then each event on a thread of its own.
When the stream ends (the agent stopped or died, or dropped a worker that
did not read), ``on_lost`` is called once: the caller falls back to watching
etcd itself (``ckptless/worker/control.py``).

Writes go the same way (:meth:`RelaySubscription.put`): the agent puts them
in etcd, batched with its other workers' (``coordinator/relay_writer.py``),
and answers each; the answer is read by the subscription's thread.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
from collections.abc import Callable

from ckptless.coordinator.client import WatchEvent
from ckptless.coordinator.relay_wire import (
    DELETE,
    PUT,
    REFUSED,
    UNAVAILABLE,
    WRITE,
    WRITTEN,
    Frame,
    RelayClosed,
    encode,
    read_any,
    read_frame,
)
from ckptless.errors import CoordinatorError, CoordinatorUnavailable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # the snapshot too: a relay that answers nothing in this time is given up
SEND_TIMEOUT_S = 5.0  # a write's frame into a relay whose agent stopped reading


class RelayWriteTimeout(CoordinatorUnavailable):
    """The relay did not answer a write in time (its agent is stopped or busy)."""


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: Frame | None = None
        self.lost: BaseException | None = None


class RelaySubscription:
    def __init__(self, path: str, on_events: Callable[[list[WatchEvent]], None],
                 on_lost: Callable[[BaseException], None]) -> None:
        """Connects and delivers the snapshot before returning; raises OSError or CoordinatorError if
        the relay cannot be reached or sends no complete snapshot within ``CONNECT_TIMEOUT_S``."""
        self._on_events, self._on_lost = on_events, on_lost
        self._cancelled = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(CONNECT_TIMEOUT_S)
            self._sock.connect(path)
            snapshot: list[WatchEvent] = []
            while True:
                _, ev = read_frame(self._sock)
                if ev is None:
                    break
                snapshot.append(ev)
        except (OSError, CoordinatorError):
            self._sock.close()
            raise
        self._sock.settimeout(None)  # a stream of events: it waits as long as the job runs (like a watch)
        # ... but a write into it does not: the kernel's send timeout bounds it (blocking mode honours it)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                              struct.pack("ll", int(SEND_TIMEOUT_S), int(SEND_TIMEOUT_S % 1 * 1e6)))
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._lost: BaseException | None = None
        on_events(snapshot)
        self._thread = threading.Thread(target=self._run, name="ckptless-relay-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                f = read_any(self._sock)
                if f.kind in (PUT, DELETE):
                    self._on_events([f.event()])
                elif f.kind in (WRITTEN, UNAVAILABLE, REFUSED):
                    with self._pending_lock:
                        slot = self._pending.pop(f.number, None)
                    if slot is not None:
                        slot.answer = f
                        slot.done.set()
                else:
                    raise CoordinatorError(f"the control relay sent a {f.kind!r} frame mid-stream")
        except (OSError, CoordinatorError) as exc:
            with self._pending_lock:
                self._lost = exc
                waiting, self._pending = list(self._pending.values()), {}
            for slot in waiting:
                slot.lost = exc
                slot.done.set()
            if not self._cancelled.is_set():
                self._on_lost(exc)

    def put(self, key: str, value: bytes, timeout_s: float) -> int:
        """Puts ``value`` at ``key`` through the agent; returns etcd's revision of the commit.

        Raises :class:`RelayClosed` when the relay is gone (write to etcd directly instead),
        :class:`RelayWriteTimeout` when it did not answer within ``timeout_s``,
        :class:`CoordinatorUnavailable` when the agent could not reach etcd (retry), and
        :class:`CoordinatorError` when it refused the key."""
        slot = _Pending()
        with self._pending_lock:
            if self._lost is not None:
                raise RelayClosed(f"the control relay is gone ({self._lost})")
            request = next(self._ids)
            self._pending[request] = slot
        try:
            with self._send_lock:
                self._sock.sendall(encode(WRITE, key, value, request))
        except OSError as exc:  # part of the frame may be out: the stream is unusable from here on
            with self._pending_lock:
                self._pending.pop(request, None)
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # the thread sees the end: on_lost, fall back to etcd
            except OSError:
                pass
            raise RelayClosed(f"the control relay took no write ({exc})") from exc
        if not slot.done.wait(timeout_s):
            with self._pending_lock:
                self._pending.pop(request, None)
            raise RelayWriteTimeout(f"the control relay did not answer a write of {key!r} within {timeout_s:.0f}s")
        if slot.lost is not None:
            raise RelayClosed(f"the control relay ended before it answered ({slot.lost})") from slot.lost
        answer = slot.answer
        assert answer is not None
        if answer.kind == WRITTEN:
            return int(answer.value or b"0")
        why = answer.value.decode(errors="replace")
        if answer.kind == UNAVAILABLE:
            raise CoordinatorUnavailable(f"write of {key!r} through the control relay: {why}")
        raise CoordinatorError(why)

    def cancel(self) -> None:
        self._cancelled.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
