"""CUDA streams and events for the state's copies: one side stream per device, waits with deadlines.

Why a module of its own: the capture copies device tensors to host memory on
a *side* stream so that the training thread does not wait for the copy, and
a restore copies host bytes back with ``non_blocking`` copies and one wait at
the end. Both need the same few primitives, and both must obey two rules
that plain ``stream.synchronize()`` breaks:

* **one stream per source device.** A stream belongs to one device; a side
  stream made on the *current* device and used for another device's tensors
  orders nothing (the copy from GPU 3 would not wait for GPU 3's compute), so
  a script that never calls ``set_device`` got unwaited, torn copies.
* **every wait has a deadline.** A GPU stuck in an un-aborted collective
  never finishes a stream; ``synchronize()`` would block the caller forever.
  :func:`wait` polls ``event.query()`` instead and raises
  :class:`~ckptless.errors.DeviceTimeout` (a fault: the rank is recovered).

Nothing here runs without CUDA; the CPU test suite covers the logic built on
it (:mod:`ckptless.state.fence`) with stand-in markers, and ``make test-gpu``
runs this module on a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ckptless.errors import DeviceTimeout

_streams: dict[torch.device, Any] = {}
_lock = threading.Lock()


class Marker(Protocol):
    """A point in one device's work: done when everything enqueued before it has run."""

    def done(self) -> bool: ...

    def order_current(self) -> None:
        """Make the device's *current* stream wait for this point (on the GPU; the CPU does not block)."""


class EventMarker:
    """A CUDA event recorded on a stream of ``device``."""

    __slots__ = ("device", "event")

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def done(self) -> bool:
        with torch.cuda.device(self.device):  # the polling thread (the mirror's) never set a device
            return bool(self.event.query())

    def order_current(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


def side_stream(device: torch.device) -> Any:
    """This process's side stream on ``device`` (made once, reused: streams are not free)."""
    with _lock:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = torch.cuda.Stream(device=device)
        return s


def mark_current(device: torch.device) -> EventMarker:
    """A marker at the end of what is enqueued on ``device``'s current stream now."""
    return EventMarker(device, torch.cuda.current_stream(device))


def wait(markers: Iterable[Marker], timeout_s: float, what: str) -> None:
    """Block until every marker is done, polling (a CUDA wait cannot be interrupted), or raise
    :class:`DeviceTimeout` after ``timeout_s`` naming ``what``.

    The poll starts at 50 us and backs off to 2 ms: a copy that is already done costs one
    query, a long one costs at most 2 ms of latency and no busy core."""
    pending = [m for m in markers if not m.done()]
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while pending:
        if time.monotonic() > deadline:
            raise DeviceTimeout(f"{what}: the GPU did not finish within {timeout_s:.0f}s "
                                "(a hung device or an un-aborted collective)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
        pending = [m for m in pending if not m.done()]


def sync_devices(devices: Iterable[torch.device], timeout_s: float, what: str) -> None:
    """Wait, with a deadline, for everything enqueued so far on each device's current stream."""
    wait([mark_current(d) for d in set(devices) if d.type == "cuda"], timeout_s, what)
