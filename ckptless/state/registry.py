"""Which objects make up a rank's training state, under which names.

Why a registry: capture and restore must agree on the exact set of objects
and their names across processes (a replacement rebuilds a lost rank's state
from an image another process captured), so names are validated once, up
front, and the RNG streams are included automatically under the reserved
name ``"rng"`` so user code cannot forget them.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from ckptless.errors import ConfigError
from ckptless.state.rng import RNGState

RNG_NAME = "rng"


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's ``Stateful`` protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _unwrap(obj: Any) -> Any:
    """Protect a DDP model as its inner module.

    DDP's own state dict is the inner module's with every key prefixed by
    ``module.``; using the inner module keeps the image independent of whether
    the restoring process wraps its model in DDP (a replacement may build
    the model before its process group exists).
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    while isinstance(obj, ddp):
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
        self._rng: RNGState | None = RNGState() if include_rng else None

    def protect(self, **objs: Any) -> None:
        """Add objects by keyword name; all are validated before any is added.

        Raises :class:`ConfigError` (naming the name and value) when a name is
        not a plain identifier, is reserved, is already protected, or the
        object lacks callable ``state_dict``/``load_state_dict``.
        """
        for name, obj in objs.items():
            if not name or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError("name", name, "must be a non-empty Python identifier")
            if name == RNG_NAME:
                raise ConfigError("name", name, "is reserved for the automatically captured RNG streams")
            if name in self._objs:
                raise ConfigError("name", name, "is already protected")
            for method in ("state_dict", "load_state_dict"):
                if not callable(getattr(obj, method, None)):
                    raise ConfigError(name, obj, f"must implement {method}() (torch.distributed.checkpoint Stateful)")
        for name, obj in objs.items():
            self._objs[name] = _unwrap(obj)

    def unprotect(self, name: str) -> None:
        """Stop protecting ``name`` (images captured before still include it)."""
        if name not in self._objs:
            raise ConfigError("name", name, "is not protected")
        del self._objs[name]

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
