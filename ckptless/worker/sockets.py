"""The sockets of each generation's communicators: shut down when the generation ends, never
inherited by forked children.

Why: a survivor passes a failure on to the ranks behind it by dropping its
groups, which closes their sockets, so peers blocked on it see the connection
end. ``close()`` only drops this process's reference to a socket; while a
forked child (a DataLoader worker, forked after the groups formed) holds a copy,
nothing is sent, the failure stops travelling at the first rank with loader
workers, and the ranks behind it wait out the collective timeout (measured:
kill -> first step 91 s instead of 4 s with ``num_workers=2``). Two measures:

* :func:`shutdown` sends the end of the connection whatever process holds a
  copy (``shutdown(2)`` acts on the socket, not on the descriptor). It runs
  when the generation is left (``groups.release_all``) and as soon as the
  control thread sees the leader declare the generation failed, so a rank
  blocked in a collective with healthy peers is released at once instead of
  hop by hop.
* A fork handler closes every recorded socket in the child, so a child never
  keeps a communicator's connection (or its memory) alive.

Torch exposes no handle on a Gloo (or NCCL bootstrap) socket, so a
generation's sockets are those that appeared while its communicators were
being built (:func:`recording`): the socket descriptors open after the build
that were not open before it, each kept with its inode so a reused descriptor
number is never touched. A socket another thread of this process opened in
that window would be counted too, and shut down when that generation ends;
the store client and the etcd client are opened before any formation starts
and are not. The one formation that runs beside user code is a replacement's
mirror group, formed while its script's setup runs (``transfer ahead``): a
connection the setup opens in those milliseconds (a metrics client) would be
ended at the next failure. Listening sockets are never shut down.

Lazily connected groups (the user's Gloo groups and the mirror group) also
open connections *after* their formation, on a pair's first message. Those
are found by address instead (:mod:`ckptless.worker.gloo_peers`): the
generation's own listeners (recorded while it formed: a connection accepted on
one is the generation's) and the peer listeners Gloo looked up through the
generation's store (a connection to one is the generation's). :func:`shutdown`
and the fork handler end every connection that matches either, whenever it
opened. A user's connection never matches: its ends are neither this rank's
Gloo listener nor a peer's.

Cost: one ``/proc/self/fd`` scan before and after each formation (O(open fds):
O(log W) Gloo connections plus the fixed ones), one scan with a
``getsockname``/``getpeername`` per open socket when a generation ends (and in
a forked child), one ``shutdown`` per matching connection; nothing per step.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_lock = threading.Lock()
_shutdown_lock = threading.Lock()  # one shutdown at a time (see shutdown)
_by_generation: dict[int, dict[int, int]] = {}  # generation -> {fd: inode}
_listener_ports: dict[int, set[int]] = {}  # generation -> this rank's listening ports (its accepted ends)
_peer_listeners: dict[int, set[tuple[str, int]]] = {}  # generation -> peers' listeners (ip, port) dialled
_fork_hook = [False]


def socket_fds() -> dict[int, int]:
    """This process's open socket descriptors: {fd: inode}."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            fd = int(name)
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[fd] = st.st_ino
    return out


@contextmanager
def recording(generation: int) -> Iterator[None]:
    """Record the sockets that appear inside the block as ``generation``'s (also when it raises:
    a half-built communicator's connections belong to the generation too)."""
    before = socket_fds()
    try:
        yield
    finally:
        new = {fd: ino for fd, ino in socket_fds().items() if before.get(fd) != ino}
        if new:
            ports = {port for port in map(_listening_port, new) if port is not None}
            with _lock:
                _by_generation.setdefault(generation, {}).update(new)
                if ports:
                    _listener_ports.setdefault(generation, set()).update(ports)
            _install_fork_hook()


def note_peer(generation: int, endpoint: tuple[str, int]) -> None:
    """A peer's listener (ip, port) that a lazily connected group of ``generation`` dials (or may):
    a connection to it is the generation's (see the module doc)."""
    with _lock:
        _peer_listeners.setdefault(generation, set()).add(endpoint)
    _install_fork_hook()


def _listening_port(fd: int) -> int | None:
    """The TCP port ``fd`` listens on, or None (not a TCP listener)."""
    try:
        with _borrowed(fd) as s:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM \
                    and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return int(s.getsockname()[1])
    except OSError:
        pass
    return None


def _normalise(ip: str) -> str:
    """An IPv4-mapped IPv6 address as its IPv4 form, so both spellings of one peer compare equal."""
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def _late_connections(ports: set[int], peers: set[tuple[str, int]], skip: set[int]) -> dict[int, int]:
    """This process's TCP connections, other than ``skip``, accepted on one of ``ports`` or dialled
    to one of ``peers``: {fd: inode}. O(open sockets) system calls."""
    out: dict[int, int] = {}
    if not ports and not peers:
        return out
    for fd, ino in socket_fds().items():
        if fd in skip:
            continue
        try:
            with _borrowed(fd) as s:
                if not _is_connection(s):
                    continue
                near, far = s.getsockname(), s.getpeername()
                if int(near[1]) in ports or (_normalise(str(far[0])), int(far[1])) in peers:
                    out[fd] = ino
        except OSError:
            continue  # not connected (yet, or any more)
    return out


