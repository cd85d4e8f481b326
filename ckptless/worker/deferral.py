"""Whether a capture may leave its replicated prefix live (issue 21's memory: ``mirror/pool.py``).

Why a rule of its own: leaving the prefix in the live tensors is exact only
while nothing writes them between the capture and the end of its round, and
only an optimizer step whose pre-hook waits for that round is known to wait.
So a capture defers only when all of these hold, and otherwise copies the whole
image (two copies of the prefix, as before):

* the pool is the default committed + in flight (``pool_buffers == 2``: one
  buffer mirrors the prefix; three ask for captures to run ahead of rounds);
* the prefix is not mirrored, and every prefix tensor is a contiguous CPU
  tensor (:meth:`ckptless.state.capture.Plan.can_defer`);
* every prefix tensor is a parameter or state of an optimizer whose step runs
  the pre-hook (``WriteOrder.optimizers``): another optimizer would write it
  unannounced;
* the process has not seen a write under a deferred capture (``live_torn``), and
  ``CKPTLESS_CAPTURE_ORDER=step`` (writes no version counter shows) is not set;
* the engine holds a committed image the new one fits (the merge writes there);
  when its first round is still running, the capture waits for it once.

Cost: O(parameters) set lookups per capture, no collective.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ckptless.mirror import MirrorEngine
from ckptless.state import Plan
from ckptless.state import is_dtensor, local_of


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Data pointers of every parameter and state tensor of ``optimizers``: what only their steps write."""
    out: set[int] = set()

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor):
            local = local_of(t) if is_dtensor(t) else t  # what a capture copies: a DTensor's local shard
            if local.numel():
                out.add(local.data_ptr())

    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
        for state in opt.state.values():
            for v in state.values() if isinstance(state, dict) else ():
                add(v)
    return out


def covered(plan: Plan, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Is every tensor of the plan's prefix written only by a step of ``optimizers``?"""
    ptrs = optimizer_tensors(optimizers)
    return all(t.data_ptr() in ptrs for e, t in zip(plan.entries, plan.tensors) if e.offset < plan.prefix and e.nbytes)


def may_defer(engine: MirrorEngine, plan: Plan, optimizers: list[torch.optim.Optimizer], mirror_replicated: bool,
              off: str | None, timeout_s: float) -> bool:
    """The module doc's rule for this capture (``off``: why this process no longer defers, or None).
    May wait (up to ``timeout_s``) for the engine's first round; raises as the engine does when broken."""
    if off is not None or engine.live_torn is not None or engine.config.pool_buffers != 2:
        return False
    if not optimizers or not plan.can_defer(mirror_replicated) or not covered(plan, optimizers):
        return False
    if engine.committed_room() == 0:
        engine.wait_idle(timeout_s)  # the first round of this engine: its buffer becomes the committed one
    return engine.committed_room() >= plan.total
