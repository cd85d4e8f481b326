"""The node's control relay: one etcd watch per node, passed on to the node's workers.

Why: a worker needs four facts from the coordinator (which generations have an
open incident, the newest generation, its membership, the job's status), all
under the job's ``job/`` keys, which the node agent already watches to follow
memberships (``launcher/follower.py``). With a watch of its own per worker,
etcd serves W watchers and sends the membership record (O(nodes) bytes) W
times per incident: 79 GB out of etcd per incident at 100,000 ranks
(docs/scale.md). Relayed, etcd serves one watcher per node and sends the
record once per node (L times fewer: 8 per node is 10 GB there); the fan-out
to the node's L workers is local.

How: the agent seeds the relay from one ``get_prefix`` and feeds it every
event of its watch (:meth:`RelayServer.on_events`); the relay keeps the
newest value of every key (by etcd revision, so a late or repeated event
never rolls a key back). A worker that connects gets every key as a put,
then a snapshot marker, then each event as it comes, in revision order, with
no gap: both happen under one lock. A subscriber that does not take its
frames within ``SEND_TIMEOUT_S`` is dropped (its worker falls back to its
own watch: ``ckptless/worker/control.py``), so one stuck worker never stalls
the agent's watch thread.

Where: a Unix socket in a directory only this user can enter (mode 0700),
so no other user of the host can read the job's records or, by binding the
name first, feed workers a false incident. Nothing is unpickled: the frames
are lengths and bytes (``coordinator/relay_wire.py``).

Writes: a worker's report, ready mark and ported mark come the other way,
as ``W`` frames, when the relay has a :class:`RelayWriter`
(``coordinator/relay_writer.py``): the agent puts what its workers sent
together in one etcd transaction and answers each write. A reader thread per
subscriber takes them (L threads per node); it also notices a worker that
exited at once, not at the next event sent to it.

Cost per incident: the agent sends each event once to each of its L
workers over the local socket (the membership: O(nodes) bytes, L times);
etcd sends it once to the agent. The workers' L reports reach etcd as about
one transaction.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import shutil
import socket
import tempfile
import threading

from ckptless.coordinator.client import KeyValue, WatchEvent
from ckptless.coordinator.relay_wire import (
    PUT,
    REFUSED,
    SNAPSHOT_END,
    UNAVAILABLE,
    WRITE,
    WRITTEN,
    RelayClosed,
    encode,
    encode_event,
    read_any,
)
from ckptless.coordinator.relay_writer import Answer, RelayWriter
from ckptless.errors import CoordinatorError

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 2.0


class RelayServer:
    """Serves a node's workers what its agent's watch of ``prefix`` sees (see the module doc)."""

    def __init__(self, directory: str | None = None, writer: RelayWriter | None = None) -> None:
        """``directory``: where the socket lives (created with mode 0700; default a fresh temporary one);
        ``writer``: takes the workers' writes to etcd (None: a write is refused and the worker puts it
        itself)."""
        if directory is None:
            self._dir = tempfile.mkdtemp(prefix="ckptless-relay-")  # mode 0700
        else:
            os.makedirs(directory, mode=0o700, exist_ok=False)
            self._dir = directory
        self.path = os.path.join(self._dir, "s")
        self._writer = writer
        self._state: dict[str, tuple[int, bytes | None]] = {}  # key -> (mod_revision, value; None: deleted)
        self._subscribers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._accept, name="ckptless-relay", daemon=True)
        self._thread.start()

    # --- the agent's side ---------------------------------------------------------------------------
    def seed(self, kvs: list[KeyValue]) -> None:
        """The keys read once before (or while) the watch starts."""
        self.on_events([kv.as_put() for kv in kvs])

    def on_events(self, events: list[WatchEvent]) -> None:
        """Newer events are kept and passed on; an event no newer than what is held is dropped."""
        with self._lock:
            frames = []
            for ev in events:
                held = self._state.get(ev.key)
                if held is not None and held[0] >= ev.mod_revision:
                    continue
                self._state[ev.key] = (ev.mod_revision, ev.value if ev.kind == "put" else None)
                frames.append(encode_event(ev))
            if frames and self._subscribers:
                self._send_all(b"".join(frames))

    def _send_all(self, data: bytes) -> None:
        keep = []
        for s in self._subscribers:
            try:
                s.sendall(data)
                keep.append(s)
            except (BrokenPipeError, ConnectionResetError):  # its worker exited
                _close(s)
            except OSError as exc:  # not reading (the send timed out): its worker watches etcd itself instead
                log.warning("control relay: dropping a subscriber that does not read (%s)", exc)
                _close(s)
        self._subscribers = keep

    # --- the workers' side --------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.settimeout(SEND_TIMEOUT_S)
            with self._lock:
                snapshot = [encode(PUT, k, v, rev) for k, (rev, v) in sorted(self._state.items()) if v is not None]
                try:
                    conn.sendall(b"".join(snapshot) + encode(SNAPSHOT_END))
                except OSError as exc:
                    log.warning("control relay: a subscriber failed during its snapshot (%s)", exc)
                    _close(conn)
                    continue
                self._subscribers.append(conn)
            threading.Thread(target=self._read, args=(conn,), name="ckptless-relay-in", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        """A subscriber's writes; its end (the worker exited) closes it here at once."""
        poller = select.poll()  # not select(): an agent may hold descriptors above FD_SETSIZE
        poller.register(conn, select.POLLIN)
        try:
            while not self._closed.is_set():
                poller.poll()  # no timeout: close() and a failed send shut the socket down, which wakes it
                f = read_any(conn)  # a frame arrives whole (one sendall): the 2 s timeout is ample
                if f.kind != WRITE:
                    raise CoordinatorError(f"a worker sent the control relay a {f.kind!r} frame")
                if self._writer is None:
                    self._answer(conn, f.number, Answer(0, False, "this control relay takes no writes"))
                else:
                    self._writer.submit(f.key, f.value, functools.partial(self._answer, conn, f.number))
        except RelayClosed:
            pass
        except (OSError, CoordinatorError) as exc:
            if not self._closed.is_set():
                log.warning("control relay: closing a subscriber (%s)", exc)
        with self._lock:
            if conn in self._subscribers:
                self._subscribers.remove(conn)
        _close(conn)

    def _answer(self, conn: socket.socket, request: int, a: Answer) -> None:
        if not a.why:
            frame = encode(WRITTEN, "", str(a.revision).encode(), request)
        else:
            frame = encode(UNAVAILABLE if a.unavailable else REFUSED, "", a.why.encode()[:65536], request)
        with self._lock:  # one sender at a time on the socket (the watch thread sends events on it)
            try:
                conn.sendall(frame)
            except OSError:
                pass  # its reader sees the end and closes it

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def close(self) -> None:
        """Stop serving: every subscriber sees the end of its stream (and falls back to its own watch)."""
        self._closed.set()
        if self._writer is not None:
            self._writer.close()
        _close(self._listener)
        with self._lock:
            for s in self._subscribers:
                _close(s)
            self._subscribers = []
        shutil.rmtree(self._dir, ignore_errors=True)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
