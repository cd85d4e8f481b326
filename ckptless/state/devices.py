"""Device-relative images: an image says a tensor lived on *a* GPU, never on which one.

Why: a replacement rarely runs on the GPU its predecessor used. A spare has
a GPU of its own, a respawn after a GPU-class exit gets another one, and a
survivor's rank may be rebuilt on another node where the same rank sits on
another index. An image that recorded ``"cuda:3"`` made a replacement on
GPU 5 create a CUDA context on its neighbour's GPU 3, fail the in-place
match against its own live tensors (``cuda:5 != cuda:3``) and allocate the
whole state there: one failure turned into two when the neighbour ran out
of memory. So the image records the device *type* (``"cuda"``), and a
restore places each tensor

* into the live tensor at the same path, on whatever device *that* tensor
  is (the in-place path, :mod:`ckptless.state.inplace`), or else
* on the rank's own GPU (:func:`target`): the *home* device that
  ``ckptless.init()`` sets here (:mod:`ckptless.worker.device`), else this
  thread's current device. A process-wide home, not the thread's current
  device: CUDA's current device is per thread, and the mirror, transfer and
  abort threads never set theirs (a CUDA call made there on device 0 would
  create a context on a neighbour's GPU).

Images written before this rule carry ``"cuda:<i>"``; the index is ignored
in the same way, so they restore onto the rank's own device too.
"""

from __future__ import annotations

import torch

from ckptless.errors import StateError

CPU = torch.device("cpu")
_home: list[torch.device] = []


def set_home(device: torch.device | None) -> None:
    """The rank's own GPU, for every thread of this process (``ckptless.init()`` sets it)."""
    _home[:] = [] if device is None else [device]


def home() -> torch.device | None:
    """The rank's own GPU: the home device, else (a process that set none) this thread's current one;
    None without CUDA."""
    if _home:
        return _home[0]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def recorded(t: torch.Tensor) -> str:
    """What an image records for ``t``'s device: its type only (``"cuda"``, ``"xpu"``, ...)."""
    return t.device.type


def parse(name: str) -> torch.device:
    """The device type an image recorded (``"cuda"``, or a legacy ``"cuda:3"`` read as ``"cuda"``)."""
    try:
        return torch.device(torch.device(name).type)
    except (RuntimeError, TypeError) as exc:
        raise StateError(f"invalid device {name!r} in the image") from exc


def target(name: str) -> torch.device:
    """Where a tensor recorded on ``name`` goes when no live tensor says: this process's current
    device of that type (raises :class:`StateError` when this process has none)."""
    kind = parse(name).type
    if kind == "cpu":
        return CPU
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise StateError("the image holds GPU tensors but this process sees no CUDA device")
        return _home[0] if _home else torch.device("cuda", torch.cuda.current_device())
    module = getattr(torch, kind, None)
    current = getattr(module, "current_device", None)
    if callable(current):
        try:
            return torch.device(kind, int(current()))
        except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
            raise StateError(f"the image holds {kind} tensors but this process has no {kind} device: {exc}") from exc
    return torch.device(kind)
