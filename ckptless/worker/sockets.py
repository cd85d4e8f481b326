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

Cost: one ``/proc/self/fd`` scan before and after each formation (O(open fds),
about 2W + 10 per rank today), one ``shutdown`` per recorded socket per
recovery, nothing per step.
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
_by_generation: dict[int, dict[int, int]] = {}  # generation -> {fd: inode}
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
            with _lock:
                _by_generation.setdefault(generation, {}).update(new)
            _install_fork_hook()


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

    Never raises: a descriptor that is already closed, or not connected, is skipped."""
    with _lock:
        gens = [g for g in _by_generation if g <= up_to_generation]
        todo = [(fd, ino) for g in gens for fd, ino in _by_generation.pop(g).items()]
    done = 0
    for fd, ino in todo:
        if not _matching(fd, ino):
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            with socket.socket(fileno=dup) as s:  # closes only the duplicate
                if _is_connection(s):
                    s.shutdown(socket.SHUT_RDWR)
                    done += 1
        except OSError:
            pass  # never connected, or already ended: nothing to end
    if todo:
        log.debug("shut down %d of %d sockets of generations <= %d", done, len(todo), up_to_generation)
    return done


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


def _close_in_child() -> None:
    """After fork, in the child: drop the copies of every recorded socket (the child never uses them;
    its copy alone would keep the connection open after the parent closes it).

    No lock here: the child has one thread, and a lock another parent thread held at the fork
    would stay held in the child forever."""
    global _lock
    _lock = threading.Lock()
    todo = [(fd, ino) for fds in list(_by_generation.values()) for fd, ino in list(fds.items())]
    _by_generation.clear()
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
