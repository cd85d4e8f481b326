"""Fault or user error? Decided where an exception leaves the user's step, from types and facts.

Why it matters: a fault (a peer died, the network broke, a hang was killed)
is recovered; a user error (the script's own exception) must fail the job
fast with that traceback and never be respawned into again. Message text is
never read. An exception escaping the step is a fault when

* it is, or was caused by (``__cause__``/``__context__``), an error the
  process-group or mirror layers raise where a failure arises
  (:class:`~ckptless.errors.CollectiveError`, any
  :class:`~ckptless.errors.TransportError` or
  :class:`~ckptless.errors.MirrorError`, torch's ``DistError`` family); or
* a collective of the current generation failed (the groups record it even
  when the DDP reducer surfaces it in C++ as a plain ``RuntimeError``): the
  exception is a consequence of that failure; or
* the coordinator already declared the generation failed.

Everything else is the user's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from ckptless.errors import MirrorError, TransportError
from ckptless.worker import groups

FAULT_TYPES: tuple[type[BaseException], ...] = (TransportError, MirrorError, dist.DistError)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 32:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_fault(exc: BaseException, generation: int, declared_failed: Callable[[int], bool] | None = None) -> bool:
    """True for failures caused by a peer or the transport; False for the user's own errors."""
    if any(isinstance(e, FAULT_TYPES) for e in _chain(exc)):
        return True
    if groups.collective_failed(generation):
        return True
    return declared_failed is not None and declared_failed(generation)
