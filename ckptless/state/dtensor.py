"""DTensor leaves in a state image: the local shard as raw bytes, the layout as typed JSON.

Why: under FSDP2 (and tensor parallelism) model parameters and optimizer
moments are ``DTensor`` s. Each rank's share of the training state is its
*local shard*, so that is what the image stores, as any other tensor; the
distribution (placements, global shape and stride, the device mesh it lives
on) is recorded next to it as plain JSON data, so a peer or the disk path can
validate it without unpickling anything, and a restoring process can rebuild
the exact DTensor around its own mesh object.

Node payload (see :mod:`ckptless.state.tree`)::

    {"DT": [local, placements, shape, stride, mesh]}

* ``local``: the local shard's tensor node (``{"T": i}`` or ``{"Td": [i, dev]}``);
* ``placements``: one entry per mesh dimension: ``["S", dim]`` (``Shard``),
  ``["R"]`` (``Replicate``), ``["P", op]`` (``Partial``, ``op`` one of
  :data:`REDUCE_OPS`);
* ``shape``, ``stride``: the *global* shape and stride;
* ``mesh``: ``[device_type, mesh_shape, dim_names or null, ranks]`` with
  ``ranks`` the mesh's global ranks in row-major order.

Restoring needs a live ``DeviceMesh`` equal to the recorded one (same device
type, shape, dimension names and ranks). :class:`Meshes` finds it among the
protected objects: the meshes of DTensor parameters of protected modules and
optimizers first, then DTensors in the other objects' live state. Nothing
here reshards: an image restores only onto the mesh (hence world size) it was
captured on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptless.errors import ManifestError, StateError

try:  # torch builds without distributed support have no DTensor: nothing to encode then
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - the project's torch has it
    DTensor = None  # type: ignore[assignment, misc]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
"""``Partial`` reduce ops an image may name (the ones DTensor implements)."""


def is_dtensor(obj: Any) -> bool:
    return DTensor is not None and isinstance(obj, DTensor)


def local_of(dt: Any) -> torch.Tensor:
    """The live local shard of ``dt`` (shares its memory: copying into it changes ``dt``)."""
    with torch.no_grad():
        return dt.to_local()


def _where(path: str) -> str:
    return path or "<root>"


def _bad(path: str, what: str) -> ManifestError:
    return ManifestError(f"malformed state tree at {_where(path)}: DTensor {what}")


def _ints(raw: Any, path: str, what: str, positive: bool = False) -> tuple[int, ...]:
    if type(raw) is not list or any(type(v) is not int or v < (1 if positive else 0) for v in raw):
        raise _bad(path, f"{what} must be a list of {'positive' if positive else 'non-negative'} ints")
    return tuple(raw)


@dataclass(frozen=True)
class MeshKey:
    """What identifies a device mesh across processes (its Python object does not)."""

    device_type: str
    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, mesh: Any) -> MeshKey:
        names = mesh.mesh_dim_names
        return cls(str(mesh.device_type), tuple(int(s) for s in mesh.shape),
                   None if names is None else tuple(str(n) for n in names),
                   tuple(int(r) for r in mesh.mesh.flatten().tolist()))

    def to_json(self) -> list[Any]:
        return [self.device_type, list(self.shape), None if self.dim_names is None else list(self.dim_names),
                list(self.ranks)]

    @classmethod
    def from_json(cls, raw: Any, path: str) -> MeshKey:
        if type(raw) is not list or len(raw) != 4 or type(raw[0]) is not str or not raw[0]:
            raise _bad(path, "mesh must be [device_type, shape, dim_names, ranks]")
        shape = _ints(raw[1], path, "mesh shape", positive=True)
        if not shape:
            raise _bad(path, "mesh shape is empty")
        names = raw[2]
        if names is not None:
            if type(names) is not list or len(names) != len(shape) or any(type(n) is not str for n in names):
                raise _bad(path, "mesh dim names must be null or one string per mesh dimension")
            names = tuple(names)
        ranks = _ints(raw[3], path, "mesh ranks")
        if len(ranks) != math.prod(shape) or len(set(ranks)) != len(ranks):
            raise _bad(path, f"mesh ranks must be {math.prod(shape)} distinct ints")
        return cls(raw[0], shape, names, ranks)


@dataclass(frozen=True)
class DTensorSpec:
    """A DTensor's distribution as plain data (validated both ways)."""

    placements: tuple[tuple[Any, ...], ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    mesh: MeshKey

    @classmethod
    def of(cls, dt: Any, path: str) -> DTensorSpec:
        """The spec of a live DTensor; unsupported placements raise :class:`StateError`."""
        placements: list[tuple[Any, ...]] = []
        for p in dt.placements:
            kind = type(p)
            if kind is Shard:
                placements.append(("S", int(p.dim)))
            elif kind is Replicate:
                placements.append(("R",))
            elif kind is Partial and p.reduce_op in REDUCE_OPS:
                placements.append(("P", str(p.reduce_op)))
            else:
                raise StateError(f"cannot capture {_where(path)}: DTensor placement {p!r} is not supported "
                                 f"(only Shard, Replicate and Partial({'/'.join(REDUCE_OPS)}))")
        return cls(tuple(placements), tuple(int(s) for s in dt.shape), tuple(int(s) for s in dt.stride()),
                   MeshKey.of(dt.device_mesh))

    def to_json(self) -> list[Any]:
        return [[list(p) for p in self.placements], list(self.shape), list(self.stride), self.mesh.to_json()]

    @classmethod
    def from_json(cls, raw: Any, path: str) -> DTensorSpec:
        if type(raw) is not list or len(raw) != 4:
            raise _bad(path, "payload must be [local, placements, shape, stride, mesh]")
        shape = _ints(raw[1], path, "shape")
        stride = _ints(raw[2], path, "stride")
        if len(stride) != len(shape):
            raise _bad(path, "stride and shape differ in length")
        mesh = MeshKey.from_json(raw[3], path)
        if type(raw[0]) is not list or len(raw[0]) != len(mesh.shape):
            raise _bad(path, "placements must be a list with one entry per mesh dimension")
        placements: list[tuple[Any, ...]] = []
        for p in raw[0]:
            if p == ["R"]:
                placements.append(("R",))
            elif type(p) is list and len(p) == 2 and p[0] == "S" and type(p[1]) is int and 0 <= p[1] < len(shape):
                placements.append(("S", p[1]))
            elif type(p) is list and len(p) == 2 and p[0] == "P" and p[1] in REDUCE_OPS:
                placements.append(("P", p[1]))
            else:
                raise _bad(path, f"placement {p!r} is not one of ['S', dim < {len(shape)}], ['R'], ['P', op]")
        return cls(tuple(placements), shape, stride, mesh)

    def check_local(self, local: torch.Tensor, path: str) -> None:
        """The local shard fits the global shape: same rank; unsharded dims equal, sharded ones no larger."""
        sharded = {p[1] for p in self.placements if p[0] == "S"}
        if local.dim() != len(self.shape) or any(
            (ls > gs) if d in sharded else (ls != gs) for d, (ls, gs) in enumerate(zip(local.shape, self.shape))
        ):
            raise _bad(path, f"local shard {tuple(local.shape)} does not fit global shape {self.shape} "
                             f"with placements {[list(p) for p in self.placements]}")

    def torch_placements(self) -> tuple[Any, ...]:
        return tuple(Shard(p[1]) if p[0] == "S" else Replicate() if p[0] == "R" else Partial(p[1])
                     for p in self.placements)

    def build(self, local: torch.Tensor, mesh: Any) -> Any:
        """A DTensor around ``local`` (kept, not copied) on ``mesh``; no collective (``run_check=False``)."""
        with torch.no_grad():
            return DTensor.from_local(local, mesh, self.torch_placements(), run_check=False,
                                      shape=torch.Size(self.shape), stride=self.stride)


class Meshes:
    """Finds the live ``DeviceMesh`` a recorded DTensor belongs on, among the protected objects.

    Scanned lazily and at most once per source kind: first the DTensor
    parameters of protected modules and optimizers (cheap: no ``state_dict``
    call), and only if that finds no match, DTensors anywhere in the other
    objects' live ``state_dict()``.
    """

    def __init__(self, objects: Iterable[Any]) -> None:
        self._objects = list(objects)
        self._found: dict[MeshKey, Any] = {}
        self._scanned_params = False
        self._scanned_states = False

    def _add(self, t: Any) -> None:
        if is_dtensor(t):
            self._found.setdefault(MeshKey.of(t.device_mesh), t.device_mesh)

    def _scan_params(self) -> None:
        self._scanned_params = True
        for obj in self._objects:
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    self._add(p)
                for b in obj.buffers():
                    self._add(b)
            elif isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    for p in group["params"]:
                        self._add(p)

    def _scan_states(self) -> None:
        self._scanned_states = True
        for obj in self._objects:
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or not callable(
                getattr(obj, "state_dict", None)
            ):
                continue
            try:
                self._walk(obj.state_dict(), 0)
            except Exception:  # an object that cannot report its state offers no mesh; its own load will tell
                continue

    def _walk(self, node: Any, depth: int) -> None:
        if depth > 32:
            return
        if is_dtensor(node):
            self._add(node)
        elif isinstance(node, Mapping):
            for v in node.values():
                self._walk(v, depth + 1)
        elif isinstance(node, (list, tuple)):
            for v in node:
                self._walk(v, depth + 1)

    def find(self, key: MeshKey, path: str) -> Any:
        """The live mesh equal to ``key``, or :class:`StateError` naming ``path``."""
        if key not in self._found and not self._scanned_params:
            self._scan_params()
        if key not in self._found and not self._scanned_states:
            self._scan_states()
        mesh = self._found.get(key)
        if mesh is None:
            raise StateError(
                f"cannot restore {_where(path)}: no protected object lives on a device mesh "
                f"{key.device_type} {list(key.shape)} (dims {key.dim_names}, ranks {list(key.ranks)}); "
                f"meshes seen: {[[k.device_type, list(k.shape), k.dim_names] for k in self._found] or 'none'} "
                "(build the model with fully_shard / the same mesh before restoring; resharding onto another "
                "mesh is not supported)")
        return mesh


def same_layout(live: Any, spec: DTensorSpec | Any) -> bool:
    """Does the live DTensor have exactly ``spec``'s distribution (``spec`` may be another DTensor)?

    Unsupported placements compare unequal (the caller then takes its slow path)."""
    try:
        if is_dtensor(spec):
            spec = DTensorSpec.of(spec, "")
        return DTensorSpec.of(live, "") == spec
    except StateError:
        return False


__all__ = ["DTensorSpec", "MeshKey", "Meshes", "REDUCE_OPS", "is_dtensor", "local_of", "same_layout"]