def _matching(fd: int, inode: int) -> bool:
    """The descriptor still names the socket that was recorded (not a reused number)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_ino == inode


def shutdown(up_to_generation: int) -> int:
    """End the connections of every recorded generation <= ``up_to_generation`` (peers blocked on them
    see the end at once, whatever child holds a copy); forget them. Returns how many were shut down.

    Never raises: a descriptor that is already closed, or not connected, is skipped.

    One shutdown at a time, the system calls included: ``groups.release_all`` calls this before it
    drops the generation's communicators, so it waits here for an abort thread's shutdown of the
    same generation to finish. Dropping a lazily connected Gloo context while another thread was
    still shutting down its sockets aborted the process (measured at W = 32: the device loop
    dispatched an event to a pair the destructor had closed, ``pair.cc:676 state_ <= CONNECTED``)."""
    with _shutdown_lock:
        return _shutdown(up_to_generation)


def _shutdown(up_to_generation: int) -> int:
    with _lock:
        gens = [g for g in _by_generation if g <= up_to_generation]
        recorded_fds = {fd: ino for g in gens for fd, ino in _by_generation.pop(g).items()}
        ports = {p for g in [g for g in _listener_ports if g <= up_to_generation] for p in _listener_ports.pop(g)}
        peers = {e for g in [g for g in _peer_listeners if g <= up_to_generation] for e in _peer_listeners.pop(g)}
    late = _late_connections(ports, {(_normalise(ip), port) for ip, port in peers}, set(recorded_fds))
    todo = list(recorded_fds.items()) + list(late.items())
    done = 0
    for fd, ino in todo:
        if not _matching(fd, ino):
            continue
        try:
            with _borrowed(fd) as s:
                if _is_connection(s):
                    s.shutdown(socket.SHUT_RDWR)
                    done += 1
        except OSError:
            pass  # never connected, or already ended: nothing to end
    if todo:
        log.debug("shut down %d of %d sockets of generations <= %d", done, len(todo), up_to_generation)
    return done


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A socket object on a duplicate of ``fd``: closing it closes only the duplicate. Raises OSError
    if ``fd`` is closed (callers skip it)."""
    with socket.socket(fileno=os.dup(fd)) as s:
        yield s


def _is_connection(s: socket.socket) -> bool:
    """A TCP connection, not a listener: shutting down Gloo's listening socket makes its accept()
    fail inside Gloo's event loop, which terminates the process (measured: SIGABRT,
    'listener.cc:63 accept: Invalid argument')."""
    if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
        return False
    return not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


def recorded(generation: int) -> dict[int, int]:
    """The sockets recorded for ``generation`` (for tests and the scale docs)."""
    with _lock:
        return dict(_by_generation.get(generation, {}))


def connections(generation: int) -> dict[int, int]:
    """Every open connection of ``generation``: recorded at formation or matched by address since
    (for tests and the scale docs): {fd: inode}."""
    with _lock:
        recorded_fds = dict(_by_generation.get(generation, {}))
        ports = set(_listener_ports.get(generation, ()))
        peers = {(_normalise(ip), port) for ip, port in _peer_listeners.get(generation, ())}
    out = _late_connections(ports, peers, set())
    for fd, ino in recorded_fds.items():
        if _matching(fd, ino):
            out.setdefault(fd, ino)
    return {fd: ino for fd, ino in out.items() if _is_connection_fd(fd)}


def _is_connection_fd(fd: int) -> bool:
    try:
        with _borrowed(fd) as s:
            return _is_connection(s)
    except OSError:
        return False


def _close_in_child() -> None:
    """After fork, in the child: drop the copies of every generation's socket, recorded or matched by
    address (the child never uses them; its copy alone would keep the connection open after the
    parent closes it).

    No lock here: the child has one thread, and a lock another parent thread held at the fork
    would stay held in the child forever."""
    global _lock, _shutdown_lock
    _lock = threading.Lock()
    _shutdown_lock = threading.Lock()
    recorded_fds = {fd: ino for fds in list(_by_generation.values()) for fd, ino in list(fds.items())}
    ports = {p for ps in list(_listener_ports.values()) for p in ps}
    peers = {(_normalise(ip), port) for es in list(_peer_listeners.values()) for ip, port in es}
    _by_generation.clear()
    _listener_ports.clear()
    _peer_listeners.clear()
    todo = list(recorded_fds.items()) + list(_late_connections(ports, peers, set(recorded_fds)).items())
    for fd, ino in todo:
        if _matching(fd, ino):
            try:
                os.close(fd)
            except OSError:
                pass


def _install_fork_hook() -> None:
    with _lock:
        if _fork_hook[0]:
            return
        _fork_hook[0] = True
    os.register_at_fork(after_in_child=_close_in_child)
