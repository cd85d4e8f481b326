"""Leave a broken generation from outside the training thread: one way out for every backend.

Why: when a peer dies, what a survivor's blocked collective does depends on
the backend. Gloo raises, but only once the failure reaches it, hop by hop
(5.3 s at 48 ranks, measured) or, where a DataLoader worker holds a copy of
a socket, at the collective timeout. NCCL does not raise at all: the kernel
spins, ``work.wait()`` returns at enqueue, and the training thread blocks at
its next CUDA sync (``loss.item()``) until torch's watchdog aborts the
communicator at the timeout (and, in its default mode, kills the process
with every replica it holds). The training thread cannot get itself out of
either wait, so another thread must: as soon as the generation is known to
be broken, every communicator of it is ended here.

* **When:** the coordinator declared the generation failed (the control
  thread's watch, :mod:`ckptless.worker.control`), or a collective of the
  generation failed in this process (any group, any thread: the DDP reducer's
  future, the user's ``wait()``), which tells peers blocked on *us* at once.
* **How:** the generation's connections get ``shutdown(2)``
  (:mod:`ckptless.worker.sockets`: reaches the peer whatever process holds a
  copy, and wakes this process's own blocked reads), and every backend that
  needs an explicit abort (NCCL: ``ncclCommAbort`` ends the spinning kernel,
  so the blocked sync returns and the next call raises) gets ``abort()``
  (:meth:`~ckptless.worker.rebindable.RebindableGroup.abort`). Gloo's own
  ``abort()`` is never called: it does not close its sockets (measured), and
  its listener must stay open (shutting it down aborted the process).
* **Off the caller's thread:** requests are queued to one daemon thread, so a
  done-callback running on a backend's own thread never aborts that backend
  from inside itself, and the caller returns in microseconds.

The abort never frees anything: the communicators are dropped, as before, by
``groups.release_all`` when the training thread leaves the generation.
"""

from __future__ import annotations

import logging
import queue
import threading

from ckptless.worker import forming, groups, rebindable, sockets

log = logging.getLogger(__name__)

_requests: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
_lock = threading.Lock()
_thread: list[threading.Thread] = []
_aborted: set[int] = set()  # generations aborted in this process
_queued: set[int] = set()  # generations requested and not yet served (one abort each, however many ask)


def abort_now(generation: int, why: str) -> int:
    """End every connection and communicator of ``generation`` in this process; returns how many
    backends were aborted explicitly (NCCL and other non-Gloo backends). Idempotent."""
    with _lock:
        first = generation not in _aborted
        _aborted.add(generation)
    sockets.shutdown(generation)
    n = sum(g.abort(generation) for g in groups.groups())
    n += forming.abort(generation)  # also those still connecting (a formation in progress)
    if first:
        log.info("generation %d aborted (%s): %d backend(s) aborted, connections shut down", generation, why, n)
    return n


def request(generation: int, why: str) -> None:
    """Abort ``generation`` from the aborter thread, as soon as possible (safe from any thread)."""
    with _lock:
        if generation in _aborted or generation in _queued:
            return
        _queued.add(generation)
        if not _thread or not _thread[0].is_alive():
            t = threading.Thread(target=_serve, name="ckptless-aborter", daemon=True)
            _thread[:] = [t]
            t.start()
    _requests.put((generation, why))


def _serve() -> None:
    while True:
        generation, why = _requests.get()
        try:
            abort_now(generation, why)
        except Exception:  # noqa: BLE001 - the leave path releases everything anyway; never kill this thread
            log.warning("aborting generation %d failed", generation, exc_info=True)
        finally:
            with _lock:
                _queued.discard(generation)


def install() -> None:
    """Abort a generation as soon as a collective of it fails in this process."""
    rebindable.on_broken(_collective_failed)


def _collective_failed(generation: int) -> None:
    request(generation, "a collective of it failed")
