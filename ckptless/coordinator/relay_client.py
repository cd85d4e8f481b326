"""A worker's subscription to its node's control relay (``coordinator/relay_server.py``).

Why: the worker learns incidents, generations, memberships and the job's end
from the agent's one etcd watch instead of a watch of its own (etcd then has
one watcher per node, not per rank). The subscription delivers the relay's
snapshot synchronously (so the caller starts with every current key, as a
first read of etcd would give it) and then each event on a thread of its own.
When the stream ends (the agent stopped or died, or dropped a worker that
did not read), ``on_lost`` is called once: the caller falls back to watching
etcd itself (``ckptless/worker/control.py``).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from ckptless.coordinator.client import WatchEvent
from ckptless.coordinator.relay_wire import read_frame
from ckptless.errors import CoordinatorError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # the snapshot too: a relay that answers nothing in this time is given up


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
        on_events(snapshot)
        self._thread = threading.Thread(target=self._run, name="ckptless-relay-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                _, ev = read_frame(self._sock)
                if ev is not None:
                    self._on_events([ev])
        except (OSError, CoordinatorError) as exc:
            if not self._cancelled.is_set():
                self._on_lost(exc)

    def cancel(self) -> None:
        self._cancelled.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
