"""Which objects make up a rank's training state, under which names.

Why a registry: capture and restore must agree on the exact set of objects
and their names across processes (a replacement rebuilds a lost rank's state
from an image another process captured), so names are validated once, up
front, and the RNG streams are included automatically under the reserved
name ``"rng"`` so user code cannot forget them.

A ``DistributedDataParallel`` model also brings a hidden object,
``__ddp__<name>`` (:mod:`ckptless.state.ddp`): its reducer's bucket phase,
ready order and layout, which a resumed run must match exactly.

What the job loop calls besides capture/restore: :meth:`StateRegistry.step_done`
after every completed step, and :meth:`StateRegistry.reset_after_failure`
on a survivor after a failed generation's groups were released.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from torch import nn

from ckptless.errors import ConfigError
from ckptless.state import fsdp
from ckptless.state.ddp import HIDDEN_PREFIX, DDPReducerState, check_supported, hidden_name
from ckptless.state.replication import ReplicaSet, of_group
from ckptless.state.rng import RNGState

RNG_NAME = "rng"


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's ``Stateful`` protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def is_hidden(name: str) -> bool:
    """Is ``name`` one of the registry's own hidden objects (a DDP reducer's state)?"""
    return name.startswith(HIDDEN_PREFIX)


def _ddp(obj: Any) -> nn.parallel.DistributedDataParallel | None:
    return obj if isinstance(obj, nn.parallel.DistributedDataParallel) else None


def _unwrap(obj: Any) -> Any:
    """Protect a DDP model as its inner module.

    DDP's own state dict is the inner module's with every key prefixed by
    ``module.``; using the inner module keeps the image independent of whether
    the restoring process wraps its model in DDP (a replacement may build
    the model before its process group exists).
    """
    while isinstance(obj, nn.parallel.DistributedDataParallel):
        obj = obj.module
    return obj


class StateRegistry:
    """Ordered, validated name -> ``Stateful`` mapping.

    Iteration yields user objects in ``protect`` order and ``"rng"`` last:
    restoring the RNG after everything else means nothing a user
    ``load_state_dict`` draws can leave the streams off their captured state.
    """

    def __init__(self, include_rng: bool = True) -> None:
        self._objs: dict[str, Stateful] = {}
        self._replicated: dict[str, ReplicaSet] = {}
        self._rng: RNGState | None = RNGState() if include_rng else None

    def protect(self, replicated_over: Any = None, **objs: Any) -> None:
        """Add objects by keyword name; all are validated before any is added.

        Raises :class:`ConfigError` (naming the name and value) when a name is
        not a plain identifier, is reserved, is already protected, or the
        object lacks callable ``state_dict``/``load_state_dict``, or is a DDP
        model whose reducer state cannot be restored exactly (see
        :func:`ckptless.state.ddp.check_supported`).

        A DDP model is protected as its inner module plus the hidden
        ``__ddp__<name>`` reducer state, which installs tracking hooks now:
        protect it before its first training step, and protect the DDP-wrapped
        model in a replacement too (an image with reducer state restores into
        a plain module, not the other way round).

        ``replicated_over`` (a process group or a list of global ranks) declares that every rank of it
        holds these objects identically (a module: its parameters): they are then recovered from a live
        replica instead of mirrored (:mod:`ckptless.state.replication`). A DDP model is declared
        replicated over its process group without asking. A wrong declaration is caught at the first
        mirror round (the replicas' checksums differ) and named.
        """
        declared = None if replicated_over is None else of_group(replicated_over)
        for name, obj in objs.items():
            if not name or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError("name", name, "must be a non-empty Python identifier")
            if name == RNG_NAME:
                raise ConfigError("name", name, "is reserved for the automatically captured RNG streams")
            if is_hidden(name):
                raise ConfigError("name", name, f"names starting with {HIDDEN_PREFIX!r} are reserved")
            if name in self._objs:
                raise ConfigError("name", name, "is already protected")
            for method in ("state_dict", "load_state_dict"):
                if not callable(getattr(obj, method, None)):
                    raise ConfigError(name, obj, f"must implement {method}() (torch.distributed.checkpoint Stateful)")
            ddp = _ddp(obj)
            if ddp is not None:
                check_supported(ddp, name)
        for name, obj in objs.items():
            self._objs[name] = _unwrap(obj)
            ddp = _ddp(obj)
            if ddp is not None:
                self._objs[hidden_name(name)] = DDPReducerState(ddp, name)
            over = declared if declared is not None or ddp is None else of_group(ddp.process_group)
            if over is not None:
                self._replicated[name] = over

    def replicated(self) -> dict[str, ReplicaSet]:
        """Protected name -> the ranks that hold it identically (DDP models, declarations)."""
        return dict(self._replicated)

    def unprotect(self, name: str) -> None:
        """Stop protecting ``name`` (images captured before still include it)."""
        if name not in self._objs or is_hidden(name):
            raise ConfigError("name", name, "is not protected")
        del self._objs[name]
        self._replicated.pop(name, None)
        tracker = self._objs.pop(hidden_name(name), None)
        if isinstance(tracker, DDPReducerState):
            tracker.close()

    def step_done(self) -> None:
        """Call after every completed training step (before or after its capture; cheap).

        It tells each DDP reducer tracker that its reducer is in a step-boundary
        state: a survivor restoring that same state then skips the replay.
        Forgetting it costs a replay per restore, never exactness.
        """
        for obj in self._objs.values():
            if isinstance(obj, DDPReducerState):
                obj.step_done()

    def reset_after_failure(self) -> list[str]:
        """On a survivor, after the failed generation's groups were released and before restoring.

        Resets every protected FSDP2 model's per-iteration state and gradients
        (:func:`ckptless.state.fsdp.reset_after_failure`); returns the names of
        the models it reset. DDP models need nothing here: their restore does it.
        """
        return [name for name, obj in self._objs.items()
                if isinstance(obj, nn.Module) and fsdp.reset_after_failure(obj)]

    def items(self) -> Iterator[tuple[str, Stateful]]:
        yield from self._objs.items()
        if self._rng is not None:
            yield RNG_NAME, self._rng

    def names(self) -> list[str]:
        return [name for name, _ in self.items()]

    def __getitem__(self, name: str) -> Stateful:
        if name == RNG_NAME and self._rng is not None:
            return self._rng
        return self._objs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._objs or (name == RNG_NAME and self._rng is not None)

    def __len__(self) -> int:
        return len(self._objs) + (self._rng is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"StateRegistry({', '.join(self.names())})"
