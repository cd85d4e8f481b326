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

Everything else is the user's, with one exception that comes first: the
GPU itself failed (:func:`device_failure`). That is neither the user's error
(nothing to fix in the script; the same step trains on another GPU) nor a
fault this process can recover from (its CUDA context is poisoned: every
further CUDA call fails, so it can neither roll back nor serve its peers'
replicas). The worker exits with kind ``device``; its agent marks the GPU bad
and the rank is recovered elsewhere (``launcher/devices.py``).

Which errors mean "the device failed": torch raises ``torch.AcceleratorError``
for a CUDA error and sets its ``error_code`` to the ``cudaError_t``
(``torch/csrc/Exceptions.cpp``, ``_new_accelerator_error_object``), so the code is
read, never the message. Chosen (:data:`DEVICE_ERROR_CODES`): uncorrectable ECC
(214), uncorrectable NVLink (220), an error the GPU's containment caught
(226: "certain classes of hardware errors ... the process must be
terminated"), hardware stack error (714), illegal instruction (715) and no
device / devices unavailable (100, 46: a GPU gone from the bus, or held by
another process). Left out on purpose, so they stay the user's error (fail
fast, never respawned into): illegal address (700), device-side assert (710),
misaligned address and invalid address space or program counter (716-718),
launch timeout (702), invalid device ordinal (101), unknown (999), and
unspecified launch failure (719), whose common causes NVIDIA names as the
program's own invalid pointers and out-of-bounds shared memory. A hardware
fault reported only as one of those ends the job as before; the other
choice would respawn a kernel bug onto every GPU and spare of the job. A
code outside the list that a hardware fault does produce costs a failed job;
one inside it that a kernel bug produces costs one GPU per incident, bounded
by the GPUs and spares there are (each is marked bad once).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from ckptless.errors import MirrorError, TransportError
from ckptless.worker import exit_file, groups
from ckptless.worker.machine import DeviceFailed

FAULT_TYPES: tuple[type[BaseException], ...] = (TransportError, MirrorError, dist.DistError)

#: ``cudaError_t`` values that mean the GPU itself failed (see the module docstring for why these).
DEVICE_ERROR_CODES: Mapping[int, str] = {
    46: "cudaErrorDevicesUnavailable",
    100: "cudaErrorNoDevice",
    214: "cudaErrorECCUncorrectable",
    220: "cudaErrorNvlinkUncorrectable",
    226: "cudaErrorContained",
    714: "cudaErrorHardwareStackError",
    715: "cudaErrorIllegalInstruction",
}


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


def device_error(exc: BaseException) -> tuple[BaseException, int] | None:
    """The CUDA error in ``exc``'s chain that means the GPU failed, with its code (None: there is none)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None:  # pragma: no cover - torch before 2.8 raised plain RuntimeErrors
        return None
    for e in _chain(exc):
        code = getattr(e, "error_code", None) if isinstance(e, accelerator_error) else None
        if isinstance(code, int) and code in DEVICE_ERROR_CODES:
            return e, code
    return None


def device_failure(exc: BaseException) -> DeviceFailed | None:
    """``DeviceFailed`` when ``exc`` (or its cause) says the GPU itself failed; checked before
    :func:`is_fault`: a collective that broke because this GPU died is this GPU's failure."""
    found = device_error(exc)
    if found is None:
        return None
    err, code = found
    summary = exit_file.summarize(err)
    return DeviceFailed(replace(summary, message=f"{summary.message.splitlines()[0] if summary.message else ''} "
                                                 f"({DEVICE_ERROR_CODES[code]}, {code})".strip()))
