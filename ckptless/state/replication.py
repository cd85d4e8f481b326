"""What a rank's image shares with its data-parallel replicas (issue 21).

Why: every rank of a DDP group (or of HSDP's replicate dimension) holds the
same parameters and optimizer state. Mirroring them to K peers every step, as
if nothing were replicated, moves K x S bytes per rank per step and holds
2K x S more host memory per rank, while a live replica already holds the very
bytes a replacement needs. So an image is laid out in two regions:

* the **replicated prefix** ``[0, bytes)``: the tensors every member of the
  image's :class:`ReplicaSet` holds identically, in image order, padded to a
  whole chunk. It is not mirrored (unless the job asks, ``mirrored``): a
  replacement pulls it from a live replica's own image, verified against the
  lost rank's chunk checksums;
* the **private suffix** ``[bytes, total)``: everything else (buffers, RNG,
  data position, shards that exist once per replica group), mirrored as before.

Replicas must agree bitwise on the prefix at every committed version: its chunk
checksums are compared between replica neighbours in every mirror round
(:mod:`ckptless.mirror.replica_check`), which catches silent data corruption
and a wrong declaration alike.

What is replicated: a DDP model's *parameters* (its buffers are not: a BatchNorm
updates its running statistics locally after DDP's broadcast, so they differ
between ranks at the step's end) and the state of an optimizer whose every
parameter is such a parameter, over the DDP group; and whatever the user
declared with ``protect(replicated_over=group, ...)`` (a module's parameters,
any other object's tensors). Pure: no process group is touched here beyond
reading a group's ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptless.errors import ConfigError, ManifestError
from ckptless.state.dtensor import is_dtensor, local_of
from ckptless.state.manifest import Manifest

EXTRA_KEY = "replicated"


@dataclass(frozen=True)
class ReplicaSet:
    """The global ranks that hold one replicated region identically (at least two).

    Kept as an arithmetic progression ``first, first + stride, ...`` (``count`` ranks) when it is one
    (DDP over the world, HSDP's strided replicate groups): O(1) in every report that carries it and
    in every test of membership; any other set is ``listed``. Build it with :meth:`of_ranks`."""

    first: int
    stride: int
    count: int
    listed: tuple[int, ...] = ()

    @classmethod
    def of_ranks(cls, ranks: Iterable[int]) -> ReplicaSet:
        r = sorted(set(int(x) for x in ranks))
        if len(r) < 2 or r[0] < 0:
            raise ConfigError("replicated_over", r, "must name two or more distinct ranks >= 0")
        stride = r[1] - r[0]
        if all(b - a == stride for a, b in zip(r, r[1:])):
            return cls(r[0], stride, len(r))
        return cls(r[0], 0, len(r), tuple(r))

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.listed or tuple(range(self.first, self.first + self.stride * self.count, self.stride))

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        if self.listed:
            return rank in self.listed
        off = rank - self.first
        return 0 <= off < self.stride * self.count and off % self.stride == 0

    def _at(self, i: int) -> int:
        return self.listed[i] if self.listed else self.first + i * self.stride

    def _index(self, rank: int) -> int:
        return self.listed.index(rank) if self.listed else (rank - self.first) // self.stride

    def at(self, i: int) -> int:
        """The set's ``i``-th rank, ascending."""
        return self._at(i)

    def index_of(self, rank: int) -> int:
        """Where ``rank`` is in the set, ascending (it must be a member)."""
        return self._index(rank)

    def neighbours(self, rank: int) -> tuple[int, int]:
        """(previous, next) around the set's ring: whom ``rank`` compares its prefix with."""
        i = self._index(rank)
        return self._at((i - 1) % self.count), self._at((i + 1) % self.count)

    def to_json(self) -> Any:
        return list(self.listed) if self.listed else {"ap": [self.first, self.stride, self.count]}

    @classmethod
    def from_json(cls, raw: Any) -> ReplicaSet:
        try:
            if isinstance(raw, dict):
                first, stride, count = (int(x) for x in raw["ap"])
                if stride <= 0 or count < 2 or first < 0:
                    raise ValueError(f"first {first}, stride {stride}, count {count}")
                return cls(first, stride, count)
            return cls.of_ranks(int(x) for x in raw)
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise ManifestError(f"malformed replica set {raw!r}: {exc}") from exc


def of_group(group: Any) -> ReplicaSet | None:
    """The ranks of a process group (or a list of ranks); None for a group of one (nothing shared)."""
    if isinstance(group, (list, tuple, range)):
        ranks = sorted(int(r) for r in group)
    else:
        import torch.distributed as dist

        ranks = sorted(dist.get_process_group_ranks(group))
    return ReplicaSet.of_ranks(ranks) if len(set(ranks)) >= 2 else None


@dataclass(frozen=True)
class Region:
    """The replicated prefix of one image, as its manifest records it."""

    bytes: int  # end of the prefix, a multiple of chunk_bytes
    ranks: ReplicaSet
    mirrored: bool  # the job mirrors the prefix too (then holders keep whole images)

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "ranks": self.ranks.to_json(), "mirrored": self.mirrored}


