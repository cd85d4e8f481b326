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
  the copy (what that saves on a real GPU is ``bench/gpu.py``'s to measure;
  it has not run yet).

What if a script writes a late tensor elsewhere (a weight clamp in the forward
pass, an EMA written before the step)? Then the copy may read a half-updated
tensor. Every in-place write through autograd bumps a tensor's version counter
(for a DTensor, the DTensor's own counter: its local shard's does not move),
so the fence records each late tensor's version at capture, and:

* **a probe first.** A process orders every copy at the start of the step for
  its first :data:`PROBE_CAPTURES` captures followed by an optimizer step, and
  checks the versions at that optimizer step. A script that writes a late
  tensor outside its optimizer step shows here, where nothing could race, and
  the process stays in that ordering (conservative, one warning).
* **then overlap, still checked.** A version that changed before the late
  copy was ordered (the optimizer pre-hook) or, if the copy finished first,
  before the mirror thread saw it done (:meth:`CopyFence.seal`) means the image
  may be torn: it is never mirrored nor offered for a rollback (the mirror
  engine breaks: a fault, the job rolls back to the committed version), and
  the process turns conservative.

Not seen by version counters (docs/state.md, "GPUs"): writes through
``tensor.data`` (it has a counter of its own), kernels and collectives that
write a parameter without autograd, and an optimizer step captured in a CUDA
graph and replayed (no pre-hook runs). The last is detected when its pre-hook
runs during the capture (the process turns conservative); for the others, set
``CKPTLESS_CAPTURE_ORDER=step`` (every copy ordered at the start of the step).
Correctness otherwise never depends on the script's shape; only the overlap does.

Pure logic over :class:`~ckptless.state.streams.Marker` s: the CPU suite drives
it with stand-in markers; ``make test-gpu`` runs it with CUDA events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptless.state import streams
from ckptless.state.dtensor import is_dtensor, local_of

log = logging.getLogger(__name__)

PROBE_CAPTURES = 2
"""Captures, each followed by an optimizer step, ordered at the step's start and checked before overlap."""


