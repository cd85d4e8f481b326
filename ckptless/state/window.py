"""Which versions can be resumed from: the gradient-accumulation window (issue 38).

Why: gradients are not in a state image (they would add the model's size to
every image and every mirror round, and the next backward would have to wait
for their device-to-host copies). That is exact where a step ends with its
optimizer step: the next step starts from zero (or None) gradients anyway. It
is not exact inside an accumulation window: with ``job.train`` every batch is
a step, so a version taken between a window's micro-batches says "the model as
the window started, k micro-batches consumed", and a resume there lost those k
micro-batches' gradients (issue 38: ``model, optimizer differ``, silently).

The choice here: **replay the window**. A version taken while some protected
optimizer holds gradients it has not stepped on is *not protected* (not
captured, not mirrored, not snapshotted): the newest protected version is the
window's start, where the parameters, the optimizer, the loop's position, the
RNG streams and any counter (``accelerator.step``) are all exactly what the
image holds, and a recovery resumes there and runs the window's micro-batches
again, on the same batches with the same streams. Every rank (survivor or
replacement) resumes at that version with no gradient at all: a restore clears
the protected parameters' ``grad`` (:func:`clear_grads`), so a survivor's
in-memory partial sums are never added to the replay. The alternative,
capturing the partial gradients, costs the model's size in every image and
mirror round and orders the next backward after their copies; replaying costs
at most one window's micro-batches per recovery, and saves the captures that
would have been taken inside it.

How a boundary is judged, per protected optimizer (the optimizer a wrapper such
as Accelerate's ``AcceleratedOptimizer`` forwards to: :func:`~ckptless.state.fence.hookable`):
clean when it stepped during the step just closed (a step post-hook sets a
flag), or when none of its parameters holds a gradient. So a micro-batch's
backward without a step is pending; the window's last micro-batch (step, then
``zero_grad``) is clean whether ``zero_grad`` sets ``None`` or zeros; an eval
batch after ``zero_grad(set_to_none=True)`` is clean. Cost per step: one flag
per optimizer when it stepped; otherwise a scan of its parameters' ``grad``
that stops at the first one set (a micro-batch: one read; a batch without
gradients: one read per parameter tensor).

What it assumes: every rank steps its optimizers in the same steps (mirror
rounds are collective: ranks that protect different versions are out of step,
a fault) -- data-parallel training does; and a step does not run a backward
*after* its optimizer step (step at the end of the window, as every
accumulating loop does). An optimizer whose step takes no hook leaves every
version protected (as before), with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from ckptless.state.fence import hookable

log = logging.getLogger(__name__)


def clean(stepped: bool, holds_grads: bool) -> bool:
    """One optimizer at a step boundary: nothing it would still step on is outside the image."""
    return stepped or not holds_grads


def decide(due: bool, is_clean: bool, owed: bool, final: bool) -> tuple[bool, bool]:
    """Protect (capture and mirror, or snapshot) the version at this boundary? And is a protection
    owed afterwards? ``due``: the period says this version (every N steps); ``owed``: a due version
    was skipped for being inside a window, so the next clean one is protected instead; ``final``:
    the run's last version, always protected (nothing trains after it, so its pending gradients
    never matter)."""
    if final:
        return True, False
    wanted = due or owed
    if wanted and is_clean:
        return True, False
    return False, wanted


class GradientWindow:
    """Sees, at each step boundary, whether the protected optimizers hold gradients not yet stepped on."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stepped: dict[int, bool] = {}
        self.blind: str | None = None  # why a step cannot be seen (every boundary then counts as clean)
        self.clean = True  # the last boundary's verdict (the state is a window's start)

    def install(self, objects: Iterable[Any]) -> None:
        """A step post-hook on every protected optimizer (again after new objects were protected)."""
        for h in self._handles:
            h.remove()
        self._handles, self._optimizers, self._stepped, self.blind = [], [], {}, None
        for obj in objects:
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            real, why = hookable(obj)
            if real is None:
                self.blind = f"{type(obj).__qualname__} takes no step hook ({why})"
                log.warning("%s: a resume inside a gradient-accumulation window cannot be told apart and "
                            "would lose the window's earlier gradients", self.blind)
                continue
            if any(real is o for o in self._optimizers):
                continue
            self._optimizers.append(real)
            self._stepped[id(real)] = False
            self._handles.append(real.register_step_post_hook(self._after_step))

    def _after_step(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._stepped[id(opt)] = True

    def boundary(self) -> bool:
        """The step just closed: is its version resumable (no gradient pending)? Resets the flags."""
        ok = True
        for opt in self._optimizers:
            if ok and not clean(self._stepped[id(opt)], _holds_grads(opt)):
                ok = False
            self._stepped[id(opt)] = False
        self.clean = ok or self.blind is not None
        return self.clean

    def reset(self) -> None:
        """Training (re)starts at a version: nothing stepped since (a restore cleared the gradients)."""
        for k in self._stepped:
            self._stepped[k] = False
        self.clean = True


def _holds_grads(opt: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for g in opt.param_groups for p in g["params"])


def clear_grads(objects: Iterable[Any]) -> None:
    """Every protected parameter's ``grad`` to None (modules and optimizers): gradients are not in the
    image, so after a restore none may survive from the steps rolled back (a survivor's partial sums
    inside an accumulation window would be added to the replayed micro-batches)."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                p.grad = None
        elif isinstance(obj, torch.optim.Optimizer):
            real, _ = hookable(obj)
            for g in (real or obj).param_groups:
                for p in g["params"]:
                    p.grad = None