def region_of(m: Manifest) -> Region | None:
    raw = m.extra.get(EXTRA_KEY)
    if raw is None:
        return None
    try:
        region = Region(int(raw["bytes"]), ReplicaSet.from_json(raw["ranks"]), bool(raw.get("mirrored", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"malformed replicated region {raw!r}") from exc
    if region.bytes < 0 or region.bytes > m.total_bytes or region.bytes % m.chunk_bytes:
        raise ManifestError(f"replicated region of {region.bytes} bytes in an image of {m.total_bytes} "
                            f"(chunks of {m.chunk_bytes})")
    return region


def held_from(m: Manifest) -> int:
    """Where a holder's copy of this image starts (bytes): after the replicated prefix unless it is mirrored."""
    region = region_of(m)
    return 0 if region is None or region.mirrored else region.bytes


def first_held_chunk(m: Manifest) -> int:
    return held_from(m) // m.chunk_bytes


def prefix_chunks(m: Manifest) -> int:
    """How many chunks the replicated prefix has (0: none)."""
    region = region_of(m)
    return 0 if region is None else region.bytes // m.chunk_bytes


def tensor_ptrs(obj: Any) -> set[tuple[str, int]]:
    """(device type, data pointer) of every non-empty tensor in a state dict tree."""
    out: set[tuple[str, int]] = set()

    def walk(x: Any, depth: int) -> None:
        if depth > 64:
            return
        if isinstance(x, torch.Tensor):
            out.update(_ptr(x))
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)

    walk(obj, 0)
    return out


def _ptr(t: torch.Tensor) -> set[tuple[str, int]]:
    """(device type, pointer) of what a capture copies: a DTensor's local shard, else the tensor."""
    local = local_of(t) if is_dtensor(t) else t
    return {(local.device.type, local.data_ptr())} if local.numel() else set()


def _param_ptrs(module: torch.nn.Module) -> set[tuple[str, int]]:
    return {x for p in module.parameters() for x in _ptr(p)}


def of_dtensors(module: Any, rank: int) -> ReplicaSet | None:
    """HSDP (FSDP2 on a 2-D mesh, replicate x shard) and any module whose DTensor parameters are
    ``Replicate`` on some mesh dimensions: the ranks that share this rank's coordinates on every other
    dimension hold the same local shards. None when no parameter is such a DTensor, when they disagree
    on mesh or placements (no single set), or when the set is this rank alone."""
    if not isinstance(module, torch.nn.Module):
        return None
    found: ReplicaSet | None = None
    seen: dict[tuple[int, tuple[Any, ...]], ReplicaSet | None] = {}  # one mesh lookup per (mesh, placements)
    for p in module.parameters():
        if not is_dtensor(p):
            return None
        mesh, placements = p.device_mesh, tuple(p.placements)  # type: ignore[attr-defined]
        key = (id(mesh), placements)
        if key not in seen:
            seen[key] = _set_of(mesh, placements)
        rs = seen[key]
        if rs is None or (found is not None and rs != found) or rank not in rs:
            return None
        found = rs
    return found


def _set_of(mesh: Any, placements: tuple[Any, ...]) -> ReplicaSet | None:
    rep_dims = [i for i, pl in enumerate(placements) if pl.is_replicate()]
    coord = mesh.get_coordinate()
    if not rep_dims or coord is None:
        return None
    index = tuple(slice(None) if d in rep_dims else coord[d] for d in range(mesh.ndim))
    ranks = [int(r) for r in mesh.mesh[index].flatten().tolist()]
    return ReplicaSet.of_ranks(ranks) if len(set(ranks)) >= 2 else None


def claim(objects: Iterable[tuple[str, Any]], states: Mapping[str, Any], declared: Mapping[str, ReplicaSet],
          rank: int) -> tuple[ReplicaSet | None, set[tuple[str, int]]]:
    """The image's replica set and the tensors (device type, pointer) it covers.

    ``declared``: protected name -> the set it is replicated over (a DDP model's inner module, or a user
    declaration); a module whose DTensor parameters are ``Replicate`` on a mesh dimension (HSDP) is
    found here (:func:`of_dtensors`). A module contributes its parameters; an optimizer whose every parameter is covered
    contributes its state; any other declared object, every tensor of its state dict. One image has
    one replicated region: a second, different set (rare: a DDP model beside another DDP group's) stays
    private, mirrored as before. A set this rank is not in is a wrong declaration: refused here.
    """
    objs = list(objects)
    chosen: ReplicaSet | None = None
    ptrs: set[tuple[str, int]] = set()
    declared = dict(declared)
    for name, obj in objs:  # HSDP and other Replicate DTensor parameters are found, not declared
        if name not in declared and isinstance(obj, torch.nn.Module):
            found = of_dtensors(obj, rank)
            if found is not None:
                declared[name] = found
    for name, obj in objs:
        rs = declared.get(name)
        if rs is None:
            continue
        if rank not in rs:
            raise ConfigError("replicated_over", list(rs.ranks), f"does not include this rank ({rank}) for {name!r}")
        if chosen is None:
            chosen = rs
        elif rs != chosen:
            continue
        ptrs |= _param_ptrs(obj) if isinstance(obj, torch.nn.Module) else tensor_ptrs(states.get(name))
    if chosen is None:
        return None, set()
    for name, obj in objs:
        if name in declared or not isinstance(obj, torch.optim.Optimizer):
            continue
        params = [x for g in obj.param_groups for p in g["params"] for x in _ptr(p)]
        if params and all(x in ptrs for x in params):
            ptrs |= tensor_ptrs(states.get(name))
    return chosen, ptrs


def held_bytes(m: Manifest) -> int:
    """Bytes of a holder's copy: the image from :func:`held_from` on."""
    return m.total_bytes - held_from(m)


def bad_held_chunks(buf: torch.Tensor, m: Manifest) -> list[int]:
    """Chunks (numbered in the whole image) of a holder's copy ``buf`` whose checksum does not match."""
    from ckptless.state.checksum import bad_chunks

    first = first_held_chunk(m)
    return [first + b for b in bad_chunks(buf, m.chunk_bytes, list(m.chunk_checksums[first:]), held_bytes(m))]
