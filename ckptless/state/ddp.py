"""A DDP reducer's bucket state as protected state: captured per step, restored exactly.

Why: a ``DistributedDataParallel`` reducer moves through three phases that
change what a step computes (measured on torch 2.13, Gloo):

* ``fresh``: the constructor's layout (one bucket per dtype, parameter order);
* ``pushed``: the first synchronised backward recorded the order in which
  gradients became ready; the next forward rebuilds the buckets from rank 0's
  order (a broadcast);
* ``rebuilt``: the final layout.

Every rank must be in the same phase with the same layout, and a resumed run
must be in the phase the fault-free run had after the restored step, or the
first collective after a recovery aborts on a size mismatch or the gradients
are summed in another order (different bits). A replacement builds a fresh
reducer; a survivor may be ahead of the restored step or stopped half way
through a backward. So the reducer's phase, the ready order and the bucket
layout are captured with the model, as a hidden protected object, and
restoring it drives the live reducer to exactly that state:

* already there, and untouched since the last completed step: nothing to do;
* ``fresh``: ``_reset_state()``, or a new reducer built the way DDP itself
  rebuilds one when unpickled if the live layout is no longer the initial one;
* ``pushed``/``rebuilt``: reset, then *replay*: a dummy backward fires the
  reducer's autograd hook for each parameter in the recorded order (for
  ``rebuilt``, the flattened bucket layout, which reproduces it) and, for
  ``rebuilt``, ``_rebuild_buckets()``; the resulting layout is checked.

The replay runs the reducer's bucket all-reduce and bucket-order broadcast:
every rank replays its own captured facts, so these must be answered locally.
**Restore inside** ``ckptless.worker.groups.local_only()``; otherwise
:meth:`DDPReducerState.load_state_dict` raises :class:`StateError` before it
touches the reducer. Gradients are not protected state: restoring sets every
reducer parameter's ``grad`` to None (a failed step may have left partial
ones, or bucket views).

Tracking needs hooks installed at ``protect`` time (a forward pre-hook on
the DDP module, which also marks the reducer touched; a post-accumulate-grad
hook per parameter, removed once the first backward's order is recorded) and
one call per completed step, :meth:`StateRegistry.step_done` (it marks the
reducer untouched, which lets a survivor skip the replay).

Supported: ``find_unused_parameters=False``, ``static_graph=False``, no comm
hook, no DDP mixed precision (all refused at ``protect``), any
``gradient_as_bucket_view``, ``bucket_cap_mb``.

Private torch 2.13 APIs used (pinned by ``tests/e2e/test_state_ddp_fsdp.py``):
``DistributedDataParallel._has_rebuilt_buckets``, ``._comm_hooks``,
``._build_params_for_reducer``, ``._build_debug_param_to_name_mapping``,
``._ddp_init_helper``, ``._use_python_reducer``,
``._delay_all_reduce_all_params``; ``Reducer._autograd_hook``,
``._rebuild_buckets``, ``._reset_state``, ``._get_zeros_like_grad_buckets``,
``._remove_autograd_hooks``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptless.errors import ConfigError, StateError
from ckptless.state.local_groups import AnswersLocally

HIDDEN_PREFIX = "__ddp__"
"""Registry names starting with this are the hidden reducer objects (reserved)."""

PHASES = ("fresh", "pushed", "rebuilt")


def hidden_name(name: str) -> str:
    return HIDDEN_PREFIX + name


def check_supported(ddp: nn.parallel.DistributedDataParallel, name: str) -> None:
    """Refuse DDP configurations whose reducer state the replay does not reproduce."""
    why = []
    if ddp.find_unused_parameters:
        why.append("find_unused_parameters=True (buckets are rebuilt differently)")
    if ddp.static_graph:
        why.append("static_graph=True")
    if getattr(ddp, "_comm_hooks", None):
        why.append("a registered comm hook (its state is not protected and the replay would run it)")
    if ddp.mixed_precision is not None:
        why.append("DDP mixed_precision")
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        why.append("the Python reducer / delayed all-reduce of all parameters")
    if getattr(ddp, "_has_rebuilt_buckets", False):
        why.append("buckets already rebuilt: protect the model before its first training step")
    if why:
        raise ConfigError(name, type(ddp).__name__, "DDP reducer state cannot be restored exactly with " +
                          "; ".join(why))


def _reducer_params(ddp: nn.parallel.DistributedDataParallel) -> list[nn.Parameter]:
    """The reducer's parameters by index: what ``_build_params_for_reducer`` lists, without its side effects."""
    seen: set[int] = set()
    out = []
    for mname, mod in ddp.module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and f"{mname}.{pname}" not in ddp.parameters_to_ignore and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class _Fire(torch.autograd.Function):
    """A backward that fires the reducer's per-parameter hook in a given order (the replay)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fire: Callable[[], None]) -> torch.Tensor:
        ctx.fire = fire
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fire()
        return grad, None


class DDPReducerState:
    """The hidden Stateful for one protected DDP module (registered as ``__ddp__<name>``).

    ``state_dict()`` is ``{"phase": "fresh"|"pushed"|"rebuilt", "order": [int]
    or None, "layout": [[int]], "forward_sync": bool}``: parameter indices as
    the reducer numbers them (its parameters that require grad, in module
    order). ``order`` is this rank's grad-ready order of its first
    synchronised backward (None before it completed); ``layout`` the buckets
    as they are now. ``forward_sync`` is DDP's ``require_forward_param_sync``:
    whether its next forward broadcasts the module's buffers. A forward under
    ``no_grad`` (an eval pass) clears it, a training forward sets it; a
    replacement's new DDP starts with it set, so without it a rank restored
    after an eval forward would broadcast while its peers did not (a hang).
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, name: str) -> None:
        check_supported(ddp, name)
        self._ddp = ddp
        self._name = name
        self._params = _reducer_params(ddp)
        self._n = len(self._params)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._fresh_layout = self._read_layout()
        if sorted(i for b in self._fresh_layout for i in b) != list(range(self._n)):
            raise ConfigError(name, type(ddp).__name__, "the reducer's buckets do not hold exactly the module's "
                                                        "parameters that require grad (cannot track its order)")
        self._layout = self._fresh_layout
        self._layout_rebuilt = False
        self._order: list[int] | None = None
        self._pushing: list[int] = []
        self._armed = False
        self._dirty = False
        self.last_action = ""
        """What the last ``load_state_dict`` did: "kept" (already there), "reset", "new reducer",
        "replayed pushed" or "replayed rebuilt" (worth a log line on a survivor)."""
        self._forward_hook = ddp.register_forward_pre_hook(self._on_forward)
        self._grad_hooks: list[Any] = []
        self._watch_grads(True)

    # --- tracking ---------------------------------------------------------------------------

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel:
        """The DDP model whose reducer this tracks."""
        return self._ddp
    def _on_forward(self, _module: nn.Module, _args: Any) -> None:
        self._dirty = True
        # DDP arms its reducer (prepare_for_backward) exactly under these conditions.
        self._armed = torch.is_grad_enabled() and bool(self._ddp.require_backward_grad_sync)

    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            # The reducer records the ready order only in its first armed backward, before a rebuild.
            if self._armed and self._order is None and not self._ddp._has_rebuilt_buckets:
                self._pushing.append(i)
                if len(self._pushing) == self._n:
                    self._order, self._pushing = self._pushing, []
                    self._watch_grads(False)  # recorded: no per-parameter Python call in later backwards
        return hook

    def _watch_grads(self, on: bool) -> None:
        """Per-parameter hooks exist only while the order is still to be recorded."""
        if on and not self._grad_hooks:
            self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(i))
                                for i, p in enumerate(self._params)]
        elif not on:
            for h in self._grad_hooks:
                h.remove()
            self._grad_hooks = []

    def step_done(self) -> None:
        """A training step completed: the live reducer is in a state worth keeping as is."""
        self._dirty = False

    def close(self) -> None:
        """Remove the tracking hooks (the model is no longer protected)."""
        self._watch_grads(False)
        self._forward_hook.remove()

    @property
    def phase(self) -> str:
        if self._ddp._has_rebuilt_buckets:
            return "rebuilt"
        return "pushed" if self._order is not None else "fresh"

    def _read_layout(self) -> list[list[int]]:
        """Bucket layout by parameter index (allocates one zeroed copy of the buckets: call sparingly)."""
        try:
            return [[self._index[id(p)] for p in b.parameters()]
                    for b in self._ddp.reducer._get_zeros_like_grad_buckets()]
        except KeyError as exc:
            raise StateError(f"{self._name}: a reducer bucket holds a parameter the module does not list") from exc

    def _current_layout(self) -> list[list[int]]:
        rebuilt = bool(self._ddp._has_rebuilt_buckets)
        if rebuilt != self._layout_rebuilt:  # the layout changes only when the buckets are rebuilt
            self._layout, self._layout_rebuilt = self._read_layout(), rebuilt
        return self._layout

    # --- Stateful -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "order": None if self._order is None else list(self._order),
                "layout": [list(b) for b in self._current_layout()],
                "forward_sync": bool(self._ddp.require_forward_param_sync)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Bring the live reducer to the captured phase and layout (inside ``groups.local_only()``)."""
        phase, order, layout = self._parse(state_dict)
        self._load_reducer(phase, order, layout)
        self._ddp.require_forward_param_sync = bool(state_dict.get("forward_sync", True))

    def _load_reducer(self, phase: str, order: list[int] | None, layout: list[list[int]]) -> None:
        if not self._dirty and self.phase == phase and self._same(phase, order, layout):
            self._pushing = []
            self._clear_grads()
            self.last_action = "kept"
            return
        self._require_local()
        if getattr(self._ddp, "_comm_hooks", None):
            raise StateError(f"{self._name}: a comm hook was registered after protect(); the replay would run it")
        self._clear_grads()
        ddp = self._ddp
        if phase == "fresh":
            self.last_action = "reset"
            if self._read_layout() != self._fresh_layout:
                self._new_reducer()
                self.last_action = "new reducer"
            ddp.reducer._reset_state()
            ddp._has_rebuilt_buckets = False
        else:
            ddp.reducer._reset_state()
            ddp._has_rebuilt_buckets = False
            replay = order if phase == "pushed" else [i for b in layout for i in b]
            assert replay is not None
            self._replay(replay, rebuild=phase == "rebuilt")
            self.last_action = f"replayed {phase}"
        self._order = None if order is None else list(order)
        self._pushing, self._armed, self._dirty = [], False, False
        self._watch_grads(self._order is None)
        self._layout, self._layout_rebuilt = self._read_layout(), bool(ddp._has_rebuilt_buckets)
        if phase != "pushed" and self._layout != layout:
            raise StateError(f"{self._name}: replaying the DDP reducer gave bucket layout {self._layout}, "
                             f"the image has {layout}")
        self._clear_grads()

    def _parse(self, sd: Any) -> tuple[str, list[int] | None, list[list[int]]]:
        where = f"{self._name} DDP reducer state"
        if not isinstance(sd, dict) or set(sd) - {"forward_sync"} != {"phase", "order", "layout"}:
            got = sorted(map(str, sd))[:5] if isinstance(sd, dict) else type(sd).__name__
            raise StateError(f"{where}: expected keys phase, order, layout (and forward_sync), got {got}")
        if type(sd.get("forward_sync", True)) is not bool:
            raise StateError(f"{where}: forward_sync must be a bool, got {sd['forward_sync']!r}")
        phase, order, layout = sd["phase"], sd["order"], sd["layout"]
        if phase not in PHASES:
            raise StateError(f"{where}: unknown phase {phase!r}")
        every = list(range(self._n))
        if order is not None and (type(order) is not list or any(type(i) is not int for i in order)
                                  or sorted(order) != every):
            raise StateError(f"{where}: order is not a permutation of the {self._n} parameter indices")
        if (type(layout) is not list or any(type(b) is not list or not b for b in layout)
                or any(type(i) is not int for b in layout for i in b) or sorted(i for b in layout for i in b) != every):
            raise StateError(f"{where}: layout is not a partition of the {self._n} parameter indices")
        if phase == "pushed" and order is None:
            raise StateError(f"{where}: phase 'pushed' without a recorded order")
        if phase == "fresh" and layout != self._fresh_layout:
            raise StateError(f"{where}: initial bucket layout {layout} differs from this reducer's "
                             f"{self._fresh_layout} (another model or bucket size?)")
        return phase, order, layout

    def _same(self, phase: str, order: list[int] | None, layout: list[list[int]]) -> bool:
        if phase == "pushed":  # the next forward rebuilds from the order; the current layout is never used
            return self._order == order
        return self._current_layout() == layout

    def _require_local(self) -> None:
        """Replaying runs collectives: only allowed where every one of them stays in this process."""
        pg = self._ddp.process_group
        if pg.size() == 1:
            return
        if isinstance(pg, AnswersLocally) and pg.answers_locally():  # a ckptless group (worker/rebindable.py)
            return
        raise StateError(
            f"{self._name}: restoring a DDP reducer replays its bucket all-reduce and broadcast, which must stay "
            "local: call restore() inside ckptless.worker.groups.local_only() (the DDP's process group must be a "
            f"ckptless group; it is {type(pg).__name__}, not answering locally)")

    def _new_reducer(self) -> None:
        """A reducer in its constructor's state, built the way DDP rebuilds one when unpickled (no collective)."""
        ddp = self._ddp
        ddp.reducer._remove_autograd_hooks()
        params, sparse = ddp._build_params_for_reducer()
        ddp._ddp_init_helper(params, sparse, ddp._build_debug_param_to_name_mapping(params), ddp.static_graph)
        ddp._has_rebuilt_buckets = False

    def _replay(self, order: list[int], rebuild: bool) -> None:
        red = self._ddp.reducer

        def fire() -> None:
            for i in order:
                # records i as ready (the order) and marks its gradient ready
                red._autograd_hook(i)  # type: ignore[attr-defined]

        red.prepare_for_backward([])
        x = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            _Fire.apply(x, fire).backward()  # the reducer finalizes in the backward's final callback
        if rebuild:
            if not red._rebuild_buckets():
                raise StateError(f"{self._name}: the DDP reducer did not rebuild its buckets on replay")
            self._ddp._has_rebuilt_buckets = True

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None


__all__ = ["DDPReducerState", "HIDDEN_PREFIX", "PHASES", "check_supported", "hidden_name"]
