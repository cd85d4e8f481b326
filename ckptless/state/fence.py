"""When may the next step write what a capture is still copying? The fence of an asynchronous capture.

Why: on a GPU the capture is a device-to-host copy. Waiting for it on the
training thread (what the capture did first) stalled every step for the rest
of the queued GPU work plus the copy. Instead the copies run on a side stream
(:mod:`ckptless.state.streams`) and nobody waits for them, except where the
next step would *overwrite* a tensor still being copied, and there the wait is
on the GPU (a stream waits for an event), never on the CPU:

* **early** tensors (module buffers, which a forward pass updates in place,
  e.g. BatchNorm's running statistics or DDP's buffer broadcast; a grad
  scaler; anything that is not a module parameter or optimizer state) are
  copied first; the compute stream waits for them at the start of the next
  step (:meth:`WriteOrder.before_step`). They are small.
* **late** tensors (module parameters and optimizer state: nearly all the
  bytes) are written only by the optimizer's step, so the compute stream
  waits for their copies in a step pre-hook of every protected optimizer
  (:meth:`WriteOrder.install`). The next step's forward and backward overlap
  the copy; on a GPU step >= 5x the copy, the step does not wait at all.

What if a script writes a late tensor elsewhere (a weight clamp in the forward
pass, an EMA written before the step)? Then the copy may read a half-updated
tensor. Every in-place write bumps a tensor's version counter, so the fence
records each late tensor's version at capture and checks it when the late copy
is ordered (the optimizer pre-hook) or, if it finished first, when the mirror
thread sees it done (:meth:`CopyFence.seal`). A changed version before either
point means the image may be torn: it is never committed (the mirror engine
treats it as a fault, the job rolls back to the committed version), and from
then on this process orders *every* copy at the start of the step
(conservative, one warning). Correctness never depends on the script's shape;
only the overlap does.

Pure logic over :class:`~ckptless.state.streams.Marker` s: the CPU suite drives
it with stand-in markers; ``make test-gpu`` runs it with CUDA events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptless.state import streams
from ckptless.state.dtensor import is_dtensor, local_of

log = logging.getLogger(__name__)


@dataclass
class CopyFence:
    """The in-flight device-to-host copies of one capture (one early and one late marker per device).

    ``watched``: (tensor index in the image, source tensor, its version at capture) of every
    late source tensor.
    """

    early: Sequence[streams.Marker]
    late: Sequence[streams.Marker]
    watched: Sequence[tuple[int, torch.Tensor, int]] = ()
    order: WriteOrder | None = None
    torn: str | None = None
    _early_ordered: bool = False
    _late_ordered: bool = False
    _sealed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self) -> bool:
        """Every copy finished (late markers come after the early ones on each device's stream)."""
        return all(m.done() for m in self.late) and all(m.done() for m in self.early)

    def wait(self, timeout_s: float, what: str) -> None:
        """Block until every copy finished (the mirror thread, before it checksums the bytes)."""
        streams.wait([*self.early, *self.late], timeout_s, what)

    def order_early(self) -> None:
        """The compute streams wait for the early copies (idempotent)."""
        with self._lock:
            if self._early_ordered or self._sealed:
                return
            self._early_ordered = True
            for m in self.early:
                m.order_current()

    def order_late(self) -> None:
        """The compute streams wait for every copy; a late tensor written before this point tears the image."""
        with self._lock:
            if self._late_ordered or self._sealed:
                return
            self._late_ordered = True
            self._check_versions("before the optimizer step")
            for m in (*self.early, *self.late):
                m.order_current()

    def seal(self) -> str | None:
        """Called once the copies are done (:meth:`wait`): the image is final. Returns why it may be
        torn, or None. A late tensor written before its copy was ordered may have raced the copy."""
        with self._lock:
            if not self._sealed:
                self._sealed = True
                if not self._late_ordered:
                    self._check_versions("while its copy ran")
            return self.torn

    def _check_versions(self, when: str) -> None:
        changed = [i for i, t, v in self.watched if t._version != v]
        if changed and self.torn is None:
            self.torn = (f"{len(changed)} protected tensor(s) (image tensor #{changed[0]} first) were written in "
                         f"place after their capture began and {when}: a parameter or optimizer state written "
                         "outside the optimizer's step")
            if self.order is not None:
                self.order.go_conservative(self.torn)


class WriteOrder:
    """Where this process's training steps wait (on the GPU) for the newest capture's copies."""

    def __init__(self) -> None:
        self.conservative = False  # order every copy at the start of the step (after a torn image)
        self._pending: CopyFence | None = None
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    def install(self, objects: Iterable[Any]) -> None:
        """A step pre-hook on every protected optimizer (again after new objects were protected)."""
        for h in self._handles:
            h.remove()
        self._handles = [obj.register_step_pre_hook(self._before_optimizer_step)
                         for obj in objects if isinstance(obj, torch.optim.Optimizer)]

    @property
    def hooked(self) -> bool:
        return bool(self._handles)

    def captured(self, fence: CopyFence | None) -> None:
        """A new capture's copies are in flight. The previous capture's are ordered first: a
        step that wrote nothing since (no optimizer step) still must not race them."""
        with self._lock:
            previous, self._pending = self._pending, fence
        if previous is not None:
            previous.order_late()
        if fence is not None:
            fence.order = self

    def before_step(self) -> None:
        """The start of a step: no user code of it has run yet."""
        f = self._pending
        if f is None:
            return
        f.order_early()
        if self.conservative or not self._handles:
            f.order_late()

    def _before_optimizer_step(self, *_: Any) -> None:
        f = self._pending
        if f is not None:
            f.order_late()

    def drain(self, timeout_s: float) -> None:
        """Wait (CPU) for the newest capture's copies: before anything restores into the live tensors."""
        with self._lock:
            f, self._pending = self._pending, None
        if f is not None:
            f.order_late()
            f.wait(timeout_s, "the last capture's copies, before a restore")

    def go_conservative(self, why: str) -> None:
        if not self.conservative:
            self.conservative = True
            log.warning("the capture may have raced a write (%s): every step now waits for the capture's "
                        "copies at its start (the next step does not overlap the copy)", why)


def late_sources(objects: Iterable[Any]) -> set[int]:
    """Data pointers of the tensors only an optimizer step writes: module parameters (a DTensor's
    local shard) and optimizer state. Everything else a capture copies is early."""
    out: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = local_of(t) if is_dtensor(t) else t
            if local.device.type != "cpu" and local.numel():
                out.add(local.data_ptr())

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add(p)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values() if isinstance(state, dict) else ():
                    add(v)
    return out
