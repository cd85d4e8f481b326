"""Tear down a left generation's communicators off the training thread, with a bound.

Why: dropping the last reference to a broken communicator runs its
destructor, and the destructors wait. ``ProcessGroupGloo``'s waits for its
queued work and joins its worker threads, which can sit in a collective (or
a lazy pair's connect retries) on a dead peer until the collective timeout:
a survivor's training thread sat 60-70 s in ``RebindableGroup.release`` at
W = 32 and in a node loss at W = 4 (issue 35), and the leader, waiting for
its report, declared the live rank lost and the job unrecoverable.
``ProcessGroupNCCL``'s destructor joins torch's watchdog thread (up to its
loop period after it saw the error) and, where it runs, the heartbeat
monitor (asleep up to ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``). None of that
is on the recovery's path: the survivor's sockets are already shut down and
its NCCL communicators already aborted (:mod:`ckptless.worker.abort`) before
anything is dropped, so its peers are released whether or not the
destructor ever returns.

So a generation's communicators are handed here whole (:func:`drop`) and
released on a thread of their own; the caller returns at once and reports
to the leader. One thread per handed batch, not one reaper thread: a
destructor stuck on one generation must not hold back the next one's.

The bound: at most :data:`MAX_PENDING` batches are being released at a
time. A batch handed while that many are still stuck is kept referenced for
the life of the process instead (leaked on purpose, logged once), so a
process that loses many generations to destructors that never return holds
a bounded number of threads; what it leaks is the communicators' memory
(Gloo: a few MiB of buffers per group; NCCL: the communicator's device
buffers), which a recovery that goes on is worth. At exit,
:mod:`ckptless.worker.exit_guard` ends the process with its exit code if a
release is still running (a destructor inside a native wait must not run at
interpreter finalization).

The cyclic garbage collection that closes a generation's last Gloo contexts
(``Work`` objects in reference cycles keep one alive) runs here too, after
the drop, so it does not land on the training thread either.

Cost: one short-lived thread per left generation and per retired mirror
group; nothing per step; O(1) in W (each rank drops its own communicators:
O(groups) objects, O(log W) connections each).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field

from ckptless.worker import exit_guard

log = logging.getLogger(__name__)

#: Releases that may run at once; a batch handed beyond this is kept alive instead (see the module doc).
MAX_PENDING = 8
#: A release slower than this is logged (with its time) when it ends: a destructor that waited on a peer.
SLOW_S = 1.0


@dataclass
class Release:
    """One batch handed to :func:`drop`: what it was and how its release went."""

    label: str
    started: float
    ended: float | None = None
    leaked: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


_lock = threading.Lock()
_running: list[Release] = []
_finished: list[Release] = []  # the last few, for tests and the logs
_kept: list[object] = []  # batches kept alive on purpose (too many releases already stuck)
_KEEP_FINISHED = 32


def drop(label: str, refs: list[object]) -> Release:
    """Release ``refs`` (the caller's last references to a generation's communicators) on a thread of
    their own; returns at once. ``refs`` is emptied: the caller must hold no other reference."""
    held = list(refs)
    refs.clear()
    rel = Release(label, time.monotonic())
    with _lock:
        stuck = sum(1 for r in _running if r.ended is None)
        if stuck >= MAX_PENDING:
            rel.leaked = True
            _kept.append(held)
    if rel.leaked:
        log.warning("%s: %d earlier releases are still waiting in destructors; its communicators are kept "
                    "for the life of this process instead of being released", label, stuck)
        return rel

    def run() -> None:
        nonlocal held
        try:
            del held  # the destructors run here: Gloo joins its threads, NCCL its watchdog
            gc.collect()  # Work objects in reference cycles keep a Gloo context (its sockets) alive
        except Exception:  # noqa: BLE001 - a failed teardown must never reach the training loop
            log.warning("%s: releasing the communicators failed", label, exc_info=True)
        finally:
            rel.ended = time.monotonic()
            with _lock:
                if rel in _running:
                    _running.remove(rel)
                _finished.append(rel)
                del _finished[:-_KEEP_FINISHED]
            if rel.seconds is not None and rel.seconds > SLOW_S:
                log.info("%s: communicators released in the background in %.1f s", label, rel.seconds)

    t = threading.Thread(target=run, name=f"ckptless-reaper-{label.replace(' ', '-')}", daemon=True)
    rel.thread = t
    with _lock:
        _running.append(rel)
    exit_guard.watch(t.is_alive, t.join)
    t.start()
    return rel


def running() -> list[Release]:
    """Releases still inside their destructors."""
    with _lock:
        return [r for r in _running if r.ended is None]


def finished() -> list[Release]:
    """The last releases that ended (at most 32)."""
    with _lock:
        return list(_finished)


def kept() -> int:
    """How many batches are kept alive on purpose (handed while :data:`MAX_PENDING` were stuck)."""
    with _lock:
        return len(_kept)
