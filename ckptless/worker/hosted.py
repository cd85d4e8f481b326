"""A survivor running a lost rank's share of each step (going on with fewer ranks, issue 22).

Why: when a node is lost and no replacement is at hand, a data-parallel job may
go on at a smaller world instead of waiting (opt-in). Keeping the global batch
keeps the training trajectory: every step still consumes the samples of all W
*logical* ranks, and the survivors run the lost ranks' micro-batches as well as
their own, accumulating gradients before the one synchronised reduction. A
survivor that *hosts* logical rank ``r`` runs the step body once as ``r`` and
once as itself; what makes the extra run "rank ``r``'s micro-batch" is, per
micro-batch:

* **rank ``r``'s rank-bound state swapped in**: its RNG streams (its dropout
  masks) and its data position (its shard of the sampler: ``set_world``),
  with every other private entry of the registry (a per-rank generator, a
  cursor) swapped the same way; models, optimizers, LR schedulers and DDP's
  reducer state are never swapped: they are the replicas' common state;
* **no collective**: the DDP modules neither broadcast buffers nor reduce
  gradients (``require_forward_param_sync``/``require_backward_grad_sync``
  off, what ``no_sync`` does), and every user group answers locally, so
  survivors hosting different numbers of ranks stay in step;
* **the gradient set aside**: a post-accumulate-grad hook moves each
  parameter's gradient into a stash as backward produces it, so the body's
  own gradient clipping or norm logging sees no gradient (it acts on the
  step's whole gradient later, as in the full world);
* **no update**: every protected optimizer's ``step``/``zero_grad`` and LR
  scheduler's ``step`` do nothing.

Then the survivor's own micro-batch runs as usual, with the stash planted as
the parameters' gradients (``zero_grad`` does nothing until the optimizer has
stepped): its backward adds its own gradient, and DDP's reducer divides by the
*logical* world size (the group object still has size W; its communicator in
a shrunk generation has the survivors only, ``RebindableGroup.build``), so the
reduced gradient is the mean over all W micro-batches: the full world's, up to
the order of the floating-point additions (measured: docs/failure-model.md).

The contract for the step body (docs/configuration.md, ``--lost-node``): it
runs once per hosted rank, so whatever else it does (an EMA update, a counter
in a local variable, a log line) runs that often too; ``job.hosted_rank`` (not
None inside a hosted micro-batch) lets it skip such work.

Pure of the control plane: who hosts which rank is decided by the leader
(:mod:`ckptless.recovery.shrink`); this module only runs micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckptless.data import protects_data_position, set_world
from ckptless.errors import ConfigError, StateError
from ckptless.state import DDPReducerState
from ckptless.state import slot
from ckptless.state import Manifest, dtype_from_name
from ckptless.state import StateRegistry, is_hidden
from ckptless.state import held_from
from ckptless.state import object_subtrees, tensor_indices
from ckptless.state import decode

log = logging.getLogger(__name__)

_COMMON = (nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)


@dataclass
class HostedRank:
    """A lost logical rank this process runs micro-batches for: its rank-bound state, by entry name."""

    rank: int
    states: dict[str, Any] = field(default_factory=dict)


def rank_bound(registry: StateRegistry) -> list[str]:
    """The entries whose state differs between data-parallel replicas: everything but the models,
    optimizers, LR schedulers, hidden (DDP reducer) state and what was declared replicated."""
    replicated = registry.replicated()
    return [name for name, obj in registry.items()
            if not is_hidden(name) and name not in replicated and not isinstance(obj, _COMMON)]


def ddp_modules(registry: StateRegistry) -> list[DistributedDataParallel]:
    """The protected DDP models (their reducers' hidden state objects name them)."""
    return [obj.ddp for _, obj in registry.items() if isinstance(obj, DDPReducerState)]


def from_image(manifest: Manifest, buffer: torch.Tensor, names: list[str]) -> HostedRank:
    """A lost rank's rank-bound state, decoded from the copy of its image this holder keeps.

    ``buffer`` starts at ``held_from(manifest)`` (a holder keeps no replicated prefix); the rank-bound
    entries are never in that prefix. Every tensor is cloned: the holder's slot is reused."""
    base = held_from(manifest)
    subtrees = object_subtrees(manifest.tree)
    states: dict[str, Any] = {}
    for name in names:
        sub = subtrees.get(name)
        if sub is None:
            raise StateError(f"rank {manifest.owner}'s image v{manifest.version} has no {name!r} to host it with")
        wanted = set(tensor_indices(sub, []))
        views: list[torch.Tensor] = []
        for i, e in enumerate(manifest.tensors):
            if i not in wanted:
                views.append(torch.empty(0))
                continue
            if e.offset < base:
                raise StateError(f"rank {manifest.owner}'s {name!r} lies in its replicated prefix")
            views.append(slot(buffer, replace(e, offset=e.offset - base), dtype_from_name(e.dtype)).clone())
        states[name] = decode(sub, views)
    return HostedRank(manifest.owner, states)


def why_not_shrinkable(registry: StateRegistry, ddp_modules: list[DistributedDataParallel]) -> str | None:
    """Why this rank's state cannot be run as another rank's micro-batch (None: it can)."""
    for _, obj in registry.items():
        said = getattr(obj, "__ckptless_not_hostable__", None)
        if isinstance(said, str):
            return said
    if not ddp_modules:
        return "no DDP model is protected (fewer ranks keeps the global batch by DDP's gradient accumulation)"
    if not protects_data_position(registry):
        return "no protected object holds the data position: a hosted micro-batch could not read the lost rank's data"
    scalers = [n for n, obj in registry.items() if type(obj).__name__ == "GradScaler"]
    if scalers:
        return f"it protects a GradScaler ({scalers[0]}): its inf checks need the gradients a hosted micro-batch sets aside"
    for ddp in ddp_modules:
        if getattr(ddp, "find_unused_parameters", False):
            return ("a DDP model has find_unused_parameters=True: a parameter used only in a hosted micro-batch "
                    "would keep its unreduced gradient")
        moving = [n for n, b in ddp.module.named_buffers() if b.is_floating_point()]
        if moving:
            return (f"its DDP model has floating-point buffers ({moving[0]}, ...): a BatchNorm's running "
                    "statistics are each rank's own, and a hosted micro-batch would update the host's")
    return None


class MicroBatches:
    """Runs one step as the hosted ranks' micro-batches, then this rank's own (see module doc).

    Drive it with ``enter(r)`` / ``leave(r)`` around each run of the step body: ``r`` a hosted
    rank, in :meth:`order`, then ``None`` for the rank's own micro-batch. ``leave`` after a failed
    run still restores this rank's own state (a recovery then rolls everything back).
    """

    def __init__(self, registry: StateRegistry, own_rank: int, world_size: int, hosted: list[HostedRank],
                 ddp_modules: list[DistributedDataParallel], local_only: Any = None) -> None:
        self.registry = registry
        self.own_rank = own_rank
        self.world_size = world_size
        self.hosted = {h.rank: h for h in hosted}
        self.ddp_modules = ddp_modules
        self._local_only = local_only  # a context manager factory: user groups answer locally
        self._names = rank_bound(registry)
        self._optimizers = [o for _, o in registry.items() if isinstance(o, torch.optim.Optimizer)]
        self._schedulers = [s for _, s in registry.items() if isinstance(s, torch.optim.lr_scheduler.LRScheduler)]
        self._params = [p for d in ddp_modules for p in d.module.parameters() if p.requires_grad]
        self._stash: dict[int, torch.Tensor] = {}
        self._stashing = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._take_grad) for p in self._params]
        self._patched: list[tuple[Any, str, Any]] = []
        self._own: dict[str, Any] = {}
        self._ctx: Any = None
        self._sync_flags: list[tuple[bool, bool]] = []
        self.current: int | None = None  # the hosted rank whose micro-batch runs now

    def order(self) -> list[int]:
        return sorted(self.hosted)

    def _zeroing_modules(self) -> list[Any]:
        return [m for d in self.ddp_modules for m in (d, d.module)]

    # --- gradients ----------------------------------------------------------------------------------
    def _take_grad(self, p: torch.Tensor) -> None:
        if not self._stashing or p.grad is None:
            return
        held = self._stash.get(id(p))
        if held is None:
            self._stash[id(p)] = p.grad.detach().clone()
        else:
            held.add_(p.grad)
        p.grad = None

    def _plant(self) -> None:
        for p in self._params:
            held = self._stash.pop(id(p), None)
            if held is not None:
                p.grad = held
        self._stash.clear()

    # --- suppression ---------------------------------------------------------------------------------
    def _suppress(self, obj: Any, method: str) -> None:
        self._patched.append((obj, method, obj.__dict__.get(method)))
        setattr(obj, method, lambda *_a, **_k: None)

    def _unpatch(self, only: Any = None) -> None:
        """Put back what was suppressed (``only``: on that object alone), newest first."""
        kept = []
        while self._patched:
            obj, method, prev = self._patched.pop()
            if only is not None and obj is not only:
                kept.append((obj, method, prev))
                continue
            if prev is None:
                obj.__dict__.pop(method, None)
            else:
                setattr(obj, method, prev)
        self._patched = kept[::-1]

    # --- state --------------------------------------------------------------------------------------
    def _swap_in(self, rank: int) -> None:
        """Load ``rank``'s rank-bound state; on an error, this rank's own is put back before it propagates."""
        h = self.hosted[rank]
        done: list[str] = []
        try:
            for name in self._names:
                obj = self.registry[name]
                if name not in h.states:
                    raise ConfigError("hosted rank", rank, f"has no state for its protected {name!r}")
                self._own[name] = obj.state_dict()
                done.append(name)
                set_world(obj, rank, self.world_size)
                obj.load_state_dict(h.states[name])
        except BaseException:
            for name in done:
                obj = self.registry[name]
                set_world(obj, self.own_rank, self.world_size)
                obj.load_state_dict(self._own.pop(name))
            raise

    def _swap_out(self, rank: int) -> None:
        h = self.hosted[rank]
        for name in self._names:
            obj = self.registry[name]
            h.states[name] = obj.state_dict()
            set_world(obj, self.own_rank, self.world_size)
            obj.load_state_dict(self._own.pop(name))

    # --- the protocol -------------------------------------------------------------------------------
    def enter(self, rank: int | None) -> None:
        if rank is None:
            if self._stash:
                self._plant()
                # The planted gradient must reach the step: no zero_grad (the optimizer's, or the model's,
                # which many scripts call instead) until an optimizer stepped.
                for m in self._zeroing_modules():
                    self._suppress(m, "zero_grad")
                for opt in self._optimizers:
                    self._suppress(opt, "zero_grad")
                    self._suppress_until_step(opt)
            return
        if rank not in self.hosted:
            raise ConfigError("hosted rank", rank, f"is not hosted by rank {self.own_rank}")
        self.current = rank
        self._swap_in(rank)
        self._sync_flags = [(d.require_backward_grad_sync, d.require_forward_param_sync) for d in self.ddp_modules]
        for d in self.ddp_modules:
            d.require_backward_grad_sync = False
            d.require_forward_param_sync = False
        for opt in self._optimizers:
            self._suppress(opt, "step")
        for s in self._schedulers:
            self._suppress(s, "step")
        self._stashing = True
        if self._local_only is not None:
            self._ctx = self._local_only()
            self._ctx.__enter__()

    def _suppress_until_step(self, opt: Any) -> None:
        """``opt.zero_grad`` does nothing until ``opt.step`` ran (then it is the real one again)."""
        real_step = opt.__dict__.get("step")

        def step(*a: Any, **k: Any) -> Any:
            self._unpatch(only=opt)  # its zero_grad and this wrapper go; the real step runs
            for m in self._zeroing_modules():
                self._unpatch(only=m)
            return (real_step if real_step is not None else type(opt).step.__get__(opt))(*a, **k)

        self._patched.append((opt, "step", real_step))
        opt.step = step

    def leave(self, rank: int | None) -> None:
        if rank is None:
            self._unpatch()
            self._stash.clear()
            return
        try:
            if self._ctx is not None:
                self._ctx.__exit__(None, None, None)
                self._ctx = None
        finally:
            self._stashing = False
            self._unpatch()
            for d, (backward, forward) in zip(self.ddp_modules, self._sync_flags):
                d.require_backward_grad_sync = backward
                d.require_forward_param_sync = forward
            self._swap_out(rank)
            self.current = None

    @contextmanager
    def state_of(self, rank: int) -> Iterator[None]:
        """Hosted rank ``rank``'s rank-bound state swapped in (to capture its image), nothing else."""
        self._swap_in(rank)
        try:
            yield
        finally:
            self._swap_out(rank)

    @contextmanager
    def micro_batch(self, rank: int | None) -> Iterator[None]:
        self.enter(rank)
        try:
            yield
        finally:
            self.leave(rank)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._unpatch()
        self._stash.clear()
