"""Non-Gloo backends of a generation being formed (and bound), reachable by an abort before they are installed.

Why a module of its own: a formation's helper thread may be inside an NCCL
init, or its member check, when the generation is given up (a peer died, a
newer generation was published). ``abort()`` of that communicator must reach
it although no group holds it yet, must run off the caller's thread (torch's
``NCCLComm::abort`` waits for the communicator's lock, which a non-blocking
init's ``waitReady`` holds until ``TORCH_NCCL_NONBLOCKING_TIMEOUT``: measured
10 s of a 12 s timeout on torch 2.11), and a backend the helper builds *after*
the give-up is aborted as it is made. Each backend is aborted once, by
whoever comes first; the references are handed back to the caller (the
reaper) when the generation is released, never dropped here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_by_generation: dict[int, list[Any]] = {}  # generation -> its non-Gloo backends built so far (installed or not)
_aborted: dict[int, Any] = {}  # id() -> backend, those aborted so far (each once; held, so no id is reused)
_aborted_generations: set[int] = set()  # a backend built for one of these later is aborted as it is made
_lock = threading.Lock()


def _claim_abort(backend: Any) -> bool:
    """True the first time ``backend`` is to be aborted (a backend is aborted once, by whoever is first)."""
    with _lock:
        if id(backend) in _aborted:
            return False
        _aborted[id(backend)] = backend
        return True


def add(generation: int, backend: Any) -> None:
    with _lock:
        _by_generation.setdefault(generation, []).append(backend)
        late = generation in _aborted_generations
    if late:  # the formation's helper built it after the generation was given up: end it at once
        abort_async(backend, generation)


def abort_async(backend: Any, generation: int) -> bool:
    """``backend.abort()`` on a thread of its own (once per backend); False if it was aborted already.

    Why not on the caller's thread: ProcessGroupNCCL's abort waits for a non-blocking init still in
    progress (the communicator's lock is held while torch waits for it to be ready, up to
    ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, which ``ckptless.init()`` bounds), and the callers (the
    aborter thread, the driver abandoning a formation) must not wait on that."""
    if not _claim_abort(backend):
        return False

    def run() -> None:
        try:
            backend.abort()
        except Exception:  # noqa: BLE001 - one backend's failed abort must not stop the others'
            log.warning("aborting a %s of generation %d failed", type(backend).__name__, generation, exc_info=True)

    threading.Thread(target=run, name=f"ckptless-abort-g{generation}", daemon=True).start()
    return True


def abort(generation: int) -> int:
    """Abort every non-Gloo backend built for ``generation`` so far, installed or still connecting (an
    abandoned formation's helper thread may be inside an NCCL init or its check); returns how many."""
    with _lock:
        _aborted_generations.add(generation)
        backends = list(_by_generation.get(generation, ()))
    return sum(abort_async(b, generation) for b in backends)


def forget(upto: int) -> list[Any]:
    """Forget the backends of generations up to ``upto`` (they were released); returns the references
    this module held, for the caller to hand to the reaper (the last one may run a destructor that waits)."""
    out: list[Any] = []
    with _lock:
        for g in [g for g in _by_generation if g <= upto]:
            for b in _by_generation.pop(g):
                _aborted.pop(id(b), None)
                out.append(b)
        _aborted_generations.difference_update([g for g in _aborted_generations if g <= upto])
    return out