@dataclass
class CopyFence:
    """The in-flight device-to-host copies of one capture (one early and one late marker per device).

    ``watched``: (tensor index in the image, the tensor whose version an in-place write bumps, its
    version at capture) of every late source.
    """

    early: Sequence[streams.Marker]
    late: Sequence[streams.Marker]
    watched: Sequence[tuple[int, torch.Tensor, int]] = ()
    order: WriteOrder | None = None
    torn: str | None = None
    _early_ordered: bool = False
    _late_ordered: bool = False
    _at_start: bool = False  # the late copies were ordered at the step's start (conservative or probing)
    _checked: bool = False
    _sealed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

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

    def order_late(self, at_start: bool = False) -> None:
        """The compute streams wait for every copy (idempotent). ``at_start``: at the step's start,
        before any of the script's code: nothing can have raced the copies yet."""
        with self._lock:
            if self._late_ordered or self._sealed:
                return
            self._late_ordered, self._at_start = True, at_start
            if not at_start:
                self._check_versions("before the optimizer step")
            for m in (*self.early, *self.late):
                m.order_current()

    def check_writes(self) -> bool | None:
        """At the first optimizer step after the capture: did the script write a late tensor before
        it? None when already asked (a second optimizer's step). Ordered at the step's start, a write
        tears nothing: it is only a fact about the script."""
        with self._lock:
            if self._checked:
                return None
            self._checked = True
            return any(t._version != v for _, t, v in self.watched)

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
    """Where this process's training steps wait (on the GPU) for the newest capture's copies.

    ``always_at_start`` (``CKPTLESS_CAPTURE_ORDER=step``): every copy is ordered at the step's
    start, for scripts whose writes no version counter shows (see the module doc)."""

    def __init__(self, always_at_start: bool = False) -> None:
        self.conservative = always_at_start  # order every copy at the start of the step
        self.clean_probes = 0  # captures followed by an optimizer step that wrote no late tensor before it
        self._pending: CopyFence | None = None
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self.optimizers: list[torch.optim.Optimizer] = []  # those whose step runs the pre-hook
        # Called first in every protected optimizer's pre-hook: the mirror engine's wait for a deferred
        # prefix (mirror/pool.py), whose live tensors only this step may overwrite.
        self.before_optimizer: Callable[[], None] | None = None

    def install(self, objects: Iterable[Any]) -> None:
        """A step pre-hook on every protected optimizer (again after new objects were protected). An
        optimizer that takes none (a wrapper that never ran ``Optimizer.__init__``) leaves the process
        ordering every copy at the step's start."""
        for h in self._handles:
            h.remove()
        self._handles, self.optimizers = [], []
        for obj in objects:
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            real, why = hookable(obj)
            if real is None:
                self.go_conservative(f"{type(obj).__qualname__} takes no step pre-hook ({why})")
            elif all(real is not o for o in self.optimizers):  # a wrapper and what it wraps: one hook
                self._handles.append(real.register_step_pre_hook(self._before_optimizer_step))
                self.optimizers.append(real)

    @property
    def overlapping(self) -> bool:
        """Late copies overlap the next step's forward and backward (else they are ordered at its start)."""
        return bool(self._handles) and not self.conservative and self.clean_probes >= PROBE_CAPTURES

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
        if not self.overlapping:
            f.order_late(at_start=True)

    def _before_optimizer_step(self, *_: Any) -> None:
        if self.before_optimizer is not None:
            self.before_optimizer()
        f = self._pending
        if f is None:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Recorded into a CUDA graph: replays run no pre-hook. The kernels being recorded do not run
            # now; from the next step on, every copy is ordered at the step's start, outside any graph.
            self.go_conservative("the optimizer step is captured in a CUDA graph")
            return
        f.order_late()
        if self.clean_probes < PROBE_CAPTURES and f._at_start:
            wrote = f.check_writes()
            if wrote:
                self.go_conservative("the script writes a parameter or optimizer state in place before its "
                                     "optimizer step")
            elif wrote is False:
                self.clean_probes += 1

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
            log.warning("%s: every step now waits for the capture's copies at its start (the next step no "
                        "longer overlaps them)", why)


WRAPPED = ("optimizer", "_optimizer", "optim")
"""Attributes an optimizer wrapper keeps what it wraps under (Accelerate's ``AcceleratedOptimizer``,
Lightning's ``LightningOptimizer``: ``optimizer``/``_optimizer``)."""


def hookable(opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer | None, str]:
    """The optimizer whose step pre-hook runs when ``opt`` steps: ``opt`` itself, or for a wrapper
    that never ran ``Optimizer.__init__`` (it has no hook table) and forwards ``step`` to the optimizer
    it holds, that one (followed down nested wrappers). A wrapper's step may skip the inner step (an
    accumulation micro-batch, a GradScaler's inf step): then nothing was written, and nothing waits.
    (None, why) when no optimizer in the chain takes a hook."""
    seen: list[Any] = []
    cur: Any = opt
    while isinstance(cur, torch.optim.Optimizer) and all(cur is not s for s in seen):
        if isinstance(vars(cur).get("_optimizer_step_pre_hooks"), dict):
            return cur, ""
        seen.append(cur)
        cur = next((w for w in (vars(cur).get(a) for a in WRAPPED) if isinstance(w, torch.optim.Optimizer)), None)
    return None, ("it never ran Optimizer.__init__ and wraps no optimizer that did, under "
                  + "/".join(WRAPPED))


def late_sources(objects: Iterable[Any]) -> dict[int, torch.Tensor]:
    """The tensors only an optimizer step writes (module parameters, optimizer state), by the data
    pointer of what the capture copies (a DTensor's local shard), each with the tensor whose version
    counter an in-place write bumps (the DTensor itself). Everything else a capture copies is early."""
    out: dict[int, torch.Tensor] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = local_of(t) if is_dtensor(t) else t
            if local.numel():
                out[local.data_ptr()] = t

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add(p)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values() if isinstance(state, dict) else ():
                    add(v)
    return out
