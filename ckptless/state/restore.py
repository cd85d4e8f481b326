"""Restore a state image into the registry's objects, exactly; in place where provable.

Two ways to load one object, with bitwise-identical results:

* **in place** (:mod:`ckptless.state.inplace`): copy each image tensor into
  the tensor the object already holds at the same path. Survivors rolling
  back take this path for their model and optimizer: memcpy speed, no
  allocation, tensor identities kept.
* **clone**: fresh clones of the object's tensors handed to its
  ``load_state_dict`` (the only way before issue 9). Used for every object
  without a plan: the RNG streams, the data position, schedulers, scalers,
  user extras, and a model/optimizer whose live state does not match the
  image (a fresh replacement's optimizer has no moments yet). A tensor bound
  for a GPU is not cloned on the CPU first: it is copied from the buffer
  straight to the rank's device (``decode``'s device copy *is* the clone).

Either way nothing the objects keep aliases the image buffer, which the
mirror reuses for the next capture. Host-to-device copies are issued
``non_blocking`` (asynchronous from a page-locked buffer) and waited for
once, with a deadline, before :func:`restore` returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from ckptless.errors import ManifestError, StateError
from ckptless.state import checksum, devices, inplace, streams
from ckptless.state.dtensor import Meshes
from ckptless.state.image import StateImage, check_buffer, slot
from ckptless.state.manifest import dtype_from_name
from ckptless.state.registry import StateRegistry, is_hidden
from ckptless.state.tree import decode


@dataclass(frozen=True)
class ObjectRestore:
    """How one protected object was restored."""

    name: str
    in_place: bool
    tensors: int
    nbytes: int
    reason: str = ""
    """Why the clone path was used ("" when in place)."""


@dataclass(frozen=True)
class RestoreReport:
    """What :func:`restore` did, per object in registry order, and how long it took."""

    objects: tuple[ObjectRestore, ...]
    verify_s: float
    load_s: float

    @property
    def in_place_bytes(self) -> int:
        return sum(o.nbytes for o in self.objects if o.in_place)

    @property
    def cloned_bytes(self) -> int:
        return sum(o.nbytes for o in self.objects if not o.in_place)

    def fallbacks(self) -> list[ObjectRestore]:
        """Objects with tensors that went the clone path (worth a log line on a survivor)."""
        return [o for o in self.objects if not o.in_place and o.tensors]


class _Clones(Sequence[torch.Tensor]):
    """Image tensors cloned on first use, each once (what ``decode`` places for the clone path).

    Tensors bound for a device (``on_device``) are handed over as views: ``decode`` copies them to
    the device, which leaves nothing aliasing the buffer, without a CPU clone in between."""

    def __init__(self, views: list[torch.Tensor], on_device: frozenset[int] = frozenset()) -> None:
        self._views = views
        self._on_device = on_device
        self._done: dict[int, torch.Tensor] = {}

    @property
    def has_device(self) -> bool:
        return bool(self._on_device)

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(i, slice):
            raise TypeError("slicing is not supported")
        if i in self._on_device:
            return self._views[i]
        t = self._done.get(i)
        if t is None:
            t = self._done[i] = self._views[i].clone()
        return t


class _Overlay(Sequence[torch.Tensor]):
    """Live tensors where a plan copied into them, clones elsewhere."""

    def __init__(self, base: _Clones, live: dict[int, torch.Tensor]) -> None:
        self._base = base
        self._live = live

    def __len__(self) -> int:
        return len(self._base)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(i, slice):
            raise TypeError("slicing is not supported")
        t = self._live.get(i)
        return self._base[i] if t is None else t


def object_subtrees(tree: Any) -> dict[str, Any]:
    """``name -> subtree`` of the (validated) root node."""
    ((tag, val),) = tree.items()
    items = val if tag == "d" else val[0]
    return {k: v for k, v in items}


def tensor_indices(node: Any, out: list[int], devices_only: bool = False) -> list[int]:
    """Indices of the tensors under ``node``; ``devices_only``: those the tree places on a device
    (``{"Td": ...}``, also as a DTensor's shard)."""
    if type(node) is list:
        for v in node:
            tensor_indices(v, out, devices_only)
    elif type(node) is dict and len(node) == 1:
        ((tag, val),) = node.items()
        if tag in ("T", "N"):
            if not devices_only:
                out.append(val)
        elif tag == "Td":
            out.append(val[0])
        elif tag == "DT":
            tensor_indices(val[0], out, devices_only)
        elif tag == "d":
            for _, v in val:
                tensor_indices(v, out, devices_only)
        elif tag in ("o", "t"):
            tensor_indices(val, out, devices_only)
    return out


def restore(registry: StateRegistry, image: StateImage, verify: bool = True, in_place: bool = True,
            timeout_s: float = 60.0) -> RestoreReport:
    """Load ``image`` into the registry's objects, exactly.

    Order of checks, all before any object is touched: buffer shape, manifest
    structure, checksums (:class:`IntegrityError`), the tree, and that the
    image holds exactly the registry's object names. Then objects are loaded
    in registry order (``rng`` last), each in place where
    :mod:`ckptless.state.inplace` finds a plan, else from fresh clones via
    its ``load_state_dict``; ``in_place=False`` forces clones everywhere.
    Both give the same bits; the returned report says which was used.
    DTensor leaves are copied into the live DTensor's local shard in place,
    or rebuilt on the matching live device mesh (:mod:`ckptless.state.dtensor`).
    A hidden DDP reducer object (see :mod:`ckptless.state.ddp`) replays
    collectives: call this inside ``ckptless.worker.groups.local_only()``.
    If loading an object fails, objects before it in registry order are
    already loaded: treat the process state as undefined and restore again.
    """
    t0 = time.perf_counter()
    m = image.manifest
    buf = image.buffer
    check_buffer(buf, "image buffer")
    m.validate()
    if buf.numel() < m.total_bytes:
        raise ManifestError(f"image buffer has {buf.numel()} bytes, manifest says {m.total_bytes}")
    if verify:
        checksum.verify(
            buf, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes,
            what=f"image of owner {m.owner} version {m.version} (generation {m.generation})",
        )
    views = [slot(buf, e, dtype_from_name(e.dtype)) for e in m.tensors]
    meshes = Meshes(obj for _, obj in registry.items())
    states = decode(m.tree, views, move=False, meshes=meshes)  # validation only: zero-copy views, nothing moved
    if not isinstance(states, dict) or not all(isinstance(k, str) for k in states):
        raise ManifestError("state tree root is not a dict of object names")
    want, have = set(registry.names()), set(states)
    # A hidden DDP-reducer object in the image has nothing to load into where the
    # restoring process protects a plain module: its model state is the same.
    have -= {n for n in have - want if is_hidden(n)}
    if want != have:
        raise StateError(
            f"image objects {sorted(have)} do not match protected objects {sorted(want)}"
            f" (missing from image: {sorted(want - have)}, unknown: {sorted(have - want)})"
        )
    subtrees = object_subtrees(m.tree)
    t1 = time.perf_counter()
    clones = _Clones(views, frozenset(tensor_indices(m.tree, [], devices_only=True)))
    done: list[ObjectRestore] = []
    touched: set[torch.device] = set()
    try:
        for name, obj in registry.items():
            done.append(_load_one(name, obj, subtrees[name], m, buf, views, clones, meshes, in_place, touched))
    finally:
        # Every device copy was asynchronous: the buffer is reused (the next capture, another restore)
        # once they are done, also when a later object failed to load.
        cuda = {d for d in touched if d.type == "cuda"}
        if clones.has_device and torch.cuda.is_available():
            cuda.add(devices.target("cuda"))  # where decode copied the clone path's device tensors
        if cuda:
            streams.sync_devices(cuda, timeout_s, f"restoring image v{m.version} of owner {m.owner}")
    return RestoreReport(tuple(done), verify_s=t1 - t0, load_s=time.perf_counter() - t1)


def _load_one(name: str, obj: Any, sub: Any, m: Any, buf: torch.Tensor, views: list[torch.Tensor],
              clones: _Clones, meshes: Meshes, in_place: bool, touched: set[torch.device]) -> ObjectRestore:
    """Load one protected object, in place where a plan exists, else from clones; ``touched`` collects
    the devices written asynchronously (the caller waits for them)."""
    idx = tensor_indices(sub, [])
    nbytes = sum(m.tensors[i].nbytes for i in idx)
    plan: inplace.InPlacePlan | None = None
    reason = "in_place=False" if not in_place else "no tensors"
    if in_place and idx:
        try:
            plan = inplace.plan(obj, sub, m.tensors, buf)
        except inplace.NoPlan as why:
            reason = str(why)
    try:
        if plan is not None:
            _copy(name, plan, views, touched)
            if plan.load:
                live = {t.index: t.live if t.keep is None else t.keep for t in plan.targets}
                obj.load_state_dict(decode(sub, _Overlay(clones, live), meshes=meshes))
        else:
            obj.load_state_dict(decode(sub, clones, meshes=meshes))
    except StateError:
        raise
    except Exception as exc:
        raise StateError(f"{name}.load_state_dict() failed: {exc}") from exc
    return ObjectRestore(name, plan is not None, len(idx), nbytes, "" if plan is not None else reason)


def _copy(name: str, plan: inplace.InPlacePlan, views: list[torch.Tensor], written: set[torch.device]) -> None:
    """The plan's copies into live tensors (device ones asynchronous); ``written`` gets their devices."""
    with torch.no_grad():
        for t in plan.targets:
            try:
                on_device = t.live.device.type != "cpu"
                t.live.copy_(views[t.index], non_blocking=on_device)
                if on_device:
                    written.add(t.live.device)
            except RuntimeError as exc:
                raise StateError(f"{name}: in-place copy into {t.path} failed: {exc}") from exc
